#!/usr/bin/env bash
# The one command for a GPU machine: install the carried wheels, print versions, run
# tools/gpu/bench_gpu.py on the quiet machine, then the CUDA tests and, beside them, the engine,
# daemon, HTTP and recovery tests on the GPU.
#
#     tools/gpu/gpu_check.sh [--dry-run] [--out DIR] [--budget S] [--phases cpu_precision,cuda_tests,device_tests,bench]
#                            [--bench-args "ARGS"] [--cuda-tests "PATHS"] [--device-tests "PATHS"]
#
# First tools/gpu/cpu_precision.py (a minute: how exact float32 is on this machine's CPU, whose
# engines the tests compare with); the benchmark then has 4 minutes; the two test phases then run
# at once (pytest-xdist workers where it is installed: one GPU holds many small engines) with
# whatever is left of the budget (530 s unless
# --budget), so the whole fits in 9 minutes with the wheels' install. A failing or timed-out phase
# is recorded and the next one runs; a test phase's processes that outlive it are killed. --phases
# runs some of them, --bench-args passes options to bench_gpu.py, --cuda-tests and --device-tests
# replace the tests the phases run (a rerun of what failed). After every phase DIR/summary.json is
# rewritten: each phase's name, exit code (124: timed out), seconds, limit and log file
# (DIR/<phase>.log, which ends with the report of each failed test, written as it failed); the
# benchmark's results so far are in DIR/bench.json. DIR defaults to $OUT when set, else
# $TMPDIR/pipeline-gpu-check. The exit code is 0 when no phase failed.
#
# On the GPU machine, run from the checkout's root with .whl/ carried (tools/gpu/gpu_wheels.sh fills
# it here): the wheels go to /tmp/site, and python3 there (which holds torch) runs everything with
# PYTHONPATH=/tmp/site:. and the CPU operators left unbuilt (PIPELINE_CPU_KERNELS=0: the CPU
# engines the tests compare with run plain torch). --dry-run walks the same phases on a machine
# without a GPU, with the checkout's .venv python: it installs nothing, skips the CUDA tests, only
# collects the device tests with --device cuda, and runs bench_gpu.py --quick.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT" || exit 2

DRY_RUN=0
OUT_DIR="${OUT:-${TMPDIR:-/tmp}/pipeline-gpu-check}"
BUDGET_S=530
PHASES=cpu_precision,cuda_tests,device_tests,bench
BENCH_ARGS=""
CUDA_TESTS=""
DEVICE_TESTS=(tests/engine tests/daemon tests/http tests/stages/test_backend.py)
needs_value() { [ "$2" -ge 2 ] || { echo "error: $1 needs a value" >&2; exit 2; }; }
while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) DRY_RUN=1 ;;
        --out) needs_value "$1" $#; OUT_DIR="$2"; shift ;;
        --budget) needs_value "$1" $#; BUDGET_S="$2"; shift
            [[ "$BUDGET_S" =~ ^[0-9]+$ ]] || { echo "error: --budget must be whole seconds, got '$BUDGET_S'" >&2; exit 2; } ;;
        --phases) needs_value "$1" $#; PHASES="$2"; shift
            for phase in ${PHASES//,/ }; do
                case "$phase" in cpu_precision|cuda_tests|device_tests|bench) ;;
                    *) echo "error: unknown phase '$phase' (expected cpu_precision, cuda_tests, device_tests, bench)" >&2; exit 2 ;;
                esac
            done ;;
        --bench-args) needs_value "$1" $#; BENCH_ARGS="$2"; shift ;;
        --cuda-tests) needs_value "$1" $#; CUDA_TESTS="$2"; shift ;;
        --device-tests) needs_value "$1" $#; read -r -a DEVICE_TESTS <<<"$2"; shift ;;
        -h|--help) sed -n '2,25p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "error: unknown argument '$1' (see --help)" >&2; exit 2 ;;
    esac
    shift
done
wanted() { [[ ",$PHASES," == *",$1,"* ]]; }
mkdir -p "$OUT_DIR" || { echo "error: cannot create --out directory '$OUT_DIR'" >&2; exit 2; }
OUT_DIR="$(cd "$OUT_DIR" && pwd)"

if [ "$DRY_RUN" = 1 ]; then
    PY="$ROOT/.venv/bin/python"
    [ -x "$PY" ] || PY=python3
else
    PY=python3
fi
export PYTHONUNBUFFERED=1 PY
export SITE=/tmp/site
BENCH_MODEL_DIR="${TMPDIR:-/tmp}/pipeline-bench-gpu-1b"  # built once, reused by later runs on this machine

PHASE_NAMES=() PHASE_RCS=() PHASE_SECONDS=() PHASE_LIMITS=() PHASE_NOTES=()
FAILED=0
START_S=$(date +%s.%N)

write_summary() {
    local args=()
    for i in "${!PHASE_NAMES[@]}"; do
        args+=("${PHASE_NAMES[$i]}" "${PHASE_RCS[$i]}" "${PHASE_SECONDS[$i]}" "${PHASE_LIMITS[$i]}" "${PHASE_NOTES[$i]}")
    done
    "$PY" - "$OUT_DIR" "$DRY_RUN" "$START_S" "$PY" "${args[@]}" <<'EOF'
import json, sys, time
out, dry_run, start_s, python, rest = sys.argv[1], sys.argv[2] == "1", float(sys.argv[3]), sys.argv[4], sys.argv[5:]
phases = []
for i in range(0, len(rest), 5):
    name, rc, seconds, limit, note = rest[i:i + 5]
    phase = {"name": name, "rc": None if rc == "" else int(rc), "seconds": round(float(seconds), 2),
             "timeout_s": int(limit), "log": f"{name}.log", "status": "skipped" if rc == "" else
             ("passed" if rc == "0" else ("timed out" if rc in ("124", "137") else "failed"))}
    if note:
        phase["note"] = note
    phases.append(phase)
summary = {"dry_run": dry_run, "python": python, "total_s": round(time.time() - start_s, 2), "phases": phases,
           "ok": all(p["status"] in ("passed", "skipped") for p in phases)}
with open(f"{out}/summary.json", "w") as f:
    json.dump(summary, f, indent=1)
EOF
}

# start_phase NAME LIMIT_S COMMAND...: runs it in the background under `timeout`, its output to
# NAME.log; finish_phase NAME waits for it, shows the log's tail and records it.
declare -A PHASE_PID PHASE_START PHASE_LIMIT
start_phase() {
    local name="$1" limit="$2"; shift 2
    local log="$OUT_DIR/$name.log"
    echo "=== $name (limit ${limit}s): $*"
    PHASE_START[$name]=$(date +%s.%N) PHASE_LIMIT[$name]=$limit
    if declare -F "$1" >/dev/null; then  # a function of this script: timeout needs a program
        timeout --kill-after=10 "$limit" bash -c "$1" >"$log" 2>&1 &
    else
        timeout --kill-after=10 "$limit" "$@" >"$log" 2>&1 &
    fi
    PHASE_PID[$name]=$!
}

finish_phase() {
    local name="$1" rc end start
    wait "${PHASE_PID[$name]}"
    rc=$?
    end=$(date +%s.%N) start="${PHASE_START[$name]}"
    tail -n 25 "$OUT_DIR/$name.log"
    echo "=== $name: exit $rc after $(awk "BEGIN {printf \"%.1f\", $end - $start}") s"
    [ "$rc" = 0 ] || FAILED=1
    PHASE_NAMES+=("$name") PHASE_RCS+=("$rc") PHASE_LIMITS+=("${PHASE_LIMIT[$name]}") PHASE_NOTES+=("")
    PHASE_SECONDS+=("$(awk "BEGIN {print $end - $start}")")
    write_summary
}

run_phase() {
    start_phase "$@"
    finish_phase "$1"
}

# skip_phase NAME LIMIT_S WHY: recorded as skipped, with the reason in its log and the summary.
skip_phase() {
    echo "=== $1: skipped: $3"
    echo "skipped: $3" >"$OUT_DIR/$1.log"
    PHASE_NAMES+=("$1") PHASE_RCS+=("") PHASE_SECONDS+=(0) PHASE_LIMITS+=("$2") PHASE_NOTES+=("$3")
    write_summary
}

install_wheels() {
    shopt -s nullglob
    local wheels=(.whl/*.whl)
    if [ ${#wheels[@]} = 0 ]; then
        echo "no wheels in .whl/: run tools/gpu/gpu_wheels.sh on a machine with network access and carry .whl" >&2
        return 1
    fi
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "${wheels[@]}"
}

print_versions() {
    "$PY" - <<'EOF'
import json, subprocess, torch
facts = {"torch": torch.__version__, "cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
         "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None}
try:
    import triton
    facts["triton"] = triton.__version__
except ImportError:
    facts["triton"] = None
if torch.cuda.is_available():
    facts["gpu"] = torch.cuda.get_device_name()
    facts["capability"] = ".".join(map(str, torch.cuda.get_device_capability()))
try:
    facts["nvidia_smi"] = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                                          "--format=csv,noheader"], capture_output=True, text=True,
                                         timeout=20).stdout.strip()
except (OSError, subprocess.TimeoutExpired):
    facts["nvidia_smi"] = None
print(json.dumps(facts, indent=1))
EOF
}

export -f install_wheels print_versions

# The test phases get what the benchmark left of the budget (at least a minute).
left_of_budget() {
    awk -v start="$START_S" -v now="$(date +%s.%N)" -v budget="$BUDGET_S" \
        'BEGIN {left = int(budget - (now - start)); print (left < 60 ? 60 : left)}'
}

# A test phase's processes carry RUN_MARK in their environment; whatever of them outlives the
# phase (a daemon of a test stopped by the time limit) is killed before the next phase.
RUN_MARK="PIPELINE_GPU_CHECK_RUN=$$-$(date +%s%N)"
kill_leftovers() {
    local environ pid
    for environ in /proc/[0-9]*/environ; do
        pid="${environ#/proc/}" pid="${pid%/environ}"
        [ "$pid" = $$ ] && continue
        grep -qzxF "$RUN_MARK" "$environ" 2>/dev/null && kill -9 "$pid" 2>/dev/null
    done
    return 0
}

# test_phase NAME WORKERS PYTEST_ARGS...: pytest under RUN_MARK, on pytest-xdist workers where it
# is installed (-v names each test as it ends), each failure's report written as it happens
# (tests/conftest.py) and appended to the phase's log when it ends, time limit or not.
test_phase() {
    local name="$1" workers="$2"; shift 2
    local options=(-q)
    "$PY" -c "import xdist" 2>/dev/null && options=(-n "$workers" -v)
    rm -f "$OUT_DIR/$name.failures"
    start_phase "$name" "$TESTS_LIMIT_S" env "$RUN_MARK" PIPELINE_TEST_FAILURE_LOG="$OUT_DIR/$name.failures" \
        "$PY" -m pytest -p no:cacheprovider -rfE "${options[@]}" "$@"
}

finish_test_phase() {
    local failures="$OUT_DIR/$1.failures"
    finish_phase "$1"
    if [ -s "$failures" ]; then
        { echo; echo "===== the failures' reports, as they happened"; cat "$failures"; } >>"$OUT_DIR/$1.log"
    fi
    rm -f "$failures"
}

if [ "$DRY_RUN" = 1 ]; then
    skip_phase install 45 "dry run: installs nothing (the checkout's .venv has every package)"
else
    run_phase install 45 install_wheels
    export PYTHONPATH="$SITE:." PIPELINE_CPU_KERNELS=0
fi
run_phase versions 45 print_versions
if [ "$DRY_RUN" = 1 ]; then
    wanted cpu_precision && skip_phase cpu_precision 120 "dry run: this machine's CPU is the one the suite already checks"
else
    wanted cpu_precision && run_phase cpu_precision 120 "$PY" tools/gpu/cpu_precision.py --out "$OUT_DIR/cpu_precision.json"
fi
# The benchmark first, on a quiet machine.
read -r -a bench_args <<<"$BENCH_ARGS"
if [ "$DRY_RUN" = 1 ]; then
    wanted bench && run_phase bench 150 "$PY" tools/gpu/bench_gpu.py --quick --json --out "$OUT_DIR/bench.json" "${bench_args[@]}"
else
    wanted bench && run_phase bench 240 "$PY" tools/gpu/bench_gpu.py --json --out "$OUT_DIR/bench.json" --model-dir "$BENCH_MODEL_DIR" "${bench_args[@]}"
fi
TESTS_LIMIT_S=$(left_of_budget)
if [ "$DRY_RUN" = 1 ]; then
    skip_phase cuda_tests "$TESTS_LIMIT_S" "dry run: needs a GPU"
    # Collected only: proves the --device option and the files' imports without running them twice.
    wanted device_tests && test_phase device_tests 2 --co --device cuda "${DEVICE_TESTS[@]}"
    wanted device_tests && finish_test_phase device_tests
    kill_leftovers
else
    read -r -a cuda_paths <<<"${CUDA_TESTS:-tests}"
    wanted cuda_tests && test_phase cuda_tests 4 -m cuda "${cuda_paths[@]}"
    wanted device_tests && test_phase device_tests 6 --device cuda "${DEVICE_TESTS[@]}"
    wanted cuda_tests && finish_test_phase cuda_tests
    wanted device_tests && finish_test_phase device_tests
    kill_leftovers
fi
echo "summary: $OUT_DIR/summary.json"
cat "$OUT_DIR/summary.json"
exit "$FAILED"
