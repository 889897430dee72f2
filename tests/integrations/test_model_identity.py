"""The namespace under vLLM follows the model's identity, not the path it was loaded from."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kvtier.integrations.vllm.identity import SAMPLE_BYTES, model_identity


def _model(where: Path, weights: bytes, config: dict[str, object] | None = None) -> Path:
    where.mkdir(parents=True)
    (where / "config.json").write_text(json.dumps(config or {"hidden_size": 64}))
    (where / "model.safetensors").write_bytes(weights)
    return where


@pytest.fixture
def weights() -> bytes:
    return os.urandom(3 * SAMPLE_BYTES + 12345)


def test_a_symlink_or_another_mount_is_the_same_model(tmp_path: Path, weights: bytes) -> None:
    model = _model(tmp_path / "a" / "model", weights)
    (tmp_path / "link").symlink_to(model)
    copy = _model(tmp_path / "b" / "copy", weights)  # the same files elsewhere
    ids = [model_identity(str(p)) for p in (model, tmp_path / "link", copy)]
    assert ids[0] == ids[1] == ids[2]
    assert "a/model" not in json.dumps(ids[0])


def test_other_weights_or_config_are_another_model(tmp_path: Path, weights: bytes) -> None:
    base = model_identity(str(_model(tmp_path / "base", weights)))
    tuned = bytearray(weights)
    tuned[len(tuned) // 2] ^= 0xFF  # one byte in the middle, same size
    assert model_identity(str(_model(tmp_path / "tuned", bytes(tuned)))) != base
    other = _model(tmp_path / "cfg", weights, {"hidden_size": 128})
    assert model_identity(str(other)) != base


def test_a_named_revision_replaces_the_files(tmp_path: Path, weights: bytes) -> None:
    a = model_identity(str(_model(tmp_path / "a", weights)), "release-7")
    b = model_identity(str(_model(tmp_path / "b", weights[::-1])), "release-7")
    assert a == b == {"revision": "release-7"}


def test_a_name_with_no_files_is_its_own_identity() -> None:
    assert model_identity("org/not-downloaded-model") == {"name": "org/not-downloaded-model"}
