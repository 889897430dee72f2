"""Build of kvtier's small C extensions; the metadata lives in pyproject.toml.

* kvtier.manager._native: the residency manager's state and policies;
* kvtier.transfer._address: buffer addresses for I/O requests;
* kvtier.tiers._blocks: the file tier's block headers and XXH3 checksums
  (xxHash vendored as one header under kvtier/tiers/_xxhash/).

All are optional: where they cannot be built (no C compiler), the package
installs without them and runs their pure-Python equivalents, slower.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kvtier.manager._native",
            sources=["kvtier/manager/_native.c"],
            extra_compile_args=["-O2", "-std=c11"],
            optional=True,
        ),
        Extension(
            "kvtier.transfer._address",
            sources=["kvtier/transfer/_address.c"],
            extra_compile_args=["-O2", "-std=c11"],
            optional=True,
        ),
        Extension(
            "kvtier.tiers._blocks",
            sources=["kvtier/tiers/_blocks.c"],
            depends=["kvtier/tiers/_xxhash/xxhash.h"],
            extra_compile_args=["-O2", "-std=c11"],
            optional=True,
        ),
    ]
)
