"""The demo's report: requests grouped by where their prefix came from, and its tables.

The tiers' figures it prints are :mod:`kvtier.demo.figures`'.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvtier.demo.check import LOGITS_RTOL

if TYPE_CHECKING:
    from rich.console import RenderableType

    from kvtier.demo.serving import DemoResult, RequestRecord, Source

__all__ = [
    "TTFT_CAPTION",
    "TTFT_COLUMNS",
    "SourceFigures",
    "explanations",
    "render",
    "source_figures",
]


@dataclass(frozen=True, slots=True)
class SourceFigures:
    """Requests grouped by where their prefix came from, against their recompute."""

    label: str
    """What the group is."""
    requests: int
    """Requests in the group."""
    prompt_tokens: float
    """Median prompt length."""
    loaded_tokens: float
    """Median tokens loaded instead of computed."""
    cpu_share: float
    """Share of the group's hit blocks that came from the CPU tier."""
    ttft_median: float
    """Median time to first token with kvtier (load + prefill of the rest), seconds."""
    ttft_p95: float
    """95th percentile (nearest rank) of the same."""
    recompute_median: float
    """Median time to first token of a full recompute of the same prompts, seconds."""
    recompute_p95: float
    """95th percentile (nearest rank) of the same."""
    floor_median: float
    """Median over the requests that loaded a prefix of their floor: the prefill
    of what they computed with the prefix already in place, seconds; nan with none."""
    over_floor: float
    """Median over the same requests of kvtier's time to first token over the floor."""
    speedup: float
    """Median over the group of recompute time over kvtier time, request by request."""
    slower: int
    """Requests where kvtier's time to first token was above the recompute's."""
    load_per_token: float
    """Seconds of lookup and load per loaded token (total over total); nan with none."""
    prefill_per_token: float
    """Seconds of kvtier's prefill per computed token (total over total)."""
    recompute_per_token: float
    """Seconds of full-recompute prefill per prompt token (total over total)."""


def _p95(values: Sequence[float]) -> float:
    ordered = sorted(values)
    return ordered[max(math.ceil(0.95 * len(ordered)) - 1, 0)]


def _ratio(num: float, den: float) -> float:
    return num / den if den else math.nan


def source_figures(label: str, records: Sequence[RequestRecord]) -> SourceFigures | None:
    """The figures of ``records`` (None when there are none)."""
    if not records:
        return None
    hit = sum(r.cpu_blocks + r.file_blocks for r in records)
    floored = [r for r in records if not math.isnan(r.floor_s)]
    loaded = sum(r.loaded_tokens for r in records)
    computed = sum(r.prompt_tokens - r.loaded_tokens for r in records)
    return SourceFigures(
        label=label,
        requests=len(records),
        prompt_tokens=statistics.median(r.prompt_tokens for r in records),
        loaded_tokens=statistics.median(r.loaded_tokens for r in records),
        cpu_share=_ratio(sum(r.cpu_blocks for r in records), hit),
        ttft_median=statistics.median(r.ttft_s for r in records),
        ttft_p95=_p95([r.ttft_s for r in records]),
        recompute_median=statistics.median(r.recompute_s for r in records),
        recompute_p95=_p95([r.recompute_s for r in records]),
        floor_median=statistics.median(r.floor_s for r in floored) if floored else math.nan,
        over_floor=statistics.median(r.ttft_s / r.floor_s for r in floored)
        if floored
        else math.nan,
        speedup=statistics.median(r.recompute_s / r.ttft_s for r in records),
        slower=sum(r.ttft_s > r.recompute_s for r in records),
        load_per_token=_ratio(sum(r.load_s for r in records if r.loaded_tokens), loaded),
        prefill_per_token=_ratio(sum(r.prefill_s for r in records), computed),
        recompute_per_token=_ratio(
            sum(r.recompute_s for r in records), sum(r.prompt_tokens for r in records)
        ),
    )


_SOURCES: tuple[tuple[Source, str], ...] = (
    ("cpu", "CPU tier"),
    ("file", "file tier"),
    ("none", "nothing loaded"),
)


def _groups(result: DemoResult) -> list[SourceFigures]:
    out = []
    for source, label in _SOURCES:
        figures = source_figures(label, [r for r in result.records if r.source == source])
        if figures is not None:
            out.append(figures)
    every = source_figures("all requests", result.records)
    if every is not None:
        out.append(every)
    return out


def explanations(groups: Sequence[SourceFigures]) -> list[str]:
    """A line for each figure of ``groups`` that seems to contradict the others.

    A kvtier / floor below 1x (kvtier faster than if loading cost nothing), a
    speed-up below 1x, and a speed-up (a median of per-request ratios) on the
    other side of 1x from the ratio of the medians shown beside it.
    """
    out = []
    for g in groups:
        if g.label == "nothing loaded":
            continue  # no load, no floor: its speed-up is the noise (the caption says so)
        if not math.isnan(g.over_floor) and g.over_floor < 1:
            out.append(
                f"{g.label}: kvtier / floor {g.over_floor:.2f}x, below 1x: loading cost less than "
                "the difference between two timings of the same prefill (the floor is timed "
                "apart, after the recompute, on the recompute's cache), so it is within the "
                "measurement's noise here"
            )
        of_medians = _ratio(g.recompute_median, g.ttft_median)
        if g.speedup < 1:
            out.append(
                f"{g.label}: speed-up {g.speedup:.2f}x, below 1x: for most of these requests, "
                "loading the prefix and computing the rest took longer than computing the "
                "whole prompt (a short prompt on a small model computes in little more than "
                "the floor of one forward pass, and the load comes on top)"
            )
        if not math.isnan(of_medians) and (of_medians < 1) != (g.speedup < 1):
            out.append(
                f"{g.label}: speed-up {g.speedup:.1f}x is the median of each request's recompute "
                f"over its kvtier time; the medians shown give {of_medians:.2f}x, as the two "
                "medians need not come from the same request"
            )
    return out


def _ms(s: float) -> str:
    return f"{s * 1e3:,.0f}" if s >= 0.1 else f"{s * 1e3:,.1f}"


def _us(s: float) -> str:
    return "-" if math.isnan(s) else f"{s * 1e6:,.1f}"


def _times(num: float, den: float) -> str:
    return "-" if math.isnan(num) or math.isnan(den) or not den else f"{num / den:,.0f}x"


TTFT_CAPTION = (
    "kvtier: lookup + load + prefill of the rest; floor: the model's own prefill of the rest "
    "with the prefix already in place (kvtier's time if loading cost nothing); recompute: "
    "prefill of the whole prompt; all on the same model thread between the other requests, "
    "without queueing for the model. The two ratios are medians of each request's own ratio "
    "(kvtier over its floor; its recompute over kvtier), not ratios of the medians beside "
    "them, which they need not match. kvtier / floor below 1x: within the noise, as the floor "
    "is a second timing of the same prefill, taken later on the recompute's cache. Nothing "
    "loaded: the same work both ways, so its speed-up shows the noise of the measurement."
)
"""The caption of the time-to-first-token table: what each column is."""

TTFT_COLUMNS = (
    "prefix mostly from",
    "requests",
    "prompt tokens, median",
    "loaded tokens, median",
    "kvtier median / p95",
    "floor median",
    "kvtier / floor, median ratio",
    "recompute median / p95",
    "speed-up, median ratio",
)
"""The columns of the time-to-first-token table."""


def render(result: DemoResult, width: int | None = None) -> list[RenderableType]:
    """The report: the tiers, time to first token by source, per token, the verdict.

    With ``width``, a table wider than ``width`` columns is printed as a block
    of ``name: value`` lines per row instead, so that no header or cell is cut.
    """
    from rich.text import Text

    from kvtier._text import fit_table, human_bytes

    fit = 10**6 if width is None else width
    st, sizes, records = result.tiers, result.sizes, result.records
    block_tokens = result.settings.block_tokens * result.settings.blocks_per_chunk
    tier_rows = [
        [
            "device (KV tensors)",
            f"{sizes.device_blocks * result.settings.block_tokens:,} tokens",
            "-",
            "-",
            "-",
            "-",
        ],
        [
            "CPU tier",
            f"{st.cpu_capacity} blocks, {human_bytes(sizes.cpu_bytes)}",
            str(sum(r.cpu_blocks > 0 for r in records)),
            str(st.cpu_hits),
            str(st.cpu_evictions),
            "-",
        ],
        [
            "file tier",
            human_bytes(sizes.file_bytes),
            str(sum(r.file_blocks > 0 for r in records)),
            f"{st.file_hits} ({st.promotions} promoted)",
            str(st.file_evictions),
            str(st.file_blocks),
        ],
    ]
    tiers = fit_table(
        f"Tiers (blocks of {block_tokens} tokens, {human_bytes(sizes.block_bytes)} each)",
        ("tier", "capacity", "requests hit", "blocks hit", "evicted", "resident at end"),
        tier_rows,
        fit,
        left=("tier",),
        name_heading=False,
    )

    groups = _groups(result)
    ttft_rows = []
    for g in groups:
        label = g.label
        if g.label == "CPU tier":
            label += f" ({g.cpu_share:.0%} of hits)"
        elif g.label == "file tier":
            label += f" ({1 - g.cpu_share:.0%} of hits)"
        ttft_rows.append(
            [
                label,
                str(g.requests),
                f"{g.prompt_tokens:,.0f}",
                f"{g.loaded_tokens:,.0f}",
                f"{_ms(g.ttft_median)} / {_ms(g.ttft_p95)}",
                "-" if math.isnan(g.floor_median) else _ms(g.floor_median),
                "-" if math.isnan(g.over_floor) else f"{g.over_floor:,.2f}x",
                f"{_ms(g.recompute_median)} / {_ms(g.recompute_p95)}",
                f"{g.speedup:,.1f}x",
            ]
        )
    ttft = fit_table(
        "Time to first token, ms: kvtier against a full recompute of the same prompts",
        TTFT_COLUMNS,
        ttft_rows,
        fit,
        left=("prefix mostly from",),
        caption=TTFT_CAPTION,
        name_heading=False,
    )

    per_token_rows = [
        [
            g.label,
            _us(g.load_per_token),
            _us(g.prefill_per_token),
            _us(g.recompute_per_token),
            "-"
            if math.isnan(g.load_per_token)
            else f"{g.recompute_per_token / g.load_per_token:,.0f}x",
        ]
        for g in groups
        if g.label != "all requests"
    ]
    per_token = fit_table(
        "Per token, µs",
        ("", "load", "prefill with kvtier", "prefill, full recompute", "recompute / load"),
        per_token_rows,
        fit,
        left=("",),
        caption="load: lookup and load over the tokens loaded; prefill: over the tokens computed "
        "(a forward pass has a floor, so short prefills cost more per token)",
        name_heading=False,
    )

    n = len(records)
    verdicts = [r.verdict for r in records if r.verdict is not None]
    answer = result.settings.workload.answer_tokens
    loaded = sum(v.blocks_loaded for v in verdicts)
    wrong = sum(v.blocks_wrong for v in verdicts)
    largest, share = result.largest_logits_difference
    ok = result.mismatches == 0
    lines = [
        Text(
            f"outputs: {sum(r.correct for r in records)}/{n} requests correct. Loaded blocks "
            f"byte for byte those stored: {loaded - wrong:,}/{loaded:,}; the same {answer} "
            f"greedy tokens as a full recompute: {sum(v.tokens_identical for v in verdicts)}/{n}; "
            f"first-token logits within {LOGITS_RTOL:.0e} of the recompute's largest logit: "
            f"{sum(v.logits_within for v in verdicts)}/{n}, largest difference "
            + (f"{largest:.1e} ({share:.1e} of the largest logit)" if largest else "0")
            + f", bit for bit in {sum(v.logits_identical for v in verdicts)}/{n}",
            style="bold green" if ok else "bold red",
        ),
    ]
    busy = sum(r.prefill_s for r in records)
    recompute = sum(r.recompute_s for r in records)
    queue = statistics.median(r.queue_s for r in records) if records else 0.0
    lines.append(
        Text(
            f"wall time {result.wall_s:.1f} s, serving and recomputing for the check; "
            f"prefill {busy:.1f} s with kvtier against {recompute:.1f} s recomputed; "
            f"waiting for the model (not in TTFT): median {_ms(queue)} ms"
        )
    )
    for g in groups:
        if g.slower and g.label in ("CPU tier", "file tier"):
            lines.append(
                Text(
                    f"{g.label}: slower than recompute for {g.slower} of {g.requests} requests",
                    style="yellow",
                )
            )
    lines += [Text(note, style="yellow") for note in explanations(groups)]
    if st.load_shortfalls or st.dropped:
        lines.append(
            Text(
                f"{st.load_shortfalls} blocks fell short on load, {st.dropped} not stored (no room)"
            )
        )
    return [tiers, ttft, per_token, *lines]
