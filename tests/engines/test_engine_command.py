"""`tokenmill engine` as a command: what it says when the chosen backend's engine is not installed."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import ROOT


def test_engine_command_reports_a_missing_backend(tmp_path):
    """`tokenmill engine --backend vllm` without vLLM: exit 2 and a line naming the extra."""
    try:
        import vllm  # noqa: F401

        pytest.skip("vLLM is installed here")
    except ImportError:
        pass
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tokenmill.cli",
            "engine",
            "--backend",
            "vllm",
            "--model",
            "x",
            "--bind",
            f"ipc://{tmp_path}/e.sock",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    assert "pip install 'tokenmill[vllm]'" in proc.stderr
