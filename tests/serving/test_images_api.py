"""Images through `tokenmill serve` with the simulated scheduler, driven by the openai SDK: a
Qwen2-VL-shaped model (tests/image_model.py), transformers' processor and tokenizer as the oracle
of the prompt, bad input, an engine without image support, and URL fetching from a local server."""

from __future__ import annotations

import base64
import http.server as http_server
import io
import subprocess
import sys
import threading

import numpy as np
import openai
import pytest
from conftest import ROOT, Server, http
from image_model import PREPROCESSOR, make_vl_model
from PIL import Image

from tokenizer_workers.images import ImageError, ImagePipeline
from tokenizer_workers.images.fetch import ImageFetchSettings
from tokenizer_workers.images.qwen2_vl import Qwen2VLProcessor

MODEL = "Tiny-Qwen2-VL"


def _png(width: int, height: int, seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8), "RGB").save(buf, "PNG")
    return buf.getvalue()


def _url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def _image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url, "detail": "auto"}}


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    return make_vl_model(tmp_path_factory.mktemp("vl"))


@pytest.fixture(scope="module")
def vl_server(vl_dir):
    srv = Server("--workers", "1", "--model", str(vl_dir), "--sim-inter-token-latency-ms", "0")
    yield srv
    srv.stop()


def _oracle_ids(vl_dir, messages_hf, images: list[bytes]) -> list[int]:
    """What transformers' Qwen2-VL processor does: render, expand each <|image_pad|> to the image's
    grid_t * grid_h * grid_w / 4 tokens, tokenize."""
    from transformers import PreTrainedTokenizerFast
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tok = PreTrainedTokenizerFast.from_pretrained(str(vl_dir))
    text = tok.apply_chat_template(messages_hf, tokenize=False, add_generation_prompt=True)
    proc = Qwen2VLImageProcessorPil(min_pixels=PREPROCESSOR["min_pixels"], max_pixels=PREPROCESSOR["max_pixels"])
    pieces = text.split("<|image_pad|>")
    assert len(pieces) == len(images) + 1
    out = pieces[0]
    for piece, data in zip(pieces[1:], images):
        grid = proc(images=[Image.open(io.BytesIO(data))], return_tensors="np")["image_grid_thw"][0]
        out += "<|image_pad|>" * (int(np.prod(grid)) // 4) + piece
    return tok(out, add_special_tokens=False)["input_ids"]


def test_image_chat_prompt_equals_transformers_processor(vl_server, vl_dir):
    a, b = _png(1024, 1024), _png(300, 200, seed=1)
    messages = [
        {"role": "system", "content": "Describe images."},
        {"role": "user", "content": [{"type": "text", "text": "Compare "}, _image_part(_url(a)), _image_part(_url(b))]},
    ]
    hf_messages = [
        messages[0],
        {"role": "user", "content": [{"type": "text", "text": "Compare "}, {"type": "image"}, {"type": "image"}]},
    ]
    expected = _oracle_ids(vl_dir, hf_messages, [a, b])
    status, _, body = http("POST", vl_server.url + "/tokenize", {"model": MODEL, "messages": messages})
    assert status == 200, body
    assert body["tokens"] == expected
    from tokenizers import Tokenizer

    pad = Tokenizer.from_file(str(vl_dir / "tokenizer.json")).token_to_id("<|image_pad|>")
    assert body["tokens"].count(pad) == 1225 + 77  # 1024^2 -> 980^2 (max_pixels 1003520); 300x200 -> 308x196
    client = vl_server.client()
    resp = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5)
    assert resp.usage.prompt_tokens == len(expected) and resp.choices[0].message.content
    again = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5)  # from the cache
    assert again.usage.prompt_tokens == len(expected)
    two = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, n=2, seed=1)
    assert len(two.choices) == 2 and two.usage.prompt_tokens == len(expected)  # each choice gets the pixel frames
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=4, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[-1].usage.prompt_tokens == len(expected)


def test_bad_images_are_400s_naming_the_part(vl_server, server):
    client = vl_server.client()
    cases = {
        "data:image/png;base64,!!!!": "base64",
        "data:image/png,notbase64": "base64",
        _url(_png(40, 40)[:60]): "truncated",
        _url(_png(1, 300)): "aspect ratio",
        "http://127.0.0.1:9/x.png": "not fetched",
    }
    for url, words in cases.items():
        messages = [{"role": "user", "content": [{"type": "text", "text": "look"}, _image_part(url)]}]
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
        body = err.value.body
        assert body["param"] == "messages[0].content[1]" and words in body["message"], (url[:40], body)
    # a text-only model (the embedded default) refuses the part by name
    messages = [{"role": "user", "content": [{"type": "text", "text": "look"}, _image_part(_url(_png(8, 8)))]}]
    with pytest.raises(openai.BadRequestError) as err:
        server.client().chat.completions.create(model="deepseek-v4", messages=messages, max_tokens=2)
    assert err.value.body["param"] == "messages[0].content[1]" and "takes no images" in err.value.body["message"]
    assert http("GET", vl_server.url + "/health")[0] == 200


_NO_IMAGES = """
import asyncio, sys
from engines.simulated import SimulatedScheduler
from scheduler_client import protocol

class NoImages(SimulatedScheduler):
    features = frozenset(protocol.FEATURES) - {protocol.FEATURE_IMAGES}

async def main():
    sched = NoImages(model=sys.argv[2], inter_token_latency_s=0)
    task = asyncio.create_task(sched.serve(sys.argv[1]))
    await sched.wait_ready()
    print("ready", flush=True)
    await task

asyncio.run(main())
"""


def test_an_engine_without_image_support_refuses_images_as_unsupported(tmp_path, vl_dir):
    endpoint = f"ipc://{tmp_path}/noimg.sock"
    proc = subprocess.Popen(
        [sys.executable, "-c", _NO_IMAGES, endpoint, str(vl_dir)], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline().strip() == "ready"
        srv = Server("--workers", "1", "--model", str(vl_dir), "--scheduler", endpoint)
        try:
            messages = [{"role": "user", "content": [_image_part(_url(_png(30, 30)))]}]
            status, _, body = http("POST", srv.url + "/v1/chat/completions", {"messages": messages, "max_tokens": 2})
            assert status == 400, body
            assert body["error"]["code"] == "unsupported" and body["error"]["param"] == "messages[0].content[0]"
            ok = srv.client().chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "text still works"}], max_tokens=2
            )
            assert ok.choices[0].finish_reason in ("length", "stop")
        finally:
            srv.stop()
    finally:
        proc.terminate()
        proc.wait(10)


class _ImageServer:
    """A local HTTP server made by the test: /img.png, redirects, a large body."""

    def __init__(self, png: bytes):
        outer = self

        class Handler(http_server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                routes = {
                    "/img.png": (200, {"Content-Type": "image/png"}, png),
                    "/hop": (302, {"Location": "/img.png"}, b""),
                    "/to-metadata": (302, {"Location": "http://169.254.169.254/latest/meta-data/"}, b""),
                    "/to-other-loopback": (302, {"Location": f"http://127.0.0.2:{outer.port}/img.png"}, b""),
                    "/loop": (302, {"Location": "/loop"}, b""),
                    "/big": (200, {"Content-Type": "image/png"}, png * 50),
                }
                status, headers, body = routes.get(self.path, (404, {}, b""))
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.httpd = http_server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def test_url_fetching_is_bounded_and_checks_every_hop():
    png = _png(56, 56)
    site = _ImageServer(png)
    try:
        allowed = ImageFetchSettings(enabled=True, timeout_s=5, max_bytes=len(png) * 2, allow_networks=["127.0.0.1/32"])
        pipeline = ImagePipeline(Qwen2VLProcessor(PREPROCESSOR), fetch=allowed)
        direct = pipeline.load_image_part(site.url("/img.png"), "p")
        assert direct.grid_thw == (1, 4, 4)
        assert pipeline.load_image_part(site.url("/hop"), "p").content_hash == direct.content_hash
        refused = {
            "/to-metadata": "169.254.169.254",
            "/to-other-loopback": "127.0.0.2",
            "/loop": "redirected more than 3",
            "/big": "at most",
            "/missing": "HTTP 404",
        }
        for path, words in refused.items():
            with pytest.raises(ImageError, match=words):
                pipeline.load_image_part(site.url(path), "p")
        unlisted = ImagePipeline(Qwen2VLProcessor(PREPROCESSOR), fetch=ImageFetchSettings(enabled=True, timeout_s=5))
        with pytest.raises(ImageError, match="loopback"):
            unlisted.load_image_part(site.url("/img.png"), "p")
    finally:
        site.close()


def test_a_server_configured_to_fetch_takes_http_image_urls(vl_dir):
    png = _png(56, 56, seed=3)
    site = _ImageServer(png)
    srv = Server(
        "--workers",
        "1",
        "--model",
        str(vl_dir),
        "--image-fetch",
        "true",
        "--image-fetch-allow",
        "127.0.0.1/32",
        "--image-fetch-timeout",
        "5",
    )
    try:
        client = srv.client()
        messages = [{"role": "user", "content": [_image_part(site.url("/hop")), "what is it?"]}]
        resp = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3)
        inline = [{"role": "user", "content": [_image_part(_url(png)), "what is it?"]}]
        assert (
            resp.usage.prompt_tokens
            == client.chat.completions.create(model=MODEL, messages=inline, max_tokens=3).usage.prompt_tokens
        )
        bad = [{"role": "user", "content": [_image_part(site.url("/to-metadata"))]}]
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=MODEL, messages=bad, max_tokens=3)
        assert err.value.body["param"] == "messages[0].content[0]" and "169.254.169.254" in err.value.body["message"]
    finally:
        srv.stop()
        site.close()
