"""Images on a real vLLM: tokenmill's workers preprocess, the vLLM bridge hands the pixels to AsyncLLM
as vLLM's prebuilt multimodal input, and a client sees what vLLM's own server gives it.

A tiny random Qwen2-VL (tests/image_model.py: text 128 x 2 layers, vision depth 2, ~34 MB, made
here) is served twice on vLLM's CPU build, both under the torch/torchvision overlay that vLLM's
Qwen2-VL path needs (tests/vllm_env.py, VLLM_VISION):

* by vLLM's own OpenAI server (its defaults: its own fetch, decode and HF processor, pixels
  normalised on the device);
* by `tokenmill engine --backend vllm` behind `tokenmill serve` (vLLM's default
  ``mm_device_do_normalize`` too: the workers send uint8 pixels, the device normalises them).

vLLM's own server also runs with ``--enable-scale-out``, and a third front end, `tokenmill serve
--engine-url` in front of its token-in API, sends each image as the file of its resized pixels (the API
takes image files; vLLM processes them again and finds nothing to resize): the same prompt token IDs
and greedy outputs as vLLM's own server there too.

For these cases (1x1, 20x20, a 1024^2 JPEG, 768x1024, a 28x5000 strip, an EXIF-rotated
JPEG, an RGBA PNG, an animated GIF, a 224^2 PNG that needs no resizing, a two-image message) the
prompt token IDs (``return_token_ids``) and the greedy outputs are vLLM's; an aspect ratio over 200
is a 400 on both; the workers' uint8 pixels equal vLLM's own uint8 processing (decode as vLLM
does, then transformers' image processor in vLLM's venv, as vLLM calls it) value for value,
resized or not; the bridge lists ``images``; and an image the engine core already holds goes to it
as its content hash (vLLM's processor cache, which the bridge keeps in shared memory), not as pixels.

Both vLLMs start in the background as soon as pytest has collected this module (as tests/vllm_stack.py
does for the text stack), at a lower CPU priority. Skipped, saying why, without vLLM's CPU build or
without the overlay.
"""

from __future__ import annotations

import base64
import io
import json
import os
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import msgspec
import numpy as np
import pytest
from vllm_env import VLLM_PYTHON, VLLM_VISION, vision_missing_reason

_why = vision_missing_reason()
if _why:
    pytest.skip(_why, allow_module_level=True)

import openai  # noqa: E402
from conftest import ROOT, Server, free_port, http  # noqa: E402
from PIL import Image  # noqa: E402
from protocol_client import ProtocolClient  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402
from vllm_stack import Proc, stop_all, wait_all  # noqa: E402

from tokenmill.scheduler_client.protocol import (  # noqa: E402
    Error,
    Generate,
    ImageItem,
    SamplingParams,
    Welcome,
    ids_to_frame,
)
from tokenmill.tokenizer_workers.images.pipeline import ImagePipeline, processor_for  # noqa: E402
from tokenmill.tokenizer_workers.images.shared_memory import SharedPixels  # noqa: E402

NAME = "Tiny-Qwen2-VL"
MAX_MODEL_LEN = 4096
NICE = 10
ENV = {"PYTHONPATH": str(VLLM_VISION)}  # torch 2.14.1 and torchvision 0.29.1 ahead of .venv-vllm's torch
SAME = ["--enforce-eager", "--no-enable-prefix-caching"]  # in both vLLMs: no compile, no cross-request state


# ---- the images ------------------------------------------------------------------------------------


def _encode(image: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    image.save(buf, fmt, **kw)
    return buf.getvalue()


def _noise(width: int, height: int, seed: int, mode: str = "RGB") -> Image.Image:
    channels = len(mode)
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, channels), dtype=np.uint8), mode)


def _photo(width: int, height: int, seed: int) -> Image.Image:
    """Smooth gradients with some grain: what resampling filters meet in photographs."""
    y, x = np.mgrid[0:height, 0:width].astype(np.float64)
    rng = np.random.default_rng(seed)
    rgb = np.stack(
        [128 + 100 * np.sin(x / 37 + k) * np.cos(y / 53 - k) + rng.normal(0, 6, x.shape) for k in range(3)], -1
    )
    return Image.fromarray(np.clip(rgb, 0, 255).astype(np.uint8), "RGB")


def _exif_rotated() -> bytes:
    exif = Image.Exif()
    exif[0x0112] = 6  # Orientation: rotate 90 degrees clockwise to display
    return _encode(_photo(200, 100, 5), "JPEG", quality=90, exif=exif)


def _gif() -> bytes:
    frames = [_noise(60, 40, 6).convert("P"), _noise(60, 40, 7).convert("P")]
    return _encode(frames[0], "GIF", save_all=True, append_images=frames[1:], duration=100, loop=0)


def _rgba() -> bytes:
    image = _noise(64, 48, 8, "RGBA")
    alpha = np.tile(np.linspace(0, 255, 64, dtype=np.uint8), (48, 1))
    image.putalpha(Image.fromarray(alpha, "L"))
    return _encode(image, "PNG")


IMAGES = {
    "1x1": ("image/png", lambda: _encode(Image.new("RGB", (1, 1), (200, 30, 60)), "PNG")),
    "20x20": ("image/png", lambda: _encode(_noise(20, 20, 1), "PNG")),
    "1024x1024-jpeg": ("image/jpeg", lambda: _encode(_photo(1024, 1024, 2), "JPEG", quality=90)),
    "768x1024": ("image/png", lambda: _encode(_photo(768, 1024, 3), "PNG")),
    "28x5000": ("image/png", lambda: _encode(_noise(28, 5000, 4), "PNG")),
    "exif-rotated-jpeg": ("image/jpeg", _exif_rotated),
    "rgba-png": ("image/png", _rgba),
    "animated-gif": ("image/gif", _gif),
    "224x224-unresized": ("image/png", lambda: _encode(_photo(224, 224, 9), "PNG")),
}
NOT_RESIZED = {"224x224-unresized"}  # smart_resize keeps 224 x 224: no resampling on either side
TOO_THIN = ("image/png", lambda: _encode(_noise(1, 300, 10), "PNG"))  # aspect ratio 300 > 200


def _data_url(kind: tuple) -> str:
    media_type, make = kind
    return f"data:{media_type};base64," + base64.b64encode(make()).decode()


def _message(*urls: str) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": "What is in the picture?"}]}]


CASES = {name: _message(_data_url(kind)) for name, kind in IMAGES.items()}
CASES["two-images"] = _message(_data_url(IMAGES["20x20"]), _data_url(IMAGES["rgba-png"]))


# ---- the two servers, started at collection ------------------------------------------------------------


class _Early:
    """Makes the model and starts both vLLMs in a thread that lives as long as they do (their
    parent-death signal is tied to it, see tests/vllm_stack.py)."""

    def __init__(self) -> None:
        self.thread: threading.Thread | None = None
        self.started = threading.Event()
        self.finished = threading.Event()
        self.root: Path | None = None
        self.procs: list = []
        self.error: BaseException | None = None
        self.t0 = time.monotonic()

    def start(self) -> None:
        if self.thread is None:
            self.t0 = time.monotonic()
            self.thread = threading.Thread(target=self._run, name="vllm-images", daemon=True)
            self.thread.start()

    def _run(self) -> None:
        try:
            self.root = Path(tempfile.mkdtemp(prefix="tmvlimg-"))
            model = self.root / NAME
            made = subprocess.run(
                ["nice", "-n", str(NICE), str(VLLM_PYTHON), str(ROOT / "tests" / "image_model.py"), str(model)],
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=300,
            )
            assert made.returncode == 0, f"tests/image_model.py failed:\n{made.stdout}{made.stderr}"
            self.procs.append(_VLLMServer(model, self.root / "vllm.log"))
            self.procs.append(_Engine(model, f"ipc://{self.root}/engine.sock", self.root / "engine.log"))
        except BaseException as exc:
            self.error = exc
        finally:
            self.started.set()
        self.finished.wait()

    def stop(self) -> list:
        statuses = stop_all(self.procs)
        self.procs.clear()
        self.finished.set()
        if self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)
        return statuses


class _VLLMServer(Proc):
    def __init__(self, model: Path, log_path: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        args = ["--model", str(model), "--served-model-name", NAME, "--max-model-len", str(MAX_MODEL_LEN)]
        args += ["--host", "127.0.0.1", "--port", str(self.port), "--enable-scale-out", *SAME]
        super().__init__([str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", *args], log_path, NICE, ENV)

    def ready(self) -> bool:
        self.check_alive("vLLM's server")
        try:
            return http("GET", self.url + "/health", timeout=2)[0] == 200
        except OSError:
            return False


class _Engine(Proc):
    def __init__(self, model: Path, endpoint: str, log_path: Path) -> None:
        self.endpoint = endpoint
        args = ["--model", str(model), "--max-model-len", str(MAX_MODEL_LEN), "--bind", endpoint]
        args += ["--engine-arg", "enforce_eager=true", "--engine-arg", "enable_prefix_caching=false"]
        super().__init__(
            [str(VLLM_PYTHON), "-m", "tokenmill.cli", "engine", "--backend", "vllm", *args], log_path, NICE, ENV
        )

    def ready(self) -> bool:
        self.check_alive("tokenmill engine --backend vllm")
        return "listening on" in self.log()


EARLY = _Early()


def start_early(items) -> None:
    """conftest calls this once the tests are collected: both vLLMs load while earlier modules run."""
    EARLY.start()


def stop_early() -> None:
    """conftest's pytest_sessionfinish: a run stopped before this module's fixture ended."""
    if EARLY.procs:
        EARLY.stop()


def _front(*engine: str) -> Server:
    """`tokenmill serve` of the image model in front of ``engine`` (--scheduler or --engine-url)."""
    args = ["--model", str(EARLY.root / NAME), *engine, "--served-model-name", NAME]
    return Server(*args, "--max-model-len", str(MAX_MODEL_LEN), "--workers", "1", timeout=120)


@pytest.fixture(scope="module")
def stack():
    EARLY.start()
    EARLY.started.wait()
    try:
        if EARLY.error is not None:
            raise EARLY.error
        vllm, engine = EARLY.procs
        wait_all(vllm, engine)
        front = _front("--scheduler", engine.endpoint)
        EARLY.procs.append(front)
        print(f"\nvLLM image stack ready {time.monotonic() - EARLY.t0:.1f} s after collection")
        yield vllm, engine, front
    finally:
        statuses = EARLY.stop()
    for p, status in statuses:
        assert status == 0, f"{type(p).__name__} exited with {status}:\n{p.log()[-3000:] if hasattr(p, 'log') else ''}"


@pytest.fixture(scope="module")
def http_front(stack):
    """`tokenmill serve --engine-url` in front of the stack's vLLM server's token-in API."""
    vllm, _, _ = stack
    front = _front("--engine-url", vllm.url)
    yield front
    assert front.stop() == 0, front.read_output()[-3000:]


_vllms: dict = {}


def _vllms_greedy(url: str, name: str):
    """vLLM's own server's answer to a case (asked once: two tests compare with it)."""
    if name not in _vllms:
        _vllms[name] = _greedy(url, CASES[name])
    return _vllms[name]


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)


def _greedy(url: str, messages: list[dict]) -> tuple[list[int], list[int], str, str]:
    r = _client(url).chat.completions.create(
        model=NAME,
        messages=messages,
        max_tokens=8,
        temperature=0,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    c = r.choices[0]
    return list(r.prompt_token_ids), list(c.token_ids), c.message.content, c.finish_reason


# ---- tests --------------------------------------------------------------------------------------------


def test_engine_lists_images_and_refuses_another_family_or_dtype(stack):
    """welcome lists images; an item of a family or dtype the bridge cannot hand to vLLM is an error
    naming images."""
    _, engine, _ = stack
    client = ProtocolClient(engine.endpoint, log=engine.log)
    try:
        welcome = client.handshake("test-images")
        assert isinstance(welcome, Welcome) and {"images", "images.by_hash", "images.shm"} <= set(welcome.features)
        prompt = [129282, *[129284] * 4, 129283, 9]
        item = ImageItem("gemma3", "float32", [16, 1176], [1, 4, 4], 1, 4, "0" * 64)
        pixels = np.zeros((16, 1176), np.float32).tobytes()
        gen = Generate(request_id="g", prompt_token_count=len(prompt), max_new_tokens=2, images=[item])
        client.send(gen, ids_to_frame(prompt), pixels)
        error = client.recv_not_stats()
        assert isinstance(error, Error) and (error.request_id, error.param) == ("g", "images"), error
        # float32 (normalised) pixels: the device would normalise them again
        item = ImageItem("qwen2_vl", "float32", [16, 1176], [1, 4, 4], 1, 4, "1" * 64)
        gen = Generate(request_id="f", prompt_token_count=len(prompt), max_new_tokens=2, images=[item])
        client.send(gen, ids_to_frame(prompt), pixels)
        error = client.recv_not_stats()
        assert isinstance(error, Error) and (error.request_id, error.param) == ("f", "images"), error
        assert "uint8" in error.message, error
    finally:
        client.close()


def test_prompt_ids_and_greedy_outputs_equal_vllm(stack):
    """Every case through both servers: the same prompt token IDs (placeholders expanded alike), the same
    greedy tokens and finish reason; and the images reach the model (different images, different
    outputs). The texts are equal too, but where the tokens end inside a UTF-8 character: tokenmill's
    text is the tokens' decode, vLLM's drops the bytes it held back (docs/engines/tokenmill-engine.md,
    "Where answers differ from vLLM's own server")."""
    vllm, _, front = stack
    tokenizer = Tokenizer.from_file(str(EARLY.root / NAME / "tokenizer.json"))
    outputs = {}
    framed = _sent(front, "pixels")
    for name, messages in CASES.items():
        theirs, ours = _vllms_greedy(vllm.url, name), _greedy(front.url, messages)
        assert ours[0] == theirs[0], f"{name}: prompt token IDs differ"
        assert (ours[1], ours[3]) == (theirs[1], theirs[3]), f"{name}: greedy output differs: {ours} != {theirs}"
        assert ours[2] == tokenizer.decode(ours[1], skip_special_tokens=True), name
        assert ours[2] == theirs[2] or (ours[2].endswith("\ufffd") and ours[2].startswith(theirs[2])), name
        outputs[name] = tuple(ours[1])
    assert len(set(outputs.values())) > len(outputs) // 2, f"the images hardly change the outputs: {outputs}"
    # the engine is on this host: it mapped every new image from the worker's shared-memory file
    assert _sent(front, "shared_memory") > 0 and _sent(front, "pixels") == framed


def test_through_vllms_token_in_api_prompt_ids_and_greedy_outputs_equal_vllm(stack, http_front):
    """Every case through tokenmill in front of the same server's token-in API: the images go as files of
    their resized pixels with one placeholder token each, and vLLM's expansion of them and its greedy
    outputs are what its own server gives for the original images."""
    vllm, _, _ = stack
    outputs = {}
    for name, messages in CASES.items():
        theirs, ours = _vllms_greedy(vllm.url, name), _greedy(http_front.url, messages)
        assert ours[0] == theirs[0], f"{name}: prompt token IDs differ"
        assert (ours[1], ours[3]) == (theirs[1], theirs[3]), f"{name}: greedy output differs: {ours} != {theirs}"
        outputs[name] = tuple(ours[1])
    assert len(set(outputs.values())) > len(outputs) // 2, f"the images hardly change the outputs: {outputs}"
    # a text-only request on the same front still streams as before
    r = _client(http_front.url).chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "Hello"}], max_tokens=3, temperature=0
    )
    assert r.choices[0].finish_reason in ("length", "stop")


def test_aspect_ratio_over_200_is_a_400_on_both(stack):
    vllm, _, front = stack
    messages = _message(_data_url(TOO_THIN))
    with pytest.raises(openai.BadRequestError):  # vLLM: "Failed to apply Qwen2VLProcessor ..."
        _greedy(vllm.url, messages)
    with pytest.raises(openai.BadRequestError) as info:
        _greedy(front.url, messages)
    assert "aspect ratio" in str(info.value)
    assert info.value.body["param"] == "messages[0].content[0]"


VLLM_PIXELS = """
import base64, json, sys
import numpy as np
from transformers import AutoImageProcessor
from vllm.multimodal.media.image import ImageMediaIO

model, cases, out = sys.argv[1], json.loads(open(sys.argv[2]).read()), sys.argv[3]
processor = AutoImageProcessor.from_pretrained(model)
arrays = {"_processor": np.array(type(processor).__name__)}
for name, url in cases.items():
    image = ImageMediaIO(image_mode="RGB").load_base64("", url.split(",", 1)[1]).media
    # as vLLM calls it with mm_device_do_normalize (its default for Qwen2-VL): resized pixels, 0..255
    got = processor(images=[image], do_rescale=False, do_normalize=False, return_tensors="np")
    arrays[name] = np.asarray(got["pixel_values"])
np.savez(out, **arrays)
"""


def test_pixels_equal_vllms_own_processing(stack, tmp_path):
    """The workers' uint8 pixels against vLLM's decoding and transformers' image processor in vLLM's venv
    (its torchvision backend) called as vLLM calls it with mm_device_do_normalize: both uint8, the same
    layout, and the same values everywhere, resized or not (the workers resize with torch's own
    arithmetic: tokenizer_workers/images/resample.py)."""
    urls = {name: _data_url(kind) for name, kind in IMAGES.items()}
    (tmp_path / "cases.json").write_text(json.dumps(urls))
    made = subprocess.run(
        [
            str(VLLM_PYTHON),
            "-c",
            VLLM_PIXELS,
            str(EARLY.root / NAME),
            str(tmp_path / "cases.json"),
            str(tmp_path / "v.npz"),
        ],
        env={**os.environ, **ENV, "HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert made.returncode == 0, made.stderr[-4000:]
    theirs = np.load(tmp_path / "v.npz")
    pipeline = ImagePipeline(processor_for(EARLY.root / NAME))
    apart = {}
    for name, url in urls.items():
        ours = pipeline.load_image_part(url, "x").pixels
        assert ours.dtype == theirs[name].dtype == np.uint8, (name, theirs[name].dtype)
        assert theirs[name].shape == ours.shape, name  # the same grid: EXIF, GIF frame, alpha alike
        apart[name] = int(np.count_nonzero(ours != theirs[name]))
    print(f"\n{theirs['_processor']}: values that differ, per image: {apart}")
    assert not any(apart.values()), apart


def test_an_item_sent_by_hash_is_served_from_the_engine_core_or_refused_as_image_missing(stack):
    """Protocol 1.2 images.by_hash on the bridge: an empty pixel frame for an image vLLM's engine core
    does not hold is image_missing (nothing starts); once the pixels have been sent, the same item by
    hash alone gives the same greedy output, and so does an item naming a shared-memory file with
    the same pixels (images.shm)."""
    _, engine, _ = stack
    client = ProtocolClient(engine.endpoint, log=engine.log)
    try:
        client.handshake("test-by-hash")
        prompt = [129282, *[129284] * 4, 129283, 9]
        content_hash = os.urandom(32).hex()  # never seen by this engine
        item = ImageItem("qwen2_vl", "uint8", [16, 1176], [1, 4, 4], 1, 4, content_hash)
        pixels = np.random.default_rng(7).integers(0, 256, (16, 1176), dtype=np.uint8).tobytes()

        def run(request_id: str, frame: bytes, image: ImageItem = item):
            gen = Generate(
                request_id=request_id,
                prompt_token_count=len(prompt),
                max_new_tokens=4,
                images=[image],
                ignore_eos=True,
                sampling=SamplingParams(temperature=0.0),
            )
            client.send(gen, ids_to_frame(prompt), frame)

        run("missing", b"")
        error = client.recv_not_stats()
        assert isinstance(error, Error) and (error.request_id, error.code, error.param) == (
            "missing",
            "image_missing",
            "images",
        ), error
        run("pixels", pixels)
        with_pixels = b"".join(o.token_ids for o in client.collect(["pixels"])["pixels"])
        run("hash", b"")
        by_hash = b"".join(o.token_ids for o in client.collect(["hash"])["hash"])
        assert by_hash == with_pixels and len(by_hash) == 16
        shared = SharedPixels()  # a file written as a worker writes one
        name, _ = shared.write("1" * 64, np.frombuffer(pixels, np.uint8).reshape(16, 1176))
        try:  # the same pixels under a hash vLLM has not seen, from a file
            run("file", b"", msgspec.structs.replace(item, content_hash=os.urandom(32).hex(), shm=name))
            assert b"".join(o.token_ids for o in client.collect(["file"])["file"]) == with_pixels
        finally:
            shared.close()
    finally:
        client.close()


def test_resent_image_goes_to_the_engine_core_as_its_hash(stack):
    """vLLM's processor cache keys on the items' mm_hash, which is the workers' content hash: the second
    time an image comes, the worker sends it by hash, the bridge's sender cache knows vLLM's engine core
    holds it and sends no pixels; the output is the same. The bridge runs vLLM's cache in shared memory
    (its default where /dev/shm has room): what vLLM holds is its ring buffer there."""
    _, engine, front = stack
    assert "mm_processor_cache_type shm" in engine.log()
    messages = CASES["768x1024"]
    seen = engine.log().count("already in vLLM's processor cache")
    by_hash = _sent(front, "by_hash")
    first = _greedy(front.url, messages)
    second = _greedy(front.url, messages)
    assert second == first
    assert engine.log().count("already in vLLM's processor cache") > seen, engine.log()[-3000:]
    assert (
        _sent(front, "by_hash") > by_hash
    )  # and the worker sent it so (images.by_hash): no pixels through the gateway


def _sent(front, how: str) -> float:
    """tokenmill_images_sent_<how>_total: pixels, by_hash or shared_memory."""
    _, _, text = http("GET", front.url + "/metrics")
    text = text.decode() if isinstance(text, bytes) else str(text)
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(f"tokenmill_images_sent_{how}_total{{")
    )
