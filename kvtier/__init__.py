"""kvtier: asyncio tiered storage for the KV cache of LLM serving.

GPU KV tensors -> pinned, page-aligned CPU region -> a chain of tiers below it,
each optional: host (shared memory, one per host) -> file (O_DIRECT, io_uring)
-> cluster (Valkey/Redis). Only the names in ``__all__`` are the public API.
"""

from __future__ import annotations

from kvtier.chain import FrontStatistics, TierReport
from kvtier.config import ClusterTierConfig, FileTierConfig, KVTierConfig
from kvtier.engine import Engine, EngineCounts, StoreSummary
from kvtier.errors import (
    AlignmentError,
    BlockNotFoundError,
    BusyError,
    CapacityError,
    ClosedError,
    ConfigurationError,
    DirectIOUnsupportedError,
    IntegrityError,
    InvalidArgumentError,
    KVTierError,
    LayoutError,
    NamespaceMismatchError,
    ProtocolError,
    SharedRegionError,
    TierIOError,
    TransferError,
    UnsafeSharedFileError,
    WorkerError,
    WorkerLostError,
)
from kvtier.keys import KEY_BYTES, chain_keys
from kvtier.layout import KVEncoding, KVLayout, TensorSpec
from kvtier.workers import Worker, WorkerGroup

__version__ = "0.1.0"

__all__ = [
    "KEY_BYTES",
    "AlignmentError",
    "BlockNotFoundError",
    "BusyError",
    "CapacityError",
    "ClosedError",
    "ClusterTierConfig",
    "ConfigurationError",
    "DirectIOUnsupportedError",
    "Engine",
    "EngineCounts",
    "FileTierConfig",
    "FrontStatistics",
    "IntegrityError",
    "InvalidArgumentError",
    "KVEncoding",
    "KVLayout",
    "KVTierConfig",
    "KVTierError",
    "LayoutError",
    "NamespaceMismatchError",
    "ProtocolError",
    "SharedRegionError",
    "StoreSummary",
    "TensorSpec",
    "TierIOError",
    "TierReport",
    "TransferError",
    "UnsafeSharedFileError",
    "Worker",
    "WorkerError",
    "WorkerGroup",
    "WorkerLostError",
    "__version__",
    "chain_keys",
]
