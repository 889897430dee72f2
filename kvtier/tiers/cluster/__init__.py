"""The cluster tier: blocks as values on a Valkey/Redis cluster shared by many instances.

* ``_tier``: :class:`ClusterTier`, the tier itself (the
  :class:`~kvtier.tiers.base.Tier` contract, and :class:`~kvtier.tiers.base.Refreshable`),
  which owns the parts below, one concern each:
* ``_values``: a block's server key, its sealed header, and why a value is refused;
* ``_presence``: the keys this instance knows present (lookup, refresh);
* ``_transfers``: the store and load paths, per node;
* ``_statistics``: :class:`ClusterTierStatistics` and the counters behind it;
* ``_client``: pipelines per node, redirections (over redis-py);
* ``_outages``: nodes down, probed back in the background; the slot map;
* ``_connect``: connection options, the probe, redis errors mapped to kvtier's;
* ``_reader``: a connection per node that reads GET replies straight into CPU rows.

Every value carries :mod:`kvtier.tiers.block_format`'s header, as the file tier's
blocks do.
"""

from __future__ import annotations

from kvtier.tiers.cluster._statistics import ClusterTierStatistics
from kvtier.tiers.cluster._tier import ClusterTier, ClusterTierConfig, open_cluster_client

__all__ = ["ClusterTier", "ClusterTierConfig", "ClusterTierStatistics", "open_cluster_client"]
