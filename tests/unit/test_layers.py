"""The import layers of pyproject.toml's [tool.importlinter] hold, and a wrong arrow breaks them.

Command line > gateway > engines > tokenizer workers > scheduler protocol > transport, process: each
layer imports only the layers below it. import-linter walks a package's files on disk, and the
repository's folders become subpackages of tokenmill only when installed (package-dir), so the
package is assembled in a temporary directory as a wheel would lay it out, and linted there."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

from conftest import ROOT

LINT = [
    sys.executable,
    "-c",
    "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())",
]


def package_dirs() -> dict[str, str]:
    """pyproject's package-dir: each top-level package (tokenmill.gateway, ...) and its folder."""
    with open(Path(ROOT) / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["tool"]["setuptools"]["package-dir"]


def assemble(dest: Path) -> Path:
    """The tokenmill package laid out under ``dest`` as installed, from the repository's folders."""
    ignore = shutil.ignore_patterns("__pycache__")
    for package, folder in sorted(package_dirs().items()):  # "tokenmill" first: the others go inside it
        shutil.copytree(Path(ROOT) / folder, dest / package.replace(".", "/"), ignore=ignore, dirs_exist_ok=True)
    shutil.copy(Path(ROOT) / "pyproject.toml", dest / "pyproject.toml")
    return dest


def _lint(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*LINT, "--config", str(root / "pyproject.toml"), "--no-cache"],
        cwd=root,
        env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=240,
    )


def test_the_layers_point_down(tmp_path):
    result = _lint(assemble(tmp_path))
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "1 kept, 0 broken" in result.stdout
    assert "Analyzed 1" in result.stdout  # (over a hundred modules: the mapped folders were found)


def test_an_upward_import_breaks_the_contract(tmp_path):
    root = assemble(tmp_path)
    protocol = root / "tokenmill" / "scheduler_client" / "protocol.py"
    protocol.write_text(protocol.read_text() + "\nfrom tokenmill.gateway import app  # an arrow pointing up\n")
    result = _lint(root)
    assert result.returncode != 0
    assert "tokenmill.scheduler_client is not allowed to import tokenmill.gateway" in result.stdout, result.stdout[
        -3000:
    ]
    assert "tokenmill.scheduler_client.protocol -> tokenmill.gateway.app" in result.stdout
