"""Configuration: frozen, validated models loadable from a dict or a TOML file.

Sizes are bytes and accept strings with units (``"8GiB"``, ``"512 MB"``), parsed
by pydantic's :class:`~pydantic.ByteSize`: whole bytes from 1 to 1 EiB, never a
bool. Every invalid value raises :class:`~kvtier.errors.ConfigurationError`
naming the field and the problem.

Names follow vLLM's KV offloading where it has one (``cpu_bytes_to_use``,
``blocks_per_chunk``, ``eviction_policy``).
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal, Self

from pydantic import (
    BaseModel,
    BeforeValidator,
    ByteSize,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)

from kvtier.errors import ConfigurationError

if TYPE_CHECKING:
    from kvtier.layout import KVLayout
    from kvtier.region import CPURegion
    from kvtier.tiers.base import Tier
    from kvtier.transfer.io_engine import IOEngine

__all__ = [
    "ClusterMode",
    "ClusterTierConfig",
    "DirectIOMode",
    "EvictionPolicyName",
    "FileTierConfig",
    "IOEngineName",
    "KVTierConfig",
    "QueueDepth",
    "RecoveryMode",
    "WritePolicy",
]

EvictionPolicyName = Literal["lru", "arc"]
WritePolicy = Literal["write_through", "write_back"]
IOEngineName = Literal["auto", "io_uring", "threads"]
DirectIOMode = Literal["auto", "require", "off"]
DurabilityMode = Literal["none", "fsync"]
RecoveryMode = Literal["foreground", "background"]

MAX_QUEUE_DEPTH = 4096
"""Largest queue depth accepted (the io_uring ring's entries)."""


def _queue_depth(value: object) -> object:
    """``"auto"`` or an int of 1..4096 (never a bool, never a numeric string)."""
    if value == "auto" and isinstance(value, str):
        return value
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"Input should be an int from 1 to {MAX_QUEUE_DEPTH} or 'auto'")
    if value < 1:
        raise ValueError("Input should be greater than or equal to 1")
    if value > MAX_QUEUE_DEPTH:
        raise ValueError(f"Input should be less than or equal to {MAX_QUEUE_DEPTH}")
    return value


QueueDepth = Annotated[int | Literal["auto"], BeforeValidator(_queue_depth)]
"""A queue depth: an int of 1..4096, or ``"auto"`` (measured at open)."""


def _invalid(model: str, problems: list[tuple[str, str]]) -> ConfigurationError:
    lines = "\n  ".join(f"{where}: {what}" for where, what in problems)
    return ConfigurationError(f"invalid {model}:\n  {lines}", tuple(problems))


def _problems(exc: ValidationError) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    for err in exc.errors(include_url=False):
        where = ".".join(str(part) for part in err["loc"])
        # A nested model raised its own ConfigurationError, which pydantic wrapped:
        # lift its problems out so the report is one flat list with full paths.
        inner = err.get("ctx", {}).get("error")
        if isinstance(inner, ConfigurationError) and inner.problems:
            out.extend((f"{where}.{sub}" if where else sub, msg) for sub, msg in inner.problems)
            continue
        got = err.get("input")
        shown = "" if isinstance(got, Mapping) else f" (got {got!r})"
        msg = err["msg"].removeprefix("Value error, ")
        out.append((where or "<root>", f"{msg}{shown}"))
    return out


MAX_BYTES = 1 << 60
"""Largest budget accepted (1 EiB): above any memory or filesystem a machine has,
and far below the 64-bit sizes that ``mmap``, ``fallocate`` and ``ctypes`` take,
so a typo cannot overflow a size further down instead of failing here."""


def _plain_bytes(value: Any) -> Any:
    # ByteSize reads -5 as an unparsable string and True as 1 byte; say what is wrong.
    if isinstance(value, bool):
        raise ValueError("must be a number of bytes, not a bool")
    if isinstance(value, int | float) and value < 0:
        raise ValueError("must be a positive number of bytes")
    return value


Bytes = Annotated[ByteSize, BeforeValidator(_plain_bytes), Field(gt=0, le=MAX_BYTES)]


class _Frozen(BaseModel):
    """Base: immutable, unknown keys rejected, validation errors re-raised as ours."""

    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True)

    def __init__(self, /, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise _invalid(type(self).__name__, _problems(exc)) from exc

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Self:
        """Build and validate from a mapping (e.g. parsed JSON or TOML).

        Raises
        ------
        ConfigurationError
            When ``data`` is not a mapping or a field is invalid.
        """
        if not isinstance(data, Mapping):
            raise ConfigurationError(f"{cls.__name__} expects a mapping, got {type(data).__name__}")
        return cls(**dict(data))


class FileTierConfig(_Frozen):
    """The O_DIRECT filesystem tier below the CPU region."""

    root: Path
    """Directory holding the tier (created with mode 0700 if missing)."""
    bytes_to_use: Bytes
    """Hard budget of ``root`` on disk, in bytes (accepts ``"64GiB"``): everything
    kvtier writes under the root counts, for every namespace (one per KV
    layout) together: slot files, quarantine copies, metadata, directories.
    A namespace's slot file (whole slots of a 4 KiB header plus one block) is
    reserved at open from what the other namespaces leave (see ``reclaim``)."""
    write_policy: WritePolicy = "write_through"
    """``write_through``: every stored block is also written to disk;
    ``write_back``: a block goes to disk only when the CPU tier evicts it."""
    eviction_policy: EvictionPolicyName = "lru"
    """Which blocks leave the file tier first when it is full."""
    io_engine: IOEngineName = "auto"
    """``io_uring``, ``threads`` (os.preadv / os.pwritev in a pool) or ``auto`` (probe)."""
    direct_io: DirectIOMode = "auto"
    """``require``: fail where O_DIRECT is refused; ``auto``: fall back to buffered
    I/O with a warning; ``off``: buffered I/O."""
    queue_depth: QueueDepth = "auto"
    """Most I/O requests in flight at once: an int of 1..4096, or ``auto``, which
    measures the depths 1 to 32 (and on io_uring 64 for blocks of 256 KiB up to
    2 MiB) on the tier's own slot file at open and takes the deepest whose best round is within
    10% of the fastest depth's typical rate (32 where the file is too small to
    measure or is not O_DIRECT)."""
    durability: DurabilityMode = "none"
    """``fsync``: the slot file is fsynced before a written block becomes visible
    (survives power loss; one flush per group of blocks written meanwhile);
    ``none``: survives a process crash, not a power loss."""
    reclaim: Literal["lru", "off"] = "lru"
    """What an open does when namespaces that no tier has open (other models,
    dtypes or block sizes) hold part of the budget. ``lru``: delete them, least
    recently used first, until the namespace being opened has the whole budget
    less what open namespaces hold; ``off``: keep them, and open with what is
    left (a warning names who holds what)."""
    instances: int = Field(default=1, ge=1, le=256)
    """Live instances (processes, engines) that share this root at once: each
    opens its own partition of the namespace and takes at most
    ``bytes_to_use // instances`` of the budget, and every instance reads the
    blocks any other stored (``docs/file-tier.md``, "Sharing a root")."""
    peer_poll_s: float = Field(default=0.02, gt=0, le=10)
    """How often the blocks other instances sharing the root stored (or
    dropped) are picked up: a block is found by the other instances' lookups
    within about this many seconds of its write's completion."""
    recovery: RecoveryMode = "foreground"
    """How an existing slot file is read back at open. ``foreground``: open returns
    once every block is known (about 1-2 s per 100 000 blocks here);
    ``background``: open returns at once and the tier knows no block, and
    refuses stores, until the scan ends (for very large tiers)."""

    @field_validator("root", mode="before")
    @classmethod
    def _root(cls, value: object) -> object:
        # Path("") is "." : an empty root would silently become the working directory.
        if isinstance(value, str | os.PathLike) and not os.fspath(value).strip():
            raise ValueError("must name a directory, got an empty path")
        return value

    @field_validator("root")
    @classmethod
    def _root_is_directory(cls, value: Path) -> Path:
        # Checked here, not at open: the error then names the key to fix.
        if value.exists() and not value.is_dir():
            raise ValueError(f"{value} exists and is not a directory")
        return value

    @property
    def buffer_alignment(self) -> int:
        """Alignment the tier needs of the CPU rows it reads and writes (O_DIRECT)."""
        return 4096

    name: ClassVar[str] = "file"
    """The tier's name in a chain (statistics, logs)."""

    @property
    def promotes_up(self) -> bool:
        """The highest lower tier: nothing above it to promote into."""
        return False

    async def open_below(
        self,
        layout: KVLayout,
        region: CPURegion,
        *,
        io_engine: IOEngine | None = None,
        enable_events: bool = False,
    ) -> Tier:
        """Open this file tier for ``region``'s rows, the region registered with it."""
        from kvtier.engine import open_file_tier_below

        return await open_file_tier_below(
            self, layout, region, io_engine=io_engine, enable_events=enable_events
        )


ClusterMode = Literal["cluster", "single"]

_NODE = r"^[A-Za-z0-9_.\-\[\]:]{1,255}:[0-9]{1,5}$"


class ClusterTierConfig(_Frozen):
    """A tier on a Valkey/Redis cluster (or one server) shared by many instances.

    In :class:`KVTierConfig` it is the lowest tier: below the file tier when
    there is one (CPU -> file -> cluster), else directly below the CPU region
    (CPU -> cluster).
    """

    nodes: tuple[Annotated[str, Field(pattern=_NODE)], ...] = Field(min_length=1)
    """``"host:port"`` of the servers to start from: any nodes of a cluster (the
    client learns the rest), or the one server with ``mode="single"``."""
    mode: ClusterMode = "cluster"
    """``cluster``: Redis Cluster protocol (slots, MOVED/ASK); ``single``: one
    server, not in cluster mode."""
    tenant_prefix: str = Field(default="kvtier", pattern=r"^[A-Za-z0-9_.\-]{1,64}$")
    """First part of every key: separates tenants sharing one cluster. Letters,
    digits, ``_``, ``.``, ``-`` only (never ``{``, ``}`` or ``:``, which would
    change slot hashing or the key layout)."""
    username: str | None = Field(default=None, min_length=1, max_length=256)
    """ACL user (``AUTH username password``); None for the default user."""
    password: SecretStr | None = None
    """Password of the user; never logged (masked in ``repr``)."""
    tls: bool = False
    """Connect with TLS."""
    tls_ca_file: Path | None = None
    """CA bundle that verifies the servers' certificates (system default if None)."""
    tls_cert_file: Path | None = None
    """Client certificate, for servers that require one (``tls-auth-clients``)."""
    tls_key_file: Path | None = None
    """Private key of ``tls_cert_file``."""
    tls_check_hostname: bool = True
    """Check that the certificate names the host connected to."""
    timeout_s: float = Field(default=2.0, gt=0, le=600)
    """Bound on one pipeline (send and replies) and on socket reads: a pipeline
    that takes longer fails its blocks with ``ETIMEDOUT``."""
    connect_timeout_s: float = Field(default=1.0, gt=0, le=600)
    """Bound on opening one connection."""
    max_inflight_bytes: Bytes = Field(default=ByteSize(8 << 20))
    """Value bytes in one pipeline on one connection (at least one block goes):
    pipelines above about 8 MiB per connection slowed SET by 2-4x here."""
    pipelines_per_node: int = Field(default=2, ge=1, le=64)
    """Pipelines in flight at once to one node, each on its own connection."""
    backoff_initial_s: float = Field(default=0.05, gt=0, le=60)
    """First wait before talking again to a node that failed."""
    backoff_max_s: float = Field(default=2.0, gt=0, le=600)
    """Longest wait between tries (the wait doubles per failure up to it)."""
    direct_reads: bool = True
    """Loads read each GET reply's payload straight into its CPU row (a
    connection of the tier's own per node, :mod:`kvtier.tiers.cluster._reader`)
    instead of through redis-py, which allocates and copies every reply:
    measured at 1.5-1.8x the throughput and a third of the client CPU here.
    Redirected keys are read again through redis-py either way."""
    presence_capacity: int = Field(default=1 << 20, ge=1, le=1 << 30)
    """Keys remembered as present by this instance (least recently used dropped
    first): what :meth:`~kvtier.tiers.cluster.ClusterTier.lookup` answers from."""
    write_policy: WritePolicy = "write_through"
    """In an engine: ``write_through``: every stored block is also written to
    the cluster in the background; ``write_back``: a block goes to the cluster
    only when the CPU tier evicts it (and at a clean close)."""
    promote_to_file: bool | None = None
    """In an engine with a file tier: a block loaded from the cluster is also
    given to the file tier (written at once under the file tier's
    ``write_through``, at CPU eviction under its ``write_back``), so that the
    next load on this machine reads it locally. ``None``: yes when there is a
    file tier; ``True`` without a file tier is an error."""

    @field_validator("tls_ca_file", "tls_cert_file", "tls_key_file")
    @classmethod
    def _readable(cls, value: Path | None) -> Path | None:
        if value is not None and not value.is_file():
            raise ValueError(f"{value} is not a readable file")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> ClusterTierConfig:
        if self.mode == "single" and len(self.nodes) != 1:
            raise ValueError('mode="single" takes exactly one node')
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("tls_cert_file and tls_key_file go together")
        if not self.tls and any(
            f is not None for f in (self.tls_ca_file, self.tls_cert_file, self.tls_key_file)
        ):
            raise ValueError("TLS files are given but tls is false")
        if self.username is not None and self.password is None:
            raise ValueError("username needs a password")
        if self.backoff_max_s < self.backoff_initial_s:
            raise ValueError("backoff_max_s is below backoff_initial_s")
        return self

    name: ClassVar[str] = "cluster"
    """The tier's name in a chain (statistics, logs)."""

    @property
    def buffer_alignment(self) -> int | None:
        """None: the cluster tier copies rows through its client and needs no alignment."""
        return None

    @property
    def promotes_up(self) -> bool:
        """Whether a block promoted from the cluster also goes to the tiers above it."""
        return self.promote_to_file is not False

    async def open_below(
        self,
        layout: KVLayout,
        region: CPURegion,
        *,
        io_engine: IOEngine | None = None,
        enable_events: bool = False,
    ) -> Tier:
        """Open the cluster tier for blocks of ``region``'s rows (no events, no I/O engine)."""
        from kvtier.tiers.cluster import ClusterTier

        return await ClusterTier.open(self, layout, block_bytes=region.row_stride)

    def addresses(self) -> list[tuple[str, int]]:
        """``(host, port)`` of every node in :attr:`nodes`."""
        out = []
        for node in self.nodes:
            host, _, port = node.rpartition(":")
            out.append((host.strip("[]"), int(port)))
        return out


class KVTierConfig(_Frozen):
    """An engine instance: CPU region budget, offload granularity and the tiers below.

    The tiers below the CPU region form one chain, highest first: the file
    tier, then the cluster tier; either may be absent.
    """

    cpu_bytes_to_use: Bytes
    """Budget of the CPU region in bytes, instance-wide (all workers together);
    never exceeded (accepts ``"8GiB"``)."""
    blocks_per_chunk: int = Field(default=1, ge=1, le=4096)
    """Device blocks per offloaded block (one CPU row, one file)."""
    eviction_policy: EvictionPolicyName = "lru"
    """Which blocks leave the CPU region first when it is full."""
    file_tier: FileTierConfig | None = None
    """The filesystem tier, directly below the CPU region, or ``None``."""
    cluster_tier: ClusterTierConfig | None = None
    """The tier on a Valkey/Redis cluster shared by many instances, the lowest
    of the chain (below the file tier, or directly below the CPU region
    without one), or ``None``. Needs the ``redis`` client (the ``cluster`` extra)."""
    shared_region_name: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    """Name of a CPU region in /dev/shm shared by several worker processes;
    ``None`` maps a private anonymous region."""
    world_size: int = Field(default=1, ge=1, le=1024)
    """Worker processes sharing each row (tensor-parallel size)."""

    @model_validator(mode="after")
    def _chain(self) -> KVTierConfig:
        if (
            self.cluster_tier is not None
            and self.cluster_tier.promote_to_file
            and self.file_tier is None
        ):
            where, what = "cluster_tier.promote_to_file", "is true but there is no file_tier"
            raise ConfigurationError(f"{where} {what}", ((where, what),))
        return self

    @property
    def chain(self) -> tuple[tuple[str, FileTierConfig | ClusterTierConfig], ...]:
        """The tiers below the CPU region, highest first, by name (``file``, ``cluster``)."""
        specs = (self.file_tier, self.cluster_tier)
        return tuple((spec.name, spec) for spec in specs if spec is not None)

    @property
    def row_alignment(self) -> int | None:
        """Alignment the chain needs of the CPU region's rows, ``None`` for none.

        The file tier reads and writes rows with O_DIRECT; the cluster tier
        copies them through its client and needs none.
        """
        needs = [a for _, spec in self.chain if (a := spec.buffer_alignment) is not None]
        return max(needs) if needs else None

    @classmethod
    def from_toml(cls, path: str | os.PathLike[str]) -> Self:
        """Load from a TOML file; a ``[kvtier]`` table is used if present.

        Raises
        ------
        ConfigurationError
            When the file cannot be read, is not TOML, or a field is invalid.
        """
        try:
            with open(path, "rb") as fh:
                data = tomllib.load(fh)
        except OSError as exc:
            raise ConfigurationError(f"cannot read configuration file {path}: {exc}") from exc
        except tomllib.TOMLDecodeError as exc:
            raise ConfigurationError(f"{path} is not valid TOML: {exc}") from exc
        table = data.get("kvtier", data)
        return cls.from_dict(table)
