"""The code and the docs say what is true now, in their own words: no issue numbers, development
sessions or branch names, which nobody who clones the repository can look up (git history holds
them). The docs also carry no dates of experiments: a figure names its machine and the command that
reproduces it, not the day it was measured.

Checked: the code, its tests, scripts, deploy files and pyproject.toml for history words; README.md
and every docs/**/*.md for history words and dates."""

from __future__ import annotations

import re
import subprocess

from conftest import ROOT

HISTORY = re.compile(
    # another project's public tracker may be cited by name: "vLLM issues #44873"
    r"(?<!vLLM )(?<!SGLang )(?<!transformers )(?<!uvicorn )\bissues? ?#?\d+\b"
    r"|\b(earlier|later|latest|previous|last|next|first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth)"
    r" sessions?\b"
    r"|\bbranch [a-z]+\d+\b",
    re.I,
)
DATE = re.compile(r"\b(19|20)\d\d-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])\b")
CODE = ("gateway", "tokenizer_workers", "scheduler_client", "engines", "tokenmill", "tests", "scripts", "deploy", ".ci")


def tracked(*paths: str) -> list[str]:
    """Files git tracks or would track (new ones not yet added count; ignored ones do not)."""
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard", *paths],
        cwd=ROOT,
        capture_output=True,
        check=True,
        timeout=60,
    )
    return sorted({name for name in out.stdout.decode().split("\0") if name and (ROOT / name).is_file()})


def doc_files() -> list[str]:
    return [name for name in tracked("README.md", "docs") if name.endswith(".md")]


def history_words(names: list[str], pattern: re.Pattern = HISTORY) -> list[str]:
    found = []
    for name in names:
        try:
            text = (ROOT / name).read_text(encoding="utf-8")
        except (UnicodeDecodeError, IsADirectoryError, FileNotFoundError):
            continue
        for number, line in enumerate(text.splitlines(), 1):
            if pattern.search(line):
                found.append(f"{name}:{number}: {line.strip()[:160]}")
    return found


def test_the_code_names_no_issue_session_or_branch():
    names = [
        name for name in tracked(*CODE, "pyproject.toml") if name != "tests/unit/test_no_history.py"
    ]  # (its probes)
    assert len(names) > 200  # (the listing found the code)
    found = history_words(names)
    assert not found, "say what and why instead:\n" + "\n".join(found)


def test_the_docs_name_no_issue_session_branch_or_date():
    names = doc_files()
    assert "README.md" in names and len(names) > 20  # (the listing found the docs)
    found = history_words(names)
    assert not found, "say what is true now, and why, instead:\n" + "\n".join(found)
    dated = history_words(names, DATE)
    assert not dated, "a figure carries its machine and command, not its day:\n" + "\n".join(dated)


def test_the_check_finds_what_it_looks_for(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(
        "x = 1  # fixed in issue 33\n# as a later session measured\n# see branch pixels34\n# a session of its own\n"
        "six full runs (this README's latest session)\n"
        "an engine session, and vLLM issues #44873\n"
    )
    found = history_words([str(probe)])
    assert [line.split(": ", 1)[1] for line in found] == [
        "x = 1  # fixed in issue 33",
        "# as a later session measured",
        "# see branch pixels34",
        "six full runs (this README's latest session)",
    ]
    notes = tmp_path / "notes.md"
    notes.write_text(
        "## Images (2026-12-05, third session)\n"
        "measured on 2026-11-29\n"
        "a 2-core VM, `tokenmill bench vllm --images`\n"
        "protocol version 1.2, 10.0.0.5:5600, 2026-13-45\n"
    )
    dated = history_words([str(notes)], DATE)
    assert [line.split(": ", 1)[1] for line in dated] == [
        "## Images (2026-12-05, third session)",
        "measured on 2026-11-29",
    ]
    assert len(history_words([str(notes)])) == 1  # (the session, on the first line)
