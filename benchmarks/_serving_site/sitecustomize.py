"""Give kvtier's threads their names in the kernel, in the vLLM processes of a benchmark.

``benchmarks/vllm_serving.py`` puts this directory first on ``PYTHONPATH``
of the ``vllm serve`` it starts, so Python imports this module at start-up
in every process of that server (the API server, the EngineCore, the
workers: vLLM spawns them with the same environment). kvtier names its
threads (``kvtier-vllm-scheduler``, ``kvtier-vllm-worker-0``,
``kvtier-file-tier``, ``kvtier-io``, ...), but Python 3.11 keeps a thread's
name to itself: the kernel's (``/proc/<pid>/task/<tid>/comm``) stays the
process's. Here every thread whose Python name starts with ``kvtier`` sets
its kernel name to that name (its first 15 bytes, the kernel's limit) as it
starts, so the benchmark can read each of kvtier's threads' CPU time from
``/proc``. Nothing else changes; another process's threads are left alone.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

_PR_SET_NAME = 15


def _install() -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return
    thread: Any = threading.Thread
    original = thread._bootstrap_inner

    def bootstrap_inner(self: threading.Thread) -> None:
        if self.name.startswith("kvtier"):
            libc.prctl(_PR_SET_NAME, ctypes.c_char_p(self.name.encode()[:15]), 0, 0, 0)
        original(self)

    thread._bootstrap_inner = bootstrap_inner


_install()
