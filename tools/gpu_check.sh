#!/usr/bin/env bash
# Check amp_bn_fix on one CUDA GPU and measure it there, in one command (under 8 minutes on an
# H100/H200-class GPU):
#
#   tools/gpu_check.sh [--out DIR] [--budget SECONDS] [--dry-run]
#
# Sections, each run on its own, recorded, and the next one run whatever happened: the bug report
# (examples/bug_report.py, and `amp-bn-fix demo`) on CUDA, tests/test_cuda.py, every CUDA-marked
# test (-m cuda), a training step under torch.cuda.set_sync_debug_mode("error"), a training step
# captured in a CUDA graph and replayed against eager, torch.compile(mode="reduce-overhead"), and
# the benchmark's CUDA rows. Writes DIR/cuda-<gpu name>.json and .md (DIR: benchmarks/results),
# prints where, and exits non-zero if any section failed.
#
# Installs nothing: it needs a CUDA build of torch and the test extra (pip install -e '.[test]')
# in the environment of PYTHON (default: .venv/bin/python if there, else python3). --budget caps
# the whole run (default 450 s); a section that would not fit is recorded as skipped, a failure.
# --dry-run needs no GPU: the same sections on CPU (the CUDA tests skip, the benchmark's CUDA rows
# run on tiny CPU tensors), writing to a temporary folder unless --out is given.
set -uo pipefail

usage() { sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
root=$(cd "$(dirname "$0")/.." && pwd)
out=""
budget=450
dry_run=0
while [[ $# -gt 0 ]]; do
    case $1 in
        --out) [[ $# -ge 2 ]] || usage; out=$2; shift 2 ;;
        --budget) [[ $# -ge 2 && $2 =~ ^[0-9]+$ ]] || usage; budget=$2; shift 2 ;;
        --dry-run) dry_run=1; shift ;;
        -h|--help) usage ;;
        *) echo "gpu_check: unknown argument $1" >&2; usage ;;
    esac
done

cd "$root" || exit 2
if [[ -n ${PYTHON:-} ]]; then py=$PYTHON
elif [[ -x .venv/bin/python ]]; then py=$root/.venv/bin/python
else py=python3
fi
# The clone's code, whether or not it is installed in that environment.
export PYTHONPATH=$root${PYTHONPATH:+:$PYTHONPATH}
# Settings from the caller's environment would change what is checked.
for name in $(env | sed -n 's/^\(AMP_BN_FIX[A-Z_]*\)=.*/\1/p'); do unset "$name"; done

work=$(mktemp -d "${TMPDIR:-/tmp}/amp_bn_fix-gpu-check.XXXXXX")
sections=$work/sections.tsv
: > "$sections"
started=$SECONDS
reserve=20  # seconds kept for writing the report
count=0
failed=0
if command -v timeout >/dev/null; then has_timeout=1; else has_timeout=0; fi

# run_section [--expect REGEX] [--ok "CODES"] NAME LIMIT_S COMMAND...
# Runs COMMAND with its output in a log of its own, for at most LIMIT_S seconds (less if the
# budget is nearly spent); passes when the exit code is one of CODES (default 0) and, with
# --expect, the log has a line matching REGEX.
run_section() {
    local expect="" ok="0"
    while [[ $1 == --* ]]; do
        case $1 in
            --expect) expect=$2; shift 2 ;;
            --ok) ok=$2; shift 2 ;;
        esac
    done
    local name=$1 limit=$2; shift 2
    count=$((count + 1))
    local log
    log=$work/$(printf '%02d' "$count")-$name.log
    local left=$((budget - (SECONDS - started) - reserve))
    if ((left < 15)); then
        echo "not run: the check's budget of ${budget} s was spent" > "$log"
        printf '%s\t%s\t%s\t%s\t%s\n' "$name" "skipped: out of time" "" 0 "$log" >> "$sections"
        failed=$((failed + 1))
        echo "== $name: skipped, out of time"
        return
    fi
    ((limit > left)) && limit=$left
    echo "== $name (at most ${limit} s)"
    local start=$SECONDS rc
    if ((has_timeout)); then
        timeout --kill-after=10 "$limit" "$@" > "$log" 2>&1
    else
        "$@" > "$log" 2>&1
    fi
    rc=$?
    local status=failed
    if [[ " $ok " == *" $rc "* ]]; then
        status=passed
        if [[ -n $expect ]] && ! grep -Eq -- "$expect" "$log"; then
            status="failed: no line matches $expect"
        fi
    elif ((rc == 124 || rc == 137)); then
        status="timed out after ${limit} s"
    fi
    [[ $status == passed ]] || failed=$((failed + 1))
    printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$status" "$rc" "$((SECONDS - start))" "$log" >> "$sections"
    echo "   $status (exit code $rc, $((SECONDS - start)) s)"
    [[ $status == passed ]] || tail -n 15 "$log" | sed 's/^/   | /'
}

# pytest exits 5 when a selection has no test: a file without CUDA tests elsewhere is no failure.
pytest=("$py" -m pytest -q -p no:cacheprovider -rfEs)

if ((dry_run)); then
    device=cpu
    device_row="(^| )cpu +(float16|bfloat16) "  # a row of the bug report's tables on this device
    bench=("$py" benchmarks/bench.py --device cpu --quick --threads 1 --only 'cuda-*,tiny-train,aten-ops')
else
    device=cuda
    device_row="(^| )cuda +(float16|bfloat16) "
    bench=("$py" benchmarks/bench.py --device cuda --threads 1 2)
fi

run_section environment 60 "$py" benchmarks/_report.py environment --device "$device"
run_section --expect "$device_row" bug-report 120 "$py" examples/bug_report.py
run_section --expect "$device_row" demo 120 "$py" -m amp_bn_fix demo
run_section test-cuda 180 "${pytest[@]}" tests/test_cuda.py -k "not sync_debug and not cuda_graph and not reduce_overhead"
run_section sync-debug 120 "${pytest[@]}" tests/test_cuda.py -k sync_debug
run_section cuda-graph 120 "${pytest[@]}" tests/test_cuda.py -k cuda_graph
run_section benchmark 300 "${bench[@]}" --out "$work" --stem bench
run_section compile-reduce-overhead 240 "${pytest[@]}" tests/test_cuda.py -k reduce_overhead
run_section --ok "0 5" cuda-marked-tests 240 "${pytest[@]}" -m cuda tests --ignore tests/test_cuda.py

gpu=$("$py" -c "import torch; print(torch.cuda.get_device_name() if torch.cuda.is_available() else '')" 2>/dev/null)
if ((dry_run)); then gpu="dry run on cpu"; fi
stem=cuda-$("$py" benchmarks/_report.py slug "${gpu:-unknown gpu}" 2>/dev/null || echo unknown-gpu)
if [[ -z $out ]]; then
    if ((dry_run)); then out=$work; else out=$root/benchmarks/results; fi
fi
bench_args=()
[[ -f $work/bench.json ]] && bench_args=(--bench "$work/bench.json")
if ! "$py" benchmarks/_report.py gpu-check --sections "$sections" ${bench_args[@]+"${bench_args[@]}"} \
        --gpu "${gpu:-unknown GPU}" --out-stem "$out/$stem"; then
    echo "gpu_check: writing the report failed; the sections' outcomes are in $sections" >&2
    failed=$((failed + 1))
fi
echo
echo "sections: $count, failed: $failed, $((SECONDS - started)) s"
echo "results: $out/$stem.json and $out/$stem.md"
echo "logs:    $work"
((failed == 0))
