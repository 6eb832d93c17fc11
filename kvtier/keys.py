"""Block keys: chained prefix hashes of token ids, and namespacing of engine-supplied hashes.

A :data:`~kvtier.index.BlockKey` names the contents of one block of KV cache.
Two sources exist:

- Engines that hash prefixes themselves (vLLM does) hand kvtier their chained
  block hash; :class:`KeyNamespace` prefixes it with a digest of the model, the
  layout fingerprint, the rank (with the world size) and a tenant namespace,
  then the kv-cache group, so keys never collide across models, layouts,
  ranks, tenants or groups.
- Engines and tools that do not get :func:`hash_token_blocks`: block ``i``'s
  hash covers its tokens and the hash of block ``i - 1``, so equal keys mean
  equal prefixes. Hashes depend only on the token ids and the algorithm (never
  on Python's per-process ``hash`` seed), so they agree across processes and
  machines.

A request of a tenant that names a salt (vLLM's ``cache_salt``) gets
:class:`TenantKey` keys: the same bytes, carrying the salt to the tiers, which
seal its records under a key derived from their own and the salt (see
:mod:`kvtier.tiers.record`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import NamedTuple

from kvtier.index.base import BlockKey

DEFAULT_HASH_ALGORITHM = "sha256"
"""Algorithm of :func:`hash_token_blocks` unless one is named."""

_TOKEN_BYTES = 8
_NAMESPACE_DIGEST_BYTES = 8
_GROUP_BYTES = 2


def hash_token_blocks(
    token_ids: Sequence[int],
    block_tokens: int,
    *,
    parent: BlockKey | None = None,
    extra: bytes = b"",
    algorithm: str = DEFAULT_HASH_ALGORITHM,
) -> list[BlockKey]:
    """Hash the full blocks of ``token_ids`` into a chain of keys.

    A trailing partial block is not hashed: only full blocks are ever stored.

    Args:
        token_ids: The token ids of a sequence, from its first token.
        block_tokens: Tokens per block (the engine's block size).
        parent: Hash of the block before ``token_ids[0]``, to continue a chain;
            ``None`` starts a new one.
        extra: Bytes mixed into every block's hash (for example a LoRA name or
            a multimodal input's digest) so otherwise equal prefixes differ.
        algorithm: A :mod:`hashlib` algorithm name.

    Returns:
        One key per full block, each the digest of the previous key, ``extra``
        and the block's token ids as little-endian signed 64-bit integers.

    Raises:
        ValueError: If ``block_tokens`` is not positive, ``algorithm`` is not
            available, or a token id does not fit in 64 bits.
    """
    if block_tokens <= 0:
        raise ValueError(f"block_tokens must be positive, got {block_tokens}")
    if algorithm not in hashlib.algorithms_available:
        raise ValueError(
            f"hash algorithm {algorithm!r} is not available; choose one of "
            f"{', '.join(sorted(hashlib.algorithms_guaranteed))}"
        )
    previous = b"" if parent is None else parent
    keys: list[BlockKey] = []
    for start in range(0, len(token_ids) - block_tokens + 1, block_tokens):
        digest = hashlib.new(algorithm)
        digest.update(len(previous).to_bytes(1, "little"))
        digest.update(previous)
        digest.update(extra)
        try:
            digest.update(
                b"".join(
                    int(token).to_bytes(_TOKEN_BYTES, "little", signed=True)
                    for token in token_ids[start : start + block_tokens]
                )
            )
        except OverflowError as exc:
            raise ValueError(
                f"a token id in block {start // block_tokens} does not fit in 64 bits"
            ) from exc
        previous = digest.digest()
        keys.append(previous)
    return keys


class TenantKey(bytes):
    """A block key of a request that names a tenant's salt: the key's bytes, and the salt.

    It is equal to (and hashes as) the plain key, so stores and indexes treat it
    as one; only the tiers' record sealing reads :attr:`salt`. The salt is a
    secret of its tenant: never written to a record, and not in ``repr``.
    """

    salt: bytes

    def __new__(cls, key: bytes, salt: bytes) -> TenantKey:
        if not salt:
            raise ValueError("a tenant's salt is not empty; give a plain key for no salt")
        made = super().__new__(cls, key)
        made.salt = salt
        return made

    def __getnewargs__(self) -> tuple[bytes, bytes]:  # type: ignore[override]
        return bytes(self), self.salt


class SplitKey(NamedTuple):
    """A namespaced key taken apart: its kv-cache group and the engine's block hash."""

    group: int
    block_hash: bytes


@dataclass(frozen=True)
class KeyNamespace:
    """Turns engine block hashes into keys private to one model, layout, rank, tenant and group.

    The namespace is a short digest of its fields; :meth:`key` prepends it and
    the group to the engine's hash, so lookups cost one concatenation.
    ``rank=None`` gives keys shared by every rank (what the scheduler's index
    uses: each rank holds its own shard of the same block in the same slot);
    lower tiers that store each rank's shard separately set the rank and the
    world size. ``namespace`` names a tenant: stores shared by several
    deployments keep each tenant's blocks apart by it.

    Keys made without ``world_size`` and ``namespace`` are the same as before
    those fields existed, so stored keys stay valid.
    """

    model: str = ""
    layout_fingerprint: str = ""
    rank: int | None = None
    world_size: int | None = None
    namespace: str = ""
    _prefixes: dict[int, bytes] = field(default_factory=dict, init=False, repr=False, compare=False)

    @cached_property
    def digest(self) -> bytes:
        """The bytes every key of this namespace starts with, whatever its group."""
        return self.prefix(0)[:_NAMESPACE_DIGEST_BYTES]

    def _digest(self) -> bytes:
        rank = "" if self.rank is None else str(self.rank)
        if self.world_size is None and not self.namespace:
            text = "\x1f".join(("kvtier-key-v1", self.model, self.layout_fingerprint, rank))
        else:
            text = json.dumps(
                [
                    "kvtier-key-v2",
                    self.model,
                    self.layout_fingerprint,
                    self.rank,
                    self.world_size,
                    self.namespace,
                ]
            )
        return hashlib.sha256(text.encode()).digest()[:_NAMESPACE_DIGEST_BYTES]

    def prefix(self, group: int) -> bytes:
        """The bytes every key of ``group`` starts with."""
        found = self._prefixes.get(group)
        if found is None:
            if group < 0:
                raise ValueError(f"a kv-cache group index is never negative, got {group}")
            found = self._digest() + group.to_bytes(_GROUP_BYTES, "little")
            self._prefixes[group] = found
        return found

    def key(self, block_hash: bytes, group: int = 0) -> BlockKey:
        """Namespace one engine block hash."""
        return self.prefix(group) + block_hash

    def keys(
        self, block_hashes: Sequence[bytes], group: int = 0, salt: bytes | None = None
    ) -> list[BlockKey]:
        """Namespace a sequence of engine block hashes; with a ``salt``, as :class:`TenantKey`."""
        prefix = self.prefix(group)
        if salt is None:
            return [prefix + block_hash for block_hash in block_hashes]
        return [TenantKey(prefix + block_hash, salt) for block_hash in block_hashes]

    def split(self, key: BlockKey) -> SplitKey:
        """Take a key made by :meth:`key` apart again.

        Raises:
            ValueError: ``key`` was not made by this namespace (another model,
                layout or rank, or not a namespaced key at all).
        """
        group_end = _NAMESPACE_DIGEST_BYTES + _GROUP_BYTES
        group = int.from_bytes(key[_NAMESPACE_DIGEST_BYTES:group_end], "little")
        if len(key) < group_end or not key.startswith(self.prefix(group)):
            raise ValueError(
                f"key {key[:group_end].hex()}... was not made by this namespace "
                f"({self!r}); split keys with the namespace that made them"
            )
        return SplitKey(group, key[group_end:])

    def owns(self, key: BlockKey) -> bool:
        """Whether ``key`` was made by this namespace (any group)."""
        return len(key) >= _NAMESPACE_DIGEST_BYTES + _GROUP_BYTES and key.startswith(self.digest)

    def for_rank(self, rank: int) -> KeyNamespace:
        """The same namespace for one rank's own shard."""
        return replace(self, rank=rank)
