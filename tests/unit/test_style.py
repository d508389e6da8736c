"""The code is as ruff (pyproject.toml's [tool.ruff]) lints and formats it."""

from __future__ import annotations

import subprocess
import sys

from conftest import ROOT


def _ruff(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ruff", *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_ruff_finds_nothing_to_lint():
    result = _ruff("check", ".")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]


def test_ruff_would_change_no_formatting():
    result = _ruff("format", "--check", ".")
    assert result.returncode == 0, "run `ruff format .`:\n" + result.stdout[-4000:] + result.stderr[-2000:]
