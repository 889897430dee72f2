"""The lower front over a real file tier (io_uring, O_DIRECT) and an engine-owned buffer.

The "engine" here is an anonymous page-aligned mapping, as vLLM 0.33's primary
region and SGLang's host pool are: kvtier reads into and writes from its slots.
"""

from __future__ import annotations

import mmap
import os
import threading
from pathlib import Path

import pytest

from kvtier.below import LowerFront, parse_lower_settings
from kvtier.chain import Answer
from kvtier.errors import AlignmentError, ConfigurationError
from kvtier.layout import KVLayout, TensorSpec
from kvtier.region import ForeignRows

STRIDE = 16384
SLOTS = 16


def _layout(model: str = "lower-front-test") -> KVLayout:
    spec = TensorSpec("slot", (1, STRIDE), "int8", 1, False)
    return KVLayout(tensors=(spec,), model_id=model, block_tokens=16)


class Engine:
    """An engine's CPU buffer: SLOTS page-aligned slots."""

    def __init__(self) -> None:
        self.mem = mmap.mmap(-1, SLOTS * STRIDE)
        self.view = memoryview(self.mem)

    def fill(self, slot: int, seed: int) -> bytes:
        data = (seed.to_bytes(4, "little") * (STRIDE // 4))[:STRIDE]
        data = bytes((b + i) % 256 for i, b in enumerate(data[:64])) + data[64:]
        self.view[slot * STRIDE : (slot + 1) * STRIDE] = data
        return data

    def slot(self, slot: int) -> bytes:
        return bytes(self.view[slot * STRIDE : (slot + 1) * STRIDE])


def _open(root: Path, engine: Engine, **extra: object) -> LowerFront:
    table = {"file_tier": {"root": str(root), "bytes_to_use": "64MiB"}, **extra}
    settings = parse_lower_settings(table, where="test", buffer_bytes=SLOTS * STRIDE)
    return LowerFront.open(settings, _layout(), ForeignRows(engine.view, STRIDE), name="t")


def _key(i: int) -> bytes:
    return i.to_bytes(16, "big")


def test_store_then_load_into_other_slots_byte_for_byte(tmp_path: Path) -> None:
    engine = Engine()
    front = _open(tmp_path, engine)
    try:
        want = {_key(i): engine.fill(i, 1000 + i) for i in range(4)}
        front.store(1, list(want), [0, 1, 2, 3])
        done = front.wait(1, timeout=30)
        assert done is not None
        assert done.ok
        assert done.done == set(want)
        assert not done.load
        for i in range(4):  # the engine drops its copies
            engine.view[i * STRIDE : (i + 1) * STRIDE] = bytes(STRIDE)
        assert [front.lookup(k) for k in want] == [Answer.HIT] * 4
        assert front.lookup(_key(99)) is Answer.MISS
        assert front.prefix([*want, _key(99), _key(0)]) == 4
        front.load(2, list(want), [8, 9, 10, 11])
        done = front.wait(2, timeout=30)
        assert done is not None
        assert done.ok
        assert done.load
        for j, (_k, data) in enumerate(want.items()):
            assert engine.slot(8 + j) == data
        st = front.statistics()
        assert st.tiers["file"].written_blocks == 4
        assert st.tiers["file"].read_blocks == 4
        assert st.stores == 1
        assert st.loads == 1
    finally:
        front.close()


def test_a_restart_finds_the_file_tiers_blocks(tmp_path: Path) -> None:
    engine = Engine()
    front = _open(tmp_path, engine)
    data = engine.fill(3, 7)
    front.store(1, [_key(3)], [3])
    assert front.wait(1, timeout=30) is not None
    front.close()
    assert front.closed
    engine2 = Engine()
    front = _open(tmp_path, engine2)
    try:
        assert front.lookup(_key(3)) is Answer.HIT
        front.load(5, [_key(3)], [0])
        done = front.wait(5, timeout=30)
        assert done is not None
        assert done.ok
        assert engine2.slot(0) == data
    finally:
        front.close()


def test_a_damaged_block_fails_its_key_and_is_forgotten(tmp_path: Path) -> None:
    engine = Engine()
    front = _open(tmp_path, engine)
    try:
        engine.fill(0, 1)
        engine.fill(1, 2)
        front.store(1, [_key(0), _key(1)], [0, 1])
        assert front.wait(1, timeout=30) is not None
        # Flip a byte in the payload of every stored block file.
        damaged = 0
        for path in tmp_path.rglob("*"):
            if path.is_file() and path.stat().st_size >= STRIDE + 4096:
                with open(path, "r+b") as f:
                    f.seek(4096 + 100)
                    b = f.read(1)
                    f.seek(4096 + 100)
                    f.write(bytes([b[0] ^ 0xFF]))
                damaged += 1
        assert damaged >= 1
        front.load(2, [_key(0), _key(1)], [5, 6])
        done = front.wait(2, timeout=30)
        assert done is not None
        assert not done.ok
        assert len(done.failed) >= 1
        assert all(front.lookup(k) is Answer.MISS for k in done.failed)
        assert front.statistics().front.blocks_failed == len(done.failed)
    finally:
        front.close()


def test_jobs_from_many_threads_each_end_once(tmp_path: Path) -> None:
    engine = Engine()
    front = _open(tmp_path, engine)
    results: dict[int, bool] = {}

    def worker(t: int) -> None:
        for r in range(5):
            job = t * 100 + r
            slot = t * 4 + r % 4
            engine.fill(slot, job)
            front.store(job, [_key(job)], [slot])
            done = front.wait(job, timeout=30)
            results[job] = done is not None and done.ok

    try:
        threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(60)
        assert len(results) == 20
        assert all(results.values())
        assert front.finished() == []  # waited on: not reported twice
        # A prefix longer than the engine's buffer cannot load: the row limit is its size.
        assert front.prefix([_key(t * 100 + r) for t in range(4) for r in range(5)]) == SLOTS
    finally:
        front.close()


def test_finished_reports_each_job_once_and_bad_slots_fail_at_once(tmp_path: Path) -> None:
    engine = Engine()
    front = _open(tmp_path, engine)
    try:
        engine.fill(0, 5)
        front.store(1, [_key(0)], [0])
        front.store(2, [_key(1)], [SLOTS])  # out of range: refused, reported failed
        front.load(3, [_key(42)], [1])  # held by no tier: failed at once
        assert front.drain(30)
        ended = {d.job: d for d in front.finished()}
        assert set(ended) == {1, 2, 3}
        assert ended[1].ok
        assert not ended[2].ok
        assert not ended[3].ok
        assert front.finished() == []
        front.store(4, [_key(5)], [0])
        with pytest.raises(ValueError, match="in flight"):
            front.store(4, [_key(6)], [1])
    finally:
        front.close()


def test_a_load_slower_than_recomputing_is_declined(tmp_path: Path) -> None:
    engine = Engine()
    front = _open(tmp_path, engine, recompute_s_per_block=1e-9)
    try:
        engine.fill(0, 5)
        front.store(1, [_key(0)], [0])
        assert front.wait(1, timeout=30) is not None
        front.load(2, [_key(0)], [1])  # measures the tier's reads
        assert front.wait(2, timeout=30) is not None
        answers = [front.lookup(_key(0), request="r") for _ in range(3)]
        assert Answer.MISS in answers
        assert front.statistics().tiers["file"].loads_declined >= 1
    finally:
        front.close()


def test_settings_refuse_what_the_lower_front_cannot_do() -> None:
    with pytest.raises(ConfigurationError, match="at least one of"):
        parse_lower_settings({}, where="cfg", buffer_bytes=1 << 20)
    with pytest.raises(ConfigurationError, match=r"unknown key\(s\) \['bogus'\]"):
        parse_lower_settings(
            {"file_tier": {"root": "/tmp"}, "bogus": 1}, where="cfg", buffer_bytes=1
        )
    with pytest.raises(ConfigurationError, match="write_through"):
        parse_lower_settings(
            {"file_tier": {"root": "/tmp", "bytes_to_use": "1GiB", "write_policy": "write_back"}},
            where="cfg",
            buffer_bytes=1 << 20,
        )
    with pytest.raises(ConfigurationError, match="lookup_deadline_s"):
        parse_lower_settings(
            {"file_tier": {"root": "/tmp", "bytes_to_use": "1GiB"}, "lookup_deadline_s": -1},
            where="cfg",
            buffer_bytes=1 << 20,
        )


def test_foreign_rows_check_alignment_and_release() -> None:
    mem = mmap.mmap(-1, 4 * STRIDE)
    view = memoryview(mem)
    with pytest.raises(AlignmentError):
        ForeignRows(view[1:], STRIDE)
    with pytest.raises(AlignmentError):
        ForeignRows(view, STRIDE + 1)
    rows = ForeignRows(view, STRIDE)
    assert rows.rows == 4
    assert rows.row(3).nbytes == STRIDE
    rows.release()
    view.release()
    mem.close()  # no view of ours is left: the engine may unmap
    assert os.sysconf("SC_PAGE_SIZE") > 0


def test_a_store_of_blocks_held_already_moves_nothing(tmp_path: Path) -> None:
    engine = Engine()
    front = _open(tmp_path, engine)
    try:
        engine.fill(0, 1)
        engine.fill(1, 2)
        front.store(1, [_key(0), _key(1)], [0, 1])
        first = front.wait(1, timeout=30)
        assert first is not None
        assert first.moved == 2
        front.store(2, [_key(0), _key(1)], [0, 1])  # the engine offers them again
        again = front.wait(2, timeout=30)
        assert again is not None
        assert again.ok
        assert again.moved == 0  # vLLM's backpressure sees no bytes that were not written
        front.load(3, [_key(1)], [5])
        loaded = front.wait(3, timeout=30)
        assert loaded is not None
        assert loaded.moved == 1
    finally:
        front.close()
