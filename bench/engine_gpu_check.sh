#!/usr/bin/env bash
# The reference engine's GPU checks in one bounded run (a lent GPU machine is held by the minute):
#   1. the gpu-marked engine tests (CUDA engine == CPU engine; CUDA graphs == uncaptured; one sync
#      per decode step);
#   2. bench/engine_throughput.py at a 16 x 2048 random Llama in bfloat16 against transformers'
#      batched generate, in the same process;
#   3. bench/engine_step.py profile: a decode step's wall time vs its GPU busy time, the default
#      engine (overlapped steps) beside the same engine one step at a time, alternating in one
#      process ($PROFILE_ARGS, default: --compare-async --repeats 3; add --compare-graphs for graphs off).
# Results go under $OUT (default /tmp/kvfleet-gpu-out): run.log, bench/engine.{json,md,png} (the CPU figures
# of docs/benchmarks/engine.json kept beside the GPU ones; copy them back into docs/benchmarks/) and a
# profiler trace of 10 decode steps at batch 32.
# Needs torch with CUDA and transformers; the engine itself must be importable (installed or on
# PYTHONPATH).
set -u
OUT=${OUT:-/tmp/kvfleet-gpu-out}
mkdir -p "$OUT/bench"
cp docs/benchmarks/engine.json "$OUT/bench/engine.json"
export PYTHONUNBUFFERED=1
WORK=/tmp/kvfleet-bench
ART=/tmp/kvfleet-bench-artifacts
SIZE=(--layers 16 --hidden 2048 --vocab 32000)
LOG="$OUT/run.log"
{
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"
} >>"$LOG" 2>&1
# The 0.87 B model is written while the tests run (CPU work, separate cores).
# From /tmp: in the checkout, its kvfleet/ folder would shadow the installed package.
(cd /tmp && python3 -c "
from pathlib import Path
from kvfleet.engine.tiny_model import make_tiny_model
make_tiny_model(Path('$WORK/llama-16x2048-v32000'), overwrite=True, layers=16, hidden=2048, vocab=32000,
                heads=8, kv_heads=4, max_position_embeddings=2048)
print('model written')") >>"$LOG" 2>&1 &
MODEL_PID=$!
echo "== gpu tests" >>"$LOG"
REPO=$PWD
(cd /tmp && timeout "${TESTS_S:-100}" python3 -m pytest -q -p no:cacheprovider -m gpu -c "$REPO/pyproject.toml" \
  --rootdir "$REPO" "$REPO/tests/engine/test_device.py" -o addopts="--import-mode=importlib -ra") >>"$LOG" 2>&1
echo "gpu tests rc=$?" >>"$LOG"
wait "$MODEL_PID"
echo "== throughput" >>"$LOG"
timeout "${THROUGHPUT_S:-170}" python3 bench/engine_throughput.py --device cuda "${SIZE[@]}" \
  --prompt-tokens 512 --new-tokens 128 --concurrency 32 --single-requests 2 --prefix-trials 3 \
  --long-prompt-tokens 1024 --skip-sequential-at-concurrency --artifacts-dir "$ART" --work-dir "$WORK" \
  --keep-devices --out-dir "$OUT/bench" >>"$LOG" 2>&1
echo "throughput rc=$?" >>"$LOG"
echo "== profile" >>"$LOG"
# shellcheck disable=SC2086  # PROFILE_ARGS is a list of flags
timeout "${PROFILE_S:-150}" python3 bench/engine_step.py profile "${SIZE[@]}" --prompt-tokens 512 --steps 100 \
  ${PROFILE_ARGS:---compare-async --repeats 3} --artifacts-dir "$ART" --work-dir "$WORK" --trace-dir "$OUT/bench" --out-dir "$OUT/bench" \
  >>"$LOG" 2>&1
echo "profile rc=$?" >>"$LOG"
tail -c 6000 "$LOG"
