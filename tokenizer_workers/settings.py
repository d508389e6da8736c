"""What a tokenizer worker is told at start, and the names both the gateway and the workers use.

Kept apart from the worker's code on purpose: the gateway builds these settings, and its event-loop
process must not import what converting requests needs (numpy, tokenizers, jinja2, Pillow).
"""

from __future__ import annotations

from typing import Any

import msgspec

DEFAULT_MODEL_NAME = "deepseek-v4"  # the embedded default model's served name
SETTINGS_ENV = "TOKENMILL_WORKER_SETTINGS"  # a local worker's ConverterSettings, as JSON


class ImageFetchSettings(msgspec.Struct):
    """Fetching http(s) image URLs (images/fetch.py): off unless the server is started with --image-fetch."""

    enabled: bool = False
    timeout_s: float = 10.0  # the whole fetch, redirects included
    max_bytes: int = 20 << 20
    max_redirects: int = 3
    allow_networks: list[str] = []  # CIDRs allowed although private/loopback/link-local


class ConverterSettings(msgspec.Struct):
    """What a worker needs to know; the gateway hands it to each worker process as JSON."""

    model_dir: str | None = None
    chat_template_file: str | None = None
    served_model_name: str | None = None
    max_model_len: int | None = None
    default_chat_template_kwargs: dict[str, Any] = {}
    content_format: str = "auto"  # "auto" | "string" | "openai"
    trust_request_chat_template: bool = False
    tokenize_cache_bytes: int = 256 << 20
    verify_tokenize_cache: bool = False
    image_cache_bytes: int = 256 << 20  # processed images by content hash, per worker
    image_max_pixels: int = 50_000_000  # the largest image decoded (checked from its header)
    image_fetch: ImageFetchSettings = msgspec.field(default_factory=ImageFetchSettings)
    # pixels to a scheduler on this host through /dev/shm (protocol 1.2 images.shm); off in a remote worker
    image_shared_memory: bool = True
    tool_call_parser: str = ""  # a name in output_parsers.TOOL_PARSERS, "auto", or "" (none)
    reasoning_parser: str = ""
    max_n: int = 128  # the most choices one request may ask for (OpenAI's limit)
    # "auto": a request's sampling defaults come from the model's generation_config.json, as in vLLM's
    # servers; "vllm": the API's own defaults (vLLM's --generation-config vllm)
    generation_config: str = "auto"
    fingerprint: bool = False  # report Converter.fingerprint() when ready (the pool admits remote workers)
