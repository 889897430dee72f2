"""The tier's own connections: GETs whose values land in their rows, SETs sent from them.

redis-py reads every reply into a new ``bytes`` (through a stream reader that
copies it again), and the tier then copies the verified payload into its row:
three copies of every byte, and most of a load's client CPU. Here a
connection is an :class:`asyncio.BufferedProtocol` that hands the socket the
row itself: a reply of the expected length (``$<header + payload>``) is
received with its 4096-byte header into a small buffer and its payload
straight into the row, then verified in place. Measured on this machine
(``benchmarks/cluster_tier.py``, three loopback nodes, 2 cores) at about
1.5-1.8x the throughput and a third of the client CPU of redis-py doing the
same GETs.

Only GET replies of RESP2 are parsed (``$-1`` absent, ``$<n>`` a value,
``-<error>``, and ``+OK`` of ``AUTH``); any other reply closes the
connection. A value of another length is read into a scratch buffer and
reported as its length (truncated or foreign); an error reply (MOVED, ASK,
TRYAGAIN, ...) is reported as its text, and the tier reads those keys again
through redis-py, which follows redirections. Connections are opened per
node on demand (``AUTH`` first when the tier has credentials, TLS with the
tier's context), at most ``pipelines_per_node`` per node (the client's gate),
and dropped on any fault: a connection that failed or timed out is aborted
and stops writing into any row at once, so a row handed back to the caller is
never written after its load returned.

The same connections carry the stores' SETs (:meth:`DirectConnections.set_from`):
each value goes out as its header, then its row, given to the transport a
piece at a time and only once the transport's buffer is empty, so that the
socket takes the bytes from the row itself and asyncio copies only what one
``send`` left over. redis-py instead joins a whole pipeline into one
``bytes`` (Python 3.11's ``writelines``), which the transport slices and
copies again into its buffer: three copies of every byte, 0.58 of the 1.48
client CPU seconds of a profiled 2 MiB store, against about a tenth of the
bytes copied once here. A reply is ``+OK`` or an error reply, returned as is (the
client follows MOVED/ASK/TRYAGAIN through redis-py). Once a SET pipeline
returned, failed or was cancelled, the transport holds nothing of its rows
(over TLS each piece is copied first: the TLS transport keeps what it was
given until it encrypts it).
"""

from __future__ import annotations

import asyncio
import collections
import ssl
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["BulkError", "DirectConnections", "ReaderLost", "direct_ssl_context"]

_SCRATCH = 8192
_DISCARD = 1 << 16
_PIECE = 1 << 20
"""Bytes of a row given to the transport at once: what one ``send`` does not
take is copied into the transport's buffer, the rest goes from the row."""


class ReaderLost(ConnectionError):
    """The connection closed, broke the protocol, or was aborted."""


@dataclass(frozen=True, slots=True)
class BulkError:
    """An error reply (``-MOVED 1234 host:port`` ...), for one command."""

    text: str


Reply = bytearray | int | BulkError | None
"""Per GET: the header (payload in its row), the length of a value of another
size (not kept), an error reply, or None (no such key). Per SET: None
(``+OK``) or an error reply."""


_Pending = tuple[memoryview | None, list[Reply], "asyncio.Future[list[Reply]]", int]


class _Protocol(asyncio.BufferedProtocol):
    """One connection; replies are matched to the commands in the order sent."""

    def __init__(self, header_bytes: int) -> None:
        self._header_bytes = header_bytes
        self._header = bytearray()
        self._scratch_buf = bytearray(_SCRATCH)
        self._scratch = memoryview(self._scratch_buf)
        self._line = bytearray()
        self._skip = 0  # bytes of CRLF still to drop after a value
        # The value being received: its parts (views to fill) and where we are.
        self._parts: list[memoryview] = []
        self._part = 0
        self._pos = 0
        self._discard = 0  # bytes of a value of another length (and its CRLF) to drop
        self._discard_len = 0
        self._discard_buf: memoryview | None = None
        # Commands sent and not answered, in order: (row, replies of its batch,
        # the batch's future, the batch's size); the row is None for AUTH.
        self._pending: collections.deque[_Pending] = collections.deque()
        # Set while the transport's buffer holds bytes (its high-water mark is 1).
        self._drained: asyncio.Future[None] | None = None
        self.transport: asyncio.Transport | None = None
        self.lost: BaseException | None = None

    # -- asyncio --------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        # pause_writing whenever a write leaves bytes buffered, resume_writing
        # once they are all sent: write_paced gives the socket the next piece
        # then. Not 0: the TLS transport pauses at "size >= high", empty or not.
        transport.set_write_buffer_limits(high=1, low=0)

    def pause_writing(self) -> None:
        if self._drained is None or self._drained.done():
            self._drained = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        drained, self._drained = self._drained, None
        if drained is not None and not drained.done():
            drained.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(ReaderLost("connection lost") if exc is None else exc)

    def get_buffer(self, sizehint: int) -> memoryview:
        if self.lost is None and self._parts:
            # The value's bytes go where they belong: the header buffer, the row.
            return self._parts[self._part][self._pos :]
        if self.lost is None and self._discard:
            buf = self._discard_buf
            if buf is None:
                buf = self._discard_buf = memoryview(bytearray(_DISCARD))
            return buf[: min(self._discard, _DISCARD)]
        return self._scratch

    def buffer_updated(self, nbytes: int) -> None:
        if self.lost is not None:
            return  # aborted: nothing lands anywhere any more
        if self._parts:
            self._advance(nbytes)
            return
        if self._discard:
            self._discard -= nbytes
            if not self._discard:
                self._finish(self._discard_len)
            return
        try:
            self._feed(self._scratch[:nbytes])
        except ReaderLost as exc:
            self.abort(exc)

    # -- parsing ----------------------------------------------------------------------

    def _advance(self, nbytes: int) -> None:
        self._pos += nbytes
        if self._pos == self._parts[self._part].nbytes:
            self._part += 1
            self._pos = 0
            if self._part == len(self._parts):
                header = self._header
                self._parts = []
                self._skip = 2
                self._finish(header)

    def _feed(self, data: memoryview) -> None:
        """Bytes received into the scratch buffer: lines, and the start of values."""
        i, n = 0, data.nbytes
        while i < n:
            if self._skip:
                take = min(self._skip, n - i)
                self._skip -= take
                i += take
                continue
            if self._parts:  # a value began in the scratch buffer: copy what came
                part = self._parts[self._part]
                take = min(part.nbytes - self._pos, n - i)
                part[self._pos : self._pos + take] = data[i : i + take]
                i += take
                self._advance(take)
                continue
            if self._discard:
                take = min(self._discard, n - i)
                self._discard -= take
                i += take
                if not self._discard:
                    self._finish(self._discard_len)
                continue
            # ``data`` is the start of the scratch buffer: search it in place.
            end = self._scratch_buf.find(b"\n", i, n)
            if end < 0:
                self._line += data[i:n]
                if len(self._line) > 4096:
                    raise ReaderLost("reply line too long")
                return
            self._line += data[i : end + 1]
            i = end + 1
            line, self._line = bytes(self._line), bytearray()
            self._reply_line(line)

    def _reply_line(self, line: bytes) -> None:
        if not self._pending:
            raise ReaderLost("reply with no command")
        kind, body = line[:1], line[1:].rstrip(b"\r\n")
        row = self._pending[0][0]
        if kind == b"+" and row is None:  # +OK of AUTH
            self._finish(None)
        elif kind == b"-":
            self._finish(BulkError(body.decode(errors="replace")))
        elif kind == b"$":
            try:
                length = int(body)
            except ValueError as exc:
                raise ReaderLost("bad bulk length") from exc
            if length < 0:
                self._finish(None)
                return
            if row is not None and length == self._header_bytes + row.nbytes:
                self._header = bytearray(self._header_bytes)
                self._parts = [memoryview(self._header), row]
                self._part = self._pos = 0
            else:
                self._discard_len = length
                self._discard = length + 2  # and its CRLF
                if not self._discard:
                    self._finish(length)
        else:
            raise ReaderLost(f"unexpected reply type {kind!r}")

    def _finish(self, reply: Reply) -> None:
        _row, out, fut, count = self._pending.popleft()
        out.append(reply)
        if len(out) == count and not fut.done():
            fut.set_result(out)

    # -- sending ------------------------------------------------------------------------

    def send(
        self, commands: bytes, rows: Sequence[memoryview | None]
    ) -> asyncio.Future[list[Reply]]:
        """Send packed commands, one reply expected per entry of ``rows``."""
        fut = self.expect(rows)
        assert self.transport is not None
        self.transport.write(commands)
        return fut

    def expect(self, rows: Sequence[memoryview | None]) -> asyncio.Future[list[Reply]]:
        """Await one reply per entry of ``rows`` (None: no value expected) for what is sent next."""
        if self.lost is not None or self.transport is None:
            raise ReaderLost("connection closed")
        fut: asyncio.Future[list[Reply]] = asyncio.get_running_loop().create_future()
        out: list[Reply] = []
        for row in rows:
            self._pending.append((row, out, fut, len(rows)))
        return fut

    async def write_paced(self, parts: Sequence[bytes | memoryview], *, copy: bool) -> None:
        """Write ``parts`` in order, each piece once the transport's buffer is empty.

        The socket takes each piece straight from where it lies; asyncio copies
        only what one ``send`` left. With ``copy`` (TLS: its transport keeps
        what it is given) each piece is copied first.

        Raises
        ------
        ReaderLost
            When the connection closed or was aborted meanwhile.
        """
        for part in parts:
            view = memoryview(part)
            for start in range(0, view.nbytes, _PIECE):
                while (drained := self._drained) is not None and not drained.done():
                    await drained
                if self.lost is not None or self.transport is None:
                    raise ReaderLost("connection closed")
                piece = view[start : start + _PIECE]
                self.transport.write(bytes(piece) if copy else piece)

    def abort(self, exc: BaseException) -> None:
        """Stop at once: no more bytes land in any row; every batch waiting fails."""
        self._fail(exc)
        if self.transport is not None:
            self.transport.abort()

    def _fail(self, exc: BaseException) -> None:
        if self.lost is None:
            self.lost = exc
        self.resume_writing()  # a paced write waiting finds the connection lost
        self._parts = []
        while self._pending:
            _row, _out, fut, _count = self._pending.popleft()
            if not fut.done():
                fut.set_exception(ReaderLost(str(exc)))


def _pack(*args: bytes) -> bytes:
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        out.append(b"$%d\r\n%s\r\n" % (len(a), a))
    return b"".join(out)


def direct_ssl_context(
    ca_file: str | None, cert_file: str | None, key_file: str | None, check_hostname: bool
) -> ssl.SSLContext:
    """The TLS context of the tier's direct connections (certificates always verified)."""
    context = ssl.create_default_context(cafile=ca_file)
    context.check_hostname = check_hostname
    context.verify_mode = ssl.CERT_REQUIRED
    if cert_file is not None:
        context.load_cert_chain(cert_file, key_file)
    return context


class DirectConnections:
    """Direct connections to the nodes, by name; at most what the client's gate lets through."""

    def __init__(
        self,
        *,
        header_bytes: int,
        username: str | None,
        password: str | None,
        ssl_context: ssl.SSLContext | None,
        connect_timeout_s: float,
    ) -> None:
        self._header_bytes = header_bytes
        self._auth: bytes | None = None
        if password is not None:
            args = [b"AUTH"] + ([username.encode()] if username else []) + [password.encode()]
            self._auth = _pack(*args)
        self._ssl = ssl_context
        self._connect_timeout = connect_timeout_s
        self._idle: dict[str, list[_Protocol]] = {}
        self._all: set[_Protocol] = set()

    def __repr__(self) -> str:
        return f"DirectConnections({len(self._all)} connections)"

    async def get_into(
        self, node: str, rkeys: Sequence[bytes], rows: Sequence[memoryview]
    ) -> list[Reply]:
        """GET ``rkeys`` from ``node`` in one pipeline, each value's payload into its row.

        Raises
        ------
        ReaderLost, OSError, TimeoutError
            When the connection fails; the rows hold no valid data then.
            Cancelled (a timeout of the caller), the connection is aborted
            before this returns: no byte lands in a row afterwards.
        """
        proto = await self._acquire(node)
        try:
            packed = [b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(k), k) for k in rkeys]
            replies = await proto.send(b"".join(packed), rows)
        except BaseException as exc:
            proto.abort(exc if isinstance(exc, Exception) else ReaderLost("cancelled"))
            self._all.discard(proto)
            raise
        self._idle.setdefault(node, []).append(proto)
        return replies

    async def set_from(
        self, node: str, values: Sequence[tuple[bytes, memoryview, memoryview]]
    ) -> list[Reply]:
        """SET each ``(key, header, payload)`` on ``node`` in one pipeline, sent from its buffers.

        One :data:`Reply` per value: None (``+OK``) or the error reply.

        Raises
        ------
        ReaderLost, OSError, TimeoutError
            When the connection fails: any of the values may or may not be
            stored. Cancelled (a timeout of the caller), the connection is
            aborted before this returns: no byte of a buffer is read afterwards.
        """
        if not values:
            return []  # no reply would come to wait for
        proto = await self._acquire(node)
        fut: asyncio.Future[list[Reply]] | None = None
        try:
            parts: list[bytes | memoryview] = []
            crlf = b""
            for key, header, payload in values:
                size = header.nbytes + payload.nbytes
                # The CRLF that ends the previous value, this one's command and
                # its header: one small write before the payload.
                parts.append(
                    b"%s*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n%s"
                    % (crlf, len(key), key, size, header)
                )
                parts.append(payload)
                crlf = b"\r\n"
            parts.append(crlf)
            fut = proto.expect([None] * len(values))
            await proto.write_paced(parts, copy=self._ssl is not None)
            replies = await fut
        except BaseException as exc:
            proto.abort(exc if isinstance(exc, Exception) else ReaderLost("cancelled"))
            self._all.discard(proto)
            if fut is not None and fut.done() and not fut.cancelled():
                fut.exception()  # retrieved: the error raised here says it
            raise
        self._idle.setdefault(node, []).append(proto)
        return replies

    async def _acquire(self, node: str) -> _Protocol:
        idle = self._idle.get(node)
        while idle:
            proto = idle.pop()
            if proto.lost is None:
                return proto
            self._all.discard(proto)
        host, _, port = node.rpartition(":")
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(self._connect_timeout):
            _transport, proto = await loop.create_connection(
                lambda: _Protocol(self._header_bytes),
                host.strip("[]"),
                int(port),
                ssl=self._ssl,
                server_hostname=host.strip("[]") if self._ssl is not None else None,
            )
        self._all.add(proto)
        if self._auth is not None:
            try:
                (reply,) = await proto.send(self._auth, [None])
            except BaseException:
                proto.abort(ReaderLost("auth"))
                self._all.discard(proto)
                raise
            if isinstance(reply, BulkError):
                proto.abort(ReaderLost("auth refused"))
                self._all.discard(proto)
                raise ReaderLost(f"AUTH refused: {reply.text.split(' ', 1)[0]}")
        return proto

    def drop(self, node: str) -> None:
        """Close the idle connections to ``node`` (it failed)."""
        for proto in self._idle.pop(node, []):
            proto.abort(ReaderLost("node failed"))
            self._all.discard(proto)

    async def aclose(self) -> None:
        """Close every connection."""
        for proto in list(self._all):
            proto.abort(ReaderLost("closed"))
        self._all.clear()
        self._idle.clear()
        await asyncio.sleep(0)
