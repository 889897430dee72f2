"""Build of kvtier's two small C extensions; the metadata lives in pyproject.toml.

* kvtier.manager._native: the residency manager's state and policies;
* kvtier.transfer._address: buffer addresses for I/O requests.

Both are optional: where they cannot be built (no C compiler), the package
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
    ]
)
