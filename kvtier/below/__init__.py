"""kvtier below another engine's CPU tier: one front for vLLM 0.33 and SGLang HiCache.

Engines that keep a CPU tier of their own take storage *below* it: vLLM
0.33's tiered offloading loads secondary tiers, SGLang HiCache an L3 backend.
:class:`LowerFront` puts kvtier's lower tiers (host, file, cluster) there: the
engine's CPU buffer is the rows (:class:`~kvtier.region.ForeignRows`), and the
chain decides as for the other fronts. The two adapters are thin:
:mod:`kvtier.integrations.vllm.tier` (vLLM 0.33's ``SecondaryTierManager``)
and :mod:`kvtier.integrations.sglang` (SGLang's ``HiCacheStorage``). See
docs/vllm.md ("Below vLLM 0.33's CPU tier") and docs/sglang.md.
"""

from kvtier.below._front import JobDone, LowerCounts, LowerFront
from kvtier.below.settings import LOWER_KEYS, LowerSettings, parse_lower_settings

__all__ = [
    "LOWER_KEYS",
    "JobDone",
    "LowerCounts",
    "LowerFront",
    "LowerSettings",
    "parse_lower_settings",
]
