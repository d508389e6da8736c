"""The docs are checked like code: every relative link in README.md, docs/**/*.md and deploy/README.md
leads to a file of the repository (and, into a markdown page, to one of its headings), and every
repository path they name (docs/..., deploy/..., tests/..., gateway/app.py, ...) exists. Paths are
looked up among the files git tracks or would track, not on the disk, so a file that exists only in
this checkout (a build output, an ignored link) does not count."""

from __future__ import annotations

import fnmatch
import posixpath
import re
import subprocess

from conftest import ROOT

TOP = (
    "docs",
    "deploy",
    "tests",
    "scripts",
    "gateway",
    "engines",
    "tokenizer_workers",
    "scheduler_client",
    "tokenmill",
    ".ci",
)
# a repository path: one of the top folders, then a path; not inside another path, a URL or ~/$VAR/@pkg
REPO_PATH = re.compile(r"(?<![\w./~$@%{}:-])((?:" + "|".join(re.escape(t) for t in TOP) + r")/[\w.@%*/-]*)")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def repo_files() -> set[str]:
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
        timeout=60,
    )
    return {name for name in out.stdout.decode().split("\0") if name and (ROOT / name).is_file()}


def folders(files: set[str]) -> set[str]:
    found = set()
    for name in files:
        parts = name.split("/")[:-1]
        for i in range(1, len(parts) + 1):
            found.add("/".join(parts[:i]))
    return found


def doc_pages(files: set[str]) -> list[str]:
    return sorted(
        name for name in files if name == "README.md" or name == "deploy/README.md" or re.match(r"docs/.*\.md$", name)
    )


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (but - and _), spaces to -."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).lower()
    text = "".join(ch for ch in text if ch.isalnum() or ch in " -_")
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    found: set[str] = set()
    counts: dict[str, int] = {}
    fenced = False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        match = None if fenced else HEADING.match(line)
        if match:
            base = slug(match.group(2))
            n = counts.get(base, 0)
            counts[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
    return found


def exists(path: str, files: set[str], dirs: set[str]) -> bool:
    path = path.rstrip("/")
    if any(ch in path for ch in "*?["):
        return any(fnmatch.fnmatchcase(name, path) for name in files | dirs)
    return path in files or path in dirs


def problems(
    pages: list[str], files: set[str], read=lambda name: (ROOT / name).read_text(encoding="utf-8")
) -> list[str]:
    dirs = folders(files)
    texts: dict[str, str] = {}

    def text_of(name: str) -> str:
        if name not in texts:
            texts[name] = read(name)
        return texts[name]

    found = []
    for page in pages:
        base = posixpath.dirname(page)
        for number, line in enumerate(text_of(page).splitlines(), 1):
            where = f"{page}:{number}"
            for target in LINK.findall(line):
                if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                    continue
                path, _, anchor = target.partition("#")
                resolved = posixpath.normpath(posixpath.join(base, path)) if path else page
                if resolved.startswith("../") or not exists(resolved, files, dirs):
                    found.append(f"{where}: link to a missing file: {target}")
                    continue
                if anchor and resolved.endswith(".md") and anchor not in anchors(text_of(resolved)):
                    found.append(f"{where}: link to a missing heading: {target}")
            for path in REPO_PATH.findall(LINK.sub("", line)):
                path = path.rstrip(".")
                if not exists(path, files, dirs):
                    found.append(f"{where}: names a path that does not exist: {path}")
    return found


def test_every_link_and_path_in_the_docs_exists():
    files = repo_files()
    pages = doc_pages(files)
    assert "README.md" in pages and "deploy/README.md" in pages and len(pages) > 20
    found = problems(pages, files)
    assert not found, "fix these links and paths (write code paths from the repository's root):\n" + "\n".join(found)


def test_every_docs_page_is_in_the_index():
    files = repo_files()
    index = (ROOT / "docs" / "README.md").read_text(encoding="utf-8")
    linked = {posixpath.normpath(posixpath.join("docs", target.partition("#")[0])) for target in LINK.findall(index)}
    missing = sorted(name for name in doc_pages(files) if name.startswith("docs/") and name != "docs/README.md")
    missing = [name for name in missing if name not in linked]
    assert not missing, f"docs/README.md does not link to {missing}"


def test_the_check_finds_what_it_looks_for():
    files = {"README.md", "docs/a.md", "docs/b/c.md", "gateway/app.py", "tests/unit/test_x.py"}
    pages = {
        "README.md": "[a](docs/a.md) [c](docs/b/c.md#setup) [x](docs/gone.md) `gateway/app.py` and gateway/nope.py.\n",
        "docs/a.md": (
            "# A page\n\n## Its `setup` (now)\n\n```\n# not a heading\n```\n"
            "[up](../README.md) [self](#its-setup-now) [bad](#not-a-heading) [out](../../elsewhere.md)\n"
            "tests/unit/test_*.py, tests/unit/test_y*.py, /etc/tokenmill/x, https://x.org/docs/none.md\n"
        ),
        "docs/b/c.md": "# Setup\n[a](../a.md#a-page) [b](../a.md#missing)\n",
    }
    found = problems(sorted(pages), files, read=pages.__getitem__)
    assert found == [
        "README.md:1: link to a missing file: docs/gone.md",
        "README.md:1: names a path that does not exist: gateway/nope.py",
        "docs/a.md:8: link to a missing heading: #not-a-heading",
        "docs/a.md:8: link to a missing file: ../../elsewhere.md",
        "docs/a.md:9: names a path that does not exist: tests/unit/test_y*.py",
        "docs/b/c.md:2: link to a missing heading: ../a.md#missing",
    ]
