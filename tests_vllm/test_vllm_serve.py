"""The `vllm serve` command that docs/vllm.md shows, run as written on vLLM's CPU build.

The block marked ``tested`` in docs/vllm.md is run by bash with ``MODEL`` set
to a tiny random Llama, on a free port of 127.0.0.1, with a file-tier root
of the test's own and ``--skip-tokenizer-init`` (the model has no tokenizer;
the requests send token ids). Two ``/v1/completions`` requests share a
prefix: the second must reuse it through kvtier (vLLM's own
``vllm:external_prefix_cache_hits_total``). The server is stopped with
SIGTERM by pid; nothing of it may stay in /dev/shm.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests_vllm._harness import prompts

DOC = Path(__file__).parent.parent / "docs" / "vllm.md"
MARK = "<!-- tested: tests_vllm/test_vllm_serve.py -->"
START_S = 420.0


def documented_command() -> str:
    text = DOC.read_text()
    block = re.search(re.escape(MARK) + r"\n```sh\n(.*?)^```", text, flags=re.S | re.M)
    assert block is not None, f"docs/vllm.md has no sh block after {MARK!r}"
    return block.group(1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _shm() -> set[str]:
    return set(os.listdir("/dev/shm"))


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        return dict(json.loads(resp.read()))


def _metric(text: str, name: str) -> float:
    values = [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + "{") or line.startswith(name + " ")
    ]
    assert values, f"{name} not in /metrics"
    return sum(values)


Server = tuple[str, subprocess.Popen[bytes], set[str]]


@pytest.fixture
def server(model_dir: Path, tmp_path: Path) -> Iterator[Server]:
    before = _shm()
    port = _free_port()
    command = documented_command()
    assert "--port 8000" in command
    assert "/var/cache/kvtier" in command
    command = command.replace("--port 8000", f"--port {port}").replace(
        "/var/cache/kvtier", str(tmp_path / "kv")
    )
    # The tiny model's own needs, after the documented arguments.
    command = command.rstrip() + (
        " --skip-tokenizer-init --dtype float32 --block-size 128 --max-model-len 4096\n"
    )
    # `python` is this venv's (vLLM's); INFO shown, as vLLM does by default.
    env = {
        **os.environ,
        "MODEL": str(model_dir),
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        "VLLM_LOGGING_LEVEL": "INFO",
    }
    log = open(tmp_path / "serve.log", "wb")  # noqa: SIM115 - closed below
    # Its own process group: SIGTERM goes to the server by its pid, and
    # whatever it leaves behind is found and killed at the end.
    proc = subprocess.Popen(
        ["bash", "-c", command.replace("\npython ", "\nexec python ")],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        cwd=tmp_path,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_S
        while True:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-4000:]
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=5) as resp:
                    if resp.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            assert time.monotonic() < deadline, (tmp_path / "serve.log").read_text()[-4000:]
            time.sleep(1.0)
        yield base, proc, before
    finally:
        if proc.poll() is None:
            with_timeout_kill(proc)
        log.close()


def with_timeout_kill(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the group, then SIGKILL what is left after 60 s."""
    with_group = os.getpgid(proc.pid)
    os.killpg(with_group, signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(with_group, signal.SIGKILL)
        proc.wait(10)


def test_documented_vllm_serve_reuses_a_prefix(
    server: Server, model_dir: Path, tmp_path: Path
) -> None:
    base, proc, before = server
    a, b = prompts(n_a=1024, shared=768, n_b=1024)
    outs = []
    for tokens in (a, b):
        out = _post(
            f"{base}/v1/completions",
            {"model": str(model_dir), "prompt": tokens, "max_tokens": 4, "temperature": 0},
        )
        outs.append(out)
        assert out["usage"]["completion_tokens"] == 4
    with urllib.request.urlopen(f"{base}/metrics", timeout=30) as resp:
        metrics = resp.read().decode()
    # B's 768 shared tokens (6 blocks of 128) came from kvtier.
    assert _metric(metrics, "vllm:external_prefix_cache_hits_total") >= 768
    log = (tmp_path / "serve.log").read_text()
    # kvtier's INFO reaches vLLM's log, in vLLM's format (process, pid, level, time).
    said = r"\(EngineCore[^)]*pid=\d+\) INFO .*kvtier: file tier: io_engine "
    assert re.search(said, log), log[-3000:]

    os.kill(proc.pid, signal.SIGTERM)  # by pid, as an operator would
    assert proc.wait(120) is not None
    time.sleep(1.0)
    left = {f for f in _shm() - before if f.startswith("kvtier")}
    assert not left, f"left in /dev/shm: {left}"
