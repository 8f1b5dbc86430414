#!/usr/bin/env bash
# One short run on a machine with a GPU: the CUDA tests, then the benchmarks with --device cuda, within 480 s.
#
#   bash bench/gpu_run.sh          # from the repository root; needs the wheels in .whl/ (see bench/README.md)
#
# Everything it prints also goes to $OUT/gpu_run.log; the benchmarks' JSON files are merged into $OUT/bench.json and
# the step statuses with the key lines of each step into $OUT/summary.txt (3 files in all). No network is needed:
# the missing pure-Python packages are installed from .whl/ into /tmp/site, and the repository's own packages are
# imported from the working tree (PYTHONPATH), never installed.
#
# Every step runs under `timeout` with its own budget (seconds, listed below; they add up to 470 s with the set-up),
# cut further where the run's deadline is nearer, and a failed or timed-out step does not stop the ones after it.
#
# GPU_RUN_ONLY="tests_devices rop_pieces" runs only the named steps (and the set-up).
#
# Rehearsal on a machine without a GPU: GPU_RUN_DEVICE=cpu OUT=$(mktemp -d) bash bench/gpu_run.sh
# runs the same steps on the CPU, with small workloads and budgets scaled by GPU_RUN_SCALE percent (default 50).
set -u -o pipefail
cd "$(dirname "$0")/.." || exit 2
START=$(date +%s)
DEVICE=${GPU_RUN_DEVICE:-cuda}
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
LOG=$OUT/gpu_run.log
WORK=$(mktemp -d /tmp/gpu_run.XXXXXX)  # per-step output and JSON files; only the merged results go to $OUT
JSON=$WORK/json
mkdir -p "$JSON" "$WORK/steps"
export PYTHONUNBUFFERED=1 MPLBACKEND=Agg PYTHONDONTWRITEBYTECODE=1
: >"$LOG"

if [ "$DEVICE" = cuda ]; then
  SCALE=${GPU_RUN_SCALE:-100} TOTAL=${GPU_RUN_TOTAL:-465}
  DEVICE_TESTS=(tests/test_devices.py)
  COMPILE_TESTS=(tests/test_landscape_compiled.py)
  SAMPLES=1000                      # ResNet-20 samples, as in every recorded CPU run
  CURVATURE=(--quick --sections 1 2 4)  # both workloads, short sweeps; memory: resnet_memory below
  PLANE=(--steps 21 --methods ll,auto)
  COMPILED=(--steps 11 --methods ll,compiled)
  F1_PLANE=(--repeat 2 --kinds 21)  # the full 51x51 plane
  PEERS=()
  CONNECTION=(--repeats 10)
  PIECES=(--samples 1000 --rounds 5)
  TRANSFORMER=(--workloads T1 --sections 1 2 --quick)
  PROFILE=(--workload T1)
  ATTENTION=(--forms sdpa gpt2 llama hfvit timmvit timm --rounds 9)  # timm: the image's own
  PROJECTION=(--models vgg11_bn resnet20 --samples 32 --rounds 3 --symmetry)
else
  SCALE=${GPU_RUN_SCALE:-50} TOTAL=${GPU_RUN_TOTAL:-300}
  DEVICE_TESTS=(tests/test_devices.py -k "test_products_on_the_device and mlp_bias")
  COMPILE_TESTS=(tests/test_landscape_compiled.py -k test_cli_compile_records_what_ran)
  SAMPLES=40
  CURVATURE=(--quick --workloads F1 --sections 1)
  PLANE=(--steps 3 --methods ll,auto)
  COMPILED=(--steps 3 --methods compiled)
  F1_PLANE=(--steps 5 --repeat 1 --kinds 3)
  PEERS=(--seeds 1 --tols 5e-3 --references 531.6470689,7.884597132  # (the float64 values for 40 samples)
         --skip pyhessian,hessian-eigenthings,curvlinops)
  CONNECTION=(--repeats 2)
  PIECES=(--samples 40 --rounds 1 --pieces 0,64)
  TRANSFORMER=(--workloads T1 --sections 1 --quick)
  PROFILE=(--workload T1 --lines 10)
  ATTENTION=(--forms sdpa timmvit --rounds 1 --samples 50)
  PROJECTION=(--models resnet20 --section projection)
fi
THREADS=$(nproc)  # all the cores (16 on the GPU machine): the CPU side of the runs
DEADLINE=$((START + TOTAL))
KILL=5  # seconds between timeout's TERM and its KILL
STATUS=() RAN=()

log() { echo "$*" | tee -a "$LOG"; }

# step NAME BUDGET COMMAND...: run COMMAND under timeout, its output to the terminal, the log and $WORK/steps/NAME.
step() {
  local name=$1 budget=$2 left rc t0 t
  shift 2
  case " install nvidia-smi versions ${GPU_RUN_ONLY:-$name} " in *" $name "*) ;; *) return ;; esac
  if ((budget >= 20)); then budget=$((budget * SCALE / 100)); fi  # the set-up steps keep theirs
  left=$((DEADLINE - $(date +%s) - KILL))
  if ((budget > left)); then budget=$left; fi
  if ((budget < 5)); then
    log "=== $name: skipped, ${left} s left before the deadline"
    STATUS+=("$(printf '%-18s skipped (deadline)' "$name")")
    return
  fi
  RAN+=("$name")
  log ""
  log "=== [$(date -u +%H:%M:%S) UTC, +$(($(date +%s) - START)) s] $name (budget ${budget} s): $*"
  t0=$(date +%s)
  timeout -k "$KILL" "$budget" "$@" 2>&1 | tee -a "$LOG" "$WORK/steps/$name"
  rc=$?
  t=$(($(date +%s) - t0))
  case $rc in
    0) STATUS+=("$(printf '%-18s ok       %4d s of %4d s' "$name" "$t" "$budget")") ;;
    124 | 137) STATUS+=("$(printf '%-18s TIMEOUT  %4d s of %4d s' "$name" "$t" "$budget")") ;;
    *) STATUS+=("$(printf '%-18s FAILED   %4d s of %4d s (exit %d)' "$name" "$t" "$budget" "$rc")") ;;
  esac
  if ((rc != 0)); then log ""; fi  # a killed command may have left its line unfinished
  log "=== $name: exit $rc after $t s"
}

log "gpu_run.sh: device $DEVICE, budgets at ${SCALE}%, deadline ${TOTAL} s, started $(date -u +%Y-%m-%dT%H:%M:%SZ)"
log "repository: $(git rev-parse --short HEAD 2>/dev/null || echo '?'), $(git status --short 2>/dev/null | wc -l) changed"

# --- set-up: the wheels (pure Python, --no-deps: nothing of the machine's own is shadowed), then what we run on
# (geoopt and plotly are imported by our own packages: without them nothing below runs)
if ! ls .whl/*.whl >/dev/null 2>&1; then log "NO WHEELS in .whl (carried?): no peers, geoopt, plotly"; fi
step install 25 bash -c 'python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl && exit
  echo "pip failed: extracting the (pure-Python) wheels into /tmp/site instead"
  for w in .whl/*.whl; do python3 -m zipfile -e "$w" /tmp/site || exit 1; done'
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
if command -v nvidia-smi >/dev/null; then
  step nvidia-smi 5 nvidia-smi -L
fi
step versions 20 python3 - <<'EOF'
import importlib, importlib.metadata as md, os, sys
import numpy, torch
print(f"python {sys.version.split()[0]}, torch {torch.__version__} (CUDA {torch.version.cuda}, cuDNN "
      f"{torch.backends.cudnn.version()}), numpy {numpy.__version__}, {os.cpu_count()} CPUs")
print(f"torch.cuda.is_available() = {torch.cuda.is_available()}, devices: "
      f"{[torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]}")
print(f"torch from {os.path.dirname(torch.__file__)}, numpy from {os.path.dirname(numpy.__file__)}")
for dist, module in [("PyHessian", "pyhessian.hessian"), ("hessian-eigenthings", "hessian_eigenthings"),
                     ("curvlinops-for-pytorch", "curvlinops"), ("loss-landscapes", "loss_landscapes"),
                     ("geoopt", "geoopt"), ("plotly", "plotly"), ("einconv", "einconv"), ("einops", "einops"),
                     ("linear-operator", "linear_operator"), ("narwhals", "narwhals"), ("triton", "triton")]:
    try:
        importlib.import_module(module)
        print(f"  {dist} {md.version(dist)}")
    except Exception as exc:  # noqa: BLE001
        print(f"  {dist}: cannot import {module} ({type(exc).__name__}: {exc})")
EOF

# --- a. the tests with a CUDA parametrization (test_devices: every public measure, product, solver and grid on the GPU
# against the CPU), then the compiled grids (torch.compile on the CPU); every failure, not the first, one line a test
# In one process: the GPU machine's image has pytest-benchmark, whose warning under xdist is an error with the
# project's warnings-as-errors setting (INTERNALERROR on 2026-11-26); the device tests take about 40 s alone.
# xdist stays loaded (tests/conftest.py implements one of its hooks), with no workers: -n 0.
PYTEST=(python3 -m pytest -n 0 -v --tb=short -p no:cacheprovider -p no:benchmark --durations=5)
step tests_devices 60 "${PYTEST[@]}" "${DEVICE_TESTS[@]}"
step tests_compiled 90 "${PYTEST[@]}" "${COMPILE_TESTS[@]}"

# --- b. the benchmarks, most wanted first (targets: HVP / gradient, top eigenvalue vs the peers, ResNet-20 measures,
# a loss plane vs loss-landscapes); --threads acts on the CPU only
step curvature 65 python3 bench/curvature.py --device "$DEVICE" "${CURVATURE[@]}" --json "$JSON/curvature.json"
step rop_pieces 45 python3 bench/rop_pieces.py --device "$DEVICE" "${PIECES[@]}" --json "$JSON/rop_pieces.json"
step transformer 90 python3 bench/curvature.py --device "$DEVICE" "${TRANSFORMER[@]}" --json "$JSON/transformer.json"
step profile_solve 30 python3 bench/profile_solve.py --device "$DEVICE" "${PROFILE[@]}"
step resnet 45 python3 bench/resnet.py --device "$DEVICE" --samples "$SAMPLES" --hvp-threads "$THREADS" \
  --hvp-rounds 3 --rounds 3 --json "$JSON/resnet.json"
step resnet_peers 105 python3 bench/resnet_peers.py --device "$DEVICE" --samples "$SAMPLES" --threads "$THREADS" \
  "${PEERS[@]}" --json "$JSON/resnet_peers.json"
step landscape_resnet 30 python3 bench/landscape.py --device "$DEVICE" --workload resnet20 --samples "$SAMPLES" \
  --repeat 1 "${PLANE[@]}" --json "$JSON/landscape_resnet20.json"
step landscape_compiled 50 python3 bench/landscape.py --device "$DEVICE" --workload resnet20 --samples "$SAMPLES" \
  --repeat 1 "${COMPILED[@]}" --json "$JSON/landscape_resnet20_compiled.json"
step landscape_f1 22 python3 bench/landscape.py --device "$DEVICE" "${F1_PLANE[@]}" --json "$JSON/landscape_f1.json"
step resnet_memory 22 python3 bench/resnet.py --device "$DEVICE" --section memory --samples "$SAMPLES" \
  --json "$JSON/resnet_memory.json"
step gspace 15 python3 bench/gspace.py --device "$DEVICE" --quick --threads 1 --json "$JSON/gspace.json"
step connection 15 python3 bench/connection.py --device "$DEVICE" "${CONNECTION[@]}"
step rop_attention 40 python3 bench/rop_attention.py --device "$DEVICE" "${ATTENTION[@]}" --json "$JSON/rop_attention.json"
step projection 90 python3 bench/projection.py --device "$DEVICE" "${PROJECTION[@]}"
if python3 -c "import timm" 2>/dev/null; then  # the GPU machine's image has timm (and torchvision)
  step timm_check 30 python3 bench/timm_check.py --device "$DEVICE"
fi

# --- results: one JSON file, and a summary
python3 - "$JSON" "$OUT/bench.json" <<'EOF' 2>&1 | tee -a "$LOG"
import json, pathlib, sys
merged = {}
for f in sorted(pathlib.Path(sys.argv[1]).glob("*.json")):
    try:
        merged[f.stem] = json.loads(f.read_text())
    except ValueError as exc:
        merged[f.stem] = {"unreadable": str(exc)}
pathlib.Path(sys.argv[2]).write_text(json.dumps(merged, indent=1, default=str))
print(f"JSON of {len(merged)} benchmark(s) merged into {sys.argv[2]}: {', '.join(merged) or 'none'}")
EOF
{
  echo "=== summary: device $DEVICE, $(($(date +%s) - START)) s in all (deadline ${TOTAL} s)"
  printf '%s\n' "${STATUS[@]}"
  keys='\bPASS\b|\bFAIL|ERROR|MISSED|\bmet\b|passed|failed|[Ee]rror|Traceback|not installed|cannot import|fastest peer'
  keys+='|reference '
  keys+='|HVP in memory|node-wise /|x a gradient|landscape\.evaluate_grid|random_plane \('
  keys+='|G-SGD \(GOptimizer\)|^  (layer|node):|auto = |/ euclidean|one projection|group of dimension'
  for name in "${RAN[@]}"; do
    lines=$(grep -E "$keys" "$WORK/steps/$name" 2>/dev/null | tail -n 14)
    if [ -n "$lines" ]; then printf '\n--- %s\n%s\n' "$name" "$lines"; fi
  done
} | tee -a "$LOG" >"$OUT/summary.txt"
cat "$OUT/summary.txt"
rm -rf "$WORK"
