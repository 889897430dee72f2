"""Storage tiers below the CPU region.

* :mod:`kvtier.tiers.base`: the contract every tier implements (:class:`Tier`) and
  its optional abilities (``Refreshable``, ``Recovers``, ``Announces``);
* :mod:`kvtier.tiers.block_format`: the header and checksum every stored block carries;
* :mod:`kvtier.tiers.file`: the O_DIRECT file tier and its parts;
* :mod:`kvtier.tiers.cluster`: the Valkey/Redis cluster tier and its parts.
"""
