"""Processed images in shared-memory files, for a scheduler on this host (protocol 1.2 ``images.shm``).

A 1024 x 1024 image is ~5.8 MB of pixels. Sent in frames it is copied into the worker link, out of
it by the gateway, into the scheduler's socket and out again: four copies, two of them on the
gateway's loop, and each a long stretch inside the kernel that a core cannot be taken from. Written
once to ``/dev/shm`` instead, its file is named in the ImageItem and the scheduler maps it.

A file lives as long as the worker's cache holds the image, and ``GRACE_S`` longer, so that a
``generate`` already on its way can still open it (the scheduler's mapping survives the removal).
The files of a worker that died without removing its own are removed by its gateway
(``remove_files_of``), and at a gateway's start those of processes no longer alive
(``remove_stale_files``): the prefix names the owning process.
"""

from __future__ import annotations

import itertools
import logging
import mmap
import os
import threading
import time
from collections import deque

import numpy as np

from scheduler_client.protocol import SHM_DIR

log = logging.getLogger("tokenmill.worker")

PREFIX = "tokenmill-img-"
_WRITE_PIECE = 256 << 10
GRACE_S = 30.0  # a removed image's file outlives it this long (a generate naming it may be in flight)


class SharedPixels:
    """This process's shared-memory image files: written, then removed when their image leaves the cache."""

    def __init__(self, directory: str = SHM_DIR):
        self.directory = directory
        self.pid = os.getpid()
        self._counter = itertools.count()
        self._lock = threading.Lock()
        self._retiring: deque[tuple[float, str, int]] = deque()  # (remove after, name, bytes)
        self._retiring_bytes = 0
        self.files = 0  # written and not yet removed, for tests and /debug
        self.failed = False  # a write failed (no space, no directory): frames from then on

    def write(self, content_hash: str, pixels: np.ndarray) -> tuple[str, np.ndarray] | None:
        """The pixels written to a new file: (its name, the pixels as a read-only view of the file, so that
        the process keeps one copy, not two); None if it could not be written (then frames carry them)."""
        name = f"{PREFIX}{self.pid}-{next(self._counter)}-{content_hash[:16]}"
        path = os.path.join(self.directory, name)
        data = memoryview(np.ascontiguousarray(pixels)).cast("B")
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        except OSError as exc:
            self._failed(exc)
            return None
        try:
            # the service's group may read it: deploy/systemd runs engines as another user of group tokenmill
            os.fchmod(fd, 0o640)
            written = 0
            while written < len(data):  # write(), not a writable mapping: a full tmpfs is ENOSPC here, not SIGBUS
                # in pieces: one 5.8 MB write is milliseconds inside the kernel, where a kernel without
                # preemption would keep the gateway's loop from the core until it returns
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
        """Remove every file this process wrote (at exit; a scheduler's mappings stay valid)."""
        remove_files_of(self.pid, self.directory)
        with self._lock:
            self._retiring.clear()
            self._retiring_bytes = self.files = 0


def remove_files_of(pid: int, directory: str = SHM_DIR) -> int:
    """Remove the image files a process wrote (it has exited, or is exiting); how many."""
    return _remove(directory, lambda owner: owner == pid)


def remove_stale_files(directory: str = SHM_DIR) -> int:
    """Remove the image files of processes no longer alive (a worker killed with its gateway); how many."""
    return _remove(directory, lambda owner: not os.path.exists(f"/proc/{owner}"))


def _remove(directory: str, whose) -> int:
    try:
        names = os.listdir(directory)
    except OSError:
        return 0
    removed = 0
    for name in names:
        if not name.startswith(PREFIX):
            continue
        owner = name[len(PREFIX) :].split("-", 1)[0]
        if owner.isdigit() and whose(int(owner)):
            removed += _unlink(os.path.join(directory, name))
    return removed


def _unlink(path: str) -> int:
    try:
        os.unlink(path)
        return 1
    except OSError:  # gone already, or another user's (a sticky directory): not ours to remove
        return 0
