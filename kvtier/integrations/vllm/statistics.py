"""The vLLM front's own statistics record, and its metrics (no vLLM import).

:class:`VLLMCounts` is :attr:`FrontStatistics.front
<kvtier.chain.FrontStatistics.front>` of the vLLM front's ``statistics()``:
what only this front counts. Each field is the series ``kvtier_<field>``
(``_total`` added to a counter's), derived by :func:`kvtier.metrics.record_metrics`
from :data:`VLLM_FIGURES`.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.metrics import Figure, MetricSpec, record_metrics

__all__ = ["VLLM_FIGURES", "VLLM_METRICS", "VLLMCounts"]


@dataclass(slots=True)
class VLLMCounts:
    """What the vLLM front counts that the Engine does not (a snapshot: ``statistics().front``)."""

    lookup_deadline_misses: int = 0
    """Lookups answered as misses because a lower tier's read or probe, or the
    request's wait, outlasted ``lookup_deadline_s`` (the chain counts them)."""
    lookup_row_limit_misses: int = 0
    """Lookups answered as misses because the request's prefix before them
    already needed every CPU row, or because no CPU row came free for their
    read within 0.1 s (the chain counts them)."""
    events_published: int = 0
    """Keys announced in KV cache events."""
    events_dropped: int = 0
    """Keys of KV cache events dropped because nobody took them."""


VLLM_FIGURES: dict[str, Figure] = {
    "lookup_deadline_misses": Figure(
        "counter",
        "Lookups answered as misses because a lower tier's read, or the request's wait, "
        "outlasted lookup_deadline_s.",
    ),
    "lookup_row_limit_misses": Figure(
        "counter",
        "Lookups answered as misses because the request's prefix before them already needed "
        "every CPU row, or no row came free for their read in time (the rest recomputed).",
    ),
    "events_published": Figure("counter", "Keys announced in KV cache events."),
    "events_dropped": Figure(
        "counter", "Keys of KV cache events dropped because nobody took them."
    ),
}
"""Each field of :class:`VLLMCounts`."""

VLLM_METRICS: tuple[MetricSpec, ...] = record_metrics(VLLMCounts, VLLM_FIGURES, fronts=("vllm",))
"""One metric per :class:`VLLMCounts` field (the vLLM front only)."""
