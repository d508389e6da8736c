"""The code says what is true now, in its own words: no issue numbers, development sessions or branch
names, which nobody who clones the repository can look up (git history holds them).

The code, its tests, scripts, deploy files and pyproject.toml are checked; README and docs/ are
checked by their own test."""

from __future__ import annotations

import re
import subprocess

from conftest import ROOT

HISTORY = re.compile(
    # another project's public tracker may be cited by name: "vLLM issues #44873"
    r"(?<!vLLM )(?<!SGLang )(?<!transformers )(?<!uvicorn )\bissues? ?#?\d+\b"
    r"|\b(earlier|later|previous|last|next|first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth) sessions?\b"
    r"|\bbranch [a-z]+\d+\b",
    re.I,
)
CODE = ("gateway", "tokenizer_workers", "scheduler_client", "engines", "tokenmill", "tests", "scripts", "deploy", ".ci")


def tracked(*paths: str) -> list[str]:
    out = subprocess.run(["git", "ls-files", "-z", *paths], cwd=ROOT, capture_output=True, check=True, timeout=60)
    return [name for name in out.stdout.decode().split("\0") if name]


def history_words(names: list[str]) -> list[str]:
    found = []
    for name in names:
        try:
            text = (ROOT / name).read_text(encoding="utf-8")
        except (UnicodeDecodeError, IsADirectoryError, FileNotFoundError):
            continue
        for number, line in enumerate(text.splitlines(), 1):
            if HISTORY.search(line):
                found.append(f"{name}:{number}: {line.strip()[:160]}")
    return found


def test_the_code_names_no_issue_session_or_branch():
    names = [
        name for name in tracked(*CODE, "pyproject.toml") if name != "tests/unit/test_no_history.py"
    ]  # (its probes)
    assert len(names) > 200  # (the listing found the code)
    found = history_words(names)
    assert not found, "say what and why instead:\n" + "\n".join(found)


def test_the_check_finds_what_it_looks_for(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(
        "x = 1  # fixed in issue 33\n# as a later session measured\n# see branch pixels34\n# a session of its own\n"
    )
    found = history_words([str(probe)])
    assert [line.split(": ", 1)[1] for line in found] == [
        "x = 1  # fixed in issue 33",
        "# as a later session measured",
        "# see branch pixels34",
    ]
