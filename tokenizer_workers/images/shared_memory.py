"""Processed images in shared-memory files, for a scheduler on this host (protocol 1.2 ``images.shm``).

A 1024 x 1024 image is ~5.8 MB of pixels. Sent in frames it is copied into the worker link, out of
it by the gateway, into the scheduler's socket and out again: four copies, two of them on the
gateway's loop, and each a long stretch inside the kernel that a core cannot be taken from. Written
once to ``/dev/shm`` instead, its file is named in the ImageItem and the scheduler maps it.

A file lives as long as the worker's cache holds the image, and ``GRACE_S`` longer, so that a
``generate`` already on its way can still open it (the scheduler's mapping survives the removal).
Whose files are they, and is it alive? Each process names its files after an owner token (its pid
and a random nonce: pids repeat across the pid namespaces of containers sharing one ``/dev/shm``)
and holds an owner file of that token locked (``flock``) while it lives. The kernel drops the lock
when the process ends, however it ends, so ``remove_stale_files`` (a gateway's start, a worker's
exit) removes exactly the files whose owner's lock is free: never a live worker's in another
container, whose pid means nothing here.
"""

from __future__ import annotations

import fcntl
import itertools
import logging
import mmap
import os
import secrets
import threading
import time
from collections import deque
from typing import TYPE_CHECKING

from tokenmill.scheduler_client.protocol import SHM_DIR

if TYPE_CHECKING:
    import numpy as np

log = logging.getLogger("tokenmill.worker")

PREFIX = "tokenmill-img-"
# A write to tmpfs takes fresh pages, which on this kind of VM (free page reporting hands freed memory
# back to the host) may first fault on the host: 256 KiB writes took 0.11 / 0.19-0.51 / 1.1-2.7 ms in the
# kernel (p50 / p99 / max, 6 MB files, quiet 2-core VM), 64 KiB ones 0.03 / 0.07 / 0.14-3.6 ms, the same
# CPU per MB: shorter stretches that a kernel without preemption cannot cut.
_WRITE_PIECE = 64 << 10
GRACE_S = 30.0  # a removed image's file outlives it this long (a generate naming it may be in flight)
OWNER, OWNING = "owner", "owning"  # an owner file's last name part: locked and in place; being made
OWNING_GRACE_S = 60.0  # an owner file still being made is left alone this long (its maker may hold it)


class SharedPixels:
    """This process's shared-memory image files: written, then removed when their image leaves the cache."""

    def __init__(self, directory: str = SHM_DIR):
        self.directory = directory
        self.owner = f"{os.getpid()}.{secrets.token_hex(4)}"
        self._owner_fd: int | None = None
        _OURS.append(self)
        self._counter = itertools.count()
        self._lock = threading.Lock()
        self._retiring: deque[tuple[float, str, int]] = deque()  # (remove after, name, bytes)
        self._retiring_bytes = 0
        self.files = 0  # written and not yet removed, for tests and /debug
        self.failed = False  # a write failed (no space, no directory): frames from then on

    def write(self, content_hash: str, pixels: np.ndarray) -> tuple[str, np.ndarray] | None:
        """The pixels written to a new file: (its name, the pixels as a read-only view of the file, so that
        the process keeps one copy, not two); None if it could not be written (then frames carry them)."""
        if self._owner_fd is None and not self._hold_owner_file():
            return None
        name = f"{PREFIX}{self.owner}-{next(self._counter)}-{content_hash[:16]}"
        path = os.path.join(self.directory, name)
        import numpy as np  # here, not at the top: the gateway imports this module for remove_stale_files

        data = memoryview(np.ascontiguousarray(pixels)).cast("B")
        fd = self._create(path)
        if fd is None:
            return None
        try:
            # the service's group may read it: deploy/systemd runs engines as another user of group tokenmill
            os.fchmod(fd, 0o640)
            written = 0
            while written < len(data):  # write(), not a writable mapping: a full tmpfs is ENOSPC here, not SIGBUS
                # in pieces (_WRITE_PIECE): one 5.8 MB write is milliseconds inside the kernel, where a kernel
                # without preemption would keep the gateway's loop from the core until it returns
                written += os.write(fd, data[written : written + _WRITE_PIECE])
            mapped = mmap.mmap(fd, len(data), access=mmap.ACCESS_READ)
        except OSError as exc:
            os.close(fd)
            _unlink(path)
            self._failed(exc)
            return None
        os.close(fd)
        with self._lock:
            self.files += 1
        view = np.frombuffer(mapped, dtype=pixels.dtype).reshape(pixels.shape)
        return name, view

    def _hold_owner_file(self) -> bool:
        """Make this process's owner file and keep it locked: made under another name and locked first,
        then renamed into place, so that no sweeper ever finds it in place and unlocked."""
        owning = os.path.join(self.directory, f"{PREFIX}{self.owner}-{OWNING}")
        fd = self._create(owning)
        if fd is None:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.rename(owning, os.path.join(self.directory, f"{PREFIX}{self.owner}-{OWNER}"))
        except OSError as exc:
            os.close(fd)
            _unlink(owning)
            self._failed(exc)
            return False
        self._owner_fd = fd
        return True

    def _create(self, path: str) -> int | None:
        """A new file, ours alone (exclusive, no link followed, mode 0600); None if it cannot be made."""
        try:
            return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        except OSError as exc:
            self._failed(exc)
            return None

    def _failed(self, exc: OSError) -> None:
        if not self.failed:
            log.warning("cannot write images to %s (%s): sending their pixels in frames instead", self.directory, exc)
        self.failed = True

    def retire(self, name: str, nbytes: int) -> None:
        """The image left the cache: its file goes after ``GRACE_S``, or at once while more than
        ``budget`` bytes wait (see ``sweep``)."""
        with self._lock:
            self._retiring.append((time.monotonic() + GRACE_S, name, nbytes))
            self._retiring_bytes += nbytes

    def sweep(self, budget: int) -> None:
        """Remove the retired files whose grace is over, and the oldest while more than ``budget`` bytes wait."""
        now = time.monotonic()
        gone = []
        with self._lock:
            while self._retiring and (self._retiring[0][0] <= now or self._retiring_bytes > budget):
                _, name, nbytes = self._retiring.popleft()
                self._retiring_bytes -= nbytes
                self.files -= 1
                gone.append(name)
        for name in gone:
            _unlink(os.path.join(self.directory, name))

    def close(self) -> None:
        """Remove every file this process wrote, its owner file last (at exit; a scheduler's mappings
        stay valid)."""
        names = _files_by_owner(self.directory).get(self.owner, [])
        _remove(self.directory, names)
        if self._owner_fd is not None:
            os.close(self._owner_fd)
            self._owner_fd = None
        with self._lock:
            self._retiring.clear()
            self._retiring_bytes = self.files = 0


_OURS: list[SharedPixels] = []  # this process's, for remove_own_files


def remove_own_files() -> None:
    """Remove every file this process wrote (it is exiting)."""
    for shared in _OURS:
        shared.close()


def remove_stale_files(directory: str = SHM_DIR) -> int:
    """Remove the image files whose owner has ended (a worker killed, or killed with its gateway): those
    whose owner file is unlocked or gone. How many files were removed (owner files not counted)."""
    removed = 0
    now = time.time()
    for owner, names in _files_by_owner(directory).items():
        if names == [f"{PREFIX}{owner}-{OWNING}"] and now - _mtime(os.path.join(directory, names[0])) < OWNING_GRACE_S:
            continue  # an owner file being made; one whose maker died while making it goes after the grace
        if _owner_alive(directory, owner):
            continue
        removed += _remove(directory, names)
    return removed


def _files_by_owner(directory: str) -> dict[str, list[str]]:
    """Our files in ``directory`` by their owner token, each owner's owner file last."""
    try:
        names = os.listdir(directory)
    except OSError:
        return {}
    owners: dict[str, list[str]] = {}
    for name in names:
        if name.startswith(PREFIX):
            owners.setdefault(name[len(PREFIX) :].split("-", 1)[0], []).append(name)
    for files in owners.values():
        files.sort(key=lambda name: name.endswith((f"-{OWNER}", f"-{OWNING}")))
    return owners


def _owner_alive(directory: str, owner: str) -> bool:
    """Whether the owner file's lock is held (by its process, alive). A file we may not open is
    another user's: treated as alive, not ours to judge (nor, in a sticky /dev/shm, to remove)."""
    try:
        fd = os.open(os.path.join(directory, f"{PREFIX}{owner}-{OWNER}"), os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except FileNotFoundError:
        return False  # files with no owner file: their owner is gone (or wrote them before owner files were)
    except OSError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def _mtime(path: str) -> float:
    try:
        return os.stat(path, follow_symlinks=False).st_mtime
    except OSError:
        return 0.0


def _remove(directory: str, names: list[str]) -> int:
    """Unlink ``names`` in their order; how many of them were image files."""
    removed = 0
    for name in names:
        gone = _unlink(os.path.join(directory, name))
        if not name.endswith((f"-{OWNER}", f"-{OWNING}")):
            removed += gone
    return removed


def _unlink(path: str) -> int:
    """1 if removed, else 0."""
    try:
        os.unlink(path)
        return 1
    except OSError:  # gone already, or another user's (a sticky directory): not ours to remove
        return 0
