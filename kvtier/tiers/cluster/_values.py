"""What a block is on the server: its key, its sealed header, and the checks that refuse a value.

The store path seals headers with it and the load path verifies replies with
it, so both read and write one format (:mod:`kvtier.tiers.block_format`'s
header, then the payload) under one key scheme,
``<tenant>:<namespace hex>:<key hex>``. It holds no state that changes and
does no I/O: the tier makes one and hands it to its collaborators.

The compiled helpers are called as ``block_format.<name>``, never bound here
by name: ``block_format`` swaps its pure-Python fallbacks for them once the
helper is built, and a name bound earlier would keep the slow one.
"""

from __future__ import annotations

from kvtier.errors import (
    BlockNotFoundError,
    IntegrityError,
    KVTierError,
    NamespaceMismatchError,
)
from kvtier.tiers import block_format
from kvtier.tiers.block_format import (
    HEADER_BYTES,
    VERIFY_OK,
    HeaderError,
    decode_header_fields,
)

__all__ = ["ValueFormat"]


class ValueFormat:
    """The key and the value of a block of one namespace and size, and why a value is refused."""

    __slots__ = ("block_bytes", "key_prefix", "namespace", "value_bytes")

    def __init__(self, tenant_prefix: str, namespace: bytes, block_bytes: int) -> None:
        self.namespace = namespace
        self.block_bytes = block_bytes
        self.value_bytes = HEADER_BYTES + block_bytes
        self.key_prefix = f"{tenant_prefix}:{namespace.hex()}:".encode()

    def key_of(self, key: bytes) -> bytes:
        """The server key of block ``key``: ``<tenant>:<namespace hex>:<key hex>``."""
        return self.key_prefix + key.hex().encode()

    def headers(
        self, keys: list[bytes], payloads: list[memoryview], stamp: int
    ) -> list[memoryview]:
        """The sealed headers of ``payloads``: two compiled calls for a pipeline's blocks."""
        heads = [memoryview(bytearray(HEADER_BYTES)) for _ in keys]
        sums = block_format.checksums(payloads)  # the GIL released once for all
        block_format.seal_headers(heads, keys, self.namespace, self.block_bytes, sums, stamp)
        return heads

    def verify_reply(
        self, key: bytes, reply: bytearray | int | None, row: memoryview
    ) -> KVTierError | None:
        """Check a direct reply as ``key``'s block, its payload already in ``row``; why not."""
        if reply is None:
            return BlockNotFoundError(f"block {key.hex()} is not in the cluster tier")
        if isinstance(reply, int):
            return IntegrityError(
                f"value has {reply} bytes, a block has {self.value_bytes} (truncated or foreign)",
                self.key_of(key).decode(),
            )
        return self.verify(key, memoryview(reply), row)

    def verify(self, key: bytes, header: memoryview, payload: memoryview) -> KVTierError | None:
        """Check ``header`` and ``payload`` as ``key``'s block; why not."""
        # One compiled call for a sound block; the reasons below for the others.
        if block_format.verify_block(header, key, self.namespace, payload) == VERIFY_OK:
            return None
        problem = self._refusal(key, header, payload)
        if problem is None:  # refused all the same: never served
            problem = IntegrityError("block failed verification", self.key_of(key).decode())
        return problem

    def _refusal(self, key: bytes, header: memoryview, payload: memoryview) -> KVTierError | None:
        """Why ``header`` and ``payload`` are not ``key``'s block (None: no reason found)."""
        where = self.key_of(key).decode()
        try:
            hkey, ns, nbytes, _at, pcheck = decode_header_fields(header)
        except HeaderError as exc:
            return IntegrityError(f"not a kvtier block: {exc}", where)
        if ns != self.namespace:
            return NamespaceMismatchError(
                f"{where}: value of namespace {ns.hex()}, expected {self.namespace.hex()}"
            )
        if hkey != key or nbytes != self.block_bytes:
            return IntegrityError("header names another block or size", where)
        if block_format.checksum(payload) != pcheck:
            return IntegrityError("payload checksum mismatch", where)
        return None

    def verify_into(self, key: bytes, value: object, into: memoryview) -> KVTierError | None:
        """Check ``value`` as ``key``'s block and copy its payload into ``into``; why not."""
        where = self.key_of(key).decode()
        if value is None:
            return BlockNotFoundError(f"block {key.hex()} is not in the cluster tier")
        if not isinstance(value, bytes):
            return IntegrityError(f"value is a {type(value).__name__}, not a block", where)
        if len(value) != self.value_bytes:
            return IntegrityError(
                f"value has {len(value)} bytes, a block has {self.value_bytes} (truncated "
                "or foreign)",
                where,
            )
        view = memoryview(value)
        payload = view[HEADER_BYTES:]
        problem = self.verify(key, view[:HEADER_BYTES], payload)
        if problem is not None:
            return problem
        into[:] = payload
        return None
