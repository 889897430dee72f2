from __future__ import annotations

import pytest

from kvtier.cli import main


def test_demo_runs_and_reports(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--conversations", "4", "--turns", "2"]) == 0
    out = capsys.readouterr().out
    assert "blocks requested" in out


def test_help_exits_zero() -> None:
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
