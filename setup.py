"""Build of the compiled residency-manager core; the metadata lives in pyproject.toml.

The extension is optional: where it cannot be built (no C compiler), the
package installs without it and kvtier.manager runs its pure-Python manager.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kvtier.manager._native",
            sources=["kvtier/manager/_native.c"],
            extra_compile_args=["-O2", "-std=c11"],
            optional=True,
        )
    ]
)
