#!/usr/bin/env bash
# The speed benchmark on one CUDA GPU, bf16 backbones, without any model or data file: a randomly initialised
# SmolLM2-135M (its architecture and vocabulary) and a randomly initialised ~1.1 B Llama, on synthetic prompts
# of the real SST-2 and RTE lengths. Tables (.md), rows (.csv) and provenance (.json) go to $OUT.
#
#     OUT=/path/to/folder scripts/bench_gpu.sh          # at most 6 minutes (time limits per run)
#
# Each run has a time limit, so that the whole stays under 6 minutes; a run that hits it leaves a note in
# $OUT/timings.txt and the next one starts.
set -uo pipefail
: "${OUT:?set OUT to the folder that receives the tables}"
cd "$(dirname "$0")/.."
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
if ! "$PY" -c "import adazeta" 2> /dev/null; then
  echo "bench_gpu.sh: $PY cannot import adazeta: run make setup, or set PYTHON to a python with adazeta installed" >&2
  exit 2
fi
mkdir -p "$OUT"
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || true
COMMON=(--device cuda --dtype bf16 --out "$OUT" --eval-examples 64)

run() {  # run LIMIT_SECONDS NAME ARGS...
  local limit=$1 name=$2; shift 2
  local start=$SECONDS
  timeout "$limit" "$PY" -m adazeta.tools.bench "$@" > "$OUT/$name.log" 2>&1
  echo "$name: exit $? in $((SECONDS - start)) s (limit $limit s)" | tee -a "$OUT/timings.txt"
}

# SmolLM2-135M, today's noise stream: everything, every method, scaling, memory.
run 110 smollm2 --weights random --model smollm2-135m "${COMMON[@]}" --repeats 5 --warmup 2 \
    --queries 1 4 8 --chunks 4 auto
# The same step with the flat noise stream (one generator call per 4 M entries), times only.
run 40 smollm2-flat --weights random --model smollm2-135m "${COMMON[@]}" --repeats 5 --warmup 2 --noise flat \
    --queries 1 4 --chunks 4 --skip-memory --skip-reference --scaling-sizes --methods mezo mezo_lora adazeta
# The backbone's speed options side by side (bf16, fp16, adapters in bf16, int8 weights, inductor compile; SDPA
# attention is transformers' default on CUDA): ratios to fp32, roofline, memory, fidelity.
run 100 smollm2-options --weights random --model smollm2-135m --device cuda --out "$OUT" --options \
    --compile-backend inductor --repeats 5 --warmup 2 --eval-examples 64
# A ~1.1 B Llama: fewer repeats.
run 110 llama-1b --model llama-1b-random "${COMMON[@]}" --repeats 3 --warmup 1 --queries 1 4 --chunks 4 \
    --memory-steps 1
ls -l "$OUT"
