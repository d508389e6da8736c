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


PARENT_ENV = "TOKENMILL_PARENT_PID"


def child_env(environ=None) -> dict:
    """Environment for a supervised child: it learns who its parent is, to die with it."""
    env = dict(os.environ if environ is None else environ)
    env[PARENT_ENV] = str(os.getpid())
    return env


def die_with_supervisor() -> None:
    """In a child started with child_env(): die when the supervising process dies."""
    parent = os.environ.get(PARENT_ENV)
    if parent and parent.isdigit():
        die_with_parent(int(parent))


def limit_memory(megabytes: int) -> None:
    """Cap this process's address space, so a runaway allocation raises MemoryError here."""
    if megabytes and megabytes > 0:
        import resource

        limit = megabytes << 20
        try:
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        except (ValueError, OSError):
            pass
