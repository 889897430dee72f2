"""Storage tiers below the CPU region.

* :mod:`kvtier.tiers.base`: the contract every tier implements (:class:`Tier`) and
  its optional abilities (``Refreshable``, ``Recovers``, ``Announces``);
* :mod:`kvtier.tiers.block_format`: the header and checksum every stored block carries
  (its compiled twin, ``_blocks``, seals and checks a run of blocks per call);
* :mod:`kvtier.tiers.file`: the O_DIRECT file tier and its parts;
* :mod:`kvtier.tiers.cluster`: the Valkey/Redis cluster tier and its parts;
* :mod:`kvtier.tiers.factory`: the one factory: :func:`~kvtier.tiers.factory.open_tiers`
  opens a configuration's chain, :func:`~kvtier.tiers.factory.aclose_tiers` closes it.

Nothing is imported here: ``import kvtier.tiers.base`` loads neither tier.
"""
