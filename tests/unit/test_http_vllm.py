"""The vLLM flavour of the http bridge (engines/http_backend.py) without a server: the bad words it hands
vLLM's token-in API, which takes words and tokenizes them itself, recovered from the token sequences the
workers made; and what the operator's word about the servers (priority scheduling, a KV connector) turns on.
tests/serving/test_engine_url.py runs the same code through `tokenmill serve` against a stand-in server, and
tests/engines/test_vllm_field_parity.py against a real vLLM."""

from __future__ import annotations

import dataclasses
import json

import pytest

from tokenmill.engines.bridge import EngineRejected, EngineRequest
from tokenmill.engines.http_backend import HTTPBackend
from tokenmill.scheduler_client.protocol import FEATURE_KV_TRANSFER_PARAMS, FEATURE_PRIORITY, SamplingParams
from tokenmill.tokenizer_workers.generation_params import bad_words_ids


@pytest.fixture(scope="module")
def backend() -> HTTPBackend:
    return HTTPBackend("http://127.0.0.1:9")  # the embedded default model; no server is asked anything


def test_bad_words_go_as_the_words_their_tokens_came_from(backend):
    tokenizer = backend.served_model().tokenizer
    # as the workers make them: a word alone and after a space, leading spaces stripped, duplicates dropped
    words = ["river", "  mill wheel", "它是一种", "folks", "river", "<｜end▁of▁sentence｜>"]
    sequences = bad_words_ids(words, tokenizer, backend.vocab_limit)
    assert len(sequences) > len(set(words))  # some words banned in both forms
    assert backend.bad_words_text(sequences) == ["river", "mill wheel", "它是一种", "folks", "<｜end▁of▁sentence｜>"]
    # and tokenized again as vLLM does, the words give the very sequences that came
    again = bad_words_ids(backend.bad_words_text(sequences), tokenizer, backend.vocab_limit)
    assert sorted(again) == sorted(sequences)


def test_a_sequence_no_word_tokenizes_to_is_refused_naming_bad_words(backend):
    """The protocol allows any token sequence; vLLM's API only words. A sequence cut inside a character
    decodes to U+FFFD, which tokenizes to something else; one word's tokens followed by another's first
    token comes back as the two joined, which vLLM would also ban after a space."""
    tokenizer = backend.served_model().tokenizer
    bytes_of_one_character = tokenizer.encode("𝔘", add_special_tokens=False).ids
    assert len(bytes_of_one_character) == 3
    river = tokenizer.encode("river", add_special_tokens=False).ids
    for sequences in ([bytes_of_one_character[:2]], [[*river, bytes_of_one_character[0]]], [river, [3128]]):
        with pytest.raises(EngineRejected) as info:
            backend.bad_words_text(sequences)
        assert info.value.param == "bad_words", sequences
    # whole, as the workers send it (alone and, where it tokenizes otherwise, after a space), it is the word
    assert backend.bad_words_text(bad_words_ids(["𝔘"], tokenizer, backend.vocab_limit)) == ["𝔘"]


def test_priority_and_kv_transfer_params_only_where_the_operator_says_the_servers_honour_them():
    request = EngineRequest(
        rid="r",
        prompt=[1, 2, 3],
        max_new_tokens=2,
        sampling=SamplingParams(),
        stop_token_ids=[],
        ignore_eos=False,
        priority=4,
        kv_transfer_params={"do_remote_decode": True},
    )
    plain = HTTPBackend("http://127.0.0.1:9")
    assert not {FEATURE_PRIORITY, FEATURE_KV_TRANSFER_PARAMS} & plain.features()
    told = HTTPBackend("http://127.0.0.1:9", scheduling_policy="priority", kv_connector=True)
    assert {FEATURE_PRIORITY, FEATURE_KV_TRANSFER_PARAMS} <= told.features()
    told.model = "m"
    body = json.loads(told.body(request))
    assert (body["priority"], body["kv_transfer_params"], body["stream"]) == (4, {"do_remote_decode": True}, False)


def test_images_go_as_files_of_their_resized_pixels_with_one_placeholder_each(tmp_path):
    """The token-in API takes image files and expands each image's one placeholder itself: the bridge
    turns the workers' pixels back into the resized image (a PNG data URL, the content hash as its uuid)
    and each placeholder run into its one token; another dtype is refused naming images."""
    import base64
    import io

    import numpy as np
    from image_model import make_vl_model
    from PIL import Image

    from tokenmill.scheduler_client.protocol import FEATURE_IMAGES, ImageItem
    from tokenmill.tokenizer_workers.images import processor_for

    model = make_vl_model(tmp_path)
    backend = HTTPBackend("http://127.0.0.1:9", model_dir=str(model))
    assert FEATURE_IMAGES in backend.features()
    assert FEATURE_IMAGES not in HTTPBackend("http://127.0.0.1:9").features()  # a text-only model
    processor = processor_for(model)
    rng = np.random.default_rng(3)
    images = [
        processor.process(Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)), f"{i}" * 64)
        for i, (h, w) in enumerate([(60, 90), (40, 30)])
    ]
    pad = 151655
    prompt, items = [1, 2], []
    for image in images:
        items.append(
            (
                ImageItem(
                    image.family,
                    "uint8",
                    list(image.pixels.shape),
                    list(image.grid_thw),
                    len(prompt) + 1,
                    image.tokens,
                    image.content_hash,
                ),
                memoryview(image.pixels.tobytes()),
            )
        )
        prompt += [151652, *[pad] * image.tokens, 151653, 7]
    request = EngineRequest(
        rid="r",
        prompt=prompt,
        max_new_tokens=2,
        sampling=SamplingParams(),
        stop_token_ids=[],
        ignore_eos=False,
        images=items,
    )
    ids, parts = backend.images_as_files(request)
    assert ids == [1, 2, 151652, pad, 151653, 7, 151652, pad, 151653, 7]
    assert [p["uuid"] for p in parts] == ["0" * 64, "1" * 64]
    for part, image in zip(parts, images, strict=True):
        png = Image.open(io.BytesIO(base64.b64decode(part["url"].split(",", 1)[1])))
        assert png.format == "PNG" and part["url"].startswith("data:image/png;base64,")
        again = processor.process(png.convert("RGB"), "x")
        assert np.array_equal(again.pixels, image.pixels) and again.grid_thw == image.grid_thw
    item, frame = items[0]
    as_float = ImageItem(item.family, "float32", item.shape, item.grid_thw, item.offset, item.length, item.content_hash)
    with pytest.raises(EngineRejected) as info:
        backend.images_as_files(dataclasses.replace(request, images=[(as_float, frame)]))
    assert info.value.param == "images"
