#!/usr/bin/env bash
# GPU check for a bare CUDA machine without network: every test marked `cuda`, then the copy
# benchmark of every GPU backend and the targets on its results, with JSON and logs in OUTDIR. Runs from the repository root,
# without installing kvtier; takes well under ten minutes on one GPU.
#
#   benchmarks/gpu_check.sh OUTDIR [WHEELDIR]
#
# WHEELDIR: wheels (see docs/gpu.md) for Python packages the machine lacks; they are installed
# with `pip --no-index` into OUTDIR/site, which goes on PYTHONPATH. The exit status is 0 only if
# the tests passed and every benchmark ran (missed targets do not fail it: they are results, in
# OUTDIR/targets.json); OUTDIR/summary.json says what each step returned.
set -uo pipefail

if [[ $# -lt 1 || $# -gt 2 ]]; then
    echo "usage: $0 OUTDIR [WHEELDIR]" >&2
    exit 2
fi
OUT=$(mkdir -p "$1" && cd "$1" && pwd)
WHEELS=${2:-}
REPO=$(cd "$(dirname "$0")/.." && pwd)
PYTHON=${PYTHON:-python3}
cd "$REPO"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"

log() { echo "[gpu_check $(date -u +%H:%M:%S)] $*" | tee -a "$OUT/gpu_check.log" >&2; }

# Python packages kvtier's tests need, as "import name=distribution name".
REQUIRED="torch=torch numpy=numpy pluggy=pluggy pydantic=pydantic yaml=pyyaml tqdm=tqdm
pytest=pytest hypothesis=hypothesis cuda.bindings=cuda-bindings"
missing=()
for pair in $REQUIRED; do
    module=${pair%%=*}
    if ! "$PYTHON" -c "import $module" 2>/dev/null; then
        missing+=("${pair##*=}")
    fi
done
install_rc=0
if [[ ${#missing[@]} -gt 0 ]]; then
    if [[ -z "$WHEELS" ]]; then
        log "missing Python packages: ${missing[*]}; pass a WHEELDIR (docs/gpu.md)"
        install_rc=1
    else
        log "installing ${missing[*]} from $WHEELS into $OUT/site"
        "$PYTHON" -m pip install --no-index --find-links "$WHEELS" --target "$OUT/site" \
            "${missing[@]}" >"$OUT/pip.log" 2>&1
        install_rc=$?
        export PYTHONPATH="$OUT/site:$PYTHONPATH"
    fi
fi

log "environment"
nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1
"$PYTHON" - >"$OUT/environment.json" 2>"$OUT/environment.log" <<'EOF'
import json, platform, torch
info = {"python": platform.python_version(), "torch": torch.__version__,
        "torch_cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available()}
if torch.cuda.is_available():
    info["device"] = torch.cuda.get_device_name()
    info["compute_capability"] = list(torch.cuda.get_device_capability())
try:
    from cuda.bindings import driver
    import cuda.bindings
    driver.cuInit(0)
    info["cuda_bindings"] = cuda.bindings.__version__
    info["driver_version"] = int(driver.cuDriverGetVersion()[1])
except Exception as exc:  # reported, not fatal: the tests will say what is missing
    info["cuda_bindings_error"] = f"{type(exc).__name__}: {exc}"
print(json.dumps(info, indent=2))
EOF

log "tests marked cuda"
timeout 240 "$PYTHON" -m pytest -p no:cacheprovider -m cuda -ra --continue-on-collection-errors tests \
    --junitxml="$OUT/pytest-cuda.xml" >"$OUT/pytest-cuda.log" 2>&1
tests_rc=$?
tail -n 3 "$OUT/pytest-cuda.log" | tee -a "$OUT/gpu_check.log" >&2

# Every GPU backend and the torch baseline, each against a contiguous pinned copy of the same
# bytes in the same run; then the targets on the ratios.
bench_rc=()
reports=()
for backend in dma kernel auto torch; do
    log "kvtier bench copy --backend $backend"
    timeout 60 "$PYTHON" -m kvtier bench copy --backend "$backend" --quiet \
        --block-bytes 4KiB 16KiB 32KiB 64KiB 128KiB 256KiB 1MiB 4MiB \
        --output "$OUT/bench-copy-$backend.json" 2>"$OUT/bench-copy-$backend.log"
    rc=$?
    bench_rc+=("\"$backend\": $rc")
    [[ $rc -eq 0 ]] && reports+=("$OUT/bench-copy-$backend.json")
done
bench_ok=$([[ ${#reports[@]} -eq 4 ]] && echo 0 || echo 1)

log "targets"
targets_rc=2
if [[ ${#reports[@]} -gt 0 ]]; then
    "$PYTHON" benchmarks/gpu_targets.py "${reports[@]}" >"$OUT/targets.json" 2>"$OUT/targets.log"
    targets_rc=$?
    cat "$OUT/targets.json" >>"$OUT/gpu_check.log"
fi

cat >"$OUT/summary.json" <<EOF
{
  "install": $install_rc,
  "missing_packages": "${missing[*]}",
  "tests_cuda": $tests_rc,
  "bench_copy": {$(IFS=,; echo "${bench_rc[*]}")},
  "targets": $targets_rc
}
EOF
log "done: tests $tests_rc, benchmarks ${bench_rc[*]}, targets $targets_rc; results in $OUT"
[[ $tests_rc -eq 0 && $bench_ok -eq 0 ]]
