"""Codex CLI (npm @openai/codex) completes a task that needs a tool call through tokenmill's
/v1/responses, offline: the simulated scheduler plays scripted replies, so the "model" calls Codex's
exec_command tool to write a file, Codex runs it and sends the whole history back (store: false,
function_call and function_call_output items, its hosted and namespace tools, include
reasoning.encrypted_content), and the model's answer ends the task.

Codex is installed once into a cache outside the repository (TOKENMILL_AGENT_CACHE, default
~/.cache/tokenmill-agents); the test skips, saying why, without node/npm or when the install fails.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import Server

CODEX_VERSION = "0.169.1"
CACHE = Path(os.environ.get("TOKENMILL_AGENT_CACHE", Path.home() / ".cache" / "tokenmill-agents"))
B, E = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CB, CE, S = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
CONTENT = "tokenmill says hi"
COMMAND = f"printf '{CONTENT}' > hello.txt && echo written-ok-42"


def codex_binary() -> Path:
    if shutil.which("node") is None or shutil.which("npm") is None:
        pytest.skip("node and npm are needed to run Codex CLI (npm @openai/codex)")
    prefix = CACHE / f"codex-{CODEX_VERSION}"
    script = prefix / "node_modules" / "@openai" / "codex" / "bin" / "codex.js"
    if not script.exists():
        prefix.mkdir(parents=True, exist_ok=True)
        try:
            proc = subprocess.run(
                [
                    "npm",
                    "install",
                    "--no-audit",
                    "--no-fund",
                    "--prefix",
                    str(prefix),
                    f"@openai/codex@{CODEX_VERSION}",
                ],
                capture_output=True,
                text=True,
                timeout=300,
            )
        except subprocess.TimeoutExpired:
            pytest.skip("npm install @openai/codex did not finish within 300 s")
        if proc.returncode != 0 or not script.exists():
            pytest.skip(f"npm install @openai/codex@{CODEX_VERSION} failed: {proc.stderr[-500:]}")
    return script


def test_codex_writes_a_file_through_tokenmill(tmp_path):
    script = codex_binary()
    replies = tmp_path / "replies.jsonl"
    call = json.dumps({"cmd": COMMAND})
    with open(replies, "w", encoding="utf-8") as f:
        for match, text in [
            ("tokenmill-task-7", f"{B}{CB}exec_command{S}{call}{CE}{E}"),
            ("written-ok-42\n", "I wrote hello.txt."),
        ]:
            f.write(json.dumps({"match": match, "text": text}, ensure_ascii=False) + "\n")
    srv = Server("--workers", "1", "--sim-inter-token-latency-ms", "0", "--sim-replies", str(replies))
    try:
        home, work = tmp_path / "codex-home", tmp_path / "work"
        home.mkdir()
        work.mkdir()
        (home / "config.toml").write_text(
            'model = "deepseek-v4"\nmodel_provider = "tokenmill"\n'
            "[model_providers.tokenmill]\n"
            f'name = "tokenmill"\nbase_url = "{srv.url}/v1"\nenv_key = "TOKENMILL_KEY"\nwire_api = "responses"\n'
        )
        env = {
            **os.environ,
            "CODEX_HOME": str(home),
            "HOME": str(tmp_path),
            "TOKENMILL_KEY": "unused",
            "NO_COLOR": "1",
        }
        proc = subprocess.run(
            [
                "node",
                str(script),
                "exec",
                "--skip-git-repo-check",
                "--dangerously-bypass-approvals-and-sandbox",
                "--json",
                f"tokenmill-task-7: create hello.txt containing exactly '{CONTENT}'.",
            ],
            cwd=work,
            env=env,
            capture_output=True,
            text=True,
            timeout=180,
        )
        log = proc.stdout[-4000:] + proc.stderr[-4000:]
        assert proc.returncode == 0, log
        assert (work / "hello.txt").read_text() == CONTENT, log
        events = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
        messages = [e["item"]["text"] for e in events if e.get("item", {}).get("type") == "agent_message"]
        assert messages and messages[-1].endswith("I wrote hello.txt."), log
        assert events[-1]["type"] == "turn.completed", log
    finally:
        srv.stop()
