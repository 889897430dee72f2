"""The CPU region: one page-aligned mapping of rows that every tier stages through.

A row holds one offloaded block: ``blocks_per_chunk`` device blocks of every KV
tensor, for every tensor-parallel worker. Worker ``r``'s slice starts at
``r * slice_bytes``; the padding that makes the stride a multiple of the
alignment sits at the end of the row::

    row i:  | worker 0 slice | worker 1 slice | ... | worker W-1 slice | pad |
            ^ i * row_stride                                               ^ (i + 1) * row_stride

One process gets private anonymous memory with transparent huge pages; several
worker processes share a file in ``/dev/shm`` (or hugetlbfs when huge pages are
reserved). See docs/cpu-region.md.
"""

from kvtier.region._region import CPURegion, RegionStatistics, reap_shared_regions
from kvtier.region._rows import ForeignRows, Rows, address_of

__all__ = [
    "CPURegion",
    "ForeignRows",
    "RegionStatistics",
    "Rows",
    "address_of",
    "reap_shared_regions",
]
