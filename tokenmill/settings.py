"""Settings of ``tokenmill serve``: one table gives each flag, its TOKENMILL_* variable and TOML key.

Precedence: command-line flag, then environment variable, then ``--config FILE`` (TOML),
then the default shown in ``--help``.
"""

from __future__ import annotations

import argparse
import json
import os
import tomllib
from dataclasses import fields
from typing import Any

from tokenmill.gateway.settings import ServeSettings
from tokenmill.tokenizer_workers.output_parsers import REASONING_PARSERS, TOOL_PARSERS

__all__ = ["ServeSettings", "OPTIONS", "CHOICES", "add_arguments", "resolve", "as_dict", "reference"]


def _bool(text: str) -> bool:
    value = str(text).strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"not a boolean: {text!r}")


def _kwargs(text) -> dict:
    value = json.loads(text) if isinstance(text, str) else text
    if not isinstance(value, dict):
        raise ValueError("expected a JSON object")
    return value


# name -> (type, help); defaults come from ServeSettings.
OPTIONS: dict[str, tuple[Any, str]] = {
    "model": (
        str,
        "HuggingFace model directory (tokenizer.json, tokenizer_config.json, ...). Default: the embedded DeepSeek-V4 tokenizer.",
    ),
    "host": (str, "Address to listen on."),
    "port": (int, "Port to listen on."),
    "gateways": (
        int,
        "Gateway processes sharing the port (SO_REUSEPORT), each with its own event loop and "
        "scheduler sessions, all sharing the tokenizer workers; /metrics on any shows the node's totals.",
    ),
    "gateway_stall_timeout": (
        float,
        "With --gateways above 1: seconds a gateway's event loop may go without answering "
        "gateway 0's pings before it is killed and replaced (0 = never; systemd's watchdog "
        "covers gateway 0).",
    ),
    "loop_rt_priority": (
        int,
        "SCHED_FIFO priority for each gateway's event-loop thread where the process may use it (root, "
        "CAP_SYS_NICE, or systemd's LimitRTPRIO=); elsewhere the loop_slice_us slice applies (0 = never "
        "real-time). The loop then preempts an engine's CPU threads the moment a request arrives; it does "
        "no conversion, so it takes little CPU.",
    ),
    "loop_slice_us": (
        int,
        "CPU time slice in microseconds that each gateway's event-loop thread asks the kernel for "
        "(Linux 6.12 and later; no privilege needed; 0 = the kernel's default). A short slice lets the "
        "loop preempt an engine or a conversion thread the moment a request arrives, so /health and "
        "streams stay prompt on cores the engine keeps busy; its CPU share is unchanged.",
    ),
    "workers": (
        int,
        "Tokenizer worker processes (0 = CPU count minus one, at least one; with --remote-workers, "
        "0 = none: only remote workers convert).",
    ),
    "conversion_threads": (
        int,
        "Requests each tokenizer worker converts at once, one thread each, sharing its "
        "tokenization cache: a long prompt starts beside another instead of waiting for it.",
    ),
    "tokenizer_threads": (
        int,
        "Threads of the tokenizers library's pool in each local tokenizer worker, which encodes a long "
        "prompt's pieces in parallel (0 = RAYON_NUM_THREADS if set, else the CPUs allowed minus one: "
        "one core stays the engine's, whose streams otherwise wait while a long prompt converts).",
    ),
    "conversion_nice": (
        int,
        "Niceness (0-19) the workers' conversion threads add to their process's. 0 shares the "
        "CPU evenly with an engine that keeps cores busy; above 0, conversion takes what the "
        "engine leaves (docs/design/cpu-sharing.md).",
    ),
    "worker_group_nice": (
        int,
        "Niceness (-20 to 19) of each tokenizer worker's scheduling group (its session's autogroup), "
        "set where permitted (root, CAP_SYS_NICE, or systemd's LimitNICE=); 0 leaves the kernel's. "
        "Below 0 a long prompt takes the cores from an engine that keeps them busy while it converts, "
        "as vLLM's own server does, and an idle worker costs nothing. No effect inside a cgroup with "
        "the cpu controller (use the unit's CPUWeight=) (docs/design/cpu-sharing.md).",
    ),
    "scheduler": (
        str,
        "Scheduler endpoint (ipc:// or tcp://); repeat the flag, or separate with commas, for "
        "data-parallel ranks (each request goes to one). Default: start the simulated scheduler.",
    ),
    "engine_url": (
        str,
        "An engine server to serve from over its token-in/token-out HTTP API (vllm serve "
        "--enable-scale-out, or SGLang's server), e.g. http://10.0.0.5:8000; repeat the flag, or separate with commas, "
        "for replicas (each a data-parallel rank). Each gets a bridge process on this host, which "
        "checks the server's model and tokenization first. Instead of --scheduler.",
    ),
    "engine_flavour": (
        str,
        "The --engine-url servers' API: vllm (vllm serve --enable-scale-out: /inference/v1/generate), "
        "sglang (SGLang's server: /generate), or auto (each bridge asks its server: SGLang answers "
        "/model_info).",
    ),
    "engine_scheduling_policy": (
        str,
        "How the --engine-url vLLM servers order waiting requests (their --scheduling-policy, which their API "
        "does not tell): priority passes each request's priority on; fcfs refuses a non-zero one with a 400 "
        "(the server would ignore it). SGLang's servers say theirs.",
    ),
    "engine_kv_connector": (
        _bool,
        "The --engine-url vLLM servers run a KV connector (their --kv-transfer-config): requests' "
        "kv_transfer_params go to them, and what the connector returns comes back; without it they are a 400.",
    ),
    "chat_template": (str, "Chat template file that overrides the model's."),
    "max_model_len": (int, "Context length. Default: from config.json or tokenizer_config.json."),
    "served_model_name": (str, "Model name clients must use. Default: the model directory's name."),
    "default_chat_template_kwargs": (
        _kwargs,
        "JSON object of template variables for every request (a request's chat_template_kwargs win).",
    ),
    "chat_template_content_format": (
        str,
        "How list-of-parts message content reaches the template: auto, string, or openai.",
    ),
    "trust_request_chat_template": (_bool, "Accept a chat_template given in a request."),
    "runtime_dir": (
        str,
        "Directory for ipc:// sockets (mode 0700). Default: $RUNTIME_DIRECTORY or a new temporary directory.",
    ),
    "remote_workers": (
        str,
        "Endpoint (tcp://ADDR:PORT) where tokenizer workers on other hosts join the pool "
        "(`tokenmill worker --connect`); CURVE keys from --curve-keys-dir (docs/operations/security.md).",
    ),
    "remote_worker_timeout": (
        float,
        "Seconds of silence after which a remote worker counts as lost (its conversion "
        "is dispatched again, its streams end with an error).",
    ),
    "api_key": (str, "Require 'Authorization: Bearer KEY' (or 'x-api-key: KEY') on /v1/*, /tokenize and /detokenize."),
    "max_body_bytes": (int, "Largest request body accepted (413 above)."),
    "max_queued_conversions": (int, "Requests allowed to wait for a worker (429 above)."),
    "max_queued_bytes": (int, "Request body bytes allowed to wait for a worker (429 above)."),
    "conversion_timeout": (float, "Seconds one conversion may take before its worker is killed and replaced."),
    "worker_memory_limit_mb": (
        int,
        "Address-space cap per tokenizer worker; a runaway template gets MemoryError (0 = none).",
    ),
    "shutdown_timeout": (float, "Seconds SIGTERM waits for in-flight requests before aborting them."),
    "timeout_keep_alive": (int, "Seconds an idle keep-alive connection stays open."),
    "max_header_bytes": (int, "Largest total size of a request's headers (431 above)."),
    "body_timeout": (float, "Seconds a client may take to send its request body (408 after)."),
    "messages_ping_interval": (
        float,
        "Seconds between the 'ping' events a streamed /v1/messages request gets while its prompt "
        "converts (its stream starts at the first; 0 = none, the stream starts when conversion ends).",
    ),
    "header_timeout": (
        float,
        "Seconds a client may take from connecting, or from the first byte of its next request, "
        "to the end of the request's headers; the connection is closed after (slow loris; 0 = no limit).",
    ),
    "send_buffer_bytes": (
        int,
        "Kernel send buffer per client connection (SO_SNDBUF); 0 = the kernel's autotuning, "
        "which may hold up to net.ipv4.tcp_wmem's maximum (4 MiB) for a client that stops reading.",
    ),
    "stream_buffer_limit": (
        int,
        "Characters of generated text one client may leave unread; past it the request is "
        "aborted (code slow_client) and its connection closed (0 = no limit).",
    ),
    "stream_history_bytes": (
        int,
        "Token history (4 bytes a token) the gateway keeps per streaming choice so that the stream moves to "
        "another tokenizer worker if its own dies; a longer stream fails with worker_died then (0 = no failover).",
    ),
    "stream_failover_wait": (
        float,
        "Seconds a stream whose tokenizer worker died while no other was alive waits for one to be ready "
        "(a replacement) to go on there; it fails with worker_died after (0 = at once).",
    ),
    "insecure_tcp": (_bool, "Allow tcp:// scheduler or remote-worker endpoints without CURVE encryption."),
    "curve_keys_dir": (
        str,
        "Directory with CURVE keys for a tcp:// scheduler, and for remote workers (see docs/operations/security.md).",
    ),
    "tokenize_cache_bytes": (
        int,
        "Per-worker byte budget of the exact tokenization cache: three quarters for "
        "pieces, one quarter for recent whole prompts (0 = off). A worker's threads share it.",
    ),
    "image_cache_bytes": (
        int,
        "Per-worker byte budget of processed images kept by content hash (a resent image is not processed again).",
    ),
    "image_max_pixels": (
        int,
        "Largest image (width x height) a worker decodes; checked from the header before decoding "
        "(decompression bombs).",
    ),
    "image_shared_memory": (
        _bool,
        "Hand processed images to a scheduler on this host as files in /dev/shm that it maps (protocol "
        "images.shm), not in frames through the gateway; used only where the scheduler lists the feature.",
    ),
    "image_fetch": (
        _bool,
        "Fetch http(s) image URLs (off: only base64 data: URLs are taken; docs/operations/security.md).",
    ),
    "image_fetch_timeout": (float, "Seconds one image fetch may take in all, redirects included."),
    "image_fetch_max_bytes": (int, "Largest image body fetched from a URL."),
    "image_fetch_max_redirects": (int, "Redirects one image fetch may follow (each hop's address checked again)."),
    "image_fetch_allow": (
        str,
        "Comma-separated networks (CIDR) image URLs may resolve to although private, loopback or link-local.",
    ),
    "verify_tokenize_cache": (
        _bool,
        "Also tokenize every chat prompt whole and count mismatches (slow; for checking).",
    ),
    "affinity": (_bool, "Send requests of one conversation to the worker that holds its cached segments."),
    "quick_conversion_bytes": (
        int,
        "Request bodies up to this size are converted by a worker's IO thread at once, "
        "without waiting for a free worker or the tokenization cache (0 = never).",
    ),
    "quick_turn_bytes": (
        int,
        "A conversation's next turn up to this size, at most --quick-conversion-bytes larger than "
        "its last turn, is converted at once by the IO thread of the worker that holds its cache "
        "(most of it is cached: cheaper than a hand-off to a conversion thread; 0 = never).",
    ),
    "dp_policy": (
        str,
        "With several --scheduler ranks: affinity (a conversation stays on the rank holding its "
        "prefix cache, within 1.25x a fair share of the load), least_loaded, or round_robin.",
    ),
    "generation_config": (
        str,
        "Where a request's sampling defaults come from when it leaves them out: auto (the model's "
        "generation_config.json: temperature, top_p, top_k, min_p, repetition_penalty, and max_new_tokens "
        "as the default max_tokens, as vLLM's servers apply them) or vllm (the API's own defaults: "
        "temperature 1, no limit but the context; vLLM's --generation-config vllm).",
    ),
    "max_n": (int, "The most choices (n) one request may ask for; each is a scheduler request (OpenAI allows 128)."),
    "tool_call_parser": (
        str,
        "Parse tool calls out of chat outputs into tool_calls: a format (hermes, qwen3_coder, "
        "llama3_json, mistral, deepseek_v3, deepseek_v31, deepseek_v4, kimi_k2, glm45, openai), "
        "auto (from the chat template), or none. Default: auto for the embedded model, else none.",
    ),
    "reasoning_parser": (
        str,
        "Separate reasoning from content: deepseek_r1, deepseek_v3, qwen3, glm45, kimi_k2, "
        "openai_gptoss, granite, auto, or none. Default: auto for the embedded model, else none.",
    ),
    "conversion_mode": (str, "pool (worker processes), or the benchmark baselines inline and thread."),
    "sim_prefill_tokens_per_s": (float, "Simulated scheduler: prefill speed."),
    "sim_inter_token_latency_ms": (float, "Simulated scheduler: time between decode steps."),
    "sim_max_running": (int, "Simulated scheduler: requests decoded together (the rest wait)."),
    "sim_max_model_len": (int, "Simulated scheduler: the engine's context length, reported in its Welcome (0 = none)."),
    "sim_busy_cores": (
        int,
        "Simulated scheduler: cores kept busy while any request runs, as a GPU engine's CPU side spins (0 = none).",
    ),
    "sim_tokens_per_step": (
        int,
        "Simulated scheduler: tokens per request per decode step (speculative decoding emits several).",
    ),
    "sim_mode": (str, "Simulated scheduler: random tokens, or echo the prompt."),
    "sim_replies": (
        str,
        'Simulated scheduler: script replies from a JSONL file of {"match": "...", "text": "..."} '
        "(docs/engines/scheduler-protocol.md §10).",
    ),
    "log_level": (str, "debug, info, warning or error."),
}
_PARSER_NAMES = ("auto", "none")
CHOICES = {
    "tool_call_parser": (*_PARSER_NAMES, *TOOL_PARSERS),
    "reasoning_parser": (*_PARSER_NAMES, *REASONING_PARSERS),
    "chat_template_content_format": ("auto", "string", "openai"),
    "conversion_mode": ("pool", "inline", "thread"),
    "dp_policy": ("affinity", "least_loaded", "round_robin"),
    "generation_config": ("auto", "vllm"),
    "engine_flavour": ("auto", "vllm", "sglang"),
    "engine_scheduling_policy": ("fcfs", "priority"),
    "sim_mode": ("random", "echo"),
    "log_level": ("debug", "info", "warning", "error"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="TOML file of settings (keys as the flags, with underscores).")
    defaults = ServeSettings.__dataclass_fields__
    for name, (kind, text) in OPTIONS.items():
        default = defaults[name].default
        env = "TOKENMILL_" + name.upper()
        flag = "--" + name.replace("_", "-")
        help_text = f"{text} [env {env}; default: {default if default not in (None, '') else 'none'}]"
        if kind is _bool:
            parser.add_argument(flag, dest=name, nargs="?", const=True, type=_bool, default=None, help=help_text)
        elif name in ("scheduler", "engine_url"):
            parser.add_argument(flag, dest=name, action="append", default=None, help=help_text)
        else:
            parser.add_argument(flag, dest=name, type=kind, default=None, choices=CHOICES.get(name), help=help_text)


REMOVED = {  # settings earlier versions took: why they are gone, for an operator upgrading a config file
    "worker_endpoint": "is no longer a setting: the gateway reaches the workers it spawns over a socket pair, "
    "which needs no endpoint; workers on other hosts join with remote_workers (docs/operations/security.md)",
}


def resolve(args: argparse.Namespace, environ=os.environ) -> ServeSettings:
    values: dict[str, Any] = {}
    if getattr(args, "config", None):
        with open(args.config, "rb") as f:
            data = tomllib.load(f)
        for name in sorted(set(data) & set(REMOVED)):
            raise SystemExit(f"{args.config}: {name} {REMOVED[name]}")
        unknown = sorted(set(data) - set(OPTIONS))
        if unknown:
            raise SystemExit(f"{args.config}: unknown settings {unknown}")
        values.update({k: OPTIONS[k][0](v) if OPTIONS[k][0] in (_kwargs,) else v for k, v in data.items()})
    for name, (kind, _) in OPTIONS.items():
        env = environ.get("TOKENMILL_" + name.upper())
        if env is not None and env != "":
            try:
                values[name] = kind(env)
            except ValueError as exc:
                raise SystemExit(f"TOKENMILL_{name.upper()}: {exc}") from None
        flag = getattr(args, name, None)
        if flag is not None:
            values[name] = flag
    for repeatable in ("scheduler", "engine_url"):  # a repeated flag, or a TOML list
        if isinstance(values.get(repeatable), list):
            values[repeatable] = ",".join(values[repeatable])
    for name, allowed in CHOICES.items():
        if name in values and values[name] not in allowed:
            raise SystemExit(f"{name} must be one of {allowed}, got {values[name]!r}")
    return ServeSettings(**values)


def as_dict(settings: ServeSettings) -> dict:
    return {f.name: getattr(settings, f.name) for f in fields(settings)}


def _shown(value: Any) -> str:
    if value is None or value == "":
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return json.dumps(value) if value else "{}"
    return str(value)


def reference() -> str:
    """docs/serving/settings.md, from this table: every flag with its variable, TOML key, default and
    meaning (tests/unit/test_settings_reference.py fails when the file and the table differ)."""
    defaults = ServeSettings.__dataclass_fields__
    lines = [
        "# `tokenmill serve` settings",
        "",
        "Generated from the option table in `tokenmill/settings.py` by `python -m tokenmill.settings`;",
        "`tests/unit/test_settings_reference.py` fails when this file and the code differ.",
        "",
        "Each setting is a flag, a `TOKENMILL_*` environment variable, or a key of the TOML file given",
        "with `--config FILE` (the flag's name with underscores). A flag beats the variable, the variable",
        "beats the file, the file beats the default. Boolean flags take no value (`--affinity`) or one",
        "(`--affinity false`); variables and TOML take `true`/`false` (variables also `1`/`0`, `yes`/`no`).",
        "",
        "| Flag | Environment variable | TOML key | Default | Meaning |",
        "|---|---|---|---|---|",
    ]
    for name, (_, text) in OPTIONS.items():
        default = defaults[name].default
        if name == "workers" and default == 0:
            shown = "0 (CPU count minus one, at least one)"
        else:
            shown = _shown(default)
        meaning = text
        if name in CHOICES:
            meaning += " One of: " + ", ".join(f"`{c}`" for c in CHOICES[name]) + "."
        if name == "scheduler":
            meaning += " Repeatable (a TOML list, or a comma-separated variable)."
        lines.append(
            f"| `--{name.replace('_', '-')}` | `TOKENMILL_{name.upper()}` | `{name}` | `{shown}` | "
            f"{meaning.replace('|', chr(92) + '|')} |"
        )
    lines += [
        "",
        "Settings that older versions took and this one refuses, with the reason given:",
        "",
        *(f"- `{name}`: {why}." for name, why in REMOVED.items()),
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    print(reference(), end="")
