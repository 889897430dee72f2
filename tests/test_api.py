from __future__ import annotations

import kvtier
from kvtier import errors

PUBLIC = {
    "KEY_BYTES",
    "AlignmentError",
    "BlockNotFoundError",
    "BusyError",
    "CapacityError",
    "ClusterTierConfig",
    "ClosedError",
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
    "UnsafeSharedFileError",
    "StoreSummary",
    "TensorSpec",
    "TierIOError",
    "TierReport",
    "TransferError",
    "Worker",
    "WorkerError",
    "WorkerGroup",
    "WorkerLostError",
    "__version__",
    "chain_keys",
}


def test_all_is_exactly_the_public_api() -> None:
    assert set(kvtier.__all__) == PUBLIC
    assert len(kvtier.__all__) == len(PUBLIC)
    for name in kvtier.__all__:
        assert hasattr(kvtier, name), name


def test_every_error_is_a_kvtier_error() -> None:
    for name in errors.__all__:
        cls = getattr(errors, name)
        assert issubclass(cls, kvtier.KVTierError), name


def test_error_builtins() -> None:
    assert issubclass(kvtier.BlockNotFoundError, KeyError)
    assert issubclass(kvtier.TierIOError, OSError)
    assert issubclass(kvtier.ConfigurationError, ValueError)
    assert issubclass(kvtier.AlignmentError, ValueError)
    assert str(kvtier.BlockNotFoundError("key abc is not resident")) == "key abc is not resident"


def test_io_error_carries_errno_and_path() -> None:
    import errno
    import pickle

    exc = kvtier.TierIOError(errno.ENOSPC, "writing block", "/x/y")
    assert exc.errno == errno.ENOSPC
    assert exc.filename == exc.path == "/x/y"
    assert "ENOSPC" in str(exc)
    assert "/x/y" in str(exc)
    back = pickle.loads(pickle.dumps(exc))
    assert (back.errno, back.path, type(back)) == (exc.errno, exc.path, type(exc))


def test_alignment_error_message() -> None:
    exc = kvtier.AlignmentError(0x1001, 100, 4096)
    assert "0x1001" in str(exc)
    assert "100 bytes" in str(exc)
    assert "4096" in str(exc)
