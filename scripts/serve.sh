#!/usr/bin/env bash
# Serve tokenmill: create ./.venv if needed, install the project into it, start it.
# Any arguments go to `tokenmill serve` (see `./scripts/serve.sh --help`).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
if ! .venv/bin/python -c "import tokenmill, gateway" 2>/dev/null || [ pyproject.toml -nt .venv/.installed ]; then
  .venv/bin/python -m pip install --quiet --upgrade pip
  .venv/bin/python -m pip install --quiet -e .
  touch .venv/.installed
fi
exec .venv/bin/tokenmill serve "$@"
