"""The scheduler core's face: what the fronts use is named in ``kvtier.chain.__all__``."""

from __future__ import annotations

import kvtier
import kvtier.chain

FACE = {
    "REMEASURE_S",
    "Answer",
    "Arrivals",
    "Busy",
    "Chain",
    "ChainStatistics",
    "FrontCounts",
    "FrontStatistics",
    "Intent",
    "LoopThread",
    "LowerTier",
    "Outcome",
    "Probe",
    "Probed",
    "Read",
    "ReadDone",
    "Runtime",
    "Settled",
    "Settlement",
    "TierChanged",
    "TierCounts",
    "TierEvents",
    "TierReport",
    "Write",
    "Written",
    "chain_for",
}


def test_the_face_is_exactly_what_the_fronts_use() -> None:
    assert set(kvtier.chain.__all__) == FACE
    for name in kvtier.chain.__all__:
        assert hasattr(kvtier.chain, name), name


def test_the_parts_are_private_modules_of_the_package() -> None:
    for name in ("Chain", "Runtime", "FrontStatistics", "Write"):
        module = getattr(kvtier.chain, name).__module__
        assert module.startswith("kvtier.chain._"), (name, module)


def test_the_public_records_are_the_packages() -> None:
    assert kvtier.FrontStatistics is kvtier.chain.FrontStatistics
    assert kvtier.TierReport is kvtier.chain.TierReport
