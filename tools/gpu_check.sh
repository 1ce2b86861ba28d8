#!/usr/bin/env bash
# Check amp_bn_fix on one CUDA GPU and measure it there, in one command, with no network and in
# under 8 minutes on an H100/H200-class GPU:
#
#   tools/gpu_check.sh [--out DIR] [--budget SECONDS] [--dry-run]
#
# 1. Preflight, in seconds: a GPU that runs a kernel; torch and wrapt within setup.cfg's
#    install_requires, pytest within its test extra, pip and setuptools there for the install. On a
#    problem it says what is wrong (and, for a missing or wrong package, how to bring its wheel
#    from a machine with network), runs nothing else and exits 2.
# 2. `pip install --no-deps --no-build-isolation --no-index -e .` into that Python (offline).
# 3. The sections, each run on its own with a time limit, recorded, and the next one run whatever
#    happened: the bug report (examples/bug_report.py, and `amp-bn-fix demo`) on CUDA,
#    tests/test_cuda.py, the guard and a training step under torch.cuda.set_sync_debug_mode("error"),
#    a training step captured in a CUDA graph and replayed against eager,
#    torch.compile(mode="reduce-overhead"), every other CUDA-marked test (-m cuda), and last the
#    benchmark's CUDA rows.
# 4. The report, DIR/cuda-<gpu name>.json and .md, and a summary, DIR/gpu-check-summary.md (what
#    passed, failed and was skipped, and where the logs are), also printed last. Every step's log
#    is in DIR/gpu-check-logs/. DIR is benchmarks/results unless --out says otherwise.
#
# PYTHON chooses the interpreter (default .venv/bin/python if there, else python3): a CUDA build of
# torch, wrapt, and the test extra (pytest, hypothesis, numpy). --budget caps the whole run,
# preflight and install included (default 450 s); a section that would not fit is recorded as not
# run, a failure. Exit code: 0 when every step passed, 1 when one failed, 2 for a bad argument or a
# failed preflight.
#
# --dry-run needs no GPU and proves the plumbing in about a minute: the preflight (no GPU is a note
# there), the install, the sections on CPU (the bug report, demo and the benchmark's CUDA rows run on
# tiny CPU tensors; the CUDA tests' sections run and are recorded as skipped, their tests skipping),
# the report and the summary. Its DIR defaults to a new temporary folder. It exits 0 unless a step
# failed.
set -uo pipefail

usage() { sed -n '2,/^set /p' "$0" | sed '$d' | sed 's/^# \{0,1\}//' >&2; exit 2; }
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

if [[ -n ${PYTHON:-} ]]; then py=$PYTHON
elif [[ -x $root/.venv/bin/python ]]; then py=$root/.venv/bin/python
else py=python3
fi
# A relative PYTHON or --out is relative to where the script was started (no symbolic link resolved:
# a virtual environment's python is a link).
if [[ $py == */* && $py != /* ]]; then py=$PWD/$py; fi
if [[ -z $out ]]; then
    if ((dry_run)); then
        out=$(mktemp -d "${TMPDIR:-/tmp}/amp_bn_fix-gpu-check.XXXXXX") || exit 2
    else
        out=$root/benchmarks/results
    fi
fi
if ! mkdir -p -- "$out/gpu-check-logs" || ! out=$(cd -- "$out" && pwd); then
    echo "gpu_check: cannot write to $out" >&2
    exit 2
fi
logs=$out/gpu-check-logs
summary=$out/gpu-check-summary.md
rm -f -- "$logs"/*.log "$logs"/sections.tsv "$logs"/bench.json "$logs"/bench.md "$summary"

cd "$root" || exit 2
# The clone's code, whether or not it is installed in that environment.
export PYTHONPATH=$root${PYTHONPATH:+:$PYTHONPATH}
# Settings from the caller's environment would change what is checked.
for name in $(env | sed -n 's/^\(AMP_BN_FIX[A-Z_]*\)=.*/\1/p'); do unset "$name"; done

sections=$logs/sections.tsv  # the sections' outcomes, for benchmarks/_report.py
started=$SECONDS
reserve=20  # seconds kept for writing the report
count=0
failed=0
if command -v timeout >/dev/null; then has_timeout=1; else has_timeout=0; fi
# Every step (preflight, install, the sections, the report), for the summary.
step_names=() step_statuses=() step_seconds=() step_details=() step_logs=()

# limited SECONDS COMMAND...: COMMAND, stopped after SECONDS where `timeout` is there.
limited() {
    if ((has_timeout)); then timeout --kill-after=10 "$@"; else shift; "$@"; fi
}

record() {  # record NAME STATUS SECONDS DETAIL LOG
    step_names+=("$1") step_statuses+=("$2") step_seconds+=("$3") step_details+=("$4") step_logs+=("$5")
    [[ $2 == passed || $2 == skipped* ]] || failed=$((failed + 1))
}

# The summary: every step's outcome and where its log is, as DIR/gpu-check-summary.md; printed.
write_summary() {
    local i passed=() failures=() skips=() result
    for i in "${!step_names[@]}"; do
        case ${step_statuses[i]} in
            passed) passed+=("${step_names[i]}") ;;
            skipped*) skips+=("${step_names[i]}") ;;
            *) failures+=("${step_names[i]}") ;;
        esac
    done
    joined() { local IFS=,; local s="$*"; echo "${s//,/, }"; }
    cell() { local s=$1; printf ' %s |' "${s//|/\\|}"; }  # a Markdown table's cell: | escaped
    if ((${#failures[@]})); then
        result="FAILED: ${#failures[@]} of ${#step_names[@]} steps failed ($(joined "${failures[@]}"))"
    elif ((${#skips[@]})); then
        result="PASSED: no step failed; ${#skips[@]} skipped"
    else
        result="PASSED: all ${#step_names[@]} steps passed"
    fi
    {
        echo "# amp_bn_fix GPU check: ${gpu:-no GPU}"
        echo
        echo "$result, in $((SECONDS - started)) s of a ${budget} s budget; $(date -u '+%Y-%m-%d %H:%M UTC')."
        echo "Python: $py"
        echo
        echo "| step | outcome | seconds | details | log |"
        echo "|---|---|---|---|---|"
        for i in "${!step_names[@]}"; do
            echo "|$(cell "${step_names[i]}")$(cell "${step_statuses[i]}")$(cell "${step_seconds[i]}")$(
                cell "${step_details[i]}")$(cell "${step_logs[i]#"$out"/}")"
        done
        echo
        echo "- Passed: $( ((${#passed[@]})) && joined "${passed[@]}" || echo none)"
        echo "- Failed: $( ((${#failures[@]})) && joined "${failures[@]}" || echo none)"
        echo "- Skipped: $( ((${#skips[@]})) && joined "${skips[@]}" || echo none)"
        [[ -n ${report_files:-} ]] && echo "- Report: $report_files"
        echo "- Logs: $logs/"
        if [[ -n ${preflight_failed:-} ]]; then
            echo
            echo "The preflight failed, so nothing else ran:"
            echo
            echo '```'
            # Its problems, each with the indented lines that go with it.
            awk '/^problem: /{p = 1; print; next} /^    /{if (p) print; next} {p = 0}' "$logs/preflight.log"
            echo '```'
        fi
    } > "$summary"
    echo
    cat "$summary"
    echo
    echo "summary: $summary"
}

# run_section [--expect REGEX] [--ok "CODES"] [--pytest] NAME LIMIT_S COMMAND...
# Runs COMMAND with its output in a log of its own, for at most LIMIT_S seconds (less if the
# budget is nearly spent); passes when the exit code is one of CODES (default 0) and, with
# --expect, the log has a line matching REGEX. With --pytest, the tally of pytest's last line is
# the step's details, and a section whose tests all skipped is recorded as skipped on a dry run
# (they need CUDA) and as failed on a real one.
run_section() {
    local expect="" ok="0" is_pytest=0
    while [[ $1 == --* ]]; do
        case $1 in
            --expect) expect=$2; shift 2 ;;
            --ok) ok=$2; shift 2 ;;
            --pytest) is_pytest=1; shift ;;
        esac
    done
    local name=$1 limit=$2; shift 2
    count=$((count + 1))
    local log
    log=$logs/$(printf '%02d' "$count")-$name.log
    local left=$((budget - (SECONDS - started) - reserve))
    if ((left < 15)); then
        echo "not run: the check's budget of ${budget} s was spent" > "$log"
        printf '%s\t%s\t%s\t%s\t%s\n' "$name" "not run: out of time" "" 0 "$log" >> "$sections"
        record "$name" "not run: out of time" 0 "" "$log"
        echo "== $name: not run, out of time"
        return
    fi
    ((limit > left)) && limit=$left
    echo "== $name (at most ${limit} s)"
    local start=$SECONDS rc
    limited "$limit" "$@" > "$log" 2>&1
    rc=$?
    local status=failed detail=""
    if ((is_pytest)); then
        detail=$(grep -E '(passed|failed|skipped|deselected|errors?|no tests ran).* in [0-9.]+s' "$log" | tail -n 1 |
                 sed -E 's/^=+ //; s/ in [0-9.]+s.*$//')
    elif ((dry_run)); then
        detail="on CPU"
    fi
    if [[ " $ok " == *" $rc "* ]]; then
        status=passed
        if [[ -n $expect ]] && ! grep -Eq -- "$expect" "$log"; then
            status="failed: no line matches $expect"
        elif ((is_pytest)) && [[ $detail =~ [0-9]+\ skipped && ! $detail =~ [0-9]+\ passed ]]; then
            if ((dry_run)); then status="skipped: no CUDA (dry run)"; else status="failed: every test skipped"; fi
        fi
    elif ((rc == 124 || rc == 137)); then
        status="timed out after ${limit} s"
    fi
    printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$status" "$rc" "$((SECONDS - start))" "$log" >> "$sections"
    record "$name" "$status" "$((SECONDS - start))" "$detail" "$log"
    echo "   $status (exit code $rc, $((SECONDS - start)) s${detail:+; $detail})"
    [[ $status == passed || $status == skipped* ]] || tail -n 15 "$log" | sed 's/^/   | /'
}

# --- 1. preflight ---------------------------------------------------------------------------------
echo "== preflight ($py)"
start=$SECONDS
limited 120 "$py" - "$root" "$dry_run" > "$logs/preflight.log" 2>&1 <<'PY'
"""What the check needs, each judged against the ranges setup.cfg asks for; exit 1 on a problem."""
import configparser
import importlib
import importlib.util
import os
import platform
import re
import sys

root, dry_run = sys.argv[1], sys.argv[2] == "1"
problems, notes, found = [], [], []


def requirements(text):
    """{name: specifier} of requirement lines such as 'wrapt>=2.5,<3' (markers and extras dropped)."""
    reqs = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].split(";", 1)[0].strip()
        m = re.match(r"([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[[^\]]*\])?\s*(.*)$", line)
        if m:
            reqs[m.group(1).lower().replace("_", "-")] = re.sub(r"\s+", "", m.group(2))
    return reqs


cfg = configparser.ConfigParser(interpolation=None)
cfg.read(os.path.join(root, "setup.cfg"))
install = requirements(cfg.get("options", "install_requires", fallback=""))
test = requirements(cfg.get("options.extras_require", "test", fallback=""))
try:
    with open(os.path.join(root, "pyproject.toml")) as f:
        build = re.search(r"^requires\s*=\s*\[([^\]]*)\]", f.read(), re.M)
    build = requirements("\n".join(re.findall(r"[\"']([^\"']+)[\"']", build.group(1)))) if build else {}
except OSError:
    build = {}


def specifier_set():
    for module in ("packaging.specifiers", "pip._vendor.packaging.specifiers"):
        try:
            return importlib.import_module(module).SpecifierSet
        except Exception:
            pass
    return None


SpecifierSet = specifier_set()


def release(version):
    """The leading numbers of a version: '2.11.0+cu128' -> (2, 11, 0), '3.0rc1' -> (3, 0)."""
    numbers = []
    for part in version.split("+")[0].split("."):
        m = re.match(r"\d+", part)
        if not m:
            break
        numbers.append(int(m.group()))
        if m.end() < len(part):
            break
    return tuple(numbers)


def satisfies(version, spec):
    """Whether ``version`` is in ``spec`` ('>=2.5,<3'): by packaging where it is, else by numbers."""
    if not spec:
        return True
    if SpecifierSet is not None:
        try:
            return SpecifierSet(spec).contains(version, prereleases=True)
        except Exception:  # a version packaging cannot parse: compare its numbers
            pass
    for clause in spec.split(","):
        m = re.match(r"(~=|===|==|!=|>=|<=|>|<)(.+)$", clause.strip())
        if not m:
            continue
        op, want = m.groups()
        have = release(version)
        if want.endswith(".*"):
            prefix = release(want[:-2])
            ok = (have[:len(prefix)] == prefix) == (op != "!=")
        else:
            wanted = release(want)
            n = max(len(have), len(wanted))
            a, b = have + (0,) * (n - len(have)), wanted + (0,) * (n - len(wanted))
            ok = {"==": a == b, "===": a == b, "!=": a != b, ">=": a >= b, "<=": a <= b, ">": a > b, "<": a < b,
                  "~=": a >= b and a[:len(wanted) - 1] == b[:len(wanted) - 1]}[op]
        if not ok:
            return False
    return True


def dist_version(dist):
    try:
        from importlib import metadata

        return metadata.version(dist)
    except Exception:
        return None


def bring(name, spec):
    """How to install ``name`` here without network: a wheel downloaded elsewhere."""
    target = f"--python-version {sys.version_info.major}.{sys.version_info.minor}"
    if sys.platform.startswith("linux"):
        target += f" --platform manylinux2014_{platform.machine()}"
    return (f"\n    To bring it without network here: on a machine with network,\n"
            f"      pip download --only-binary=:all: {target} '{name}{spec}' -d wheels/\n"
            f"    copy wheels/ to this machine, then\n"
            f"      {sys.executable} -m pip install --no-index --find-links wheels/ '{name}{spec}'")


def check_module(name, spec, where, consequence=None):
    """Import ``name`` (the module this Python will load, which may not be the installed one) and
    judge its version against ``spec``: a problem, or with ``consequence`` (what goes wrong) a note."""
    def complain(message):
        if consequence is None:
            problems.append(message + bring(name, spec))
        else:
            notes.append(f"{message} {consequence}")

    try:
        module = importlib.import_module(name)
    except Exception as error:
        complain(f"{name} is missing ({type(error).__name__}: {error}); {where} asks for {name}{spec}.")
        return None
    version = getattr(module, "__version__", None) or dist_version(name)
    place = os.path.dirname(getattr(module, "__file__", None) or "?")
    if version is None:
        notes.append(f"{name} at {place} has no version to check; {where} asks for {name}{spec}.")
        return module
    version = str(version)
    print(f"{name}: {version} at {place} ({where}: {name}{spec or ', any version'})")
    if not satisfies(version, spec):
        complain(f"{name} {version} (at {place}) is outside the range {where} asks for: {name}{spec}.")
    elif consequence is None:
        found.append(f"{name} {version}")
    return module


print(f"python: {platform.python_version()} at {sys.executable}")
python_requires = cfg.get("options", "python_requires", fallback="")
if not satisfies(platform.python_version(), python_requires):
    problems.append(f"Python {platform.python_version()} is outside setup.cfg's python_requires {python_requires}.")
found.append(f"Python {platform.python_version()}")

torch = check_module("torch", install.get("torch", ""), "setup.cfg's install_requires")
check_module("wrapt", install.get("wrapt", ""), "setup.cfg's install_requires")
check_module("pytest", test.get("pytest", ""), "setup.cfg's test extra")
collect = "Test files importing it cannot be collected: the cuda-marked-tests section will fail."
for name, consequence in (("hypothesis", collect), ("numpy", collect), ("expecttest", "The tests that need it skip.")):
    if name in test:
        check_module(name, test[name], "setup.cfg's test extra", consequence)
if importlib.util.find_spec("pip") is None:
    problems.append(f"pip is missing, which the install needs: {sys.executable} -m ensurepip (no network needed).")
setuptools = dist_version("setuptools")
if setuptools is None:
    problems.append("setuptools is missing, which the install needs to build the package."
                    + bring("setuptools", build.get("setuptools", "")))
elif not satisfies(setuptools, build.get("setuptools", "")):
    notes.append(f"setuptools {setuptools} is outside pyproject.toml's build requirement "
                 f"setuptools{build['setuptools']}: the install may fail.")

gpu = "none"
if torch is not None and not any(p.startswith("torch ") for p in problems):
    try:
        available = torch.cuda.is_available()
    except Exception as error:
        available, why = False, f"torch.cuda.is_available() raised {type(error).__name__}: {error}"
    else:
        why = ("it is a CPU-only build" if torch.version.cuda is None else
               f"it is built for CUDA {torch.version.cuda} but sees no GPU (the driver? "
               f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})")
    if available:
        try:
            gpu = torch.cuda.get_device_name()
            assert (torch.ones(4, device="cuda") * 2).sum().item() == 8  # a kernel of this build runs here
            print(f"GPU: {gpu}, CUDA {torch.version.cuda}, {torch.cuda.device_count()} device(s); a kernel ran")
        except Exception as error:
            (notes if dry_run else problems).append(f"CUDA is available but a kernel does not run on {gpu}: "
                                                    f"{type(error).__name__}: {error}")
    elif dry_run:
        notes.append(f"no CUDA: torch {torch.__version__}: {why}; a dry run needs none.")
    else:
        problems.append(f"no CUDA: torch {torch.__version__}: {why}. The check needs one CUDA GPU "
                        "(--dry-run runs the plumbing without).")
found.append(f"GPU {gpu}")

for note in notes:
    print(f"note: {note}")
for problem in problems:
    print(f"problem: {problem}")
print("found: " + ", ".join(found))
if problems:
    print(f"preflight failed: {len(problems)} problem(s); nothing else was run.")
sys.exit(1 if problems else 0)
PY
rc=$?
sed 's/^/   /' "$logs/preflight.log"
if ((rc != 0)); then
    case $rc in
        124|137) status="timed out after 120 s" ;;
        127) status="failed: cannot run $py (set PYTHON)" ;;
        *) status=failed ;;
    esac
    preflight_failed=1
    gpu=""
    record preflight "$status" "$((SECONDS - start))" "" "$logs/preflight.log"
    echo "gpu_check: the preflight failed${status#failed}; see above or $logs/preflight.log" >&2
    write_summary
    exit 2
fi
record preflight passed "$((SECONDS - start))" "$(sed -n 's/^found: //p' "$logs/preflight.log" | tail -n 1)" \
    "$logs/preflight.log"

# --- 2. the offline install -----------------------------------------------------------------------
install=("$py" -m pip install --no-deps --no-build-isolation --no-index --disable-pip-version-check --no-input -e .)
echo "== install: ${install[*]:1}"
start=$SECONDS
limited 180 "${install[@]}" > "$logs/install.log" 2>&1
rc=$?
detail="editable, offline"
if ((rc != 0)) && grep -q externally-managed-environment "$logs/install.log"; then
    # A system Python that pip leaves to the OS's packages: this machine is the check's own.
    detail="editable, offline, with --break-system-packages"
    echo "   the Python is externally managed: again with --break-system-packages"
    limited 180 "${install[@]}" --break-system-packages >> "$logs/install.log" 2>&1
    rc=$?
fi
if ((rc == 0)); then status=passed; else status="failed (exit code $rc)"; fi
record install "$status" "$((SECONDS - start))" "$detail" "$logs/install.log"
echo "   $status ($((SECONDS - start)) s)"
[[ $status == passed ]] || tail -n 15 "$logs/install.log" | sed 's/^/   | /'

# --- 3. the sections: correctness first, then the benchmark ---------------------------------------
: > "$sections"
# pytest exits 5 when a selection has no test: a file without CUDA tests elsewhere is no failure.
pytest=("$py" -m pytest -q -p no:cacheprovider -rfEs)

if ((dry_run)); then
    device=cpu
    device_row="(^| )cpu +(float16|bfloat16) "  # a row of the bug report's tables on this device
    bench=("$py" benchmarks/bench.py --device cpu --quick --threads 1 --only 'cuda-*,tiny-train,aten-ops,traffic')
else
    device=cuda
    device_row="(^| )cuda +(float16|bfloat16) "
    bench=("$py" benchmarks/bench.py --device cuda --threads 1 2)
fi

run_section environment 60 "$py" benchmarks/_report.py environment --device "$device"
run_section --expect "$device_row" bug-report 120 "$py" examples/bug_report.py
run_section --expect "$device_row" demo 120 "$py" -m amp_bn_fix demo
run_section --pytest test-cuda 180 "${pytest[@]}" tests/test_cuda.py -k "not sync_debug and not cuda_graph and not reduce_overhead"
run_section --pytest sync-debug 120 "${pytest[@]}" tests/test_cuda.py -k sync_debug
run_section --pytest cuda-graph 120 "${pytest[@]}" tests/test_cuda.py -k cuda_graph
run_section --pytest compile-reduce-overhead 240 "${pytest[@]}" tests/test_cuda.py -k reduce_overhead
run_section --pytest --ok "0 5" cuda-marked-tests 240 "${pytest[@]}" -m cuda tests --ignore tests/test_cuda.py
run_section benchmark 300 "${bench[@]}" --out "$logs" --stem bench

# --- 4. the report and the summary ----------------------------------------------------------------
gpu=$("$py" -c "import torch; print(torch.cuda.get_device_name() if torch.cuda.is_available() else '')" 2>/dev/null)
if ((dry_run)); then gpu="dry run on cpu"; fi
stem=cuda-$("$py" benchmarks/_report.py slug "${gpu:-unknown gpu}" 2>/dev/null || echo unknown-gpu)
bench_args=()
[[ -f $logs/bench.json ]] && bench_args=(--bench "$logs/bench.json")
start=$SECONDS
if "$py" benchmarks/_report.py gpu-check --sections "$sections" ${bench_args[@]+"${bench_args[@]}"} \
        --gpu "${gpu:-unknown GPU}" --out-stem "$out/$stem" > "$logs/report.log" 2>&1; then
    report_files="$out/$stem.md and $out/$stem.json"
    record report passed "$((SECONDS - start))" "$stem.md, $stem.json" "$logs/report.log"
else
    echo "gpu_check: writing the report failed; the sections' outcomes are in $sections" >&2
    record report failed "$((SECONDS - start))" "" "$logs/report.log"
fi
write_summary
((failed == 0))
