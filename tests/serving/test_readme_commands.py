"""The README's quick start runs as written: the server its serve command starts answers the exact curl
body it shows with a 200, its Python example streams a reply, and every `tokenmill` subcommand, bench
scenario and flag its commands name exists.

The serve command is `./scripts/serve.sh [ARGS]`, which makes a virtual environment and then runs
`tokenmill serve ARGS`: here the `tokenmill serve` part runs (conftest's Server, on a free port instead
of 8000, which the README's URLs are rewritten to)."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys

from conftest import ROOT, Server, http

from tokenmill.gateway.settings import ServeSettings

README = (ROOT / "README.md").read_text(encoding="utf-8")
DEFAULT_URL = "http://127.0.0.1:8000"


def fenced(text: str) -> list[tuple[str, str]]:
    """(language, body) of every fenced block."""
    return [(m.group(1), m.group(2)) for m in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.M | re.S)]


def shell_lines(text: str) -> list[str]:
    """The commands of the bash blocks, continuation lines joined, comments dropped."""
    lines = []
    for lang, body in fenced(text):
        if lang == "bash":
            for line in body.replace("\\\n", " ").splitlines():
                line = line.split(" #", 1)[0].strip()
                if line and not line.startswith("#"):
                    lines.append(line)
    return lines


def quick_start() -> tuple[list[str], str, bytes, dict, str]:
    """The serve command's arguments, and the curl's URL, body and headers, and the Python example."""
    serve = next(line for line in shell_lines(README) if line.startswith("./scripts/serve.sh"))
    curl = shlex.split(next(line for line in shell_lines(README) if line.startswith("curl ")))
    url = next(arg for arg in curl if arg.startswith("http"))
    body = curl[curl.index("-d") + 1].encode()
    headers = dict(h.split(": ", 1) for h in (curl[i + 1] for i, arg in enumerate(curl) if arg == "-H"))
    python = next(body for lang, body in fenced(README) if lang == "python")
    return shlex.split(serve)[1:], url, body, headers, python


def code_text(text: str) -> str:
    """The commands the README writes as code: its shell lines and its inline code spans."""
    return "\n".join(shell_lines(text) + re.findall(r"`([^`\n]+)`", text))


def help_of(*command: str) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "tokenmill.cli", *command, "--help"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_the_quick_start_serves_the_chat_it_shows():
    args, url, body, headers, python = quick_start()
    defaults = ServeSettings()
    # the README's URLs are where its serve command listens by default
    assert url.startswith(DEFAULT_URL + "/") and f"http://{defaults.host}:{defaults.port}" == DEFAULT_URL
    assert DEFAULT_URL in python
    srv = Server(*args)
    try:
        status, _, answer = http("POST", url.replace(DEFAULT_URL, srv.url), body, headers)
        assert status == 200, answer
        assert answer["object"] == "chat.completion" and answer["choices"][0]["message"]["content"], answer
        example = subprocess.run(
            [sys.executable, "-c", python.replace(DEFAULT_URL, srv.url)], capture_output=True, text=True, timeout=120
        )
        assert example.returncode == 0, example.stderr
        assert example.stdout.strip(), "the Python example printed nothing"
    finally:
        srv.stop()


def test_tokenmill_help_lists_every_subcommand_the_readme_names():
    code = code_text(README)
    named = set(re.findall(r"(?<![\w/.-])tokenmill ([a-z][a-z-]*)", code))
    assert {"serve", "engine", "bench"} <= named
    listed = set(re.findall(r"^    ([a-z][a-z-]*)\b", help_of(), re.M))
    assert named <= listed, f"tokenmill --help does not list {sorted(named - listed)}"
    scenarios = set(re.findall(r"tokenmill bench ([a-z_]+)", code))
    bench_help = help_of("bench")
    missing = sorted(s for s in scenarios if not re.search(rf"^\s+{s}\b", bench_help, re.M))
    assert not missing, f"tokenmill bench --help does not list {missing}"


def test_every_flag_the_readme_passes_exists():
    """The flags of its `./scripts/serve.sh`, `tokenmill serve`, `tokenmill engine` and `tokenmill bench
    SCENARIO` commands, against each command's --help."""
    helps: dict[tuple, str] = {}
    checked = 0
    for line in shell_lines(README) + re.findall(r"`((?:tokenmill|\./scripts/serve\.sh) [^`\n]*)`", README):
        words = shlex.split(line)
        if words[0] == "./scripts/serve.sh":
            command: tuple = ("serve",)
        elif words[0] == "tokenmill" and len(words) > 1 and words[1] in ("serve", "engine"):
            command = (words[1],)
        elif words[0] == "tokenmill" and len(words) > 2 and words[1] == "bench" and not words[2].startswith("-"):
            command = ("bench", words[2])
        else:
            continue
        if command not in helps:
            helps[command] = help_of(*command)
        for flag in (w.split("=", 1)[0] for w in words if w.startswith("--")):
            assert re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", helps[command]), (
                f"{line!r}: tokenmill {' '.join(command)} has no {flag}"
            )
            checked += 1
    assert checked >= 10  # (the README's commands were found)
