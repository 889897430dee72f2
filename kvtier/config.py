"""Configuration: frozen, validated models loadable from a dict or a TOML file.

Sizes are bytes: an int, or a string with a unit (``"8GiB"``, ``"2M"``,
``"512 MB"``), read by :func:`parse_bytes`. ``K M G T P E`` and ``KiB MiB GiB
TiB PiB EiB`` are powers of 1024, ``KB MB GB TB PB EB`` powers of 1000 (GNU
coreutils' rule: ``dd bs=2M``), any case; a fraction is taken only where it
makes whole bytes (``"1.5GiB"``, never ``"1.5 B"``); from 1 byte to 1 EiB,
never a bool. Every invalid value raises
:class:`~kvtier.errors.ConfigurationError` naming the field and the problem; an
unknown key names the nearest valid one.

Names follow vLLM's KV offloading where it has one (``cpu_bytes_to_use``,
``blocks_per_chunk``, ``eviction_policy``).
"""

from __future__ import annotations

import difflib
import math
import os
import re
import tomllib
import typing
from collections.abc import Mapping
from fractions import Fraction
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, Self

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

__all__ = [
    "ClusterMode",
    "ClusterTierConfig",
    "DirectIOMode",
    "EvictionPolicyName",
    "FileTierConfig",
    "HostTierConfig",
    "IOEngineName",
    "KVTierConfig",
    "QueueDepth",
    "RecoveryMode",
    "TierConfig",
    "WritePolicy",
    "parse_bytes",
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


def _model_at(model: type[BaseModel], path: tuple[int | str, ...]) -> type[BaseModel] | None:
    """The model whose fields the keys at ``path`` (below ``model``) are, if one."""
    for part in path:
        field = model.model_fields.get(str(part))
        if field is None:
            return None
        kinds = typing.get_args(field.annotation) or (field.annotation,)
        nested = [k for k in kinds if isinstance(k, type) and issubclass(k, BaseModel)]
        if len(nested) != 1:
            return None
        model = nested[0]
    return model


def _unknown_key(model: type[BaseModel], loc: tuple[int | str, ...]) -> str:
    """What to say of the unknown key at ``loc``: the nearest valid key, or them all."""
    owner = _model_at(model, loc[:-1])
    if owner is None:
        return "unknown key"
    keys = list(owner.model_fields)
    near = difflib.get_close_matches(str(loc[-1]), keys, n=1, cutoff=0.6)
    if near:
        return f"unknown key, did you mean {near[0]!r}?"
    return f"unknown key (the keys of {owner.__name__} are {', '.join(keys)})"


def _problems(exc: ValidationError, model: type[BaseModel]) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    for err in exc.errors(include_url=False):
        where = ".".join(str(part) for part in err["loc"])
        # A nested model raised its own ConfigurationError, which pydantic wrapped:
        # lift its problems out so the report is one flat list with full paths.
        inner = err.get("ctx", {}).get("error")
        if isinstance(inner, ConfigurationError) and inner.problems:
            out.extend((f"{where}.{sub}" if where else sub, msg) for sub, msg in inner.problems)
            continue
        if err["type"] == "extra_forbidden" and err["loc"]:
            out.append((where, _unknown_key(model, err["loc"])))
            continue
        got = err.get("input")
        shown = "" if isinstance(got, Mapping) else f" (got {got!r})"
        msg = err["msg"].removeprefix("Value error, ")
        out.append((where or "<root>", f"{msg}{shown}"))
    return out


MIN_PEER_POLL_S = 0.001
"""Shortest ``peer_poll_s`` accepted (1 ms): a poll compares every peer's index,
so a shorter period (``1e-9``) would be a busy loop of the event loop."""

MAX_BYTES = 1 << 60
"""Largest budget accepted (1 EiB): above any memory or filesystem a machine has,
and far below the 64-bit sizes that ``mmap``, ``fallocate`` and ``ctypes`` take,
so a typo cannot overflow a size further down instead of failing here."""


_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([A-Za-z]*)\s*")
_UNITS: dict[str, int] = {"": 1, "b": 1}
for _power, _prefix in enumerate("kmgtpe", start=1):
    _UNITS[_prefix] = _UNITS[_prefix + "i"] = _UNITS[_prefix + "ib"] = 1024**_power
    _UNITS[_prefix + "b"] = 1000**_power
del _power, _prefix


def parse_bytes(value: object) -> int:
    """A number of bytes from an int or a string with a unit, by one rule.

    ``K M G T P E`` (also ``Ki``...) and ``KiB MiB GiB TiB PiB EiB`` are powers of
    1024; ``KB MB GB TB PB EB`` are powers of 1000; ``B`` or no unit is bytes;
    any case, spaces allowed (``"2M"`` and ``"2MiB"`` are 2,097,152, ``"2MB"``
    2,000,000). This is GNU coreutils' rule (``dd bs=2M``, ``truncate -s 4G``).
    A fraction is taken where it makes a whole number of bytes (``"1.5GiB"``,
    ``"0.5K"``) and refused where it does not (``"1.5 B"``, ``"0.1K"``); a float
    must be whole. No range is checked here but the sign.

    Raises
    ------
    ValueError
        For a bool, a negative or fractional number of bytes, or a string that is
        not a number with a known unit.
    """
    if isinstance(value, bool):
        raise ValueError("must be a number of bytes, not a bool")
    if isinstance(value, int):
        if value < 0:
            raise ValueError("must be a positive number of bytes")
        return int(value)
    if isinstance(value, float):
        if value < 0:
            raise ValueError("must be a positive number of bytes")
        if not math.isfinite(value) or not value.is_integer():
            raise ValueError("must be a whole number of bytes")
        return int(value)
    if not isinstance(value, str):
        raise ValueError(f"must be a number of bytes or a size string, not {type(value).__name__}")
    if value.strip().startswith("-"):
        raise ValueError("must be a positive number of bytes")
    match = _SIZE.fullmatch(value)
    if match is None:
        raise ValueError(
            "could not parse a size: a number and an optional unit (4096, 512KiB, 2M, 8GiB, 1.5GB)"
        )
    number, unit = match.groups()
    scale = _UNITS.get(unit.lower())
    if scale is None:
        raise ValueError(
            f"unknown unit {unit!r}: B, K/KiB, M/MiB, G/GiB, T/TiB, P/PiB, E/EiB "
            "(powers of 1024) or KB, MB, GB, TB, PB, EB (powers of 1000)"
        )
    size = Fraction(number) * scale
    if size.denominator != 1:
        raise ValueError(f"not a whole number of bytes ({float(size):,.1f} bytes)")
    return int(size)


def _to_bytes(value: Any) -> Any:
    # Every size through parse_bytes, so ByteSize below only ever sees an int:
    # its own parser reads "4G" as 4e9 and "1.5 B" as 1 byte.
    return parse_bytes(value)


Bytes = Annotated[ByteSize, BeforeValidator(_to_bytes), Field(gt=0, le=MAX_BYTES)]


class _Frozen(BaseModel):
    """Base: immutable, unknown keys rejected, validation errors re-raised as ours."""

    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True)

    def __init__(self, /, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise _invalid(type(self).__name__, _problems(exc, type(self))) from exc

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
    instances: int = Field(default=1, ge=1, le=256, strict=True)
    """Live instances (processes, engines) that share this root at once: each
    opens its own partition of the namespace and takes at most
    ``bytes_to_use // instances`` of the budget, and every instance reads the
    blocks any other stored (``docs/file-tier.md``, "Sharing a root")."""
    peer_poll_s: float = Field(default=0.02, ge=MIN_PEER_POLL_S, le=10, strict=True)
    """How often the blocks other instances sharing the root stored (or
    dropped) are picked up: a block is found by the other instances' lookups
    within about this many seconds of its write's completion. From 0.001
    (below, the event loop would do little else) to 10 seconds."""
    recovery: RecoveryMode = "foreground"
    """How an existing slot file is read back at open. ``foreground``: open returns
    once every block is known (about 1-2 s per 100 000 blocks here);
    ``background``: open returns at once and the tier knows no block, and
    refuses stores, until the scan ends (for very large tiers)."""

    @field_validator("root", mode="before")
    @classmethod
    def _root(cls, value: object) -> object:
        if not isinstance(value, str | os.PathLike):
            return value
        text = os.fspath(value)
        if not isinstance(text, str):
            return value
        # Path("") is "." : an empty root would silently become the working directory.
        if not text.strip():
            raise ValueError("must name a directory, got an empty path")
        # "~/cache" is the home directory's, as in a shell; left as it is, it
        # would create a directory named "~" in the working directory.
        if text.startswith("~"):
            expanded = os.path.expanduser(text)
            if expanded.startswith("~"):
                raise ValueError(
                    f"cannot expand {text!r} (no such user, or HOME unset): "
                    "write ./~... for a directory named ~"
                )
            return expanded
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
        """A block read from the file tier also goes to the host tier above it, when
        there is one (so that the other instances on the host find it in RAM)."""
        return True


class HostTierConfig(_Frozen):
    """One CPU tier per host in shared memory, shared by every instance on it.

    In :class:`KVTierConfig` it is the highest lower tier (CPU -> host -> file
    -> cluster): every block stored from the device is also written to this
    instance's rows of the host segment, and a block any instance on the host
    holds is read from its row (verified) into a CPU row. See
    ``docs/host-tier.md``.
    """

    bytes_to_use: Bytes
    """The host budget: the whole segment's rows (``4096 + block`` bytes each,
    rounded to pages), for every instance together. Every instance of the
    namespace on the host gives the same value; one that gives another is
    refused (``ConfigurationError`` naming both) while the segment is live."""
    instances: int = Field(default=2, ge=1, le=256, strict=True)
    """Instances attached at once at most (one per GPU, typically): each owns
    at most ``rows // instances`` rows (it stores, evicts and reuses only its
    own) and reads every row. Checked like ``bytes_to_use``."""
    directory: Path = Path("/dev/shm")
    """Where the segment file lives: a tmpfs (or hugetlbfs) mount."""
    lease_ttl_s: float = Field(default=5.0, gt=0, le=600)
    """A reader's lease on a peer's row older than this is not honoured by the
    row's owner (the reader's checks after its copy still make a reused row a
    miss, never wrong bytes)."""
    peer_poll_s: float = Field(default=0.02, ge=MIN_PEER_POLL_S, le=10, strict=True)
    """How often the blocks other instances stored (or evicted) are picked up
    (a compare of the row table's sequence words: no syscall)."""
    orphan_grace_s: float | None = Field(default=30.0, gt=0, le=86400)
    """Seconds a segment no instance holds is kept (for an instance restarting to
    adopt its blocks) before a janitor process removes it, when its instances were
    all killed (or force-killed by their server's shutdown) and none could close
    it; ``None``: no janitor (``kvtier gc --shm`` removes such a segment)."""
    write_policy: Literal["write_through"] = "write_through"
    """Every stored block is written to the host tier at once (so that the other
    instances find it); the only policy."""

    @field_validator("directory")
    @classmethod
    def _directory(cls, value: Path) -> Path:
        if not value.is_dir():
            raise ValueError(f"{value} is not a directory (a tmpfs mount such as /dev/shm)")
        return value

    name: ClassVar[str] = "host"
    """The tier's name in a chain (statistics, logs)."""

    @property
    def buffer_alignment(self) -> int | None:
        """None: the host tier copies rows with memcpy and needs no alignment."""
        return None

    @property
    def promotes_up(self) -> bool:
        """The highest lower tier: nothing above it to promote into."""
        return False


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
    """Bound on opening one connection, and on each probe of a node (connect,
    TLS and AUTH handshakes, ``PING``): at open every node is probed at once,
    so a node that does not answer (down, or hung: connections accepted,
    nothing answered) delays the open by about this much."""
    require_at_open: bool = False
    """Fail the open (``TierIOError``, ``ETIMEDOUT`` or ``ECONNREFUSED``) unless
    every node answers. By default the tier opens anyway: a node that does not
    answer is down (a WARNING names it; its blocks are misses; a background
    task reconnects), and with no node answering every block is a miss until
    one does. Credentials, TLS or mode refused fail the open either way."""
    max_inflight_bytes: Bytes = Field(default=ByteSize(8 << 20))
    """Value bytes in one pipeline on one connection (at least one block goes):
    pipelines above about 8 MiB per connection slowed SET by 2-4x here."""
    pipelines_per_node: int = Field(default=2, ge=1, le=64)
    """Pipelines in flight at once to one node, each on its own connection."""
    backoff_initial_s: float = Field(default=0.05, gt=0, le=60)
    """First wait before probing again a node that is down (its blocks fail at
    once meanwhile, without I/O)."""
    backoff_max_s: float = Field(default=2.0, gt=0, le=600)
    """Longest wait between probes (the wait doubles per failed probe up to it)."""
    direct_reads: bool = True
    """Loads read each GET reply's payload straight into its CPU row (a
    connection of the tier's own per node, :mod:`kvtier.tiers.cluster._reader`)
    instead of through redis-py, which allocates and copies every reply:
    measured at 1.5-1.8x the throughput and a third of the client CPU here.
    Redirected keys are read again through redis-py either way."""
    direct_writes: bool = True
    """Stores send each value (header, then its CPU row) on those connections,
    the row handed to the socket where it lies, instead of through redis-py,
    which joins a pipeline into one ``bytes`` that asyncio copies again.
    Redirected keys are written again through redis-py either way."""
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

    def addresses(self) -> list[tuple[str, int]]:
        """``(host, port)`` of every node in :attr:`nodes`."""
        out = []
        for node in self.nodes:
            host, _, port = node.rpartition(":")
            out.append((host.strip("[]"), int(port)))
        return out


TierConfig = HostTierConfig | FileTierConfig | ClusterTierConfig
"""The configuration of one tier below the CPU region."""


class KVTierConfig(_Frozen):
    """An engine instance: CPU region budget, offload granularity and the tiers below.

    The tiers below the CPU region form one chain, highest first: the host
    tier, the file tier, then the cluster tier; any may be absent.
    """

    cpu_bytes_to_use: Bytes
    """Budget of the CPU region in bytes, instance-wide (all workers together);
    never exceeded (accepts ``"8GiB"``)."""
    blocks_per_chunk: int = Field(default=1, ge=1, le=4096, strict=True)
    """Device blocks per offloaded block (one CPU row, one file)."""
    eviction_policy: EvictionPolicyName = "lru"
    """Which blocks leave the CPU region first when it is full."""
    host_tier: HostTierConfig | None = None
    """One CPU tier for every instance on the host, in shared memory, directly
    below this instance's CPU region, or ``None``."""
    file_tier: FileTierConfig | None = None
    """The filesystem tier, directly below the CPU region, or ``None``."""
    cluster_tier: ClusterTierConfig | None = None
    """The tier on a Valkey/Redis cluster shared by many instances, the lowest
    of the chain (below the file tier, or directly below the CPU region
    without one), or ``None``. Needs the ``redis`` client (the ``cluster`` extra)."""
    shared_region_name: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    """Name of a CPU region in /dev/shm shared by several worker processes;
    ``None`` maps a private anonymous region."""
    world_size: int = Field(default=1, ge=1, le=1024, strict=True)
    """Worker processes sharing each row (tensor-parallel size)."""
    decline_slow_loads: bool = False
    """A lookup answers a block of a lower tier (file, cluster) as a miss when,
    by what kvtier measured, it would arrive later than recomputing it: the
    tier's delivered seconds per block times the blocks queued ahead, against
    :attr:`recompute_s_per_block`. Counted as ``loads_declined``. Off by
    default (measured on vLLM's CPU build only, where it never hurt); a set
    ``recompute_s_per_block`` turns it on."""
    recompute_s_per_block: float | None = Field(default=None, gt=0, le=3600)
    """What computing one offloaded block costs the serving engine, in seconds;
    setting it turns :attr:`decline_slow_loads` on. ``None``: measured where
    kvtier sees the compute (under vLLM, from placement to the end of the store
    of each step's new blocks) when :attr:`decline_slow_loads` is on, and
    nothing declined where it does not see it (the Engine: its caller computes)."""

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
    def chain(self) -> tuple[tuple[str, TierConfig], ...]:
        """The tiers below the CPU region, highest first, by name (host, file, cluster)."""
        specs = (self.host_tier, self.file_tier, self.cluster_tier)
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
