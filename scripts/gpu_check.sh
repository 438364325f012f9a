#!/usr/bin/env bash
# The GPU checks of the docs' "GPUs" page, on a machine with CUDA, in the Python that holds its
# torch (no install: the package runs from this checkout through PYTHONPATH). Usage:
#
#   bash scripts/gpu_check.sh tests    # pytest -m gpu: every strategy family and codec on CUDA
#   bash scripts/gpu_check.sh codecs   # encode + decode per 10M floats, CPU against CUDA
#   bash scripts/gpu_check.sh bench    # step time, samples/s: 6 strategies (hylo twice), CUDA
#   bash scripts/gpu_check.sh tests codecs   # several, in turn
#
# On a machine lent for 10 minutes a command, run them as four commands:
#   GPU_TESTS='not resume' bash scripts/gpu_check.sh tests    # 12 fits, 8 codec checks
#   GPU_TESTS=resume bash scripts/gpu_check.sh tests codecs   # 5 fit-and-resume, the codecs
#   bash scripts/gpu_check.sh bench                           # 6 strategies (hylo twice), vgg_mini
#   BENCH_MODELS=resnet18 bash scripts/gpu_check.sh bench     # the same seven runs on resnet18
# (GPU_TESTS is pytest's -k expression within the gpu tests.)
#
# Results (at most 8 files: logs and JSON) go to $OUT, or to ./gpu-results when OUT is unset.
# The bench runs its hosts on loopback (--network local: unshaped, so it times the GPU's
# compute and each strategy's own overheads); BENCH_NETWORK=netns puts them behind shaped links
# instead (root, ip and tc needed). BENCH_STEPS and BENCH_MODELS override the steps per run
# (default 200) and the models (default vgg_mini); BENCH_PLOT=1 also draws PNGs.
# ACCELERATOR=cpu (bench on the CPU) and CODEC_DEVICES=cpu rehearse the script without a GPU.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-results}
mkdir -p "$OUT"
PYTHON=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
status=0

environment() {
  "$PYTHON" - <<'EOF' 2>&1 | tee "$OUT/environment.txt"
import importlib, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
for index in range(torch.cuda.device_count()):
    print(f"gpu {index}:", torch.cuda.get_device_name(index))
for name in ("pytorch_lightning", "lightning", "torchmetrics", "cloudpickle", "pytest", "rich"):
    try:
        print(name, importlib.import_module(name).__version__)
    except ImportError as error:
        print(name, "MISSING:", error)
EOF
}

run_tests() {
  local select=()
  [ -n "${GPU_TESTS:-}" ] && select=(-k "$GPU_TESTS")
  "$PYTHON" -m pytest -m gpu "${select[@]}" -p no:cacheprovider -v -rs 2>&1 \
    | tee "$OUT/gpu_tests.log" || status=1
}

run_codecs() {
  local devices=()
  for device in ${CODEC_DEVICES:-cpu cuda}; do devices+=(--device "$device"); done
  "$PYTHON" -m lightning_parallel.cli codecs --all "${devices[@]}" \
    --json "$OUT/codecs.json" 2>&1 | tee "$OUT/codecs.txt" || status=1
}

run_bench() {
  local model plot=()
  for model in ${BENCH_MODELS:-vgg_mini}; do
    [ "${BENCH_PLOT:-0}" = 1 ] && plot=(--plot "$OUT/bench_$model.png")
    "$PYTHON" -m lightning_parallel.cli bench --accelerator "${ACCELERATOR:-cuda}" \
      --network "${BENCH_NETWORK:-local}" --bandwidth 10gbit --latency 0 --hosts 2 \
      --model "$model" --max-steps "${BENCH_STEPS:-200}" --timeout 300 \
      -s ddp -s hylo -s hylo:piece_numel=524288 -s model_averaging -s parameter_server \
      -s gropipe:stages=2 -s spectrain:stages=2 \
      --json "$OUT/bench_$model.json" "${plot[@]}" --log-dir "/tmp/lp-gpu-bench-$model" \
      2>&1 | tee "$OUT/bench_$model.txt" || status=1
  done
}

[ $# -gt 0 ] || set -- all
for what in "$@"; do
  case "$what" in
    tests | codecs | bench | all) ;;
    *) echo "usage: $0 [tests|codecs|bench|all ...]" >&2; exit 2 ;;
  esac
done
environment
for what in "$@"; do
  case "$what" in
    tests) run_tests ;;
    codecs) run_codecs ;;
    bench) run_bench ;;
    all) run_tests; run_codecs; run_bench ;;
  esac
done
exit $status
