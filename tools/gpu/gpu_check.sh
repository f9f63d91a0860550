#!/usr/bin/env bash
# The one command for a GPU machine: install the carried wheels, print versions, run the CUDA
# tests, the engine, daemon, HTTP and recovery tests on the GPU, then tools/gpu/bench_gpu.py.
#
#     tools/gpu/gpu_check.sh [--dry-run] [--out DIR]
#
# Each phase has its own time limit, the benchmark whatever is left of 530 s, so the whole fits in
# 9 minutes with the wheels' install; a failing
# or timed-out phase is recorded and the next one runs. After every phase DIR/summary.json is
# rewritten: each phase's name, exit code (124: timed out), seconds, limit and log file
# (DIR/<phase>.log); the benchmark's results so far are in DIR/bench.json. DIR defaults to $OUT
# when set, else $TMPDIR/pipeline-gpu-check. The exit code is 0 when no phase failed.
#
# On the GPU machine, run from the checkout's root with .whl/ carried (tools/gpu/gpu_wheels.sh fills
# it here): the wheels go to /tmp/site, and python3 there (which holds torch) runs everything with
# PYTHONPATH=/tmp/site:. --dry-run walks the same phases on a machine without a GPU, with the
# checkout's .venv python: it installs nothing, skips the CUDA tests, only collects the device tests
# with --device cuda, and runs bench_gpu.py --quick.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT" || exit 2

DRY_RUN=0
OUT_DIR="${OUT:-${TMPDIR:-/tmp}/pipeline-gpu-check}"
while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) DRY_RUN=1 ;;
        --out) [ $# -ge 2 ] || { echo "error: --out needs a directory" >&2; exit 2; }; OUT_DIR="$2"; shift ;;
        -h|--help) sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "error: unknown argument '$1' (expected --dry-run or --out DIR)" >&2; exit 2 ;;
    esac
    shift
done
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
BUDGET_S=530
BENCH_MODEL_DIR="${TMPDIR:-/tmp}/pipeline-bench-gpu-1b"  # built once, reused by later runs on this machine
DEVICE_TESTS=(tests/engine tests/daemon tests/http tests/stages/test_backend.py)

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

# run_phase NAME LIMIT_S COMMAND...: runs it under `timeout`, its output to NAME.log and here.
run_phase() {
    local name="$1" limit="$2"; shift 2
    local log="$OUT_DIR/$name.log" start end rc
    echo "=== $name (limit ${limit}s): $*"
    start=$(date +%s.%N)
    if declare -F "$1" >/dev/null; then  # a function of this script: timeout needs a program
        timeout --kill-after=10 "$limit" bash -c "$1" >"$log" 2>&1
    else
        timeout --kill-after=10 "$limit" "$@" >"$log" 2>&1
    fi
    rc=$?
    end=$(date +%s.%N)
    tail -n 25 "$log"
    echo "=== $name: exit $rc after $(awk "BEGIN {printf \"%.1f\", $end - $start}") s"
    [ "$rc" = 0 ] || FAILED=1
    PHASE_NAMES+=("$name") PHASE_RCS+=("$rc") PHASE_LIMITS+=("$limit") PHASE_NOTES+=("")
    PHASE_SECONDS+=("$(awk "BEGIN {print $end - $start}")")
    write_summary
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

# The benchmark gets what the phases before it left of the budget (at least a minute).
bench_limit() {
    awk -v start="$START_S" -v now="$(date +%s.%N)" -v budget="$BUDGET_S" \
        'BEGIN {left = int(budget - (now - start)); print (left < 60 ? 60 : left)}'
}

if [ "$DRY_RUN" = 1 ]; then
    skip_phase install 45 "dry run: installs nothing (the checkout's .venv has every package)"
else
    run_phase install 45 install_wheels
    export PYTHONPATH="$SITE:."
fi
run_phase versions 45 print_versions
if [ "$DRY_RUN" = 1 ]; then
    skip_phase cuda_tests 120 "dry run: needs a GPU"
    # Collected only: proves the --device option and the files' imports without running them twice.
    run_phase device_tests 150 "$PY" -m pytest -q --co --device cuda -p no:cacheprovider "${DEVICE_TESTS[@]}"
    run_phase bench "$(bench_limit)" "$PY" tools/gpu/bench_gpu.py --quick --json --out "$OUT_DIR/bench.json"
else
    run_phase cuda_tests 120 "$PY" -m pytest -q -m cuda -p no:cacheprovider
    run_phase device_tests 150 "$PY" -m pytest -q --device cuda -p no:cacheprovider "${DEVICE_TESTS[@]}"
    run_phase bench "$(bench_limit)" "$PY" tools/gpu/bench_gpu.py --json --out "$OUT_DIR/bench.json" --model-dir "$BENCH_MODEL_DIR"
fi
echo "summary: $OUT_DIR/summary.json"
cat "$OUT_DIR/summary.json"
exit "$FAILED"
