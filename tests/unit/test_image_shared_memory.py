"""The workers' shared-memory image files (protocol 1.2 images.shm), in a directory of the test's own:
written once and read back as the cache's pixels, removed after their image leaves the cache, and
those of exited processes swept; a directory that cannot take them means frames."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys

import numpy as np

from tokenmill.tokenizer_workers.images.base import ProcessedImage
from tokenmill.tokenizer_workers.images.cache import ImageCache
from tokenmill.tokenizer_workers.images.shared_memory import PREFIX, SharedPixels, remove_stale_files


def _pixels(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (16, 1176), dtype=np.uint8)


def test_pixels_are_written_once_and_read_back_from_the_file(tmp_path):
    shared = SharedPixels(str(tmp_path))
    pixels = _pixels(1)
    name, view = shared.write("ab" * 32, pixels)
    assert name.startswith(f"{PREFIX}{shared.owner}-") and name.endswith("abababababababab")
    assert shared.owner.startswith(f"{os.getpid()}.") and (tmp_path / f"{PREFIX}{shared.owner}-owner").exists()
    assert (tmp_path / name).read_bytes() == pixels.tobytes()
    assert np.array_equal(view, pixels) and not view.flags.writeable  # the file's mapping, not a copy
    assert oct((tmp_path / name).stat().st_mode & 0o777) == "0o640"
    other, _ = shared.write("ab" * 32, pixels)  # the same image converted twice at once: two files
    assert other != name and shared.files == 2


def test_a_file_outlives_its_cache_entry_by_the_grace_or_until_the_bytes_wait_too_long(tmp_path):
    shared = SharedPixels(str(tmp_path))
    cache = ImageCache(2 * 16 * 1176, on_drop=lambda image: shared.retire(image.shm, image.nbytes))
    names = []
    for seed in range(3):
        name, view = shared.write(f"{seed:064x}", _pixels(seed))
        names.append(name)
        cache.put(f"{seed:064x}", ProcessedImage("qwen2_vl", view, (1, 4, 4), 4, f"{seed:064x}", shm=name))
    owner = f"{PREFIX}{shared.owner}-owner"
    assert cache.evictions == 1 and sorted(os.listdir(tmp_path)) == sorted(
        [*names, owner]
    )  # the evicted one's kept for now
    shared.sweep(budget=1 << 30)
    assert len(os.listdir(tmp_path)) == 4  # within its grace
    shared.sweep(budget=0)  # more bytes retiring than allowed: removed at once
    assert sorted(os.listdir(tmp_path)) == sorted([*names[1:], owner]) and shared.files == 2
    shared.close()
    assert os.listdir(tmp_path) == [] and shared.files == 0


_WRITER = """
import sys, numpy as np
from tokenmill.tokenizer_workers.images.shared_memory import SharedPixels
shared = SharedPixels(sys.argv[1])
print(shared.write("cd" * 32, np.zeros((16, 1176), np.uint8))[0], flush=True)
sys.stdin.read()
shared.close()
"""


def _writer(directory) -> tuple[subprocess.Popen, str]:
    """Another process that has written one image file and lives until its stdin closes: (it, the file's name)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(directory)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    return proc, proc.stdout.readline().strip()


def test_files_are_swept_when_their_owner_has_ended_however_it_ended(tmp_path):
    """Liveness is the owner file's lock, not a pid: a process killed with SIGKILL leaves its lock free
    and its files are swept; a live one's stay, in this process or another; so do those of an owner
    whose pid does not exist here but whose lock is held (a worker in another container's pid namespace
    sharing /dev/shm), which judging by /proc/<pid> would have removed."""
    live, live_name = _writer(tmp_path)
    killed, killed_name = _writer(tmp_path)
    killed.kill()
    killed.wait()
    ours = SharedPixels(str(tmp_path))
    our_name, _ = ours.write("ef" * 32, _pixels(2))
    elsewhere = "999999999.0badcafe"  # no such pid here; its owner holds the lock (another pid namespace)
    held = os.open(tmp_path / f"{PREFIX}{elsewhere}-owner", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(held, fcntl.LOCK_EX)
    (tmp_path / f"{PREFIX}{elsewhere}-0-0123456789abcdef").write_bytes(b"x")
    (tmp_path / f"{PREFIX}12345-0-0123456789abcdef").write_bytes(b"x")  # an older version's name: no owner file
    (tmp_path / f"{PREFIX}7.00000001-owning").write_bytes(b"")  # an owner file being made
    stuck = tmp_path / f"{PREFIX}8.00000002-owning"  # ... and one whose maker died making it, long ago
    stuck.write_bytes(b"")
    os.utime(stuck, (0, 0))
    (tmp_path / "psm_other_program").write_bytes(b"y")  # not ours: never touched
    try:
        assert remove_stale_files(str(tmp_path)) == 2  # the killed writer's image and the old-style one
        left = set(os.listdir(tmp_path))
        assert killed_name not in left and not any(
            name.startswith(f"{PREFIX}{killed_name.split('-')[2]}") for name in left
        )
        assert {live_name, our_name, f"{PREFIX}{elsewhere}-0-0123456789abcdef", f"{PREFIX}7.00000001-owning"} <= left
        assert stuck.name not in left and "psm_other_program" in left
        live.stdin.close()  # it ends as a worker does: it removes its own files, owner file included
        assert live.wait(30) == 0
        assert not any(name.startswith(live_name.rsplit("-", 2)[0]) for name in os.listdir(tmp_path))
        ours.close()
        assert not any(ours.owner in name for name in os.listdir(tmp_path))
        fcntl.flock(held, fcntl.LOCK_UN)  # the other namespace's worker ends
        assert remove_stale_files(str(tmp_path)) == 1
        assert sorted(os.listdir(tmp_path)) == sorted([f"{PREFIX}7.00000001-owning", "psm_other_program"])
    finally:
        os.close(held)
        if live.poll() is None:
            live.kill()


def test_a_directory_that_cannot_take_the_pixels_means_frames(tmp_path):
    shared = SharedPixels(str(tmp_path / "missing"))
    assert shared.write("00" * 32, _pixels(0)) is None and shared.failed


def test_only_a_scheduler_on_this_host_is_offered_the_files():
    """The gateway hands images.shm on to its workers only where every scheduler endpoint is on this
    host: an ipc:// socket, or TCP to a loopback address."""
    from tokenmill.gateway.scheduler_ranks import on_this_host

    local = ["ipc:///run/tokenmill/engine.sock", "tcp://127.0.0.1:5555", "tcp://127.0.0.2:5555", "tcp://[::1]:5555"]
    remote = ["tcp://10.0.0.7:5555", "tcp://[fe80::1]:5555", "tcp://engine-3.internal:5555", "inproc://x"]
    assert all(on_this_host(e) for e in local + ["tcp://localhost:5555"])
    assert not any(on_this_host(e) for e in remote)
