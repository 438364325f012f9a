#!/usr/bin/env bash
# The GPU checks of the docs' "GPUs" page, on a machine with CUDA, in the Python that holds its
# torch (no install: the package runs from this checkout through PYTHONPATH). Usage:
#
#   bash scripts/gpu_check.sh tests    # pytest -m gpu: every strategy family and codec on CUDA
#   bash scripts/gpu_check.sh codecs   # encode + decode per 10M floats, CPU against CUDA
#   bash scripts/gpu_check.sh bench    # step time, samples/s: 6 strategies (hylo twice), CUDA
#   bash scripts/gpu_check.sh calibrate # the plan's compute measured on the GPU, against bench
#   bash scripts/gpu_check.sh tests codecs   # several, in turn
#
# On a machine lent for 10 minutes a command, run them as four commands:
#   GPU_TESTS='not resume' bash scripts/gpu_check.sh tests    # 12 fits, 8 codec checks
#   GPU_TESTS=resume bash scripts/gpu_check.sh tests codecs   # 5 fit-and-resume, the codecs
#   bash scripts/gpu_check.sh bench                           # 6 strategies (hylo twice), vgg_mini
#   BENCH_MODELS=resnet18 bash scripts/gpu_check.sh bench     # the same seven runs on resnet18
# (GPU_TESTS is pytest's -k expression within the gpu tests.) On a lease of 15 minutes in all,
# run everything as one command instead, the tests spread over pytest-xdist workers (382 s on
# an H200 machine with 16 cores: tests 82 s, then the codecs, then 13 to 32 s a bench run):
#   GPU_TEST_WORKERS=13 TESTS_TIMEOUT=210 bash scripts/gpu_check.sh tests codecs;
#   BENCH_RUN_TIMEOUT=90 BENCH_MODELS='vgg_mini resnet18' bash scripts/gpu_check.sh bench archive
# GPU_TEST_WORKERS: pytest-xdist workers for the tests (ignored where xdist is missing);
# TESTS_TIMEOUT: seconds for the whole test run (default: none); BENCH_RUN_TIMEOUT: seconds per
# bench run (default 300); BENCH_SPECS: the bench's specs instead of the seven below.
# `archive` packs the text logs and the bench's worker logs into $OUT/logs.tar.gz (the
# JSON and the test log stay beside it), so that the results fit in 8 files.
#
# Results (at most 8 files: logs, JSON and the archive) go to $OUT, or to ./gpu-results when
# OUT is unset.
# The bench runs its hosts on loopback (--network local: unshaped, so it times the GPU's
# compute and each strategy's own overheads); BENCH_NETWORK=netns puts them behind shaped links
# instead (root, ip and tc needed). BENCH_STEPS and BENCH_MODELS override the steps per run
# (default 200) and the models (default vgg_mini); BENCH_PLOT=1 also draws PNGs.
# `calibrate`: `plan --accelerator cuda` (the profile taken on the GPU) for each of
# CALIBRATE_MODELS (default: vgg_mini resnet18 gpt resnet50) at each of CALIBRATE_BATCHES
# (default: 32 256), and a table of the forward, backward and the rate of the counted operations
# reached (what `plan --accelerator-tflops --utilization` assumes); then `bench --predict` of
# CALIBRATE_SPECS (default: ddp model_averaging hylo gropipe:stages=2) on two ranks sharing the
# GPU over gloo, on CALIBRATE_PAIR (default resnet18), CALIBRATE_STEPS steps a run (default
# 150). The plans go to $OUT/calibrate/ (`archive` packs them).
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
import importlib, importlib.metadata, torch
import subprocess
print(subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout if torch.cuda.is_available() else "no nvidia-smi run")
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
for index in range(torch.cuda.device_count()):
    print(f"gpu {index}:", torch.cuda.get_device_name(index))
for name in ("pytorch_lightning", "lightning", "torchmetrics", "cloudpickle", "pytest", "rich"):
    try:
        importlib.import_module(name)
        print(name, importlib.metadata.version(name.replace("_", "-")))
    except (ImportError, importlib.metadata.PackageNotFoundError) as error:
        print(name, "MISSING:", error)
EOF
}

run_tests() {
  local select=() workers=()
  [ -n "${GPU_TESTS:-}" ] && select=(-k "$GPU_TESTS")
  if ! "$PYTHON" -c "import xdist" 2>/dev/null; then
    workers=(-o "addopts=--strict-markers -ra")  # pyproject's addopts ask for xdist's -n
  elif [ -n "${GPU_TEST_WORKERS:-}" ]; then
    workers=(-n "$GPU_TEST_WORKERS")
  else
    workers=(-n 0)
  fi
  timeout --kill-after=10 "${TESTS_TIMEOUT:-0}" \
    "$PYTHON" -m pytest -m gpu "${select[@]}" "${workers[@]}" -p no:cacheprovider -v -rs 2>&1 \
    | tee "$OUT/gpu_tests.log" || status=1
}

run_codecs() {
  local devices=()
  for device in ${CODEC_DEVICES:-cpu cuda}; do devices+=(--device "$device"); done
  "$PYTHON" -m lightning_parallel.cli codecs --all "${devices[@]}" \
    --json "$OUT/codecs.json" 2>&1 | tee "$OUT/codecs.txt" || status=1
}

run_bench() {
  local model spec plot=() specs=()
  for spec in ${BENCH_SPECS:-ddp hylo hylo:piece_numel=524288 model_averaging parameter_server \
    gropipe:stages=2 spectrain:stages=2}; do
    specs+=(-s "$spec")
  done
  for model in ${BENCH_MODELS:-vgg_mini}; do
    [ "${BENCH_PLOT:-0}" = 1 ] && plot=(--plot "$OUT/bench_$model.png")
    "$PYTHON" -m lightning_parallel.cli bench --accelerator "${ACCELERATOR:-cuda}" \
      --network "${BENCH_NETWORK:-local}" --bandwidth 10gbit --latency 0 --hosts 2 \
      --model "$model" --max-steps "${BENCH_STEPS:-200}" --timeout "${BENCH_RUN_TIMEOUT:-300}" \
      "${specs[@]}" --json "$OUT/bench_$model.json" "${plot[@]}" --log-dir "/tmp/lp-gpu-bench-$model" \
      2>&1 | tee "$OUT/bench_$model.txt" || status=1
  done
}

run_calibrate() {
  local model batch spec specs=()
  mkdir -p "$OUT/calibrate"
  for model in ${CALIBRATE_MODELS:-vgg_mini resnet18 gpt resnet50}; do
    for batch in ${CALIBRATE_BATCHES:-32 256}; do
      "$PYTHON" -m lightning_parallel.bench.plan --accelerator "${ACCELERATOR:-cuda}" \
        --model "$model" --batch-size "$batch" -s ddp --hosts 8 --bandwidth 100gbit \
        --latency 10us --scale 8 --json "$OUT/calibrate/plan_${model}_$batch.json" \
        > "$OUT/calibrate/plan_${model}_$batch.txt" 2>&1 \
        || { status=1; tail -5 "$OUT/calibrate/plan_${model}_$batch.txt"; }
    done
  done
  "$PYTHON" scripts/compute_rates.py "$OUT"/calibrate/plan_*.json | tee "$OUT/calibrate/rates.txt"
  for spec in ${CALIBRATE_SPECS:-ddp model_averaging hylo gropipe:stages=2}; do specs+=(-s "$spec"); done
  model=${CALIBRATE_PAIR:-resnet18}
  "$PYTHON" -m lightning_parallel.cli bench --predict --accelerator "${ACCELERATOR:-cuda}" \
    --network local --hosts 2 "${specs[@]}" --model "$model" --max-steps "${CALIBRATE_STEPS:-150}" \
    --timeout "${BENCH_RUN_TIMEOUT:-300}" --json "$OUT/calibrate_pair_$model.json" \
    --log-dir /tmp/lp-gpu-bench-calibrate-pair 2>&1 | tee "$OUT/calibrate/pair_$model.txt" || status=1
}

archive() {  # the text logs and the bench's worker logs into one file; JSON and the test log stay
  tar -czf /tmp/lp-gpu-logs.tar.gz "$OUT" /tmp/lp-gpu-bench-* 2>/dev/null
  rm -rf "$OUT"/*.txt "$OUT/calibrate"
  mv /tmp/lp-gpu-logs.tar.gz "$OUT/logs.tar.gz"
  ls -l "$OUT"
}

[ $# -gt 0 ] || set -- all
for what in "$@"; do
  case "$what" in
    tests | codecs | bench | calibrate | all | archive) ;;
    *) echo "usage: $0 [tests|codecs|bench|calibrate|all|archive ...]" >&2; exit 2 ;;
  esac
done
environment
for what in "$@"; do
  case "$what" in
    tests) run_tests ;;
    codecs) run_codecs ;;
    bench) run_bench ;;
    calibrate) run_calibrate ;;
    all) run_tests; run_codecs; run_bench ;;
    archive) archive ;;
  esac
done
exit $status
