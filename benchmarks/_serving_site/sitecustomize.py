"""Name kvtier's threads in the kernel, and, when asked, slow a tier down, in the vLLM
processes of a benchmark.

``benchmarks/vllm_serving.py`` puts this directory first on ``PYTHONPATH``
of the ``vllm serve`` it starts, so Python imports this module at start-up
in every process of that server (the API server, the EngineCore, the
workers: vLLM spawns them with the same environment).

**Thread names.** kvtier names its threads (``kvtier-vllm-scheduler``,
``kvtier-vllm-worker-0``, ``kvtier-file-tier``, ``kvtier-io``, ...), but
Python 3.11 keeps a thread's name to itself: the kernel's
(``/proc/<pid>/task/<tid>/comm``) stays the process's. Here every thread
whose Python name starts with ``kvtier`` sets its kernel name to that name
(its first 15 bytes, the kernel's limit) as it starts, so the benchmark can
read each of kvtier's threads' CPU time from ``/proc``. Another process's
threads are left alone.

**A slow tier** (the load-or-recompute decision's benchmark): with
``KVTIER_BENCH_SLOW_READ_S`` (seconds added to every read) or
``KVTIER_BENCH_SLOW_BLOCK_S`` (seconds per block on one link that reads
share in order) set in the server's environment, the tier named by
``KVTIER_BENCH_SLOW_TIER`` (``file`` by default; ``cluster``, ``host``) is
wrapped in :class:`kvtier.testing.faults.SlowTier` as it opens. vLLM builds
kvtier's tiers itself, from ``kv_connector_extra_config``, and kvtier has
no hook to hand it a wrapped tier (nor should it: this is a test knob, not
a setting), so this benchmark harness replaces
``kvtier.tiers.factory.open_tier``, the one function both fronts open
every tier through, with one that wraps what it returns. It does so lazily,
by an import hook that patches the module right after it is first executed:
nothing is imported that the process would not import anyway, and with
neither variable set nothing is installed at all.
"""

from __future__ import annotations

import ctypes
import importlib.abc
import os
import sys
import threading
from collections.abc import Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Any

_PR_SET_NAME = 15
_FACTORY = "kvtier.tiers.factory"


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


def _seconds(name: str) -> float:
    value = float(os.environ.get(name) or 0.0)
    if value < 0:
        raise ValueError(f"{name} must be >= 0 seconds, got {value}")
    return value


def _slow_down(factory: Any, read_s: float, block_s: float, which: str) -> None:
    """Replace ``factory.open_tier`` with one that wraps the ``which`` tier it opens."""
    original = factory.open_tier

    async def open_tier(spec: Any, *args: Any, **kwargs: Any) -> Any:
        tier = await original(spec, *args, **kwargs)
        kind = type(spec).__name__.removesuffix("TierConfig").lower()
        if kind != which:
            return tier
        from kvtier.testing.faults import SlowTier

        bandwidth = tier.block_bytes / block_s if block_s else None
        print(
            f"[kvtier benchmark: the {kind} tier is slowed: {read_s} s a read, "
            f"{block_s} s a block (pid {os.getpid()})]",
            file=sys.stderr,
            flush=True,
        )
        return SlowTier(tier, read_delay_s=read_s, bandwidth=bandwidth)

    factory.open_tier = open_tier


class _PatchFactory(importlib.abc.MetaPathFinder):
    """Finds ``kvtier.tiers.factory`` as the other finders do, and patches it once executed."""

    def __init__(self, read_s: float, block_s: float, which: str) -> None:
        self.read_s, self.block_s, self.which = read_s, block_s, which

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if fullname != _FACTORY:
            return None
        sys.meta_path.remove(self)  # once
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec: ModuleSpec | None = find(fullname, path, target) if find is not None else None
            if spec is not None and spec.loader is not None:
                break
        else:
            return None
        loader: Any = spec.loader
        execute = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            execute(module)
            _slow_down(module, self.read_s, self.block_s, self.which)

        loader.exec_module = exec_module
        return spec


def _install_slow_tier() -> None:
    read_s = _seconds("KVTIER_BENCH_SLOW_READ_S")
    block_s = _seconds("KVTIER_BENCH_SLOW_BLOCK_S")
    if not (read_s or block_s):
        return
    which = os.environ.get("KVTIER_BENCH_SLOW_TIER") or "file"
    sys.meta_path.insert(0, _PatchFactory(read_s, block_s, which))


_install()
_install_slow_tier()
