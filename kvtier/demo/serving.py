"""The demo's asyncio serving loop: a real model over kvtier's tiers.

Requests arrive concurrently. Each one takes device blocks, looks its prompt's
blocks up, ``await``\\ s :meth:`Engine.load` of the hits, prefills the rest and
decodes greedily on the model's one worker thread (so loads and stores of other
requests run while it computes), then ``await``\\ s :meth:`Engine.store` of its
blocks. The CPU stands in for the GPU: the "device" KV tensors are CPU tensors.
The CPU tier and the file tier (in a temporary directory) are sized from the
workload so that its KV does not fit in them: hits come from both.

Every loaded block is checked, while its request holds it, against a digest
of the bytes stored under its key (:mod:`kvtier.demo.check`). Once served,
every prompt is computed again from scratch on a cache of its own, queued on
the same model thread among the other requests, so that it runs under the same
conditions: that is the ground truth each served request is compared with (the
greedy tokens, and the first token's logits within a tolerance, bit for bit
where the model's arithmetic allows), and the full recompute whose time to
first token the report sets beside kvtier's. On that recompute's cache, with
the prefix in place, the part of the prompt that kvtier's request computed is
computed again: the floor, kvtier's time to first token if loading cost
nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal, TypeVar

import torch

from kvtier.config import FileTierConfig, KVTierConfig
from kvtier.demo.check import BlockLedger, Verdict, block_digest, judge
from kvtier.demo.figures import TierFigures, read_statistics
from kvtier.demo.model import TILE, DemoModel, Generation, ModelConfig
from kvtier.demo.workload import (
    Conversation,
    WorkloadSettings,
    build_conversations,
    prompt_of,
    schedule,
)
from kvtier.engine import Engine
from kvtier.keys import chain_keys
from kvtier.layout import KVLayout

__all__ = ["DemoResult", "DemoSettings", "RequestRecord", "TierSizes", "run_demo"]

_T = TypeVar("_T")

Source = Literal["cpu", "file", "none"]
"""Where most of a request's loaded prefix came from (``file`` on a tie), or
``none`` when nothing was loaded."""


@dataclass(frozen=True, slots=True)
class DemoSettings:
    """What the demo runs."""

    workload: WorkloadSettings = field(default_factory=WorkloadSettings)
    """The conversations and their order."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The model's shape."""
    model_seed: int = 0
    """Seed of the model's weights."""
    concurrency: int = 4
    """Requests in flight at once."""
    block_tokens: int = 16
    """Tokens per device KV block (vLLM's default)."""
    blocks_per_chunk: int = 4
    """Device blocks per offloaded block."""
    cpu_share: float = 0.25
    """CPU tier capacity as a share of the offloaded blocks the workload
    produces (raised to what the requests in flight need at once)."""
    tmp_parent: Path | None = None
    """Where the temporary directory of the file tier goes (default: the
    system's temporary directory)."""
    corrupt_one_block: bool = False
    """Test hook: zero one loaded device block of the first request that loads
    any, as a tier returning wrong bytes would; the check of loaded blocks
    must catch it, and the demo fail."""
    metrics_port: int | None = None
    """Serve the engine's Prometheus metrics on ``http://127.0.0.1:PORT/metrics``
    while the demo runs (0: a free port); None: no server. Needs
    ``kvtier[metrics]``."""

    @classmethod
    def quick(cls) -> DemoSettings:
        """A 2-layer model on 16 short requests that still hit both tiers: seconds, for tests."""
        workload = WorkloadSettings(
            conversations=8,
            turns=2,
            system_prompts=1,
            system_tokens=64,
            documents=6,
            document_tokens=384,
            user_tokens=(16, 48),
            answer_tokens=4,
        )
        model = ModelConfig(
            vocab=4096, hidden=256, layers=2, heads=4, kv_heads=2, head_dim=64, intermediate=768
        )
        return cls(workload=workload, model=model, concurrency=2, cpu_share=0.25)


@dataclass(frozen=True, slots=True)
class TierSizes:
    """How the demo sized the device and the tiers for its workload."""

    workload_blocks: int
    """Offloaded blocks the workload's sequences span (distinct prefixes)."""
    block_bytes: int
    """KV bytes of one offloaded block."""
    device_blocks: int
    """Device KV blocks: room for the requests in flight, no more."""
    cpu_blocks: int
    """Rows of the CPU tier."""
    cpu_bytes: int
    """Bytes of the CPU region."""
    file_bytes: int
    """Bytes reserved by the file tier."""
    file_root: str
    """The file tier's (temporary) directory."""
    metrics_url: str | None = None
    """Where the engine's metrics are served while the demo runs, or None."""


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """What one request did and measured."""

    index: int
    """Arrival order."""
    conversation: int
    """Conversation index."""
    turn: int
    """Turn within the conversation (0 first)."""
    prompt_tokens: int
    """Tokens of the prompt."""
    cpu_blocks: int
    """Offloaded blocks the lookup found in the CPU tier."""
    file_blocks: int
    """Offloaded blocks the lookup found in the file tier."""
    loaded_tokens: int
    """Prompt tokens whose KV was loaded (not computed)."""
    load_s: float
    """Lookup and load, from the request's start to its blocks on the device."""
    queue_s: float
    """Waiting for the model's worker thread (busy with other requests)."""
    prefill_s: float
    """Prefill of the tokens not loaded, to the first token's logits."""
    tokens: tuple[int, ...]
    """The greedy tokens generated."""
    blocks_wrong: int = 0
    """Loaded blocks whose bytes were not those stored under their key."""
    recompute_s: float = math.nan
    """Prefill of the whole prompt from scratch, to the first token's logits."""
    floor_s: float = math.nan
    """Prefill of the tokens this request computed, with the prefix already in
    place (computed, not loaded): its time to first token if loading cost
    nothing. Nan when nothing was loaded."""
    verdict: Verdict | None = None
    """The comparison with the recompute (None until checked)."""

    @property
    def source(self) -> Source:
        """Where most of the loaded prefix came from."""
        if not self.loaded_tokens:
            return "none"
        return "file" if self.file_blocks >= self.cpu_blocks else "cpu"

    @property
    def ttft_s(self) -> float:
        """Time to first token with kvtier: load plus prefill (queueing excluded)."""
        return self.load_s + self.prefill_s

    @property
    def correct(self) -> bool:
        """Checked, and every check held (:attr:`Verdict.correct`)."""
        return self.verdict is not None and self.verdict.correct


@dataclass(frozen=True, slots=True)
class DemoResult:
    """Everything the demo measured."""

    settings: DemoSettings
    """What ran."""
    sizes: TierSizes
    """How the tiers were sized."""
    records: tuple[RequestRecord, ...]
    """One per request, in arrival order."""
    tiers: TierFigures
    """The engine's statistics at the end of serving."""
    wall_s: float
    """Wall time of serving and recomputing."""

    @property
    def mismatches(self) -> int:
        """Requests that failed a check: a wrong block, other tokens or logits out of tolerance."""
        return sum(not r.correct for r in self.records)

    @property
    def largest_logits_difference(self) -> tuple[float, float]:
        """The largest difference of first-token logits from the recompute's seen,
        and the same as a share of that recompute's largest logit."""
        verdicts = [r.verdict for r in self.records if r.verdict is not None]
        worst = max(verdicts, key=lambda v: v.logits_difference, default=None)
        if worst is None:
            return 0.0, 0.0
        scale = worst.logits_scale or math.inf  # all-zero logits: no share to give
        return worst.logits_difference, worst.logits_difference / scale


Progress = Callable[[Literal["served", "verified"], RequestRecord, int, int], None]
"""Called after each request is served and after each is verified, with the
record, how many are done and how many there are."""


class _ModelWorker:
    """One thread runs every forward pass, as one GPU runs one batch at a time.

    Two requests computing at once on this machine's cores would each take
    twice as long; one thread keeps the prefill times comparable and leaves the
    event loop free for other requests' loads and stores.
    """

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvtier-demo-model")

    async def run(self, fn: Callable[[], _T]) -> tuple[_T, float]:
        """Run ``fn`` on the worker; return its result and how long it waited to start.

        Notes
        -----
        When the awaiting task is cancelled this still waits for ``fn`` to end
        before the cancellation propagates, since ``fn`` writes device blocks
        that the caller releases afterwards.
        """
        submitted = time.perf_counter()

        def timed() -> tuple[_T, float]:
            began = time.perf_counter()
            return fn(), began - submitted

        fut = asyncio.get_running_loop().run_in_executor(self._pool, timed)
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            await asyncio.wait([fut])
            raise

    def close(self) -> None:
        self._pool.shutdown(wait=True)


class _DeviceBlocks:
    """The device's free KV blocks, and the waits for them."""

    def __init__(self, num_blocks: int) -> None:
        self._free = list(range(num_blocks))
        self._cond = asyncio.Condition()

    async def take(self, n: int) -> list[int]:
        async with self._cond:
            await self._cond.wait_for(lambda: len(self._free) >= n)
            got, self._free = self._free[:n], self._free[n:]
        return got

    async def give(self, ids: list[int]) -> None:
        async with self._cond:
            self._free.extend(ids)
            self._cond.notify_all()


@dataclass(slots=True)
class _Served:
    record: RequestRecord
    prompt: list[int]
    first_logits: torch.Tensor


def _size(settings: DemoSettings, conversations: Sequence[Conversation]) -> tuple[int, int, int]:
    """Distinct offloaded blocks of the workload, and the longest request in device
    and in offloaded blocks (answers stood in for by placeholders)."""
    w = settings.workload
    offload = settings.block_tokens * settings.blocks_per_chunk
    keys: set[bytes] = set()
    longest = 0
    for c in conversations:
        answers = [[c.index] * w.answer_tokens] * w.turns
        seq = prompt_of(c, w.turns - 1, answers) + answers[-1][:-1]
        longest = max(longest, len(seq))
        keys.update(chain_keys(seq, offload, b"demo sizing"))
    return len(keys), -(-longest // settings.block_tokens), -(-longest // offload)


@contextlib.asynccontextmanager
async def _metrics(engine: Engine, port: int | None) -> AsyncIterator[str | None]:
    """The engine's metrics on 127.0.0.1:``port`` while the block runs (its URL), or None."""
    if port is None:
        yield None
        return
    from kvtier.metrics import serve_metrics

    server, _thread = serve_metrics(engine, port)
    try:
        yield f"http://127.0.0.1:{server.server_port}/metrics"
    finally:
        server.shutdown()
        server.server_close()


async def run_demo(
    settings: DemoSettings,
    progress: Progress | None = None,
    opened: Callable[[TierSizes], None] | None = None,
    stage: Callable[[str], None] | None = None,
) -> DemoResult:
    """Serve the workload over kvtier, then check every request against a recompute.

    Parameters
    ----------
    settings
        What to run.
    progress
        Called as requests are served and verified.
    opened
        Called with the tiers' sizes once the engine is open, before serving.
    stage
        Called with a line as each step of the set-up begins (building the
        model, warming it up, opening the engine): they take a while on a slow
        machine before the first request is served.

    Returns
    -------
    DemoResult
        The measurements; :attr:`DemoResult.mismatches` counts wrong outputs.

    Raises
    ------
    KVTierError
        When the engine cannot open (for instance, no room for the file tier).
    """
    say = stage or (lambda _line: None)
    w = settings.workload
    c = settings.model
    say(
        f"set-up: building the model ({c.layers} layers, hidden size {c.hidden}, "
        f"random weights from seed {settings.model_seed})"
    )
    model = DemoModel(settings.model, seed=settings.model_seed)
    conversations = build_conversations(w, settings.model.vocab)
    order = schedule(w)
    workload_blocks, request_blocks, request_chunks = _size(settings, conversations)
    bpc = settings.blocks_per_chunk
    device_blocks = settings.concurrency * request_blocks
    kv = model.new_cache(device_blocks, settings.block_tokens)
    layout = KVLayout.from_tensors(
        kv,
        model_id=f"kvtier-demo/{c.layers}x{c.hidden}-gqa{c.heads}:{c.kv_heads}@seed{settings.model_seed}",
        block_tokens=settings.block_tokens,
        blocks_per_chunk=bpc,
        num_blocks=device_blocks,
    )
    block_bytes = layout.bytes_per_chunk
    row_bytes = -(-block_bytes // 4096) * 4096
    # Room for every request in flight to pin its blocks and store its new ones.
    cpu_rows = max(
        math.ceil(settings.cpu_share * workload_blocks), (settings.concurrency + 1) * request_chunks
    )
    # Twice the workload: the slot file's headers and free space, and never an eviction.
    file_bytes = -(-2 * workload_blocks * (row_bytes + 4096) // 2**20) * 2**20
    worker = _ModelWorker()
    scratch = model.new_cache(request_blocks, settings.block_tokens)
    try:
        # A server warms up before it takes requests: the first forward passes
        # of a process pay for allocations and kernel selection.
        warm = [t % c.vocab for t in range(3 * TILE)]
        say("set-up: warming the model up (its first forward passes)")
        await worker.run(
            functools.partial(model.generate, scratch, range(request_blocks), warm, 0, 2)
        )
        with tempfile.TemporaryDirectory(prefix="kvtier-demo-", dir=settings.tmp_parent) as tmp:
            root = Path(tmp) / "file-tier"
            config = KVTierConfig(
                cpu_bytes_to_use=cpu_rows * row_bytes,
                blocks_per_chunk=bpc,
                file_tier=FileTierConfig(root=root, bytes_to_use=file_bytes),
            )
            say(
                f"set-up: opening the engine (CPU tier of {cpu_rows} blocks, file tier "
                f"preallocated in {root})"
            )
            started = time.perf_counter()
            async with (
                await Engine.open(config, layout, kv) as engine,
                _metrics(engine, settings.metrics_port) as metrics_url,
            ):
                at_open = read_statistics(engine.statistics())
                sizes = TierSizes(
                    workload_blocks=workload_blocks,
                    block_bytes=block_bytes,
                    device_blocks=device_blocks,
                    cpu_blocks=at_open.cpu_capacity,
                    cpu_bytes=cpu_rows * row_bytes,
                    file_bytes=file_bytes,
                    file_root=str(root),
                    metrics_url=metrics_url,
                )
                if opened is not None:
                    opened(sizes)
                loop = _ServingLoop(settings, model, engine, kv, scratch, worker, progress)
                records = await loop.serve(conversations, order)
                await engine.flush()
                tiers = read_statistics(engine.statistics())
            wall_s = time.perf_counter() - started
    finally:
        worker.close()
    return DemoResult(settings, sizes, tuple(records), tiers, wall_s)


class _ServingLoop:
    """The requests of one run over one engine."""

    def __init__(
        self,
        settings: DemoSettings,
        model: DemoModel,
        engine: Engine,
        kv: list[torch.Tensor],
        scratch: list[torch.Tensor],
        worker: _ModelWorker,
        progress: Progress | None,
    ) -> None:
        self._settings = settings
        self._model = model
        self._engine = engine
        self._kv = kv
        self._worker = worker
        self._scratch = scratch
        self._device = _DeviceBlocks(kv[0].shape[1])
        self._progress = progress
        self._corrupt = settings.corrupt_one_block
        self._ledger = BlockLedger()
        self._served = 0
        self._checked: list[RequestRecord] = []
        self._total = 0

    async def serve(
        self, conversations: Sequence[Conversation], order: list[tuple[int, int]]
    ) -> list[RequestRecord]:
        """Serve ``order`` and check each request; a conversation's turn waits for
        its previous answer."""
        self._total = len(order)
        answers: list[list[list[int]]] = [[] for _ in conversations]
        answered = [asyncio.Event() for _ in order]
        position = {pair: i for i, pair in enumerate(order)}
        slots = asyncio.Semaphore(self._settings.concurrency)

        async def one(index: int, conv: int, turn: int) -> None:
            if turn:
                await answered[position[(conv, turn - 1)]].wait()
            async with slots:
                prompt = prompt_of(conversations[conv], turn, answers[conv])
                done = await self._request(index, conv, turn, prompt)
            answers[conv].append(list(done.record.tokens))
            answered[index].set()
            await self._check(done)

        # Requests arrive in order; each starts as soon as a slot is free.
        async with asyncio.TaskGroup() as tg:
            for i, (conv, turn) in enumerate(order):
                tg.create_task(one(i, conv, turn))
        return sorted(self._checked, key=lambda r: r.index)

    async def _request(self, index: int, conv: int, turn: int, prompt: list[int]) -> _Served:
        engine, bpc = self._engine, self._settings.blocks_per_chunk
        answer_tokens = self._settings.workload.answer_tokens
        block_tokens = self._settings.block_tokens
        ids = await self._device.take(-(-(len(prompt) + answer_tokens - 1) // block_tokens))
        try:
            # The statistics around the lookup tell which tier each hit is in; they
            # are the demo's bookkeeping, so their time is left out of load_s.
            before = read_statistics(engine.statistics())
            began = time.perf_counter()
            keys = chain_keys(prompt, engine.block_tokens, engine.namespace)
            # The last prompt token is always computed: its logits give the first token.
            usable = keys[: (len(prompt) - 1) // engine.block_tokens]
            hits = engine.lookup(usable)
            looked = time.perf_counter()
            after = read_statistics(engine.statistics())
            resumed = time.perf_counter()
            loaded = await engine.load(usable[:hits], ids[: hits * bpc]) if hits else 0
            load_s = looked - began + time.perf_counter() - resumed
            start = loaded * engine.block_tokens
            if loaded and self._corrupt:
                self._corrupt = False
                bad = ids[loaded * bpc // 2]
                for t in self._kv:
                    t[:, bad].zero_()
            # Checked while this request holds the blocks: nothing else writes
            # them, and its prefill only writes the blocks after them.
            digests = await asyncio.to_thread(self._digests, ids, 0, loaded) if loaded else []
            wrong = sum(
                not self._ledger.matches(k, d)
                for k, d in zip(usable[:loaded], digests, strict=True)
            )
            gen, queue_s = await self._worker.run(
                lambda: self._model.generate(self._kv, ids, prompt, start, answer_tokens)
            )
            seq = prompt + gen.tokens[:-1]
            stored = chain_keys(seq, engine.block_tokens, engine.namespace)
            # Only what this request computed is a reference: the blocks it
            # loaded are checked, never vouched for. Recorded before the store,
            # which another request may find as soon as it is under way.
            computed = await asyncio.to_thread(self._digests, ids, loaded, len(stored))
            for key, digest in zip(stored[loaded:], computed, strict=True):
                self._ledger.record(key, digest)
            await engine.store(stored, ids[: len(stored) * bpc])
        finally:
            await self._device.give(ids)
        record = RequestRecord(
            index=index,
            conversation=conv,
            turn=turn,
            prompt_tokens=len(prompt),
            cpu_blocks=after.cpu_hits - before.cpu_hits,
            file_blocks=after.file_hits - before.file_hits,
            loaded_tokens=start,
            load_s=load_s,
            queue_s=queue_s,
            prefill_s=gen.prefill_s,
            tokens=tuple(gen.tokens),
            blocks_wrong=wrong,
        )
        self._served += 1
        if self._progress is not None:
            self._progress("served", record, self._served, self._total)
        return _Served(record, prompt, gen.first_logits)

    def _digests(self, ids: Sequence[int], lo: int, hi: int) -> list[bytes]:
        """Digests of offloaded blocks ``lo`` to ``hi`` of the request holding ``ids``."""
        bpc = self._settings.blocks_per_chunk
        return [block_digest(self._kv, ids[i * bpc : (i + 1) * bpc]) for i in range(lo, hi)]

    def _recompute(self, prompt: list[int], start: int) -> tuple[Generation, float]:
        """The full recompute of ``prompt`` on the scratch cache, then the floor:
        ``prompt[start:]`` again, on top of the prefix that the recompute left."""
        table = range(self._scratch[0].shape[1])
        ref = self._model.generate(
            self._scratch, table, prompt, 0, self._settings.workload.answer_tokens
        )
        if not start:
            return ref, math.nan
        began = time.perf_counter()
        int(self._model.forward(self._scratch, table, prompt[start:], start).argmax())
        return ref, time.perf_counter() - began

    async def _check(self, served: _Served) -> None:
        """Recompute ``served``'s prompt from scratch on the scratch cache, and compare."""
        r = served.record
        (ref, floor_s), _ = await self._worker.run(
            functools.partial(self._recompute, served.prompt, r.loaded_tokens)
        )
        record = replace(
            r,
            recompute_s=ref.prefill_s,
            floor_s=floor_s,
            verdict=judge(
                r.tokens,
                served.first_logits,
                ref.tokens,
                ref.first_logits,
                blocks_loaded=r.loaded_tokens // self._engine.block_tokens,
                blocks_wrong=r.blocks_wrong,
            ),
        )
        self._checked.append(record)
        if self._progress is not None:
            self._progress("verified", record, len(self._checked), self._total)
