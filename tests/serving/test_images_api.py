"""Images through `tokenmill serve` with the simulated scheduler, driven by the openai SDK: a
Qwen2-VL-shaped model (tests/image_model.py), transformers' processor and tokenizer as the oracle
of the prompt, bad input, an engine without image support, and URL fetching from a local server."""

from __future__ import annotations

import base64
import contextlib
import http.server as http_server
import io
import os
import re
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import openai
import pytest
from conftest import ROOT, Server, http
from image_model import PREPROCESSOR, make_vl_model
from PIL import Image

from tokenmill.tokenizer_workers.images.pipeline import ImageError, ImagePipeline
from tokenmill.tokenizer_workers.images.qwen2_vl import Qwen2VLProcessor
from tokenmill.tokenizer_workers.settings import ImageFetchSettings

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


_SCHEDULER = """
import asyncio, sys
from tokenmill.engines.simulated import SimulatedScheduler
from tokenmill.scheduler_client import protocol

class Scheduler(SimulatedScheduler):
    if sys.argv[4] == "no-images":
        features = frozenset(protocol.FEATURES) - {protocol.FEATURE_IMAGES}

async def main():
    sched = Scheduler(model=sys.argv[2], inter_token_latency_s=0, image_cache_bytes=int(sys.argv[3]))
    task = asyncio.create_task(sched.serve(sys.argv[1]))
    await sched.wait_ready()
    print("ready", flush=True)
    await task

asyncio.run(main())
"""


@contextlib.contextmanager
def _simulated_scheduler(tmp_path, vl_dir, image_cache_bytes: int = 4 << 30, images: bool = True, wrap: list[str] = ()):
    """A simulated scheduler of its own (one that takes no images, or holds few; ``wrap``: the command
    it runs under), started by the test; yields its endpoint."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    endpoint = f"ipc://{tmp_path}/scheduler.sock"
    args = [endpoint, str(vl_dir), str(image_cache_bytes), "images" if images else "no-images"]
    command = [*wrap, sys.executable, "-c", _SCHEDULER, *args]
    proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        yield endpoint
    finally:
        proc.terminate()
        proc.wait(10)


def _counter(srv, name: str) -> float:
    _, _, text = http("GET", srv.url + "/metrics")
    text = text.decode() if isinstance(text, bytes) else str(text)
    return sum(float(v) for v in re.findall(rf"^{name}_total\{{[^}}]*\}} (\S+)$", text, re.M))


def test_a_resent_image_goes_by_its_hash_and_one_the_engine_evicted_goes_again_with_its_pixels(tmp_path, vl_dir):
    """Protocol 1.2 images.by_hash against a simulated scheduler that holds one 56 x 56 image (18,816
    bytes of uint8 pixels) at a time, pixels in frames (shared memory off): an image resent goes as its
    hash alone; after another image has pushed it out, the engine answers image_missing, the gateway
    gets the pixels from the worker and sends the request again, and the client sees the same answer
    as on the first turn."""
    with _simulated_scheduler(tmp_path, vl_dir, image_cache_bytes=20000) as endpoint:
        srv = Server(
            "--workers", "1", "--model", str(vl_dir), "--scheduler", endpoint, "--image-shared-memory", "false"
        )
        try:
            client = srv.client()
            a, b = _url(_png(56, 56, seed=3)), _url(_png(56, 56, seed=4))

            def turn(url: str, stream: bool = False) -> tuple[int, str]:
                """(prompt tokens, greedy text): the engine saw the same prompt and image either way."""
                messages = [{"role": "user", "content": [{"type": "text", "text": "What is it?"}, _image_part(url)]}]
                args = {"model": MODEL, "messages": messages, "max_tokens": 3, "temperature": 0}
                if not stream:
                    out = client.chat.completions.create(**args)
                    return out.usage.prompt_tokens, out.choices[0].message.content
                chunks = list(
                    client.chat.completions.create(**args, stream=True, stream_options={"include_usage": True})
                )
                return chunks[-1].usage.prompt_tokens, "".join(
                    c.choices[0].delta.content or "" for c in chunks if c.choices
                )

            def sent():
                return [
                    _counter(srv, n)
                    for n in (
                        "tokenmill_images_sent_pixels",
                        "tokenmill_images_sent_by_hash",
                        "tokenmill_image_pixels_resent",
                    )
                ]

            first = turn(a)
            assert sent() == [1, 0, 0]
            assert turn(a) == first and sent() == [1, 1, 0]  # held: its hash alone
            assert turn(b)[0] == first[0] and sent() == [2, 1, 0]  # b's pixels push a out of the engine
            assert turn(a, stream=True) == first  # by hash, image_missing, then with its pixels
            assert sent() == [2, 2, 1]
            assert turn(a) == first and sent() == [2, 3, 1]  # held again
        finally:
            srv.stop()


def _turn(client, url: str, stream: bool = False) -> tuple[int, str]:
    """One chat turn with one image: (prompt tokens, greedy text)."""
    messages = [{"role": "user", "content": [{"type": "text", "text": "What is it?"}, _image_part(url)]}]
    args = {"model": MODEL, "messages": messages, "max_tokens": 3, "temperature": 0}
    if not stream:
        out = client.chat.completions.create(**args)
        return out.usage.prompt_tokens, out.choices[0].message.content
    chunks = list(client.chat.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    return chunks[-1].usage.prompt_tokens, "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def _shm_files(pids) -> list[str]:
    """The names of the files in /dev/shm these processes own (protocol 1.2 images.shm: images, owner files)."""
    from tokenmill.tokenizer_workers.images.shared_memory import PREFIX

    return [n for n in os.listdir("/dev/shm") if n.startswith(PREFIX) and int(n[len(PREFIX) :].split(".")[0]) in pids]


def _image_files(pids) -> dict[str, bytes]:
    """The shared-memory image files these processes wrote, by name."""
    out = {}
    for name in _shm_files(pids):
        if not name.endswith("-owner"):
            with open(os.path.join("/dev/shm", name), "rb") as f:
                out[name] = f.read()
    return out


_SENT = ("tokenmill_images_sent_pixels", "tokenmill_images_sent_shared_memory", "tokenmill_images_sent_by_hash")


def test_images_reach_an_engine_on_this_host_as_shared_memory_files(tmp_path, vl_dir):
    """Protocol 1.2 images.shm: the worker writes an image's pixels once to /dev/shm and the engine (a
    simulated scheduler on an ipc:// socket) maps the file, so no pixel frame crosses the gateway. The
    file holds exactly the pixels the worker's pipeline makes; an image the engine has let go (it
    holds one at a time here) is mapped again from its file, with no image_missing round trip; the
    worker's files go with it, and a killed worker's are swept by its gateway."""
    a, b = _png(56, 56, seed=5), _png(56, 56, seed=6)
    with _simulated_scheduler(tmp_path, vl_dir, image_cache_bytes=20000) as endpoint:
        srv = Server("--workers", "1", "--model", str(vl_dir), "--scheduler", endpoint)
        try:
            client = srv.client()
            pids = set(srv.children())
            first = _turn(client, _url(a))
            assert [_counter(srv, n) for n in _SENT] == [0, 1, 0]
            files = _image_files(pids)
            pipeline = ImagePipeline(Qwen2VLProcessor(PREPROCESSOR))
            assert list(files.values()) == [pipeline.load_image_part(_url(a), "image").pixels.tobytes()]
            assert _turn(client, _url(a)) == first and [_counter(srv, n) for n in _SENT] == [0, 1, 1]
            assert _turn(client, _url(b))[0] == first[0]  # b pushes a out of the engine
            assert _turn(client, _url(a), stream=True) == first  # by hash: not held, so mapped from its file
            assert [_counter(srv, n) for n in _SENT] == [0, 2, 2]
            assert _counter(srv, "tokenmill_image_pixels_resent") == 0
            assert len(_image_files(pids)) == 2
            (worker,) = pids  # killed, it removes nothing itself: its gateway sweeps the files it owned
            os.kill(worker, signal.SIGKILL)
            deadline = time.monotonic() + 60
            while (_shm_files(pids) or not set(srv.children()) - pids) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert _shm_files(pids) == [] and set(srv.children()) - pids  # gone, and a replacement runs
            assert _turn(client, _url(a)) == first  # which writes the image again
            pids = set(srv.children())
            assert len(_image_files(pids)) == 1
        finally:
            srv.stop()
        assert _shm_files(pids) == []  # removed with the worker, its owner file too


_PRIVATE_SHM = 'mount -t tmpfs tokenmill-test /dev/shm && exec "$@"'


def test_an_engine_that_cannot_see_the_files_gets_the_pixels_in_frames(tmp_path, vl_dir):
    """A scheduler on this host in a mount namespace of its own (a container's /dev/shm) lists
    images.shm but cannot open the worker's files: it answers image_missing, the gateway sends the
    same request again with the pixels, the client sees the same answer as from a scheduler that
    can, and after three such misses the worker sends pixels in frames from the start."""
    probe = subprocess.run(["unshare", "--mount", "--map-root-user", "sh", "-c", "mount -t tmpfs t /dev/shm"])
    if probe.returncode != 0:
        pytest.skip("no private mount namespace here (unshare --mount --map-root-user)")
    images = [_url(_png(56, 56, seed=10 + i)) for i in range(5)]
    with _simulated_scheduler(tmp_path / "seeing", vl_dir) as endpoint:
        srv = Server("--workers", "1", "--model", str(vl_dir), "--scheduler", endpoint)
        try:
            expected = [_turn(srv.client(), url) for url in images]
        finally:
            srv.stop()
    wrap = ["unshare", "--mount", "--map-root-user", "sh", "-c", _PRIVATE_SHM, "sh"]
    with _simulated_scheduler(tmp_path / "blind", vl_dir, wrap=wrap) as endpoint:
        srv = Server("--workers", "1", "--model", str(vl_dir), "--scheduler", endpoint)
        try:
            answers = [_turn(srv.client(), url) for url in images]
            assert answers == expected
            # three by file, each refused and sent again with its pixels; then frames from the start
            assert [_counter(srv, n) for n in _SENT] == [2, 3, 0]
            assert _counter(srv, "tokenmill_image_pixels_resent") == 3
        finally:
            srv.stop()


def test_an_engine_without_image_support_refuses_images_as_unsupported(tmp_path, vl_dir):
    with _simulated_scheduler(tmp_path, vl_dir, images=False) as endpoint:
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


# ---- the agent APIs' image forms: Anthropic `image` blocks, Responses `input_image` ----------------


def _jpeg(width: int, height: int, seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8), "RGB").save(buf, "JPEG")
    return buf.getvalue()


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _block(data: bytes, media_type: str = "image/png") -> dict:
    return {"type": "image", "source": {"type": "base64", "media_type": media_type, "data": _b64(data)}}


def _anthropic(srv):
    import anthropic

    return anthropic.Anthropic(base_url=srv.url, api_key="none", max_retries=0, timeout=60)


def _chat_tokens(srv, messages) -> int:
    return srv.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=2).usage.prompt_tokens


def test_agent_api_images_count_as_the_chat_path_counts(vl_server):
    png, jpeg = _png(640, 480, seed=5), _jpeg(300, 200, seed=6)
    jpeg_url = "data:image/jpeg;base64," + _b64(jpeg)
    chat = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "Compare "}, _image_part(_url(png)), _image_part(jpeg_url)],
        }
    ]
    expected = _chat_tokens(vl_server, chat)
    assert expected > 391 + 77  # 640x480 -> 644x476; 300x200 -> 308x196
    claude = _anthropic(vl_server)
    blocks = [{"type": "text", "text": "Compare "}, _block(png), _block(jpeg, "image/jpeg")]
    counted = claude.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": blocks}])
    answered = claude.messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": blocks}])
    assert counted.input_tokens == answered.usage.input_tokens == expected
    parts = [
        {"type": "input_text", "text": "Compare "},
        {"type": "input_image", "image_url": _url(png), "detail": "auto"},
        {"type": "input_image", "image_url": jpeg_url, "detail": "high"},
    ]
    response = vl_server.client().responses.create(
        model=MODEL, max_output_tokens=2, input=[{"role": "user", "content": parts}]
    )
    assert response.usage.input_tokens == expected

    # a tool's screenshot: Anthropic's tool_result image follows the tool message as a user message (as vLLM)
    call = {"id": "c1", "type": "function", "function": {"name": "shot", "arguments": "{}"}}
    chat_tool = [
        {"role": "user", "content": "take a screenshot"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "done"},
        {"role": "user", "content": [_image_part(_url(png))]},
    ]
    result = {"type": "tool_result", "tool_use_id": "c1", "content": [{"type": "text", "text": "done"}, _block(png)]}
    claude_tool = [
        {"role": "user", "content": "take a screenshot"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "c1", "name": "shot", "input": {}}]},
        {"role": "user", "content": [result]},
    ]
    assert claude.messages.count_tokens(model=MODEL, messages=claude_tool).input_tokens == _chat_tokens(
        vl_server, chat_tool
    )
    # Responses keeps a function_call_output's images in the tool message, as vLLM does
    chat_output = [*chat_tool[:2], {"role": "tool", "tool_call_id": "c1", "content": [_image_part(_url(png))]}]
    items = [
        {"role": "user", "content": "take a screenshot"},
        {"type": "function_call", "call_id": "c1", "name": "shot", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_image", "image_url": _url(png)}]},
    ]
    response = vl_server.client().responses.create(model=MODEL, max_output_tokens=2, input=items)
    assert response.usage.input_tokens == _chat_tokens(vl_server, chat_output)


def test_bad_agent_api_images_are_400s_naming_the_block(vl_server, server):
    import anthropic

    claude = _anthropic(vl_server)
    tiff = io.BytesIO()
    Image.new("RGB", (8, 8)).save(tiff, "TIFF")
    good = _block(_png(16, 16))
    bad_blocks = {
        "messages[0].content[1]": ({"type": "base64", "media_type": "image/png", "data": "!!!!"}, "base64"),
        "messages[0].content[1].source.media_type": (
            {"type": "base64", "media_type": "image/bmp", "data": good["source"]["data"]},
            "image/jpeg",
        ),
        "messages[0].content[1] ": (  # the bytes are not what media_type says
            {"type": "base64", "media_type": "image/jpeg", "data": good["source"]["data"]},
            "image/png, not the declared image/jpeg",
        ),
        "messages[0].content[1]  ": (  # an unsupported format, whatever it is called
            {"type": "base64", "media_type": "image/png", "data": _b64(tiff.getvalue())},
            "not a known image type",
        ),
        "messages[0].content[1].source.type": ({"type": "file", "file_id": "file_1"}, "Files API"),
        "messages[0].content[1].source.url": ({"type": "url", "url": "ftp://x/y.png"}, "http(s)"),
    }
    for param, (source, words) in bad_blocks.items():
        blocks = [{"type": "text", "text": "look"}, {"type": "image", "source": source}]
        with pytest.raises(anthropic.BadRequestError) as err:
            claude.messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": blocks}])
        message = err.value.body["error"]["message"]
        assert err.value.body["error"]["type"] == "invalid_request_error", err.value.body
        assert message.startswith(param.strip() + ":") and words in message, (param, message)
    client = vl_server.client()
    bad_parts = {
        "input[0].content[1]": ({"image_url": "data:image/png;base64,!!!!"}, "base64"),
        "input[0].content[1] ": (
            {"image_url": "data:image/tiff;base64," + _b64(tiff.getvalue())},
            "not a readable image",
        ),
        "input[0].content[1].file_id": ({"file_id": "file-abc"}, "no file store"),
        "input[0].content[1].detail": ({"image_url": _url(_png(8, 8)), "detail": "ultra"}, "original"),
    }
    for param, (part, words) in bad_parts.items():
        parts = [{"type": "input_text", "text": "look"}, {"type": "input_image", **part}]
        with pytest.raises(openai.BadRequestError) as err:
            client.responses.create(model=MODEL, max_output_tokens=2, input=[{"role": "user", "content": parts}])
        body = err.value.body
        assert body["param"] == param.strip() and words in body["message"], (param, body)
    # a text-only model refuses both by name, in each API's own shape
    with pytest.raises(anthropic.BadRequestError) as err:
        _anthropic(server).messages.create(
            model="deepseek-v4", max_tokens=2, messages=[{"role": "user", "content": [good]}]
        )
    assert err.value.body["error"]["message"].startswith("messages[0].content[0]: this model takes no images")
    with pytest.raises(openai.BadRequestError) as err:
        server.client().responses.create(
            model="deepseek-v4",
            max_output_tokens=2,
            input=[{"role": "user", "content": [{"type": "input_image", "image_url": _url(_png(8, 8))}]}],
        )
    assert err.value.body["param"] == "input[0].content[0]" and "takes no images" in err.value.body["message"]
