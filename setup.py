"""Build of kvtier's small C extensions; the metadata lives in pyproject.toml.

* kvtier.manager._native: the residency manager's state and policies;
* kvtier.transfer._address: buffer addresses for I/O requests;
* kvtier.transfer._copy: the device transfers' copy loops (memcpy, and CUDA's
  runtime loaded at run time, so it builds without CUDA);
* kvtier.transfer._gather: a CUDA kernel that copies a table of pieces in one
  launch, compiled at run time by NVRTC and launched through the driver (both
  loaded at run time: it builds without CUDA too);
* kvtier.tiers._blocks: the block headers and XXH3 checksums of both tiers
  (kvtier.tiers.block_format; xxHash vendored as one header under kvtier/third_party/xxhash/).

All are optional: where they cannot be built (no C compiler), the package
installs without them and runs their pure-Python equivalents, slower.
"""

import platform

from setuptools import Extension, setup

# XXH3's run-time choice of SSE2 / AVX2 / AVX-512 loops exists for x86-64 only.
_X86 = platform.machine().lower() in ("x86_64", "amd64")

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
            "kvtier.transfer._copy",
            sources=["kvtier/transfer/_copy.c"],
            extra_compile_args=["-O2", "-std=gnu11"],
            libraries=["dl"],
            optional=True,
        ),
        Extension(
            "kvtier.transfer._gather",
            sources=["kvtier/transfer/_gather.c"],
            extra_compile_args=["-O2", "-std=gnu11"],
            libraries=["dl"],
            optional=True,
        ),
        Extension(
            "kvtier.tiers._blocks",
            sources=["kvtier/tiers/_blocks.c"]
            + (["kvtier/third_party/xxhash/xxh_x86dispatch.c"] if _X86 else []),
            depends=[
                "kvtier/third_party/xxhash/xxhash.h",
                "kvtier/third_party/xxhash/xxh_x86dispatch.h",
            ],
            define_macros=[("KVTIER_XXH_DISPATCH", "1")] if _X86 else [],
            extra_compile_args=["-O2", "-std=c11"],
            optional=True,
        ),
    ]
)
