"""The cluster tier: blocks as values on a Valkey/Redis cluster shared by many instances.

* ``_tier``: :class:`ClusterTier`, the tier itself (the
  :class:`~kvtier.tiers.base.Tier` contract, and :class:`~kvtier.tiers.base.Refreshable`);
* ``_client``: pipelines per node, redirections, outages of nodes (over redis-py);
* ``_reader``: a connection per node that reads GET replies straight into CPU rows.

Every value carries :mod:`kvtier.tiers.block_format`'s header, as the file tier's
blocks do.
"""

from __future__ import annotations

from kvtier.tiers.cluster._tier import (
    ClusterTier,
    ClusterTierConfig,
    ClusterTierStatistics,
    open_cluster_client,
)

__all__ = ["ClusterTier", "ClusterTierConfig", "ClusterTierStatistics", "open_cluster_client"]
