"""``kvtier inspect``: what a file tier root holds, read without opening the tier.

A namespace directory of format version 2 keeps its blocks in fixed-size slots
of one preallocated file, ``blocks.dat``: slot ``i`` is bytes
``[i * slot_bytes, (i + 1) * slot_bytes)`` and holds a 4096-byte block header
(:mod:`kvtier.tiers.block_format`) followed by the payload. A slot whose header
bytes are all zero is free; one whose header is not zero but does not decode is
torn (an interrupted write).

Reading is safe while a tier has the root open: ``blocks.dat`` is opened
read-only, nothing here writes or renames. Whether a namespace is open is
asked with a non-blocking shared ``flock`` on its ``lock``, under a shared
lock on the root's ``kvtier.lock`` (held for that moment only, never during
the slot scan), so that the question cannot make a tier that is opening fail
(see :mod:`kvtier.tiers.file`, the root lock). A slot the tier rewrites while we read it may
be seen half-written and reported torn or failing its checksum: the report
describes the bytes as they were read.

Directories of format version 1 (one file per block under ``blocks/``) are
reported as legacy with a count of their files and are not read: the tier
no longer deletes them (it rewrites ``namespace.json`` and leaves
``blocks/``, counted in the budget); remove ``blocks/`` by hand.
"""

from __future__ import annotations

import contextlib
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtier.errors import InvalidArgumentError, TierIOError
from kvtier.tiers.block_format import (
    HEADER_BYTES,
    BlockHeader,
    HeaderError,
    checksum,
    decode_header,
)
from kvtier.tiers.file import TIER_FORMAT_VERSION as FORMAT_VERSION
from kvtier.tiers.file import (
    Description,
    NamespaceUsage,
    lock_root_blocking,
    read_description,
    scan_root,
)

__all__ = ["BadFile", "NamespaceReport", "inspect_root"]


_ZERO_HEADER = bytes(HEADER_BYTES)


@dataclass(frozen=True, slots=True)
class BadFile:
    """A file, or one slot of ``blocks.dat``, that fails verification."""

    path: str
    """Path of the file; for a slot ``"<path of blocks.dat>@slot <index>"``."""
    reason: str
    """Why it fails."""


@dataclass(slots=True)
class NamespaceReport:
    """What one namespace directory of a root holds."""

    namespace: str
    """The namespace directory's name: the namespace (32 hex characters), then
    ``.<n>`` for partition ``n`` of a root shared by live instances."""
    description: dict[str, Any] | None
    """Contents of ``namespace.json`` (None when missing, unreadable or of the
    wrong shape: then ``bad`` says which field)."""
    last_used: float | None = None
    """When a tier last opened or closed the namespace (seconds since the
    epoch, the ``lock`` file's mtime), None when unknown."""
    disk_bytes: int = 0
    """Bytes allocated to the namespace directory and everything under it
    (``st_blocks * 512``): what it takes from the root's budget."""
    open: bool | None = None
    """True while a tier has the namespace open; None when it could not be asked."""
    format_version: int | None = None
    """``format_version`` of ``namespace.json``; when that is missing, 2 if
    ``blocks.dat`` exists, 1 if ``blocks/`` does, else None."""
    legacy: bool = False
    """A format version 1 directory (one file per block), which is not read."""
    legacy_files: int = 0
    """Regular files under ``blocks/`` (the version 1 block files)."""
    legacy_bytes: int = 0
    """Their bytes on disk (``st_size``)."""
    slot_bytes: int | None = None
    """Bytes per slot (header plus payload), None when unknown."""
    slots: int = 0
    """Slots ``blocks.dat`` has room for (its size // ``slot_bytes``)."""
    blocks: int = 0
    """Slots holding a header that decodes (including duplicates, and slots
    whose payload fails verification)."""
    free: int = 0
    """Slots whose header bytes are all zero."""
    torn: int = 0
    """Slots whose header is not zero but does not decode (interrupted writes)."""
    duplicates: int = 0
    """Blocks whose key an earlier slot also holds (``blocks - duplicates``
    distinct keys); harmless, the tier keeps one."""
    bytes: int = 0
    """Size of ``blocks.dat`` (``st_size``)."""
    quarantined: int = 0
    """Entries in ``quarantine/`` (copies of slots that failed verification)."""
    temporaries: int = 0
    """Entries in ``tmp/`` (short-lived probe files)."""
    verified: int = 0
    """Blocks whose namespace, payload length and payload checksum were
    checked and good (only with ``verify=True``)."""
    oldest_stored: int | None = None
    """Oldest store time among the blocks (seconds since the epoch), None when
    no block records one."""
    newest_stored: int | None = None
    """Newest store time among the blocks, None when no block records one."""
    bad: list[BadFile] = field(default_factory=list)
    """Torn slots, unreadable or inconsistent files and, with ``verify=True``,
    blocks failing verification."""

    def as_dict(self) -> dict[str, Any]:
        """Summarize the report as a JSON-able dict.

        Returns
        -------
        dict[str, Any]
            Every field but ``description``, plus ``model_id`` and
            ``block_bytes`` and ``layout`` taken from it.
        """
        desc = self.description or {}
        layout = desc.get("layout") or {}
        return {
            "namespace": self.namespace,
            "model_id": layout.get("model_id"),
            "format_version": self.format_version,
            "legacy": self.legacy,
            "legacy_files": self.legacy_files,
            "legacy_bytes": self.legacy_bytes,
            "block_bytes": desc.get("block_bytes"),
            "slot_bytes": self.slot_bytes,
            "slots": self.slots,
            "blocks": self.blocks,
            "free": self.free,
            "torn": self.torn,
            "duplicates": self.duplicates,
            "bytes": self.bytes,
            "disk_bytes": self.disk_bytes,
            "last_used": self.last_used,
            "open": self.open,
            "quarantined": self.quarantined,
            "temporaries": self.temporaries,
            "verified": self.verified,
            "oldest_stored": self.oldest_stored,
            "newest_stored": self.newest_stored,
            "bad": [{"path": b.path, "reason": b.reason} for b in self.bad],
            "layout": layout,
        }


def inspect_root(root: Path, *, verify: bool = False) -> list[NamespaceReport]:
    """Describe every namespace under a file tier root.

    Every slot's header is read and classified (free, torn, block); torn
    headers are always reported in ``bad``.

    Parameters
    ----------
    root
        The ``root`` of a :class:`~kvtier.config.FileTierConfig`.
    verify
        Also read every block's whole slot and check its namespace (against
        its directory), its payload length (against ``block_bytes``) and its
        payload checksum.

    Returns
    -------
    list[NamespaceReport]
        One per namespace directory, sorted by name.

    Raises
    ------
    InvalidArgumentError
        When ``root`` does not exist or is not a directory.
    TierIOError
        When ``root`` cannot be listed.
    """
    try:
        st = os.stat(root, follow_symlinks=False)
    except FileNotFoundError:
        raise InvalidArgumentError(f"{root} does not exist") from None
    except OSError as exc:
        raise TierIOError(exc.errno or 0, f"cannot stat the root: {exc.strerror}", root) from exc
    if not stat.S_ISDIR(st.st_mode):
        raise InvalidArgumentError(f"{root} is not a directory")
    # A shared root lock for the open/closed question only: opens and gc take
    # it exclusive, so none of them runs while namespaces' locks are probed.
    # Without a root lock file no tier of this version ever opened the root.
    lock = lock_root_blocking(root, shared=True, create=False)
    try:
        usage = scan_root(root, probe=True)
    finally:
        if lock is not None:
            os.close(lock)
    return [_inspect_namespace(ns, verify) for ns in usage.namespaces]


def _inspect_namespace(ns: NamespaceUsage, verify: bool) -> NamespaceReport:
    ns_dir = ns.path
    desc_path = ns_dir / "namespace.json"
    desc: Description | None = None
    problem: str | None = None
    try:
        desc = read_description(desc_path)
    except TierIOError as exc:
        problem = exc.strerror or str(exc)
    report = NamespaceReport(ns_dir.name, None if desc is None else desc.raw)
    report.last_used = ns.last_used
    report.disk_bytes = ns.disk_bytes
    report.open = ns.open
    report.temporaries = len(_scandir(ns_dir / "tmp"))
    report.quarantined = len(_scandir(ns_dir / "quarantine"))
    dat = ns_dir / "blocks.dat"
    has_dat = _is_regular(dat)
    has_legacy = _is_dir(ns_dir / "blocks")
    if has_legacy:
        # Counted in any directory: version 1 files left beside a blocks.dat
        # are disk the tier has yet to give back.
        report.legacy_files, report.legacy_bytes = _count_legacy(ns_dir / "blocks")
    version = None if desc is None else desc.format_version
    if version is None:
        version = 2 if has_dat else 1 if has_legacy else None
    report.format_version = version
    report.legacy = version == 1
    if problem is not None:
        # Without the slot size no slot can be found: say so rather than guess
        # from the first header, which may itself be torn.
        skipped = f"; {dat.name} not read" if has_dat else ""
        report.bad.append(BadFile(str(desc_path), f"{problem}{skipped}"))
        return report
    if not has_dat or version != FORMAT_VERSION:
        return report
    if desc is None or desc.slot_bytes is None or desc.block_bytes is None:
        report.bad.append(
            BadFile(
                str(desc_path),
                f"namespace.json is missing, so the slot size is unknown; {dat.name} not read",
            )
        )
        return report
    report.slot_bytes = desc.slot_bytes
    _scan(report, dat, desc.slot_bytes, desc.block_bytes, bytes.fromhex(desc.namespace), verify)
    return report


def _scan(
    report: NamespaceReport,
    path: Path,
    slot_bytes: int,
    block_bytes: int,
    namespace: bytes,
    verify: bool,
) -> None:
    """Classify every slot of ``path`` into ``report``."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return  # removed while we looked
    except OSError as exc:
        report.bad.append(BadFile(str(path), f"cannot open: {exc.strerror}"))
        return
    # Header reads are 4 KiB a slot apart: readahead would pull in payload bytes
    # (megabytes a slot) that a scan without --verify never looks at.
    with contextlib.suppress(OSError):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
    try:
        try:
            size = os.fstat(fd).st_size
        except OSError as exc:
            report.bad.append(BadFile(str(path), f"cannot stat: {exc.strerror}"))
            return
        report.bytes = size
        report.slots = size // slot_bytes
        if verify and size % slot_bytes:
            # The tier sizes the file in whole slots; a remainder is no slot at all.
            report.bad.append(
                BadFile(str(path), f"size {size} is not a whole number of {slot_bytes}-byte slots")
            )
        seen: set[bytes] = set()
        slot: memoryview | None = None  # one buffer reused for every slot (verify only)
        for i in range(report.slots):
            where = f"{path}@slot {i}"
            offset = i * slot_bytes
            try:
                head: bytes | memoryview = os.pread(fd, HEADER_BYTES, offset)
                if len(head) < HEADER_BYTES:
                    report.slots = i  # the file shrank while we looked
                    break
                if verify and head != _ZERO_HEADER:
                    # The whole slot in one read, and the header taken from that
                    # read, so that header and payload are the same write even
                    # when the tier rewrites the slot between our two reads.
                    if slot is None:
                        slot = memoryview(bytearray(slot_bytes))
                    if _pread_into(fd, slot, offset) < slot_bytes:
                        report.slots = i
                        break
                    head = slot[:HEADER_BYTES]
                    # Verifying reads every byte of a file that may be far larger
                    # than memory: drop what we read so that the page cache we
                    # take stays one slot (the tier itself uses O_DIRECT).
                    with contextlib.suppress(OSError):
                        os.posix_fadvise(fd, offset, slot_bytes, os.POSIX_FADV_DONTNEED)
            except OSError as exc:
                report.bad.append(BadFile(where, f"read failed: {exc.strerror}"))
                continue
            if head == _ZERO_HEADER:
                report.free += 1
                continue
            try:
                header = decode_header(memoryview(head))
            except HeaderError as exc:
                report.torn += 1
                report.bad.append(BadFile(where, f"torn header: {exc}"))
                continue
            report.blocks += 1
            if header.key in seen:
                report.duplicates += 1
            seen.add(header.key)
            stored = header.stored_at
            if stored:
                report.oldest_stored = min(report.oldest_stored or stored, stored)
                report.newest_stored = max(report.newest_stored or stored, stored)
            if not verify or slot is None:
                continue
            reason = _verify(header, slot, namespace, block_bytes)
            if reason is None:
                report.verified += 1
            else:
                report.bad.append(BadFile(where, reason))
    finally:
        os.close(fd)


def _verify(
    header: BlockHeader, slot: memoryview, namespace: bytes, block_bytes: int
) -> str | None:
    """Why the block in ``slot`` (header and payload) is bad, or None when it verifies."""
    if header.namespace != namespace:
        return f"foreign namespace {header.namespace.hex()} (key {header.key.hex()})"
    if header.payload_bytes != block_bytes:
        return (
            f"payload length {header.payload_bytes} is not the namespace's {block_bytes} bytes "
            f"(key {header.key.hex()})"
        )
    if checksum(slot[HEADER_BYTES : HEADER_BYTES + block_bytes]) != header.payload_checksum:
        return f"payload checksum mismatch (key {header.key.hex()})"
    return None


def _pread_into(fd: int, view: memoryview, offset: int) -> int:
    """Fill ``view`` from ``offset``; returns the bytes read (fewer only at end of file)."""
    pos = 0
    while pos < len(view):
        got = os.preadv(fd, [view[pos:]], offset + pos)
        if got == 0:
            break
        pos += got
    return pos


def _count_legacy(blocks: Path) -> tuple[int, int]:
    """Regular files and their bytes in the fan-out directories under ``blocks``."""
    files = size = 0
    for fan in _scandir(blocks):
        try:
            if not fan.is_dir(follow_symlinks=False):
                continue
        except OSError:
            continue  # removed while we looked
        for entry in _scandir(Path(fan.path)):
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue  # removed while we looked
            if stat.S_ISREG(st.st_mode):
                files += 1
                size += st.st_size
    return files, size


def _scandir(path: Path) -> list[os.DirEntry[str]]:
    try:
        with os.scandir(path) as it:
            return list(it)
    except OSError:
        return []


def _is_regular(path: Path) -> bool:
    try:
        return stat.S_ISREG(os.stat(path, follow_symlinks=False).st_mode)
    except OSError:
        return False


def _is_dir(path: Path) -> bool:
    try:
        return stat.S_ISDIR(os.stat(path, follow_symlinks=False).st_mode)
    except OSError:
        return False
