"""Shared memory: the low layer the CPU region and the host tier both stand on.

A public face over two private parts, as :mod:`multiprocessing.shared_memory`
is one over ``mmap`` and ``shm_open``:

* files (:mod:`kvtier.shm._files`): open-file-description locks on single
  bytes of a shared file (a liveness signal no pid can fake), the loop that
  creates a named shared file (unnamed first, linked once made) or joins it,
  the allocation of its bytes, the one reaper of files nobody holds, and the
  checks every such file passes before it is mapped: this user's own private
  regular file, in a directory nobody else can replace it in
  (:class:`~kvtier.errors.UnsafeSharedFileError`);
* mappings (:mod:`kvtier.shm._mmap`): ``mmap(2)`` at an aligned address,
  ``madvise``, population of pages, the machine's page sizes and memory.

Nothing here knows what a region or a segment holds.
"""

from __future__ import annotations

from kvtier.shm._files import (
    OPEN_FLAGS,
    acquire,
    allocate,
    check_directory,
    check_private,
    create_or_join,
    describe_owner,
    held_by_others,
    loose_mode,
    open_shared,
    reap_files,
    release,
    same_file,
    set_lock,
)
from kvtier.shm._mmap import (
    MADV_HUGEPAGE,
    MADV_POPULATE_READ,
    MADV_POPULATE_WRITE,
    PAGE_SIZE,
    PMD_SIZE,
    madvise,
    map_aligned,
    memory_bytes,
    munmap,
    populate,
    round_up,
    thp_honours_madvise,
)

__all__ = [
    "MADV_HUGEPAGE",
    "MADV_POPULATE_READ",
    "MADV_POPULATE_WRITE",
    "OPEN_FLAGS",
    "PAGE_SIZE",
    "PMD_SIZE",
    "acquire",
    "allocate",
    "check_directory",
    "check_private",
    "create_or_join",
    "describe_owner",
    "held_by_others",
    "loose_mode",
    "madvise",
    "map_aligned",
    "memory_bytes",
    "munmap",
    "open_shared",
    "populate",
    "reap_files",
    "release",
    "round_up",
    "same_file",
    "set_lock",
    "thp_honours_madvise",
]
