"""The ``redis`` tier: block records in a shared Redis or Redis Cluster, for a fleet.

Each record is one Redis string, ``kvtier:<hex of the key>``, holding the
record header of :mod:`kvtier.tiers.record` and the body. A batch is one
pipeline (``GETRANGE``, ``SET``, ``EXISTS`` or ``DEL`` per key, no
transaction); with ``cluster: true`` the client sends each node the commands
of the keys it owns. A read asks for one byte more than a record of its key
(``GETRANGE key 0 <record length>``), so a longer value, another program's
under a kvtier key, is a ``length`` miss without being read whole. On a
single server the tier frames ``SET`` and ``GETRANGE`` itself on one of the
client's pooled connections: a ``SET`` sends header and body as two chunks of
one bulk string, and each reply is read from the socket straight into a
buffer of its own (redis-py's parser copies a large reply several times on
its way to a ``bytes``). Capacity and eviction are the
server's (``maxmemory`` and its policy): the tier never assumes a key written
is still there, and a write the server refuses for memory is a drop counted
as ``no_space``.

Failures never reach the caller: a batch that cannot reach the server is a
miss (get) or a drop (put), counted by cause, and opens a back-off window
(``reconnect_backoff_s``, doubling up to ``reconnect_max_backoff_s``) during
which requests are answered at once without touching the network; the first
batch after it reconnects through the client's connection pool.

The URL may carry a user name and password, in its user info or its query
(``?username=...&password=...``); it is a secret in the config (shown as
``**********``) and every log line, ``repr`` and message shows the URL
without them.

A stalled server costs a batch one ``timeout_s``: the client retries a batch
once on a fresh connection after a connection error (a server restarted since
the socket was opened), never after a timeout.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit

import redis
import redis.cluster
import redis.exceptions
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvtier.index.base import BlockKey
from kvtier.tiers.base import Cause, TierSpec
from kvtier.tiers.redis_config import RedisTierConfig
from kvtier.tiers.remote import RemoteTier

KEY_PREFIX = b"kvtier:"
"""Every Redis key the tier writes starts with this."""


_CREDENTIALS = frozenset({"password", "username"})
"""Query parameters of a URL that redis-py takes as credentials."""


def redacted_url(url: str) -> str:
    """``url`` without its credentials: user name and password, in the user info or in the
    query (``?password=...``, ``?username=...``)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    netloc = host if parts.port is None else f"{host}:{parts.port}"
    query = urlencode(
        [
            (name, "****" if name.lower() in _CREDENTIALS else value)
            for name, value in parse_qsl(parts.query, keep_blank_values=True)
        ],
        safe="*",
    )
    return parts._replace(netloc=netloc, query=query, fragment="").geturl()


def _client_replies(connection: Any, count: int) -> list[Any]:
    """The next ``count`` replies through redis-py's parser, an error reply as its exception."""
    replies: list[Any] = []
    for _ in range(count):
        try:
            replies.append(connection.read_response(disable_decoding=True))
        except redis.exceptions.ResponseError as exc:
            replies.append(exc)
    return replies


class _BulkReplies:
    """Reads the replies to pipelined ``GETRANGE``s (or ``GET``s) from a connected socket.

    Each value lands in a buffer from ``take`` (a :meth:`ReadBuffers.take`), read
    from the socket into place; reply lines and the bytes that follow them in
    the same ``recv`` go through a small scratch buffer. Replies are RESP2: a bulk string, a nil
    bulk string (``$-1``) or an error line. A socket failure is raised as
    redis-py's ``TimeoutError`` or ``ConnectionError``; the stream's position
    is then unknown and the caller must drop the connection.
    """

    SCRATCH_BYTES = 64 << 10

    def __init__(self, sock: socket.socket, take: Callable[[int], memoryview]) -> None:
        self._sock = sock
        self._take = take
        self._scratch = bytearray(self.SCRATCH_BYTES)
        self._view = memoryview(self._scratch)
        self._start = self._end = 0

    def read(self, count: int) -> list[memoryview | None | redis.exceptions.ResponseError]:
        """The next ``count`` replies: values, ``None`` for a missing key, or the server's error."""
        return [self._reply() for _ in range(count)]

    def _reply(self) -> memoryview | None | redis.exceptions.ResponseError:
        line = self._line()
        kind, rest = line[:1], line[1:]
        if kind == b"-":
            return redis.exceptions.ResponseError(rest.decode(errors="replace"))
        if kind != b"$":
            raise redis.exceptions.InvalidResponse(f"expected a bulk string, got {line[:40]!r}")
        length = int(rest)
        if length < 0:
            return None
        target = self._take(length)
        buffered = min(length, self._end - self._start)
        target[:buffered] = self._view[self._start : self._start + buffered]
        self._start += buffered
        filled = buffered
        while filled < length:
            filled += self._recv_into(target[filled:])
        if self._line():
            raise redis.exceptions.InvalidResponse("a bulk string ran past its length")
        return target

    def _line(self) -> bytes:
        """The next line without its ``\\r\\n``."""
        while True:
            end = self._scratch.find(b"\r\n", self._start, self._end)
            if end >= 0:
                line = bytes(self._view[self._start : end])
                self._start = end + 2
                return line
            if self._start:
                unread = self._end - self._start
                self._view[:unread] = self._view[self._start : self._end]
                self._start, self._end = 0, unread
            if self._end == len(self._scratch):
                raise redis.exceptions.InvalidResponse("a reply line longer than 64 KiB")
            self._end += self._recv_into(self._view[self._end :])

    def _recv_into(self, target: memoryview) -> int:
        try:
            received = self._sock.recv_into(target)
        except TimeoutError as exc:
            raise redis.exceptions.TimeoutError(f"reading a reply: {exc}") from None
        except OSError as exc:
            raise redis.exceptions.ConnectionError(f"reading a reply: {exc}") from None
        if not received:
            raise redis.exceptions.ConnectionError("the server closed the connection")
        return received


class RedisTier(RemoteTier):
    """Records in Redis, one string per record; see the module docstring."""

    failures = (redis.exceptions.RedisError, redis.exceptions.RedisClusterException, OSError)
    causes = {
        redis.exceptions.TimeoutError: Cause.TIMEOUT,
        redis.exceptions.OutOfMemoryError: Cause.NO_SPACE,
        redis.exceptions.ReadOnlyError: Cause.READ_ONLY,
        redis.exceptions.ResponseError: Cause.SERVER,
    }
    other_cause = Cause.CONNECTION

    def __init__(self, config: RedisTierConfig, spec: TierSpec) -> None:
        """Connect and check the server answers.

        Raises:
            TierError: The server does not answer and ``required`` is true.
        """
        url = redacted_url(config.url.get_secret_value())
        super().__init__(config, spec, name="redis", where=url)
        self.url = url
        self.cluster = config.cluster
        self._buffers = threading.local()
        self._open(lambda: self._connect(config), url + (" (cluster)" if self.cluster else ""))

    def _connect(self, config: RedisTierConfig) -> str | None:
        try:
            self._client = self._make_client(config)
            self._client.ping()
        except self.failures as exc:
            self._release()
            what = "Redis Cluster" if config.cluster else "Redis"
            return (
                f"cannot reach {what} at {self.url}: {exc}; start the server, or fix url (and "
                "tls_ca_path for rediss://)"
            )
        return None

    def _make_client(self, config: RedisTierConfig) -> Any:
        options: dict[str, Any] = {
            "socket_timeout": config.timeout_s,
            "socket_connect_timeout": config.timeout_s,
            "max_connections": config.io_threads + 1,
            # RESP2: replies in the shape _BulkReplies reads, and no pushed messages.
            "protocol": 2,
        }
        if config.tls_ca_path is not None:
            options["ssl_ca_certs"] = str(config.tls_ca_path)
        url = config.url.get_secret_value()
        # One quick retry on a fresh connection (a server restarted since the socket was
        # opened); longer outages are the tier's back-off, not the client's. A timeout is
        # not retried: a stalled server costs a batch one timeout_s, not two.
        retry = Retry(NoBackoff(), 1, supported_errors=(redis.exceptions.ConnectionError,))
        if config.cluster:
            return redis.cluster.RedisCluster.from_url(url, retry=retry, **options)
        return redis.Redis.from_url(url, retry=retry, **options)

    @staticmethod
    def _name(key: BlockKey) -> bytes:
        return KEY_PREFIX + key.hex().encode()

    def _pipeline(
        self, command: str, keys: Sequence[BlockKey], *values: Sequence[Any]
    ) -> list[Any] | None:
        """Run ``command`` per key in one pipeline: the replies, or ``None`` (counted)."""

        def send() -> list[Any]:
            pipe = self._client.pipeline(transaction=False)
            for position, key in enumerate(keys):
                getattr(pipe, command)(self._name(key), *(value[position] for value in values))
            return pipe.execute(raise_on_error=False)  # type: ignore[no-any-return]

        return self._call_store(keys, send)

    def _set_records(
        self, keys: Sequence[BlockKey], records: Sequence[memoryview]
    ) -> list[Any] | None:
        """``SET`` each key to its encoded record: the replies, or ``None`` (counted)."""
        if self.cluster:
            # The cluster client routes each key to its node and follows redirections;
            # it takes whole values, so records are joined in this thread's buffers.
            values = [
                self._codec.encode_into(buffer, key, record)
                for buffer, key, record in zip(self._staging(len(keys)), keys, records, strict=True)
            ]
            return self._pipeline("set", keys, values)
        return self._call_store(keys, lambda: self._send_sets(keys, records))

    def _send_sets(self, keys: Sequence[BlockKey], records: Sequence[memoryview]) -> list[Any]:
        """Pipeline ``SET`` on one connection, writing the protocol framing here.

        Each value is the header followed by the payload; they go out as separate
        chunks of one bulk string, so the payload is never copied to join them.
        Each record is hashed just before it is sent, not all before the first
        is sent, so the send reads a payload the hash has just brought into the
        CPU's cache (a pipeline of 8 records of 2 MiB: 0.91-0.95x of a bare
        redis-py pipeline hashed all first, 1.02x hashed one by one).
        """

        def chunks() -> Iterator[bytes | memoryview]:
            for key, record in zip(keys, records, strict=True):
                name = self._name(key)
                header, body = self._codec.header(key, record)
                yield b"*3\r\n$3\r\nSET\r\n$%d\r\n%b\r\n$%d\r\n%b" % (
                    len(name),
                    name,
                    len(header) + len(body),
                    header,
                )
                yield body
                yield b"\r\n"

        return self._exchange(chunks, lambda connection: _client_replies(connection, len(keys)))

    def _exchange(
        self,
        chunks: Callable[[], Iterable[bytes | memoryview]],
        read: Callable[[Any], list[Any]],
    ) -> list[Any]:
        """Send what ``chunks()`` yields on one pooled connection and ``read`` the replies.

        A stale connection is retried once on a fresh one (the client's retry),
        sending ``chunks()`` anew; a connection that failed mid-exchange is
        dropped, since where its stream stands is unknown.
        """
        pool = self._client.connection_pool
        connection = pool.get_connection()

        def send() -> list[Any]:
            connection.send_packed_command(chunks())
            return read(connection)

        def reconnect(_: Exception) -> None:
            connection.disconnect()

        try:
            replies: list[Any] = connection.retry.call_with_retry(send, reconnect)
            return replies
        except BaseException:
            connection.disconnect()
            raise
        finally:
            pool.release(connection)

    def _read_bound(self, key: BlockKey) -> int:
        """The last byte a read of ``key`` asks for: one past its record, so that a longer
        value shows as too long without being read whole."""
        return self._codec.encoded_bytes(key)

    def _send_gets(self, keys: Sequence[BlockKey]) -> list[Any]:
        """Pipeline ``GETRANGE`` (to :meth:`_read_bound`) on one connection and read the
        replies with :class:`_BulkReplies`.

        The socket is read directly only on a RESP2 connection whose redis-py
        parser holds no unread bytes (it never does between whole exchanges);
        otherwise (a URL that asks for ``protocol=3``, a parser this does not
        know) the replies go through redis-py.
        """
        commands = b"".join(
            b"*4\r\n$8\r\nGETRANGE\r\n$%d\r\n%b\r\n$1\r\n0\r\n$%d\r\n%d\r\n"
            % (len(name), name, len(str(bound)), bound)
            for name, bound in zip(map(self._name, keys), map(self._read_bound, keys), strict=True)
        )

        def read(connection: Any) -> list[Any]:
            sock = getattr(connection, "_sock", None)
            buffered = getattr(getattr(connection, "_parser", None), "_buffer", None)
            resp2 = str(getattr(connection, "protocol", "")) == "2"
            if resp2 and sock is not None and (buffered is None or buffered.unread_bytes() == 0):
                return _BulkReplies(sock, self._read_buffers.take).read(len(keys))
            return _client_replies(connection, len(keys))

        return self._exchange(lambda: [commands], read)

    def _read(self, keys: Sequence[BlockKey]) -> list[memoryview | None]:
        if self.cluster:
            replies = self._pipeline(
                "getrange", keys, [0] * len(keys), [*map(self._read_bound, keys)]
            )
        else:
            replies = self._call_store(keys, lambda: self._send_gets(keys))
        if replies is None:
            return [None] * len(keys)
        found: list[memoryview | None] = []
        for key, reply in zip(keys, replies, strict=True):
            if not reply:  # GETRANGE answers a missing key with an empty string
                found.append(None)
            elif isinstance(reply, Exception):
                self._count_error(self._cause_of(reply))
                found.append(None)
            else:
                found.append(self._checked(key, reply))
        return found

    def _staging(self, count: int) -> list[bytearray]:
        """This thread's buffers for ``count`` encoded records, kept from batch to batch.

        Joined records go to long-lived buffers because a fresh multi-megabyte
        allocation per record costs more (page faults) than the copy itself.
        """
        buffers: list[bytearray] | None = getattr(self._buffers, "list", None)
        if buffers is None:
            buffers = self._buffers.list = []
        while len(buffers) < count:
            buffers.append(bytearray(self._codec.max_encoded_bytes))
        return buffers[:count]

    def _write(self, keys: Sequence[BlockKey], records: Sequence[memoryview]) -> list[bool]:
        replies = self._set_records(keys, records)
        if replies is None:
            return [False] * len(keys)
        stored = []
        for reply in replies:
            if isinstance(reply, Exception):
                self._count_error(self._cause_of(reply))
                stored.append(False)
            else:
                stored.append(True)
        return self._count_stored(stored)

    def _exists(self, keys: Sequence[BlockKey]) -> list[bool]:
        return self._flags("exists", keys)

    def _remove(self, keys: Sequence[BlockKey]) -> list[bool]:
        return self._flags("delete", keys)

    def _flags(self, command: str, keys: Sequence[BlockKey]) -> list[bool]:
        replies = self._pipeline(command, keys)
        if replies is None:
            return [False] * len(keys)
        flags = []
        for reply in replies:
            if isinstance(reply, Exception):
                self._count_error(self._cause_of(reply))
                flags.append(False)
            else:
                flags.append(bool(reply))
        return flags

    def __repr__(self) -> str:
        return f"RedisTier({self.url!r}, cluster={self.cluster}, namespace={self.keys.namespace!r})"


def build_redis_tier(config: RedisTierConfig, spec: TierSpec) -> RedisTier:
    """The ``redis`` tier's factory."""
    return RedisTier(config, spec)
