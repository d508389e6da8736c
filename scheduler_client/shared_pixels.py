"""Reading an image's pixels from a shared-memory file (protocol 1.2 ``images.shm``).

A tokenizer worker on this host writes each processed image once to ``/dev/shm`` and names the file
in the ImageItem; the scheduler maps it read-only, so megabytes of pixels cross neither the worker
link, the gateway's loop nor this scheduler's socket (each of those is a copy, and on a busy host a
long copy inside the kernel holds a core the gateway may be waiting for). The mapping stays valid
after the worker removes the file; a file already gone, or one this process may not read, is the
front end's cue to send the pixels in frames (``image_missing``).
"""

from __future__ import annotations

import mmap
import os

from tokenmill.scheduler_client.protocol import SHM_DIR, SHM_NAME


def available() -> bool:
    """Whether this host has the shared-memory directory (Linux); without it the feature is not listed."""
    return os.path.isdir(SHM_DIR)


def open_pixels(name: str, size: int) -> memoryview:
    """The file's ``size`` bytes, mapped read-only. ValueError for a name outside the protocol's
    pattern; OSError when it cannot be opened or holds another number of bytes."""
    if not SHM_NAME.fullmatch(name):
        raise ValueError(f"{name!r} is not a tokenmill shared-memory name")
    fd = os.open(os.path.join(SHM_DIR, name), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        actual = os.fstat(fd).st_size
        if actual != size:
            raise OSError(f"{name} holds {actual} bytes, not {size}")
        return memoryview(mmap.mmap(fd, size, access=mmap.ACCESS_READ))
    finally:
        os.close(fd)
