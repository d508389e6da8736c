#!/usr/bin/env bash
# Run the test suite: create ./.venv if needed, install the project with its test extras, run pytest.
# Arguments go to pytest (e.g. ./scripts/test.sh -k fidelity).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
if [ pyproject.toml -nt .venv/.installed-test ] || ! .venv/bin/python -c "import tokenmill, openai, transformers" 2>/dev/null; then
  .venv/bin/python -m pip install --quiet --upgrade pip
  .venv/bin/python -m pip install --quiet -e '.[test]'
  touch .venv/.installed-test
fi
# tests/test_systemd.py checks deploy/systemd with systemd-analyze (Debian package systemd).
if ! command -v systemd-analyze >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends systemd; } >/tmp/tokenmill-apt.log 2>&1; then
    echo "scripts/test.sh: could not install systemd-analyze (see /tmp/tokenmill-apt.log)" >&2
  fi
fi
# tests/test_engine_transformers.py runs a real (tiny) model with the transformers engine: torch, CPU build.
.venv/bin/python -c "import torch" 2>/dev/null || .venv/bin/python -m pip install --quiet torch==2.13.0
exec .venv/bin/python -m pytest "$@"
