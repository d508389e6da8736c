"""Installed, the project is one import package, tokenmill, and its gateway stays light.

The repository's folders (gateway/, tokenizer_workers/, scheduler_client/, engines/, tokenmill/) are
mapped into the package by pyproject's package-dir; a folder left out of the packages list would be
missing from the wheel without a word, and a top-level name such as ``gateway`` would collide with any
other distribution that ships one."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from conftest import ROOT
from test_layers import package_dirs

HEAVY = ("numpy", "tokenizers", "jinja2", "PIL", "blake3", "torch", "transformers")


def expected_modules() -> set[str]:
    """Every module and package data file of the repository's folders, as its path inside the wheel."""
    want = set()
    for package, folder in package_dirs().items():
        base = Path(ROOT) / folder
        for path in base.rglob("*"):
            if path.is_file() and "__pycache__" not in path.parts and path.suffix in (".py", ".jinja"):
                want.add("/".join([*package.split("."), *path.relative_to(base).parts]))
    return want


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    out, src = tmp_path_factory.mktemp("wheel"), tmp_path_factory.mktemp("source")
    for name in ("pyproject.toml", "README.md"):  # built from a copy: setuptools leaves build/ where it builds
        shutil.copy(Path(ROOT) / name, src / name)
    for folder in set(package_dirs().values()):
        shutil.copytree(Path(ROOT) / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(src)],
        check=True,
        capture_output=True,
        timeout=240,
    )
    (path,) = out.glob("tokenmill-*.whl")
    return zipfile.ZipFile(path)


def test_the_wheel_holds_one_top_level_package_and_every_module(wheel):
    names = wheel.namelist()
    (top_level,) = [n for n in names if n.endswith(".dist-info/top_level.txt")]
    assert wheel.read(top_level).decode().split() == ["tokenmill"]
    assert {n.split("/")[0] for n in names} == {"tokenmill", top_level.split("/")[0]}
    missing = expected_modules() - set(names)
    assert not missing, f"in the repository but not in the wheel (pyproject's packages list): {sorted(missing)}"
    assert "tokenmill/default_model/chat_template.jinja" in names


def test_every_folder_with_modules_is_a_listed_package():
    import tomllib

    with open(Path(ROOT) / "pyproject.toml", "rb") as f:
        listed = set(tomllib.load(f)["tool"]["setuptools"]["packages"])
    found = set()
    for package, folder in package_dirs().items():
        base = Path(ROOT) / folder
        for init in base.rglob("__init__.py"):
            if "__pycache__" in init.parts:
                continue
            rel = init.parent.relative_to(base).parts
            found.add(".".join([*package.split("."), *rel]))
    assert found == listed, f"folders: {sorted(found ^ listed)}"


def test_the_gateway_imports_none_of_the_workers_heavy_modules():
    """The gateway's process runs the event loop: parsing, rendering and encoding belong to the workers."""
    code = (
        "import sys, tokenmill.gateway.server, tokenmill.gateway.app, tokenmill.commands.serve\n"
        f"print(' '.join(m for m in {HEAVY!r} if m in sys.modules))"
    )
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert got.stdout.split() == [], f"the gateway imported {got.stdout.split()}"


def test_a_text_model_loads_no_image_or_grammar_module():
    """A tokenizer worker of a text-only model (the default) converts a chat without numpy or Pillow, whose
    image pipeline it never uses, and a simulated scheduler starts without llguidance, which it needs at
    its first structured request: each is ~0.1-0.4 s more of start-up, paid at every worker restart."""
    code = (
        "import json, sys\n"
        "import tokenmill.engines.simulated\n"
        "from tokenmill.tokenizer_workers import messages as m\n"
        "from tokenmill.tokenizer_workers.converter import Converter\n"
        "from tokenmill.tokenizer_workers.settings import ConverterSettings\n"
        "cv = Converter(ConverterSettings())\n"
        "body = json.dumps({'model': cv.model_name, 'messages': [{'role': 'user', 'content': 'hi'}]}).encode()\n"
        "done = cv.convert(m.ConvertJob(0, 'chat', 'r', False), body).done\n"
        "assert done.error is None, done.error\n"
        "print(' '.join(m for m in ('numpy', 'PIL', 'llguidance') if m in sys.modules))"
    )
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert got.returncode == 0, got.stderr[-3000:]
    assert got.stdout.split() == [], f"loaded {got.stdout.split()}"
