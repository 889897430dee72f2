"""The compiled copy loops (``kvtier.transfer._copy``) on their own.

The CPU loop is checked byte for byte against the row layout's reference over
the cases that shape a plan (K/V-first and block-first, fp16 and bf16,
``blocks_per_chunk`` 1 and 4, consecutive and scattered ids, a skip into the
first row), split over helpers and not; bad plans are refused before a byte
moves. The CUDA loop is checked without a GPU against a stand-in CUDA runtime
(memcpy behind the runtime's entry points), in a subprocess, since a process
loads one runtime for good.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kvtier.layout import KVLayout
from kvtier.testing.device import HostRows, reference_row
from kvtier.transfer._copier import native
from kvtier.transfer._cpu_copy import CpuCopier
from kvtier.transfer.device import _ThreadedTransfer

pytestmark = pytest.mark.skipif(native is None, reason="kvtier.transfer._copy is not built")

BLOCKS, ROWS = 40, 8
ROOT = Path(__file__).resolve().parents[2]


def _kv(kv_first: bool, dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    shapes = [(2, BLOCKS, 4, 2, 8), (2, BLOCKS, 16)] if kv_first else [(BLOCKS, 4, 16), (BLOCKS, 6)]
    out = []
    for shape in shapes:
        n = int(np.prod(shape)) * 2
        out.append(torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).view(dtype))
    return [t.reshape(s) for t, s in zip(out, shapes, strict=True)]


def _ids(scattered: bool, n: int, seed: int) -> np.ndarray:
    if scattered:
        return np.random.default_rng(seed).permutation(BLOCKS)[:n]
    return np.arange(BLOCKS - n, BLOCKS) if seed else np.arange(n)


def _block(t: torch.Tensor, kv_first: bool, b: int) -> bytes:
    part = t[:, b] if kv_first else t[b]
    return bytes(part.contiguous().view(torch.uint8).numpy().tobytes())


@pytest.mark.parametrize("kv_first", [True, False], ids=["kv-first", "block-first"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("bpc", [1, 4])
@pytest.mark.parametrize("scattered", [False, True], ids=["consecutive", "scattered"])
@pytest.mark.parametrize("split", [1, 1 << 40], ids=["helpers", "alone"])
def test_store_then_load_matches_the_reference(
    kv_first: bool, dtype: torch.dtype, bpc: int, scattered: bool, split: int
) -> None:
    kv = _kv(kv_first, dtype)
    original = [t.clone() for t in kv]
    layout = KVLayout.from_tensors(
        kv, model_id="m", block_tokens=4, blocks_per_chunk=bpc, kv_first=kv_first
    )
    host = HostRows.for_layout(layout, rows=ROWS)
    xfer = _ThreadedTransfer(layout, kv, host.views, CpuCopier(threads=2, split_bytes=split))
    rows = np.random.default_rng(1).permutation(ROWS)[:5] if scattered else np.arange(1, 6)
    src = _ids(scattered, 5 * bpc, 0)
    xfer.run_now(True, rows, src)
    for i, r in enumerate(rows.tolist()):
        want = reference_row(layout, original, src[i * bpc : (i + 1) * bpc].tolist())
        row = host.row(r)
        assert bytes(row[: len(want)].numpy()) == want
        assert not row[len(want) :].any(), "padding was written"
    for skip in sorted({0, bpc - 1}):
        dst = _ids(scattered, 5 * bpc - skip, 1 + skip)
        for t in kv:
            t.zero_()
        xfer.run_now(False, rows, dst, skip)
        for t, o in zip(kv, original, strict=True):
            for pos, d in enumerate(dst.tolist()):
                assert _block(t, kv_first, d) == _block(o, kv_first, int(src[skip + pos]))
            others = sorted(set(range(BLOCKS)) - set(dst.tolist()))
            assert not (t[:, others] if kv_first else t[others]).view(torch.uint8).any()


def _plan_arrays() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """A table of one tensor (4 blocks of 8 bytes, 3 rows of 16 bytes) and a plan of 2 pieces."""
    dev = np.arange(32, dtype=np.uint8)
    host = np.zeros(3 * 24, dtype=np.uint8)  # row stride 24 > 16: padding between rows
    table = np.array([[dev.ctypes.data, host.ctypes.data, 8, 24, 32, 16, 3]], dtype=np.int64)
    pieces = np.array([[2, 0, 3, 1], [0, 0, 0, 2]], dtype=np.int64)
    spans = np.array([[0, 2]], dtype=np.int64)
    return table, pieces, spans, dev, host


def test_a_plan_copies_its_pieces_and_counts_them() -> None:
    assert native is not None
    table, pieces, spans, _dev, host = _plan_arrays()
    assert native.check(table, pieces, spans) == (24, 2)
    for parts in (1, 2, 3, 5):
        host[:] = 0
        moved = [native.copy_host(table, pieces, spans, True, i, parts) for i in range(parts)]
        assert sum(moved) == 24
        assert host[48:56].tolist() == list(range(24, 32))  # row 2 <- block 3
        assert host[:16].tolist() == list(range(16))  # row 0 <- blocks 0 and 1
        assert not host[16:48].any()
        assert not host[56:].any()


@pytest.mark.parametrize(
    ("change", "error", "message"),
    [
        (lambda t, p, s: (t, p, s.astype(np.int32)), TypeError, "int64"),
        (lambda t, p, s: (t, p[:, :3].copy(), s), ValueError, "columns"),
        (lambda t, p, s: (t, p, np.array([[0, 3]])), ValueError, "span"),
        (lambda t, p, s: (t, p, np.zeros((2, 2), dtype=np.int64)), ValueError, "2 spans for 1"),
        (lambda t, p, s: (t, _set(p, 0, 0, 3), s), ValueError, "outside"),  # row 3 of 3
        (lambda t, p, s: (t, _set(p, 0, 2, 4), s), ValueError, "outside"),  # device block 4 of 4
        (lambda t, p, s: (t, _set(p, 1, 1, 1), s), ValueError, "outside"),  # past the row's bytes
        (lambda t, p, s: (t, _set(p, 0, 3, 0), s), ValueError, "outside"),  # no units
        (lambda t, p, s: (t, _set(p, 0, 3, 1 << 62), s), ValueError, "outside"),  # overflows
        (lambda t, p, s: (t, _set(p, 0, 1, -1), s), ValueError, "outside"),
        (lambda t, p, s: (_set(t, 0, 2, 0), p, s), ValueError, "bad table entry"),
        (lambda t, p, s: (_set(t, 0, 1, 0), p, s), ValueError, "bad table entry"),
    ],
    ids=[
        "int32",
        "columns",
        "span-past-end",
        "span-count",
        "row",
        "device",
        "row-bytes",
        "empty",
        "overflow",
        "negative",
        "unit",
        "null-host",
    ],
)
def test_bad_plans_are_refused_before_a_byte_moves(change: Any, error: type, message: str) -> None:
    assert native is not None
    table, pieces, spans, _dev, host = _plan_arrays()
    bad = change(table, pieces, spans)
    with pytest.raises(error, match=message):
        native.check(*bad)
    with pytest.raises(error, match=message):
        native.copy_host(*bad, True, 0, 1)
    assert not host.any()
    with pytest.raises(ValueError, match="part"):
        native.copy_host(table, pieces, spans, True, 2, 2)


def _set(a: np.ndarray, i: int, j: int, value: int) -> np.ndarray:
    out = a.copy()
    out[i, j] = value
    return out


# -- the CUDA loop against a stand-in runtime -----------------------------------------------

FAKE_CUDART = r"""
#include <stdlib.h>
#include <string.h>
static int last;
long memcpys, batches, batched_pieces;
int cudaRuntimeGetVersion(int *v) { *v = VERSION; return 0; }
int cudaSetDevice(int d) { return d == 0 ? 0 : (last = 101); }
int cudaGetLastError(void) { int e = last; last = 0; return e; }
const char *cudaGetErrorName(int e) { return e == 1 ? "cudaErrorInvalidValue" : "cudaErrorOther"; }
const char *cudaGetErrorString(int e) { (void)e; return "stand-in error"; }
int cudaMemcpyAsync(void *dst, const void *src, size_t n, int kind, void *stream) {
    if (getenv("FAKE_FAIL_MEMCPY") || stream == NULL || (kind != 1 && kind != 2))
        return last = 1;
    memcpy(dst, src, n);
    memcpys++;
    return 0;
}
typedef struct { int order, st, si, dt, di; unsigned flags; } attrs_t;
#if VERSION >= 13000
int cudaMemcpyBatchAsync(void **d, void **s, size_t *n, size_t count, attrs_t *a, size_t *idx,
                         size_t nattrs, void *stream) {
#else
int cudaMemcpyBatchAsync(void **d, void **s, size_t *n, size_t count, attrs_t *a, size_t *idx,
                         size_t nattrs, size_t *fail, void *stream) {
    if (fail == NULL) return last = 1;
#endif
    if (getenv("FAKE_FAIL_BATCH") || stream == NULL || nattrs != 1 || idx[0] != 0 || a->order != 1)
        return last = 1;
    for (size_t i = 0; i < count; i++)
        memcpy(d[i], s[i], n[i]);
    batches++;
    batched_pieces += count;
    return 0;
}
"""

SCRIPT = r"""
import ctypes, json, os, sys
import numpy as np, torch
from kvtier.layout import KVLayout
from kvtier.testing.device import HostRows, reference_row
from kvtier.transfer import _copy
from kvtier.transfer._copier import _Copier
from kvtier.transfer._cuda_copy import load_cudart
from kvtier.transfer.device import _ThreadedTransfer

path = sys.argv[1]
version = _copy.cuda_load(path)
lib = ctypes.CDLL(path)
out = {"version": version, "load_cudart": list(load_cudart())}

class Stand(_Copier):
    name = "stand-in"
    def __init__(self, batch):
        self.batch = batch
    def mark(self):
        return None
    def run(self, plan, marker):
        t = plan.tensors
        n = _copy.cuda_copy(t.table, plan.pieces, plan.spans, plan.store, 1, 0, self.batch)
        return n, None

def counters():
    return [ctypes.c_long.in_dll(lib, n).value for n in ("memcpys", "batches", "batched_pieces")]

def round_trip(batch):
    g = torch.Generator().manual_seed(5)
    kv = [torch.randint(0, 256, (2 * 24 * 64,), dtype=torch.uint8, generator=g)
          .view(torch.float16).reshape(2, 24, 32), torch.ones(24, 16, dtype=torch.bfloat16)]
    original = [t.clone() for t in kv]
    layout = KVLayout.from_tensors(kv, model_id="m", block_tokens=4, blocks_per_chunk=2)
    host = HostRows.for_layout(layout, rows=6)
    xfer = _ThreadedTransfer(layout, kv, host.views, Stand(batch))
    rows, src = [4, 1, 2], [7, 3, 9, 10, 22, 0]
    before = counters()
    xfer.run_now(True, rows, src)
    ok = all(bytes(host.row(r)[: layout.bytes_per_chunk].numpy())
             == reference_row(layout, original, src[2 * i : 2 * i + 2]) for i, r in enumerate(rows))
    for t in kv:
        t.zero_()
    xfer.run_now(False, rows, [5, 6, 11, 12, 13], skip=1)
    for t, o in zip(kv, original):  # as bytes: random bits hold NaNs
        t, o = t.view(torch.uint8), o.view(torch.uint8)
        got = t[:, [5, 6, 11, 12, 13]] if t.dim() == 3 else t[[5, 6, 11, 12, 13]]
        ok = ok and torch.equal(got, o[:, src[1:]] if o.dim() == 3 else o[src[1:]])
    after = counters()
    return {"bytes_ok": bool(ok), "delta": [a - b for a, b in zip(after, before)],
            "copies": xfer.statistics().copies_issued}

out["batch"] = round_trip(True)
out["loop"] = round_trip(False)
os.environ["FAKE_FAIL_BATCH"] = "1"
out["refused"] = round_trip(True)
out["status"] = _copy.cuda_status()
del os.environ["FAKE_FAIL_BATCH"]
out["after_refusal"] = round_trip(True)
os.environ["FAKE_FAIL_MEMCPY"] = "1"
try:
    round_trip(False)
except Exception as exc:
    cause = exc.__cause__
    out["memcpy_error"] = [type(exc).__name__, type(cause).__name__, str(cause)]
try:
    none = np.zeros((0, 4), dtype=np.int64)
    _copy.cuda_copy(none, none, np.zeros((0, 2), dtype=np.int64), True, 0, 0, True)
except Exception as exc:
    out["stream_0"] = [type(exc).__name__, str(exc)]
print(json.dumps(out))
"""


def _stand_in(tmp_path: Path, version: int) -> dict[str, Any]:
    if shutil.which("gcc") is None:
        pytest.skip("no gcc to build the stand-in CUDA runtime")
    src = tmp_path / "fake.c"
    src.write_text(FAKE_CUDART)
    lib = tmp_path / f"libcudart-{version}.so"
    subprocess.run(
        ["gcc", "-O1", "-shared", "-fPIC", f"-DVERSION={version}", str(src), "-o", str(lib)],
        check=True,
    )
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(SCRIPT), str(lib)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    return result


@pytest.mark.parametrize("version", [13000, 12080], ids=["cuda-13", "cuda-12.8"])
def test_the_cuda_loop_against_a_stand_in_runtime(tmp_path: Path, version: int) -> None:
    out = _stand_in(tmp_path, version)
    assert out["version"] == version
    assert out["load_cudart"] == [str(tmp_path / f"libcudart-{version}.so"), version]
    # Pieces per run of ids consecutive in a row, twice for the K/V-first tensor: the store's
    # rows hold ids 7,3 | 9,10 | 22,0 (5 runs), the load's get 5 | 6,11 | 12,13 (4 runs).
    pieces = 5 * 3 + 4 * 3
    for run in ("batch", "loop", "refused", "after_refusal"):
        assert out[run]["bytes_ok"], run
        assert out[run]["copies"] == pieces, run
    # Batched: one cudaMemcpyBatchAsync per request; looped: a cudaMemcpyAsync per piece.
    assert out["batch"]["delta"] == [0, 2, pieces]  # the store's batch and the load's
    assert out["loop"]["delta"] == [pieces, 0, 0]
    # A refused batch is issued piece by piece, and batches are not tried again.
    assert out["refused"]["delta"] == [pieces, 0, 0]
    assert out["status"]["batch_error"] == 1
    assert out["after_refusal"]["delta"] == [pieces, 0, 0]
    name, cause, cause_text = out["memcpy_error"]
    assert name == "TransferError"
    assert cause == "RuntimeError"
    assert cause_text == "cudaMemcpyAsync failed: cudaErrorInvalidValue (1): stand-in error"
    assert out["stream_0"][0] == "ValueError"


# -- planning and index checks: the compiled ones against numpy's ----------------------

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from kvtier.transfer.device import _unit_pieces  # noqa: E402


@st.composite
def _requests(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray, int, int, bool, bool]:
    bpc = draw(st.integers(1, 4))
    nrows = draw(st.integers(1, 12))
    rows = draw(st.lists(st.integers(0, 15), min_size=nrows, max_size=nrows, unique=True))
    skip = draw(st.integers(0, bpc - 1))
    n = nrows * bpc - skip
    # Runs of consecutive ids (what makes pieces longer than one sub-block) and jumps.
    start = draw(st.integers(0, 40))
    steps = draw(st.lists(st.sampled_from([1, 1, 1, 2, -3, 7]), min_size=n, max_size=n))
    ids = [start]
    for step in steps[1:]:
        ids.append(max(0, ids[-1] + step))
    return (
        np.array(rows, dtype=np.int64),
        np.array(ids, dtype=np.int64),
        bpc,
        skip,
        draw(st.booleans()),
        draw(st.booleans()),
    )


@settings(max_examples=300, deadline=None)
@given(_requests())
def test_plan_units_is_numpys_plan(
    req: tuple[np.ndarray, np.ndarray, int, int, bool, bool],
) -> None:
    rows, ids, bpc, skip, kv_first, store = req
    assert native is not None
    per_row = np.repeat(rows, bpc)[skip:]
    subs = np.tile(np.arange(bpc, dtype=np.int64), rows.size)[skip:]
    want = _unit_pieces(per_row, subs, ids, bpc, 1000, kv_first, store)
    out = np.full(8 * ids.size + 4, -7, dtype=np.int64)
    got = native.plan_units(rows, ids, bpc, skip, 1000, kv_first, store, out)
    assert np.array_equal(out[: 4 * got].reshape(-1, 4), want)
    assert (out[4 * got :] == -7).all()  # nothing written past what it reports


def test_plan_units_refuses_what_does_not_fit() -> None:
    assert native is not None
    rows, ids = np.arange(2, dtype=np.int64), np.arange(4, dtype=np.int64)
    with pytest.raises(ValueError, match="out too small"):
        native.plan_units(rows, ids, 2, 0, 10, False, True, np.empty(8, dtype=np.int64))
    with pytest.raises(ValueError, match="more ids than rows hold"):
        native.plan_units(rows, ids, 1, 0, 10, False, True, np.empty(64, dtype=np.int64))
    with pytest.raises(ValueError, match="skip"):
        native.plan_units(rows, ids, 2, 2, 10, False, True, np.empty(64, dtype=np.int64))
    with pytest.raises(TypeError, match="int64"):
        native.plan_units(rows.astype(np.int32), ids, 2, 0, 10, False, True, np.empty(64))


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.integers(-2, 70), max_size=40),
    st.sampled_from([1, 64, 65, 1 << 27]),
    st.booleans(),
)
def test_check_index_is_numpys_check(values: list[int], bound: int, unique: bool) -> None:
    assert native is not None
    arr = np.array(values, dtype=np.int64)
    if arr.size and (arr.min() < 0 or arr.max() >= bound):
        want = 1
    else:
        want = 2 if unique and np.unique(arr).size != arr.size else 0
    assert native.check_index(arr, bound, unique) == want


I64_MAX = np.iinfo(np.int64).max


@pytest.mark.parametrize(
    ("rows", "ids", "bpc", "num_blocks", "message"),
    [
        pytest.param([0], [I64_MAX], 1, I64_MAX, "num_blocks", id="num-blocks-int64-max"),
        pytest.param([0], [I64_MAX - 1], 1, 1 << 62, "id 9223372036854775806", id="id-int64-max"),
        pytest.param([0, 1], [5, 6], 1, 4, "id 5 outside", id="id-beyond-num-blocks"),
        pytest.param([0], [-1], 1, 10, "id -1 outside", id="id-negative"),
        pytest.param([0], [0], (1 << 62) + 1, 10, "bpc", id="bpc-near-2-62"),
        pytest.param([0], [0], 1 << 31 | 1, 10, "bpc", id="bpc-beyond-2-31"),
        pytest.param([I64_MAX], [0], 1, 10, "row 9223372036854775807", id="row-int64-max"),
        pytest.param([1 << 62], [0], 2, 10, "row 4611686018427387904", id="row-times-2bpc"),
        pytest.param([-1], [0], 1, 10, "row -1", id="row-negative"),
        pytest.param([0, 0], [0, 1], 1 << 62, 10, "bpc", id="nrows-times-bpc"),
    ],
)
@pytest.mark.parametrize("store", [True, False], ids=["store", "load"])
def test_plan_units_refuses_out_of_contract_values(
    rows: list[int], ids: list[int], bpc: int, num_blocks: int, message: str, store: bool
) -> None:
    # Each of these overflowed an int64 sum or product inside the loop (UBSan);
    # the loop refuses them itself now, before writing anything.
    assert native is not None
    out = np.full(64, -7, dtype=np.int64)
    r, i = np.array(rows, dtype=np.int64), np.array(ids, dtype=np.int64)
    with pytest.raises(ValueError, match=message):
        native.plan_units(r, i, bpc, 0, num_blocks, True, store, out)
    assert (out == -7).all()


def test_plan_units_takes_ids_at_its_bounds() -> None:
    # The largest values in contract plan as they should (no wrap-around in a key).
    assert native is not None
    top = (1 << 62) - 2
    rows = np.array([((1 << 62) // 8) - 1], dtype=np.int64)
    out = np.empty(64, dtype=np.int64)
    got = native.plan_units(rows, np.array([top, top + 1]), 4, 2, 1 << 62, True, False, out)
    assert got == 2
    assert out[:8].tolist() == [rows[0], 2, top, 2, rows[0], 6, top + (1 << 62), 2]


def test_int64_vector_names_what_it_wants() -> None:
    # Strided and foreign inputs are refused with a sentence, not the buffer
    # protocol's bare "ndarray is not C-contiguous" (the Python side copies them).
    assert native is not None
    with pytest.raises(ValueError, match="values must be a C-contiguous int64 array"):
        native.check_index(np.arange(8, dtype=np.int64)[::2], 10, True)
    with pytest.raises(TypeError, match="values must be an int64 array, got list"):
        native.check_index([1, 2], 10, True)
    with pytest.raises(TypeError, match="ids must be an int64 array, got format"):
        native.plan_units(
            np.arange(2), np.arange(2, dtype=np.int32), 1, 0, 10, False, True, np.empty(16)
        )
