"""What the benchmarks below other engines (``sglang_l3.py``, ``vllm_secondary_tier.py``)
print about the machine and the run, and their small figure helpers.

Imported as ``_bench_env`` by a benchmark run as a script (its directory is first
on ``sys.path``).
"""

from __future__ import annotations

import contextlib
import os
import platform
import statistics
import subprocess
from pathlib import Path

_REPO = Path(__file__).resolve().parent.parent

__all__ = ["commit", "drop_caches", "f2", "filesystem", "loadavg", "machine", "med", "ratio"]


def drop_caches() -> str | None:
    """``sync; echo 3 > /proc/sys/vm/drop_caches``; None, or why it was refused."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError as exc:
        return str(exc)
    return None


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem = ""
    with contextlib.suppress(OSError, ValueError), open("/proc/meminfo") as f:
        mem = f"{int(f.readline().split()[1]) / (1 << 20):.0f} GiB RAM"
    return f"{cpu}, {os.cpu_count()} cores, {mem}, Linux {platform.release()}"


def filesystem(path: Path) -> str:
    best, fs, dev = "", "?", "?"
    with contextlib.suppress(OSError), open("/proc/mounts") as f:
        for line in f:
            parts = line.split()
            mount = parts[1]
            if str(path).startswith(mount) and len(mount) > len(best):
                best, dev, fs = mount, parts[0], parts[2]
    return f"{fs} on {dev} (mounted at {best})"


def commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=_REPO,
            capture_output=True,
            text=True,
            check=True,
        )
    except (OSError, subprocess.CalledProcessError):
        return "?"
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no"],
        cwd=_REPO,
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    return out.stdout.strip() + (" (tree has uncommitted changes)" if dirty else "")


def loadavg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def ratio(a: float, b: float) -> float:
    return a / b if b and b == b and a == a else float("nan")


def f2(x: float) -> str:
    return "n/a" if x != x else f"{x:.2f}"


def med(xs: list[float]) -> float:
    xs = [x for x in xs if x == x]
    return statistics.median(xs) if xs else float("nan")
