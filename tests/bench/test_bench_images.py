"""The image scenario of `tokenmill bench vllm --images` (tokenmill/bench/images.py), one round of it
against `tokenmill serve` on its simulator: every figure is reported, nothing fails (values are not
asserted, except what must hold whatever the machine)."""

from __future__ import annotations

import time

from conftest import Server
from image_model import make_vl_model

from tokenmill.bench import images as img


def test_one_round_of_image_chats_reports_every_figure(tmp_path, monkeypatch):
    monkeypatch.setattr(img, "IDLE_PROBE_S", 0.5)  # the idle probe's length does not change what is checked
    model = make_vl_model(tmp_path / "vl")
    rounds = [img.chat_bodies("bench", f"test {time.time_ns()}", img.photo_images(img.CHATS * img.IMAGES_PER_CHAT, 5))]
    srv = Server("--model", str(model), "--served-model-name", "bench", "--sim-inter-token-latency-ms", "0")
    try:
        img.warm_up(srv.port, "bench")
        figures = img.image_chats(srv.port, "tokenmill", srv.proc.pid, rounds)
    finally:
        srv.stop()
    assert figures["errors"] == []
    assert set(img.FIGURES) <= set(figures)
    assert figures["images_per_s"] > 0 and figures["prompt_tokens"] > 0
    assert (
        figures["resend_front_cpu_ms_per_image"] < figures["front_cpu_ms_per_image"]
    )  # resent images are not processed again
    assert figures["pixels_resent"] == 0
    assert figures["loop_lag_max_ms"] >= 0
    assert figures["idle_front_cpu_ms_per_s"] >= 0 and figures["resend_cpu_vs_first_net"] >= 0
    assert figures["health_p50_ms"] <= figures["health_p99_ms"] <= figures["health_max_ms"]
    if figures["cpu_stall_max_ms"] is not None:  # real-time watchers ran (root): the clear maximum is one of the probes
        assert figures["health_max_clear_ms"] <= figures["health_max_ms"]
