"""The storage tiers below the CPU region: the chain CPU -> host -> file -> cluster.

Every tier is staged through CPU-region rows and implements one contract; a
configuration names those it wants, in that order (each one optional):

* :mod:`kvtier.tiers.base`: the contract every tier implements (:class:`Tier`), its
  results and statistics, and its optional abilities (``Refreshable``, ``Recovers``,
  ``Announces``, ``Watched``, ``HasMetrics``);
* :mod:`kvtier.tiers.block_format`: the header and checksum every stored block carries
  (its compiled twin, ``_blocks``, seals and checks a run of blocks per call);
* :mod:`kvtier.tiers.host`: the host tier, one CPU tier per host in shared memory,
  shared by every instance on it;
* :mod:`kvtier.tiers.file`: the O_DIRECT file tier, a bounded slot file per namespace
  under a root that live instances may share;
* :mod:`kvtier.tiers.cluster`: the Valkey/Redis cluster tier, shared by instances on
  many machines;
* :mod:`kvtier.tiers.factory`: the one factory: :func:`~kvtier.tiers.factory.open_tiers`
  opens a configuration's chain, :func:`~kvtier.tiers.factory.aclose_tiers` closes it.

The host, file and cluster tiers do not import each other. Nothing is imported
here: ``import kvtier.tiers.base`` loads no tier.
"""
