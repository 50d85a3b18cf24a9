#!/usr/bin/env bash
# The prepared GPU check: the one command to run first on a GPU machine, from the repository root,
# with no network. Needs .gpu/ from bench/gpu/prepare.sh (run where PyPI is reachable), a python3
# with torch (CUDA), g++ and nvcc.
#
# usage: bench/gpu/run.sh OUT [--dry-run]
#
#   1. installs the carried wheels (.gpu/wheels) into /tmp/splitmoe-gpu/site, put on PYTHONPATH
#   2. installs the project (pip install -e: builds the native kernels, in parallel)
#   3. logs the machine: nvidia-smi, torch and its GPU, the CPU's kernels
#   4. runs the CUDA tests (pytest -m cuda, fixtures from .gpu/fixtures): OUT/cuda-tests.xml
#   5. makes the Qwen3-30B-A3B-shape models, 6 and 24 layers, Q4_K_M (in the background, during 4)
#   6. the speed table: splitmoe bench run with attention on CUDA, then on the CPU, per model:
#      OUT/bench-<N>l-<cuda|cpu>.json
#   7. OUT/gpu-table.md: CUDA against CPU attention and the two targets, printed last
# Everything goes to OUT/run.log too. A failed phase is recorded and the check goes on; each
# phase has a timeout, and a phase that no longer fits GPU_CHECK_BUDGET_S (450 s) is skipped,
# saying so.
#
# --dry-run: what needs no GPU, here: the wheels into a temporary cp312 target, the native
# kernels (an already-built library is reused), the CUDA tests' command (each test skips), a
# 1-layer model, CPU attention on a tiny workload, the table; it ends listing what it skipped.
#
# Environment: GPU_CHECK_BUDGET_S (450), GPU_CHECK_TESTS_S (150: the CUDA tests' share),
# GPU_CHECK_LAYERS ("6 24"), GPU_CHECK_WORKLOAD (the bench's workload flags), PYTHON (python3).
set -uo pipefail

usage() { awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "${BASH_SOURCE[0]}"; }

OUT="" DRY=0
for arg in "$@"; do
    case $arg in
        -h|--help) usage; exit 0 ;;
        --dry-run) DRY=1 ;;
        -*) echo "run.sh: unknown option $arg" >&2; usage >&2; exit 2 ;;
        *) [[ -z $OUT ]] || { echo "run.sh: one OUT folder, got $OUT and $arg" >&2; exit 2; }; OUT=$arg ;;
    esac
done
[[ -n $OUT ]] || { echo "run.sh: OUT folder missing" >&2; usage >&2; exit 2; }

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
cd "$REPO"

PY=${PYTHON:-python3}
BUDGET_S=${GPU_CHECK_BUDGET_S:-450}
TESTS_S=${GPU_CHECK_TESTS_S:-150}
export PYTHONUNBUFFERED=1 PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1
if (( DRY )); then
    WORK=$(mktemp -d /tmp/splitmoe-gpu-dry.XXXXXX)
    LAYERS=${GPU_CHECK_LAYERS:-1}
    DEVICES=(cpu)
    WORKLOAD=${GPU_CHECK_WORKLOAD:---prompt-tokens 32 --decode-tokens 4 --streams 4 --stream-prompt-tokens 4 --bandwidth-mb 32}
else
    WORK=/tmp/splitmoe-gpu
    LAYERS=${GPU_CHECK_LAYERS:-6 24}
    DEVICES=(cuda cpu)
    WORKLOAD=${GPU_CHECK_WORKLOAD:---prompt-tokens 512 --decode-tokens 32 --streams 16 --stream-prompt-tokens 16}
fi
SITE=$WORK/site
MODELS=$WORK/models
START=$SECONDS
SUMMARY=() SKIPPED=() DRY_SKIPPED=()
MODELS_PID="" FAILED=0

elapsed() { echo $((SECONDS - START)); }
left() { echo $((BUDGET_S - (SECONDS - START))); }
# The timeout of a phase: at most $1 seconds, leaving $2 for the phases after it.
fit() { local t=$(($(left) - $2)); echo $((t < $1 ? t : $1)); }
phase() { PHASE=$1 PHASE_START=$SECONDS; echo; echo "=== [$(elapsed) s] $PHASE"; }
# Ends the phase: "ok", "FAILED (rc N)" or "TIMED OUT" from an exit status.
end_phase() {
    local rc=$1 status=ok
    (( rc == 124 || rc == 137 )) && status="TIMED OUT" || { (( rc )) && status="FAILED (rc $rc)"; }
    (( rc )) && FAILED=1
    SUMMARY+=("$(printf '%-34s %-16s %4d s' "$PHASE" "$status" $((SECONDS - PHASE_START)))")
    echo "=== $PHASE: $status, $((SECONDS - PHASE_START)) s"
}
skip() {
    SKIPPED+=("$1: $2")
    SUMMARY+=("$(printf '%-34s %-16s' "$1" "SKIPPED")")
    echo "=== [$(elapsed) s] skipped $1: $2"
}
model_path() { echo "$MODELS/qwen3-30b-a3b-${1}l-q4_k_m.gguf"; }

install_wheels() {
    local wheels=(.gpu/wheels/*.whl)
    [[ -e ${wheels[0]} ]] || { echo "no .gpu/wheels/*.whl: run bench/gpu/prepare.sh where PyPI is reachable"; return 1; }
    rm -rf "$SITE"
    if (( DRY )); then  # this interpreter is not 3.12: install for the GPU machine's, import nothing
        timeout 120 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
            --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
            --platform manylinux_2_35_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_17_x86_64 \
            --platform manylinux2014_x86_64 "${wheels[@]}" || return
        echo "${#wheels[@]} wheels installed into $SITE (for CPython 3.12; not on this PYTHONPATH)"
        DRY_SKIPPED+=("the carried wheels on PYTHONPATH (cp312 builds; this python is $("$PY" -c 'import platform; print(platform.python_version())'))")
    else
        timeout 120 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
            "${wheels[@]}" || return
        export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
        "$PY" -c 'import grpc, google.protobuf as pb, gguf, fastapi, pydantic, uvicorn, llguidance, opentelemetry.sdk
print(f"grpcio {grpc.__version__}, protobuf {pb.__version__}, fastapi {fastapi.__version__}, pydantic {pydantic.VERSION}")' || return
    fi
    "$PY" -m splitmoe.bench.gpu_check check-wheels .gpu/wheels bench/gpu/image-packages.txt
}

build_native() {
    local suffix so
    suffix=$("$PY" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
    so=kernels/_native$suffix
    local t0=$SECONDS
    if (( DRY )); then  # `pip install -e .` would re-point this machine's shared environment
        DRY_SKIPPED+=("pip install -e . (this machine's environment is shared: the kernels are built in place)")
        if [[ -f $so ]]; then
            echo "reusing $so (delete it to time a build)"
        else
            timeout 300 "$PY" setup.py -q build_ext --inplace || return
            echo "native kernels built in $((SECONDS - t0)) s"
        fi
    else
        timeout 300 "$PY" -m pip install -q --no-index --no-deps --no-build-isolation -e . \
            || { echo "pip install -e failed: building the kernels in place"
                 timeout 300 "$PY" setup.py -q build_ext --inplace; } \
            || return
        echo "installed, native kernels built, in $((SECONDS - t0)) s"
    fi
    "$PY" -c 'from splitmoe.kernels import native
print("native kernels:", native.isa() if native.AVAILABLE else f"UNAVAILABLE ({native.UNAVAILABLE_REASON})")
raise SystemExit(0 if native.AVAILABLE else 1)'
}

log_machine() {
    if command -v nvidia-smi >/dev/null; then
        timeout 30 nvidia-smi
    else
        echo "nvidia-smi: not found"
        (( DRY )) && DRY_SKIPPED+=("nvidia-smi")
    fi
    timeout 60 "$PY" - <<'EOF'
import platform
import torch
print(f"python {platform.python_version()}, torch {torch.__version__} (CUDA {torch.version.cuda})")
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"GPU: {p.name}, {p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} SMs, sm_{p.major}{p.minor}")
else:
    print("GPU: torch sees none")
EOF
    timeout 30 "$PY" -m splitmoe.kernels.cpu_features
    echo "CPUs: $(nproc); NUMA nodes: $(ls -d /sys/devices/system/node/node* 2>/dev/null | wc -l); $(free -g | awk '/Mem:/ { print $2 " GiB of memory" }')"
    g++ --version | head -1
    command -v nvcc >/dev/null && nvcc --version | tail -1 || echo "nvcc: not found"
}

start_models() {  # in the background: one core, while the tests use the GPU
    mkdir -p "$MODELS"
    (
        for n in $LAYERS; do
            m=$(model_path "$n")
            [[ -f $m ]] && { echo "model: $m (made before)"; continue; }
            extra=()
            (( DRY )) && extra=(--vocab 1024)
            "$PY" -m splitmoe bench make-model --shape qwen3-30b-a3b --layers "$n" --quant q4_k_m "${extra[@]}" --out "$m"
        done
    ) >"$WORK/make-model.log" 2>&1 &
    MODELS_PID=$!
    echo "making the models in the background (pid $MODELS_PID): $LAYERS layers"
}

cuda_test_files() { grep -rlE 'mark\.cuda' tests --include='*.py' | sort; }

run_cuda_tests() {
    local files timeout_s=$1 extra=()
    mapfile -t files < <(cuda_test_files)
    (( ${#files[@]} )) || { echo "no test marked cuda under tests/"; return 0; }
    echo "files: ${files[*]}"
    (( DRY )) && DRY_SKIPPED+=("the CUDA tests' bodies (run, but each skips: torch sees no GPU here)")
    "$PY" -c 'import pytest_timeout' 2>/dev/null && extra=(--timeout=120)
    # four workers share the GPU: the tests are small, and the tiny models' CPU work dominates them
    (( DRY )) || { "$PY" -c 'import xdist' 2>/dev/null && extra+=(-n 4); }
    # SIGINT at the limit: pytest stops as on Ctrl-C and still writes its summary and the XML
    SPLITMOE_FIXTURES_DIR=$REPO/.gpu/fixtures timeout -s INT --kill-after=20 "$timeout_s" \
        "$PY" -m pytest -m cuda -q -p no:cacheprovider --junitxml="$OUT/cuda-tests.xml" --durations=10 \
        --continue-on-collection-errors "${extra[@]}" "${files[@]}"
}

wait_models() {  # until made, or $1 seconds
    local deadline=$((SECONDS + $1))
    while kill -0 "$MODELS_PID" 2>/dev/null && (( SECONDS < deadline )); do sleep 1; done
    if kill -0 "$MODELS_PID" 2>/dev/null; then
        kill "$MODELS_PID"; wait "$MODELS_PID" 2>/dev/null
        cat "$WORK/make-model.log"
        return 124
    fi
    wait "$MODELS_PID"; local rc=$?
    cat "$WORK/make-model.log"
    return $rc
}

bench_run() {  # layers device timeout_s
    local n=$1 device=$2 run_dir=$WORK/runs/${1}l-$2 rc
    rm -rf "$run_dir"
    # shellcheck disable=SC2086 # WORKLOAD is a list of flags
    timeout --kill-after=15 "$3" "$PY" -m splitmoe bench run --model "$(model_path "$n")" --attention-device "$device" \
        --no-inprocess $WORKLOAD --json "$OUT/bench-${n}l-$device.json" --run-dir "$run_dir"
    rc=$?
    if (( rc )); then
        for log in "$run_dir"/*.log; do [[ -f $log ]] && { echo "--- last lines of $log"; tail -n 25 "$log"; }; done
    fi
    return $rc
}

# Seconds a bench run needs at least, and may take at most, by model depth.
bench_min_s() { (( $1 <= 6 )) && echo 40 || echo 80; }
bench_cap_s() { (( $1 <= 6 )) && echo 100 || echo 180; }

main() {
    trap '[[ -n $MODELS_PID ]] && kill "$MODELS_PID" 2>/dev/null' EXIT
    echo "GPU check$( ((DRY)) && echo ' (dry run)'): $REPO -> $OUT, $(date -u +%FT%TZ), budget $BUDGET_S s"
    mkdir -p "$WORK"

    phase "carried wheels"; install_wheels; end_phase $?
    phase "native kernels"; build_native; end_phase $?
    phase "machine"; log_machine; end_phase $?
    start_models

    local t
    t=$(fit "$TESTS_S" 200)
    if (( t >= 30 )); then
        phase "CUDA tests"; run_cuda_tests "$t"; end_phase $?
    else
        skip "CUDA tests" "$t s of the budget left for them, 30 needed (the speed table keeps 200)"
    fi

    t=$(fit 240 60)
    phase "models ($LAYERS layers)"; wait_models "$((t > 10 ? t : 10))"; end_phase $?

    for n in $LAYERS; do
        for device in "${DEVICES[@]}"; do
            local name="bench ${n} layers, $device attention"
            if [[ ! -f $(model_path "$n") ]]; then
                skip "$name" "no model"
                continue
            fi
            t=$(fit "$(bench_cap_s "$n")" 15)
            if (( t < $(bench_min_s "$n") )); then
                skip "$name" "$t s of the budget left for it, $(bench_min_s "$n") needed"
                continue
            fi
            phase "$name"; bench_run "$n" "$device" "$t"; end_phase $?
        done
        (( DRY )) && DRY_SKIPPED+=("bench run --attention-device cuda on the $n-layer model")
    done

    phase "table"
    local note=""
    (( DRY )) && note="Dry run on $(nproc) CPUs without a GPU: a $LAYERS-layer model and a tiny workload; CUDA columns not measured."
    echo; echo "=== phases (total $(elapsed) s of $BUDGET_S)"
    printf '  %s\n' "${SUMMARY[@]}"
    (( ${#SKIPPED[@]} )) && { echo "=== skipped for time or a missing input:"; printf '  %s\n' "${SKIPPED[@]}"; }
    if (( DRY )); then
        echo "=== dry run: CUDA steps skipped, to run on the GPU machine:"
        printf '  %s\n' "${DRY_SKIPPED[@]}"
    fi
    echo
    "$PY" -m splitmoe.bench.gpu_check table "$OUT" --note "$note" || return
    return $FAILED
}

(( DRY )) && trap 'rm -rf "$WORK"' EXIT

main 2>&1 | tee "$OUT/run.log"
exit "${PIPESTATUS[0]}"
