"""The workers' shared-memory image files (protocol 1.2 images.shm), in a directory of the test's own:
written once and read back as the cache's pixels, removed after their image leaves the cache, and
those of exited processes swept; a directory that cannot take them means frames."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np

from tokenizer_workers.images.base import ProcessedImage
from tokenizer_workers.images.cache import ImageCache
from tokenizer_workers.images.shared_memory import PREFIX, SharedPixels, remove_files_of, remove_stale_files


def _pixels(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (16, 1176), dtype=np.uint8)


def test_pixels_are_written_once_and_read_back_from_the_file(tmp_path):
    shared = SharedPixels(str(tmp_path))
    pixels = _pixels(1)
    name, view = shared.write("ab" * 32, pixels)
    assert name.startswith(f"{PREFIX}{os.getpid()}-") and name.endswith("abababababababab")
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
    assert cache.evictions == 1 and len(os.listdir(tmp_path)) == 3  # the evicted one's file is kept for now
    shared.sweep(budget=1 << 30)
    assert len(os.listdir(tmp_path)) == 3  # within its grace
    shared.sweep(budget=0)  # more bytes retiring than allowed: removed at once
    assert sorted(os.listdir(tmp_path)) == sorted(names[1:]) and shared.files == 2
    shared.close()
    assert os.listdir(tmp_path) == [] and shared.files == 0


def test_files_of_exited_processes_are_swept_and_live_ones_kept(tmp_path):
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = int(gone.stdout)
    for owner in (dead, os.getpid()):
        (tmp_path / f"{PREFIX}{owner}-0-0123456789abcdef").write_bytes(b"x")
    (tmp_path / "psm_other_program").write_bytes(b"y")  # not ours: never touched
    assert remove_stale_files(str(tmp_path)) == 1
    assert sorted(os.listdir(tmp_path)) == sorted([f"{PREFIX}{os.getpid()}-0-0123456789abcdef", "psm_other_program"])
    assert remove_files_of(os.getpid(), str(tmp_path)) == 1
    assert os.listdir(tmp_path) == ["psm_other_program"]


def test_a_directory_that_cannot_take_the_pixels_means_frames(tmp_path):
    shared = SharedPixels(str(tmp_path / "missing"))
    assert shared.write("00" * 32, _pixels(0)) is None and shared.failed


def test_only_a_scheduler_on_this_host_is_offered_the_files():
    """The gateway hands images.shm on to its workers only where every scheduler endpoint is on this
    host: an ipc:// socket, or TCP to a loopback address."""
    from gateway.scheduler_ranks import on_this_host

    local = ["ipc:///run/tokenmill/engine.sock", "tcp://127.0.0.1:5555", "tcp://127.0.0.2:5555", "tcp://[::1]:5555"]
    remote = ["tcp://10.0.0.7:5555", "tcp://[fe80::1]:5555", "tcp://engine-3.internal:5555", "inproc://x"]
    assert all(on_this_host(e) for e in local + ["tcp://localhost:5555"])
    assert not any(on_this_host(e) for e in remote)
