"""Claude Code (npm @anthropic-ai/claude-code) completes a task that needs a tool call through
tokenmill's /v1/messages, offline, with the simulated scheduler playing scripted replies: it asks
for a file, the "model" calls Claude Code's Write tool, Claude Code writes the file and sends the
tool result back, and the model's last turn ends the task.

Claude Code is installed from npm into a cache folder outside the repository
($TOKENMILL_NPM_CACHE_DIR, default ~/.cache/tokenmill-tests/claude-code), once; the test skips,
saying why, when node/npm is missing or the install fails (no registry).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import Server

B, E = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CB, CE, S = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
VERSION = "2.1"


def claude_binary() -> Path:
    if shutil.which("node") is None or shutil.which("npm") is None:
        pytest.skip("node and npm are needed to install Claude Code (npm @anthropic-ai/claude-code)")
    cache = Path(os.environ.get("TOKENMILL_NPM_CACHE_DIR", Path.home() / ".cache" / "tokenmill-tests")) / "claude-code"
    package = cache / "node_modules" / "@anthropic-ai" / "claude-code"
    binary = cache / "node_modules" / ".bin" / "claude"
    if not binary.exists():
        cache.mkdir(parents=True, exist_ok=True)
        try:
            subprocess.run(
                [
                    "npm",
                    "install",
                    "--no-audit",
                    "--no-fund",
                    "--prefix",
                    str(cache),
                    f"@anthropic-ai/claude-code@{VERSION}",
                ],
                check=True,
                capture_output=True,
                timeout=600,
            )
        except (subprocess.SubprocessError, OSError) as exc:
            pytest.skip(f"could not install @anthropic-ai/claude-code from npm: {exc}")
    probe = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=60)
    if probe.returncode != 0:  # npm may not have run the post-install step that places the binary
        subprocess.run(["node", str(package / "install.cjs")], capture_output=True, timeout=300, cwd=package)
        probe = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=60)
    if probe.returncode != 0:
        pytest.skip(f"Claude Code does not run here: {probe.stderr[-300:]}")
    return binary


def test_claude_code_writes_a_file_through_a_tool_call(tmp_path):
    binary = claude_binary()
    work, home = tmp_path / "work", tmp_path / "home"
    work.mkdir()
    home.mkdir()
    target = work / "hello.txt"
    args = json.dumps({"file_path": str(target), "content": "tokenmill says hi\n"})
    replies = tmp_path / "replies.jsonl"
    replies.write_text(
        json.dumps({"match": "TASK-31-WRITE", "text": f"A file.</think>Writing it.{B}{CB}Write{S}{args}{CE}{E}"})
        + "\n"
        + json.dumps({"match": "File created successfully", "text": "Written.</think>The file is written."})
        + "\n",
        encoding="utf-8",
    )
    srv = Server(
        "--workers", "1", "--sim-inter-token-latency-ms", "0", "--sim-replies", str(replies), "--api-key", "k31"
    )
    try:
        model = "deepseek-v4"
        env = {
            "PATH": os.environ["PATH"],
            "HOME": str(home),
            "ANTHROPIC_BASE_URL": srv.url,
            "ANTHROPIC_API_KEY": "k31",  # sent as x-api-key
            "ANTHROPIC_MODEL": model,
            "ANTHROPIC_DEFAULT_OPUS_MODEL": model,
            "ANTHROPIC_DEFAULT_SONNET_MODEL": model,
            "ANTHROPIC_DEFAULT_HAIKU_MODEL": model,
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
            "DISABLE_TELEMETRY": "1",
            "DISABLE_ERROR_REPORTING": "1",
            "DISABLE_AUTOUPDATER": "1",
            "CLAUDE_CODE_ATTRIBUTION_HEADER": "0",
        }
        run = subprocess.run(
            [
                str(binary),
                "-p",
                "TASK-31-WRITE: create hello.txt",
                "--output-format",
                "json",
                "--allowedTools",
                "Write",
            ],
            cwd=work,
            env=env,
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert run.returncode == 0, (run.stdout[-2000:], run.stderr[-2000:])
        result = json.loads(run.stdout)
        assert result["subtype"] == "success" and not result["is_error"], result
        assert result["result"] == "The file is written." and result["num_turns"] == 2
        assert target.read_text() == "tokenmill says hi\n"
    finally:
        srv.stop()
