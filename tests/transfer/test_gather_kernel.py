"""The gather kernel of the CUDA backend (``kvtier.transfer._gather``) without a GPU.

What a CPU can check: the piece table every round's launch reads, against a
plain-Python reference and by applying it with memmove (a round trip byte for
byte against the row layout's reference); the loader, compile, build and launch
path against a stand-in NVRTC and driver (in a subprocess: a process loads
them once), the kernel's compile failure reported with NVRTC's log; and that
without CUDA the loader refuses with why, logged once, so the copier gathers
with the indexing kernels. ``KVTIER_TEST_NVRTC`` (a libnvrtc path) also
compiles the real kernel, for every architecture kvtier meets.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kvtier.layout import KVLayout
from kvtier.testing.device import HostRows, reference_row
from kvtier.transfer._copier import CopyPlan, _Copier, native
from kvtier.transfer._cuda_copy import (
    gather_native,
    kernel_gather_copy,
    piece_table,
    row_slices,
)
from kvtier.transfer.device import _ThreadedTransfer

pytestmark = [
    pytest.mark.skipif(native is None, reason="kvtier.transfer._copy is not built"),
    pytest.mark.skipif(gather_native is None, reason="kvtier.transfer._gather is not built"),
]

ROOT = Path(__file__).resolve().parents[2]
BLOCKS = 40


def _kv(kv_first: bool) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    # Halves of 256 bytes, 6 bytes and 40 bytes: 16-byte, 2-byte and 8-byte multiples.
    shapes = (
        [(2, BLOCKS, 4, 2, 16), (2, BLOCKS, 3), (2, BLOCKS, 20)]
        if kv_first
        else [(BLOCKS, 4, 32), (BLOCKS, 3)]
    )
    out = []
    for shape in shapes:
        n = int(np.prod(shape)) * 2
        out.append(torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).view(torch.float16))
    return [t.reshape(s) for t, s in zip(out, shapes, strict=True)]


def _memmove_launch(address: int, count: int) -> None:
    """What the kernel does, on the CPU: each entry's bytes from source to destination."""
    table = np.ctypeslib.as_array(ctypes.cast(address, ctypes.POINTER(ctypes.c_int64)), (count, 3))
    for src, dst, n in table.tolist():
        ctypes.memmove(dst, src, n)


class KernelGather(_Copier):
    """:func:`kernel_gather_copy` on CPU tensors, rows copied with memcpy."""

    name = "kernel-gather"

    def __init__(self, staging: int, launch: Callable[[int, int], None], entry: int) -> None:
        self.staging, self.launch, self.entry = staging, launch, entry
        self.launches = self.entries = 0
        self.tables: list[tuple[CopyPlan, list[int], int]] = []

    def mark(self) -> object:
        return None

    def run(self, plan: CopyPlan, marker: object) -> tuple[int, Callable[[], None] | None]:
        assert native is not None
        slices = row_slices(plan.tensors.table)
        assert slices is not None
        size = max(self.staging, slices[0])
        buffers = [torch.empty(size, dtype=torch.uint8) for _ in range(2)]
        self.tables.append((plan, [b.data_ptr() for b in buffers], size // slices[0]))

        def rows(table: np.ndarray, pieces: np.ndarray, spans: np.ndarray) -> None:
            native.copy_host(table, pieces, spans, plan.store, 0, 1)

        def launch(address: int, count: int) -> None:
            self.launches += 1
            self.entries += count
            self.launch(address, count)

        return kernel_gather_copy(plan, buffers, slices, rows, launch, entry=self.entry), None


def _reference_table(
    plan: CopyPlan, buffers: list[int], cap: int, slices: tuple[int, np.ndarray], entry: int
) -> list[list[tuple[int, int, int]]]:
    """Per round, the entries a piece at a time (a round's order: tensor, then piece)."""
    t = plan.tensors.table
    request_rows = sorted(set(plan.pieces[:, 0].tolist()))
    rounds: list[list[tuple[int, int, int]]] = [[] for _ in range(-(-len(request_rows) // cap))]
    for i in range(len(t)):
        dev, _host, unit = (int(v) for v in t[i, :3])
        a, b = plan.spans[i].tolist()
        for row, host_unit, dev_unit, units in plan.pieces[a:b].tolist():
            k = request_rows.index(row)
            r, slot = divmod(k, cap)
            staging = buffers[r % 2] + slot * slices[0] + int(slices[1][i]) + host_unit * unit
            device = dev + dev_unit * unit
            src, dst = (device, staging) if plan.store else (staging, device)
            for at in range(0, units * unit, entry):
                rounds[r].append((src + at, dst + at, min(entry, units * unit - at)))
    return rounds


def _round_trip(copier: _Copier, kv_first: bool, bpc: int, scattered: bool) -> None:
    kv = _kv(kv_first)
    original = [t.clone() for t in kv]
    layout = KVLayout.from_tensors(
        kv, model_id="m", block_tokens=4, blocks_per_chunk=bpc, kv_first=kv_first
    )
    host = HostRows.for_layout(layout, rows=7)
    rng = np.random.default_rng(bpc)
    rows = rng.permutation(7)[:5] if scattered else np.arange(1, 6)
    src = rng.permutation(BLOCKS)[: 5 * bpc] if scattered else np.arange(5 * bpc)
    skip = bpc - 1
    dst = rng.permutation(BLOCKS)[: 5 * bpc - skip] if scattered else np.arange(5 * bpc - skip)
    xfer = _ThreadedTransfer(layout, kv, host.views, copier)
    xfer.run_now(True, rows, src)
    for i, r in enumerate(rows.tolist()):
        want = reference_row(layout, original, src[i * bpc : (i + 1) * bpc].tolist())
        assert bytes(host.row(r)[: layout.bytes_per_chunk].numpy()) == want, f"row {r}"
    for t in kv:
        t.zero_()
    xfer.run_now(False, rows, dst, skip)
    for t, o in zip(kv, original, strict=True):
        t8, o8 = t.view(torch.uint8), o.view(torch.uint8)
        got = t8[:, dst] if kv_first else t8[dst]
        want_t = o8[:, src[skip:]] if kv_first else o8[src[skip:]]
        assert torch.equal(got, want_t)
        rest = np.setdiff1d(np.arange(BLOCKS), dst)
        assert not (t8[:, rest] if kv_first else t8[rest]).any()  # nothing else written


@pytest.mark.parametrize("kv_first", [True, False], ids=["kv-first", "block-first"])
@pytest.mark.parametrize("bpc", [1, 4], ids=["bpc1", "bpc4"])
@pytest.mark.parametrize("scattered", [False, True], ids=["consecutive", "scattered"])
@pytest.mark.parametrize(
    ("staging", "entry"),
    [(1, 64 << 10), (1 << 20, 64 << 10), (1, 16), (1 << 20, 24)],
    ids=["round-per-row", "one-round", "cut-16", "cut-24"],
)
def test_the_piece_table_against_a_reference_and_applied(
    kv_first: bool, bpc: int, scattered: bool, staging: int, entry: int
) -> None:
    copier = KernelGather(staging, _memmove_launch, entry)
    _round_trip(copier, kv_first, bpc, scattered)
    assert copier.launches >= 2  # a store's rounds and a load's
    launched = 0
    for plan, buffers, cap in copier.tables:
        slices = row_slices(plan.tensors.table)
        assert slices is not None
        request_rows = np.unique(plan.pieces[:, 0])
        want = _reference_table(plan, buffers, cap, slices, entry)
        for compiled in (True, False):  # kvtier.transfer._gather.table, and numpy
            entries, bounds = piece_table(plan, request_rows, cap, buffers, slices, entry, compiled)
            assert len(bounds) == len(want) + 1
            for r, expected in enumerate(want):
                got = [tuple(e) for e in entries[bounds[r] : bounds[r + 1]].tolist()]
                assert got == expected, f"compiled {compiled}, round {r}"
            assert (entries[:, 2] <= entry).all()
        launched += len(entries)
    assert copier.entries == launched  # the copier's own cut, at the entry size it was given


def test_a_piece_outside_its_tensor_is_refused_before_a_launch() -> None:
    launches: list[int] = []
    copier = KernelGather(1 << 20, lambda a, n: launches.append(n), 1 << 16)
    kv = _kv(True)
    layout = KVLayout.from_tensors(kv, model_id="m", block_tokens=4, kv_first=True)
    host = HostRows.for_layout(layout, rows=3)
    xfer = _ThreadedTransfer(layout, kv, host.views, copier)
    xfer.run_now(True, np.array([0]), np.array([1]))
    plan = copier.tables[0][0]
    bad = plan.pieces.copy()
    bad[0, 2] = 2 * BLOCKS  # past the device tensor (K and V halves of every block)
    wrong = CopyPlan(plan.store, plan.tensors, bad, plan.spans, plan.copies, plan.nbytes)
    before = len(launches)
    with pytest.raises(ValueError, match="outside"):
        copier.run(wrong, None)
    assert len(launches) == before


# -- the loader, compile, build and launch against a stand-in NVRTC and driver ------------

FAKE_NVRTC = r"""
#include <stdlib.h>
#include <string.h>
char last_option[256];
int nvrtcVersion(int *major, int *minor) { *major = 13; *minor = 0; return 0; }
int nvrtcCreateProgram(void **p, const char *src, const char *name, int n, const char *const *h,
                       const char *const *i) { *p = strdup(src); return 0; }
int nvrtcCompileProgram(void *p, int n, const char *const *options) {
    strncpy(last_option, options[0], sizeof(last_option) - 1);
    return getenv("FAKE_NVRTC_FAIL") ? 6 : 0;  /* NVRTC_ERROR_COMPILATION */
}
static const char LOG[] = "kvtier_gather.cu(3): error: stand-in compile error";
int nvrtcGetProgramLogSize(void *p, size_t *n) {
    *n = getenv("FAKE_NVRTC_FAIL") ? sizeof(LOG) : 1;
    return 0;
}
int nvrtcGetProgramLog(void *p, char *out) {
    if (getenv("FAKE_NVRTC_FAIL")) memcpy(out, LOG, sizeof(LOG)); else out[0] = 0;
    return 0;
}
static const char IMAGE[] = "\177ELF stand-in";
int nvrtcGetCUBINSize(void *p, size_t *n) { *n = sizeof(IMAGE); return 0; }
int nvrtcGetCUBIN(void *p, char *out) { memcpy(out, IMAGE, sizeof(IMAGE)); return 0; }
int nvrtcGetPTXSize(void *p, size_t *n) { *n = sizeof(IMAGE); return 0; }
int nvrtcGetPTX(void *p, char *out) { memcpy(out, IMAGE, sizeof(IMAGE)); return 0; }
int nvrtcDestroyProgram(void **p) { free(*p); *p = 0; return 0; }
const char *nvrtcGetErrorString(int e) {
    return e == 6 ? "NVRTC_ERROR_COMPILATION" : "NVRTC_OTHER";
}
"""

FAKE_DRIVER = r"""
#include <stdlib.h>
#include <string.h>
long launches, entries, current;
static int function = 42, context = 7;
int cuInit(unsigned f) { return 0; }
int cuDriverGetVersion(int *v) { *v = 13000; return 0; }
int cuDeviceGet(int *d, int i) { *d = i; return i == 0 ? 0 : 101; }
int cuDeviceGetAttribute(int *v, int attr, int d) { *v = attr == 75 ? 9 : 0; return 0; }
int cuDevicePrimaryCtxRetain(void **c, int d) { *c = &context; return 0; }
int cuCtxSetCurrent(void *c) { current = c == &context; return 0; }
int cuModuleLoadData(void **m, const void *image) {
    *m = (void *)1;
    return memcmp(image, "\177ELF stand-in", 14) == 0 ? 0 : 200;
}
int cuModuleGetFunction(void **f, void *m, const char *name) {
    *f = &function;
    return strcmp(name, "kvtier_copy_pieces") == 0 ? 0 : 500;
}
int cuLaunchKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                   unsigned bz, unsigned shm, void *stream, void **params, void **extra) {
    if (f != &function || !current || stream == NULL || gy != 1 || gz != 1 || bx != 256 || extra)
        return 1;
    const long long *table = *(const long long **)params[0];
    for (unsigned i = 0; i < gx; i++)
        memmove((void *)table[3 * i + 1], (const void *)table[3 * i], (size_t)table[3 * i + 2]);
    launches++;
    entries += gx;
    return getenv("FAKE_LAUNCH_FAIL") ? 1 : 0;
}
int cuGetErrorName(int e, const char **s) {
    *s = e == 1 ? "CUDA_ERROR_INVALID_VALUE" : "CUDA_ERROR_OTHER";
    return 0;
}
int cuGetErrorString(int e, const char **s) { *s = "stand-in error"; return 0; }
"""

SCRIPT = r"""
import ctypes, json, logging, os, sys
import numpy as np
sys.path.insert(0, os.path.join(os.getcwd(), "tests", "transfer"))
from kvtier.errors import ConfigurationError
from kvtier.transfer import _gather
from kvtier.transfer._cuda_copy import load_gather_kernel
import test_gather_kernel as t

records = []
logging.basicConfig(level=logging.INFO)
logging.getLogger("kvtier.transfer").addHandler(type("H", (logging.Handler,), {
    "emit": lambda self, r: records.append(r.getMessage())})())
nvrtc, driver = sys.argv[1], sys.argv[2]
out = {"nvrtc": _gather.load_nvrtc(nvrtc), "driver": _gather.load_driver(driver)}
lib, nv = ctypes.CDLL(driver), ctypes.CDLL(nvrtc)
try:
    out["built"] = load_gather_kernel(0)
except ConfigurationError as exc:
    out["error"] = str(exc)
    try:
        load_gather_kernel(0)
    except ConfigurationError as again:
        out["again"] = str(again) == str(exc)
    out["records"] = records
    print(json.dumps(out))
    sys.exit(0)
out["option"] = (ctypes.c_char * 256).in_dll(nv, "last_option").value.decode()
out["status"] = {k: str(v) for k, v in _gather.status().items()}

def launch(address, count):
    _gather.launch(address, count, 1, 0)

copier = t.KernelGather(1, launch, 64 << 10)
t._round_trip(copier, True, 4, True)
out["launches"] = [copier.launches, ctypes.c_long.in_dll(lib, "launches").value]
out["entries"] = ctypes.c_long.in_dll(lib, "entries").value
for call in ((0, 1, 1, 0), (8, 1, 0, 0), (8, 1, 1, 3)):
    try:
        _gather.launch(*call)
    except Exception as exc:
        out.setdefault("refused", []).append([type(exc).__name__, str(exc)])
os.environ["FAKE_LAUNCH_FAIL"] = "1"
table = np.zeros(3, dtype=np.int64)
try:
    _gather.launch(table.ctypes.data, 0, 1, 0)  # nothing to launch: no error
    _gather.launch(table.ctypes.data, 1, 1, 0)
except RuntimeError as exc:
    out["launch_error"] = str(exc)
out["records"] = records
print(json.dumps(out))
"""


def _stand_in(tmp_path: Path, **env: str) -> dict[str, Any]:
    if shutil.which("gcc") is None:
        pytest.skip("no gcc to build the stand-in NVRTC and driver")
    libs = []
    for name, text in (("libnvrtc-fake.so", FAKE_NVRTC), ("libcuda-fake.so", FAKE_DRIVER)):
        src = tmp_path / (name + ".c")
        src.write_text(text)
        subprocess.run(
            ["gcc", "-O1", "-shared", "-fPIC", str(src), "-o", str(tmp_path / name)], check=True
        )
        libs.append(str(tmp_path / name))
    return _python(SCRIPT, *libs, **env)


def _python(script: str, *args: str, **env: str) -> dict[str, Any]:
    """Run ``script`` in a fresh process (NVRTC and the driver load once a process): its
    last line of output, as JSON."""
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script), *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, **env},
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    return result


def test_build_and_launch_against_a_stand_in_nvrtc_and_driver(tmp_path: Path) -> None:
    out = _stand_in(tmp_path)
    assert out["nvrtc"] == [13, 0]
    assert out["driver"] == 13000
    assert out["built"] == "CUBIN for sm_90 by NVRTC 13.0, driver 13.0"
    assert out["option"] == "--gpu-architecture=sm_90"  # the device's compute capability
    assert "libnvrtc-fake.so" in out["status"]["nvrtc"]
    # A round per row, 5 rows: five launches for the store and five for the load, each
    # over its round's pieces of every tensor (3 tensors, K and V, 4 blocks a row).
    assert out["launches"] == [10, 10]
    assert out["entries"] == 2 * 5 * 3 * 2 * 4 - 3 * 2 * 3  # the load skips 3 blocks
    refused = out["refused"]
    assert refused[0] == ["ValueError", "bad table (address 0, 1 entries)"]
    assert refused[1] == ["ValueError", "launch needs a created stream, not stream 0"]
    assert refused[2][0] == "RuntimeError"
    assert "not built for device 3" in refused[2][1]
    assert out["launch_error"] == (
        "cuLaunchKernel failed: CUDA_ERROR_INVALID_VALUE (1): stand-in error"
    )
    assert out["records"] == []  # nothing to say when the kernel builds


def test_a_compile_failure_carries_nvrtc_log_and_is_logged_once(tmp_path: Path) -> None:
    out = _stand_in(tmp_path, FAKE_NVRTC_FAIL="1")
    error = out["error"]
    assert error.startswith("the gather kernel could not be built: NVRTC 13.0 could not compile")
    assert "NVRTC_ERROR_COMPILATION" in error
    assert "stand-in compile error" in error  # NVRTC's log, whole
    assert out["again"]  # remembered: the same error, no second try
    assert len(out["records"]) == 1
    assert out["records"][0].startswith("gather kernel unavailable on cuda:0")
    assert "stand-in compile error" in out["records"][0]


FALLBACK = r"""
import json, logging
from kvtier.errors import ConfigurationError
from kvtier.transfer import _cuda_copy

records = []
logging.getLogger("kvtier.transfer").setLevel(logging.INFO)
logging.getLogger("kvtier.transfer").addHandler(type("H", (logging.Handler,), {
    "emit": lambda self, r: records.append([r.levelname, r.getMessage()])})())
_cuda_copy.nvrtc_candidates = lambda: ["/nonexistent/libnvrtc.so.13"]
errors = []
for _ in range(2):
    try:
        _cuda_copy.load_gather_kernel(0)
    except ConfigurationError as exc:
        errors.append(str(exc))
print(json.dumps({"errors": errors, "records": records}))
"""


def test_without_nvrtc_the_loader_says_why_once() -> None:
    out = _python(FALLBACK)
    assert len(out["errors"]) == 2
    assert out["errors"][0] == out["errors"][1]
    assert out["errors"][0].startswith("no NVRTC could be loaded: dlopen(/nonexistent/")
    assert len(out["records"]) == 1
    level, message = out["records"][0]
    assert level == "INFO"
    assert message.startswith("gather kernel unavailable on cuda:0, indexing kernels gather")


def test_the_compiled_table_refuses_what_does_not_agree() -> None:
    assert gather_native is not None
    table = np.array([[1 << 20, 1 << 21, 16, 64, 256, 64, 4]], dtype=np.int64)
    pieces = np.array([[2, 0, 0, 4]], dtype=np.int64)
    spans = np.array([[0, 1]], dtype=np.int64)
    one = np.array([1 << 22], dtype=np.int64)
    offsets = np.zeros(1, dtype=np.int64)
    args = (table, pieces, spans, True)
    with pytest.raises(ValueError, match="not one of the request's"):
        gather_native.table(*args, np.array([0, 1]), 1, one, offsets, 64, 1 << 16)
    with pytest.raises(ValueError, match="span outside"):
        gather_native.table(table, pieces, spans + 1, True, np.array([2]), 1, one, offsets, 64, 8)
    with pytest.raises(ValueError, match="do not agree"):
        gather_native.table(*args, np.array([2]), 0, one, offsets, 64, 8)
    with pytest.raises(TypeError, match="int64"):
        gather_native.table(*args, np.array([2], dtype=np.int32), 1, one, offsets, 64, 8)
    entries, bounds = gather_native.table(*args, np.array([2]), 1, one, offsets, 64, 24)
    got = np.frombuffer(entries, np.int64).reshape(-1, 3).tolist()
    assert got == [
        [1 << 20, 1 << 22, 24],
        [(1 << 20) + 24, (1 << 22) + 24, 24],
        [(1 << 20) + 48, (1 << 22) + 48, 16],
    ]
    assert np.frombuffer(bounds, np.int64).tolist() == [0, 3]


def test_the_module_imports_and_holds_nothing_before_loading() -> None:
    assert gather_native is not None
    assert "kvtier_copy_pieces" in gather_native.KERNEL
    with pytest.raises(RuntimeError, match="not built for device 0"):
        gather_native.launch(8, 1, 1, 0)
    with pytest.raises(ValueError, match="out of range"):
        gather_native.build(-1)


@pytest.mark.skipif(
    not os.environ.get("KVTIER_TEST_NVRTC"), reason="KVTIER_TEST_NVRTC names no libnvrtc"
)
def test_the_real_kernel_compiles() -> None:
    script = """
        import json, sys
        from kvtier.transfer import _gather
        _gather.load_nvrtc(sys.argv[1])
        out = {str(a): _gather.compile(a)[:4].hex() for a in (75, 80, 86, 89, 90)}
        out["ptx"] = _gather.compile(90, ptx=True)[:2].decode()
        try:
            _gather.compile(90, source="not C++")
        except RuntimeError as exc:
            out["error"] = str(exc)
        print(json.dumps(out))
        """
    out = _python(script, os.environ["KVTIER_TEST_NVRTC"])
    for arch in ("75", "80", "86", "89", "90"):
        assert out[arch] == "7f454c46", arch  # an ELF image: a CUBIN
    assert out["ptx"] == "//"
    assert "error: expected a declaration" in out["error"]
