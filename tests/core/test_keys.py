"""Block keys: chained token hashing and namespacing."""

from __future__ import annotations

import hashlib
import pickle
import subprocess
import sys

import pytest

from kvtier.keys import KeyNamespace, hash_token_blocks


def test_only_full_blocks_are_hashed() -> None:
    assert len(hash_token_blocks(list(range(11)), 4)) == 2
    assert hash_token_blocks([1, 2, 3], 4) == []


def test_chain_depends_on_the_whole_prefix() -> None:
    first = hash_token_blocks([1, 2, 3, 4, 5, 6, 7, 8], 4)
    other = hash_token_blocks([9, 2, 3, 4, 5, 6, 7, 8], 4)
    assert first[0] != other[0]
    assert first[1] != other[1], "block 1 must depend on block 0"
    assert hash_token_blocks([1, 2, 3, 4, 5, 6, 7, 8, 9], 4) == first


def test_continuing_a_chain_equals_hashing_it_whole() -> None:
    tokens = list(range(100, 124))
    whole = hash_token_blocks(tokens, 4)
    head = hash_token_blocks(tokens[:8], 4)
    tail = hash_token_blocks(tokens[8:], 4, parent=head[-1])
    assert head + tail == whole


def test_first_block_matches_the_documented_digest() -> None:
    tokens = [1, -2, 3, 2**40]
    expected = hashlib.sha256(
        b"\x00" + b"".join(t.to_bytes(8, "little", signed=True) for t in tokens)
    ).digest()
    assert hash_token_blocks(tokens, 4) == [expected]


def test_extra_bytes_and_algorithm_change_keys() -> None:
    tokens = list(range(8))
    plain = hash_token_blocks(tokens, 4)
    assert hash_token_blocks(tokens, 4, extra=b"lora-a") != plain
    blake = hash_token_blocks(tokens, 4, algorithm="blake2b")
    assert blake != plain and len(blake[0]) == 64


def test_keys_are_stable_across_processes() -> None:
    code = (
        "from kvtier.keys import hash_token_blocks;"
        "print(hash_token_blocks(list(range(32)), 8)[-1].hex())"
    )
    outputs = {
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={"PYTHONHASHSEED": seed},
        ).stdout.strip()
        for seed in ("1", "2")
    }
    assert outputs == {hash_token_blocks(list(range(32)), 8)[-1].hex()}


@pytest.mark.parametrize(
    ("tokens", "block_tokens", "algorithm", "message"),
    [
        ([1], 0, "sha256", "block_tokens must be positive"),
        ([1], 1, "no-such-hash", "not available"),
        ([2**70], 1, "sha256", "does not fit in 64 bits"),
    ],
)
def test_bad_arguments_are_explained(
    tokens: list[int], block_tokens: int, algorithm: str, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        hash_token_blocks(tokens, block_tokens, algorithm=algorithm)


def test_namespaces_separate_models_layouts_ranks_and_groups() -> None:
    block_hash = b"\x01" * 32
    keys = {
        KeyNamespace("m1").key(block_hash),
        KeyNamespace("m2").key(block_hash),
        KeyNamespace("m1", "layout-a").key(block_hash),
        KeyNamespace("m1", rank=0).key(block_hash),
        KeyNamespace("m1", rank=1).key(block_hash),
        KeyNamespace("m1").key(block_hash, group=1),
    }
    assert len(keys) == 6
    assert KeyNamespace("m1").key(block_hash) == KeyNamespace("m1").key(block_hash)


def test_namespace_keys_match_key_and_end_with_the_hash() -> None:
    namespace = KeyNamespace("model", "fp", rank=3)
    hashes = [bytes([i]) * 8 for i in range(4)]
    assert namespace.keys(hashes, 2) == [namespace.key(h, 2) for h in hashes]
    assert all(
        key.endswith(h) and key.startswith(namespace.prefix(2))
        for key, h in zip(namespace.keys(hashes, 2), hashes, strict=True)
    )
    assert namespace.for_rank(5) == KeyNamespace("model", "fp", rank=5)


def test_namespace_pickles_and_rejects_negative_groups() -> None:
    namespace = KeyNamespace("model")
    namespace.key(b"x")
    clone = pickle.loads(pickle.dumps(namespace))
    assert clone == namespace and clone.key(b"x") == namespace.key(b"x")
    with pytest.raises(ValueError, match="never negative"):
        namespace.key(b"x", group=-1)


def test_split_returns_the_group_and_the_engine_hash() -> None:
    namespace = KeyNamespace("model", "fp")
    assert namespace.split(namespace.key(b"\x01\x02hash", 3)) == (3, b"\x01\x02hash")
    assert namespace.split(namespace.key(b"", 0)).block_hash == b""
    assert namespace.split(namespace.key(b"h", 300)).group == 300


def test_split_refuses_keys_of_another_namespace() -> None:
    key = KeyNamespace("model").key(b"hash", 1)
    with pytest.raises(ValueError, match="was not made by this namespace"):
        KeyNamespace("other").split(key)
    with pytest.raises(ValueError, match="was not made by this namespace"):
        KeyNamespace("model").split(b"short")


def test_keys_without_world_size_or_namespace_are_unchanged() -> None:
    """Keys stored before world_size and namespace existed stay valid."""
    assert KeyNamespace("m", "fp", 3).key(b"h", 1).hex() == "d622633e66a78b56010068"
    assert KeyNamespace("m", "fp").key(b"h", 1).hex() == "5c077fc9a3d84a68010068"


def test_world_size_and_tenant_namespace_separate_keys() -> None:
    block_hash = b"\x02" * 32
    base = KeyNamespace("m", "fp", rank=0)
    keys = {
        base.key(block_hash),
        KeyNamespace("m", "fp", rank=0, world_size=1).key(block_hash),
        KeyNamespace("m", "fp", rank=0, world_size=2).key(block_hash),
        KeyNamespace("m", "fp", rank=0, world_size=2, namespace="a").key(block_hash),
        KeyNamespace("m", "fp", rank=0, world_size=2, namespace="b").key(block_hash),
        KeyNamespace("m", "fp", rank=0, namespace="a").key(block_hash),
    }
    assert len(keys) == 6


def test_for_rank_keeps_world_size_and_namespace() -> None:
    namespace = KeyNamespace("m", "fp", rank=None, world_size=4, namespace="tenant")
    assert namespace.for_rank(3) == KeyNamespace("m", "fp", 3, 4, "tenant")


def test_owns_tells_a_namespaces_keys_from_others() -> None:
    tenant = KeyNamespace("m", "fp", 0, 1, "tenant")
    assert tenant.owns(tenant.key(b"h")) and tenant.owns(tenant.key(b"h", group=5))
    assert not tenant.owns(KeyNamespace("m", "fp", 0, 1, "other").key(b"h"))
    assert not tenant.owns(tenant.digest)
    assert len(tenant.digest) == 8 and tenant.key(b"h").startswith(tenant.digest)
