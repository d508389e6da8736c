"""The import layers of pyproject.toml's [tool.importlinter] hold, and a wrong arrow breaks them.

Command line > gateway > engines > tokenizer workers > scheduler protocol > transport, process:
each layer imports only the layers below it (issue 30)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from conftest import ROOT

PACKAGES = ("tokenmill", "gateway", "tokenizer_workers", "scheduler_client", "engines")
LINT = [
    sys.executable,
    "-c",
    "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())",
]


def _lint(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*LINT, "--config", str(root / "pyproject.toml"), "--no-cache"],
        cwd=root,
        env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=240,
    )


def test_the_layers_point_down():
    result = _lint(Path(ROOT))
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "1 kept, 0 broken" in result.stdout


def test_an_upward_import_breaks_the_contract(tmp_path):
    for name in PACKAGES:
        shutil.copytree(Path(ROOT) / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(Path(ROOT) / "pyproject.toml", tmp_path / "pyproject.toml")
    protocol = tmp_path / "scheduler_client" / "protocol.py"
    protocol.write_text(protocol.read_text() + "\nfrom gateway import app  # an arrow pointing up\n")
    result = _lint(tmp_path)
    assert result.returncode != 0
    assert "scheduler_client is not allowed to import gateway" in result.stdout, result.stdout[-3000:]
    assert "scheduler_client.protocol -> gateway.app" in result.stdout
