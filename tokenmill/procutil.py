"""Linux process hygiene: children that die with their parent and names an operator can read in ps."""

from __future__ import annotations

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15


def _prctl(option: int, arg) -> None:
    if sys.platform != "linux":
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(option, arg, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def die_with_parent(expected_parent: int | None = None) -> None:
    """Ask the kernel to SIGKILL this process when its parent dies, even by kill -9."""
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if expected_parent is not None and os.getppid() != expected_parent:
        os._exit(1)  # the parent died before the request took effect


def set_process_name(name: str) -> None:
    """The kernel's comm name (15 bytes, shown by ps -e, top and pgrep)."""
    _prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]))
