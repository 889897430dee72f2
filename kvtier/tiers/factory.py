"""The one tier factory: the chain of a configuration opened, and closed again.

Both fronts (:class:`~kvtier.engine.Engine` and the vLLM front's
:class:`~kvtier.integrations.vllm.manager.KVTierOffloadingManager`) open the
tiers below the CPU region here, from :attr:`KVTierConfig.chain
<kvtier.config.KVTierConfig.chain>`: the configuration is plain data, and this
module is the one place that turns each of its tier configurations into an
open :class:`~kvtier.tiers.base.Tier`. It sits above the tiers it opens (host,
file, cluster) and below the fronts, so no tier and no configuration imports it.

* :func:`open_tiers` opens them in chain order, highest first; if one fails,
  those opened before it are closed again (lowest first) before the error
  propagates.
* :func:`aclose_tiers` closes them lowest first; a tier whose close fails is
  logged and the others are still closed.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvtier.config import ClusterTierConfig, HostTierConfig, KVTierConfig, TierConfig
from kvtier.errors import InvalidArgumentError
from kvtier.layout import KVLayout
from kvtier.tiers.base import Tier
from kvtier.tiers.cluster import ClusterTier
from kvtier.tiers.file import FileTier
from kvtier.tiers.host import ChainedHostTier

if TYPE_CHECKING:
    from kvtier.region import Rows
    from kvtier.transfer.io_engine import IOEngine

__all__ = ["aclose_tiers", "open_tier", "open_tiers"]

log = logging.getLogger("kvtier.tiers")


async def open_tier(
    spec: TierConfig,
    layout: KVLayout,
    region: Rows,
    *,
    io_engine: IOEngine | None = None,
    enable_events: bool = False,
) -> Tier:
    """Open one tier of the chain for blocks of ``region``'s rows.

    A file tier is given ``region``'s memory to register (the kernel then pins
    no pages per request; where it refuses, the I/O goes as before: see
    :meth:`FileTier.register_memory <kvtier.tiers.file.FileTier.register_memory>`),
    ``io_engine`` (one of its own when ``None``) and ``enable_events``. A
    cluster tier takes neither: its values go through its client; nor does the
    host tier, which copies rows in memory.
    """
    if isinstance(spec, HostTierConfig):
        return await ChainedHostTier.open(spec, layout, block_bytes=region.row_stride)
    if isinstance(spec, ClusterTierConfig):
        return await ClusterTier.open(spec, layout, block_bytes=region.row_stride)
    tier = await FileTier.open(
        spec,
        layout,
        block_bytes=region.row_stride,
        alignment=min(region.alignment, spec.buffer_alignment),
        io_engine=io_engine,
        enable_events=enable_events,
    )
    try:
        tier.register_memory([region.buffer()])
    except BaseException:
        await tier.aclose()
        raise
    return tier


async def open_tiers(
    config: KVTierConfig,
    layout: KVLayout,
    region: Rows,
    *,
    io_engine: IOEngine | None = None,
    enable_events: bool = False,
) -> list[Tier]:
    """Open the tiers of ``config.chain`` in order, highest first, for ``region``'s rows.

    Parameters
    ----------
    config
        The instance's configuration: its :attr:`~kvtier.config.KVTierConfig.chain`
        names the tiers (any of host, file and cluster, in that order).
    layout
        The KV layout: the namespace of every block the tiers hold.
    region
        The CPU region whose rows the tiers store from and load into.
    io_engine
        The file tier's I/O engine; ``None`` opens one of its own.
    enable_events
        Whether the file tier records KV cache events.

    Returns
    -------
    list[Tier]
        One open tier per entry of ``config.chain``, in the same order.

    Raises
    ------
    KVTierError
        The error of the tier that failed to open (anything else, a
        cancellation included, propagates the same way), after every tier
        opened before it was closed again, lowest first.
    """
    tiers: list[Tier] = []
    names: list[str] = []
    try:
        for name, spec in config.chain:
            tiers.append(
                await open_tier(
                    spec, layout, region, io_engine=io_engine, enable_events=enable_events
                )
            )
            names.append(name)
    except BaseException:
        await aclose_tiers(tiers, names)
        raise
    return tiers


async def aclose_tiers(tiers: Sequence[Tier], names: Sequence[str]) -> None:
    """Close ``tiers`` (as :func:`open_tiers` returned them), lowest first.

    A tier that fails to close is logged (named by ``names``, one per tier)
    and the others are closed all the same; nothing is raised but a
    cancellation of the caller.

    Raises
    ------
    InvalidArgumentError
        When ``names`` does not name each tier once (nothing is closed).
    """
    if len(names) != len(tiers):
        raise InvalidArgumentError(f"{len(tiers)} tiers but {len(names)} names")
    for name, tier in reversed(list(zip(names, tiers, strict=True))):
        try:
            await tier.aclose()
        except Exception:
            log.exception("closing the %s tier failed", name)
