"""Import-only stand-in for torchvision (test shim; not SGLang's or torchvision's code).

The registry's torchvision wheels for torch 2.13 are CUDA-linked. SGLang reaches
torchvision only through ``sglang.srt.configs`` (imported by
``mem_cache/memory_pool.py``): ``deepseek_ocr.py`` and
``multimodal/internvl_utils.py`` name ``torchvision.transforms`` at import, and
transformers then imports its image utilities. Nothing on the KV-cache path
calls torchvision: every name here is a placeholder that raises if called.
``tests_sglang/conftest.py`` puts this directory first on ``sys.path`` only
when no real torchvision imports (docs/lab/engines-below.md, "Installs").
"""

from __future__ import annotations

import enum
import sys
import types
from typing import Any

__version__ = "0.28.0+shim"


class InterpolationMode(enum.Enum):
    """torchvision's names for resampling filters (values only)."""

    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


class ImageReadMode(enum.Enum):
    """torchvision.io's image read modes (values only)."""

    UNCHANGED = 0
    GRAY = 1
    GRAY_ALPHA = 2
    RGB = 3
    RGB_ALPHA = 4


class _Placeholder:
    def __init__(self, name: str) -> None:
        self._name = name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"torchvision shim: {self._name} is not available")

    def __getattr__(self, item: str) -> _Placeholder:
        return _Placeholder(f"{self._name}.{item}")

    def __mro_entries__(self, bases: tuple[Any, ...]) -> tuple[type, ...]:
        return (object,)


class _Module(types.ModuleType):
    def __getattr__(self, item: str) -> _Placeholder:
        if item.startswith("__"):
            raise AttributeError(item)
        return _Placeholder(f"{self.__name__}.{item}")


def _module(name: str, **attrs: Any) -> _Module:
    mod = _Module(name)
    mod.__dict__.update(attrs)
    mod.__path__ = []  # a package: submodule imports resolve through sys.modules
    sys.modules[name] = mod
    return mod


transforms = _module("torchvision.transforms", InterpolationMode=InterpolationMode)
transforms.functional = _module(
    "torchvision.transforms.functional", InterpolationMode=InterpolationMode
)
transforms.v2 = _module("torchvision.transforms.v2")
transforms.v2.functional = _module("torchvision.transforms.v2.functional")
io = _module("torchvision.io", ImageReadMode=ImageReadMode)
ops = _module("torchvision.ops")
models = _module("torchvision.models")
