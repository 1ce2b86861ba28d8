#!/usr/bin/env bash
# Run the test suite on a given torch version, in a virtual environment outside the clone.
#
#   tools/test_on_torch.sh [--python PYTHON] VERSION [VENV_DIR] [-- PYTEST_ARGS...]
#
# PYTHON (default python3, >= 3.10) makes the virtual environment. VENV_DIR defaults to
# ${TMPDIR:-/tmp}/amp_bn_fix-torch-VERSION-pyX.Y and is reused while it holds that torch version.
# PYTEST_ARGS default to the README's test command (-q); e.g. `-- -q -m "not slow"`. Needs the
# package index. torch from PyPI is a CUDA build on Linux: it runs on CPU, but its nvidia-* packages
# (several GB) are required, since torch loads their libraries when it is imported. Where pip's own
# configuration caps torch below VERSION, run with PIP_CONFIG_FILE=/dev/null to leave it out.
set -euo pipefail

usage() { sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
python=python3
if [[ ${1:-} == --python ]]; then
    [[ $# -ge 2 ]] || usage
    python=$2; shift 2
fi
[[ $# -ge 1 && $1 != -* ]] || usage
version=$1; shift
py_version=$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])') || { echo "cannot run $python" >&2; exit 2; }
venv=${TMPDIR:-/tmp}/amp_bn_fix-torch-$version-py$py_version
if [[ $# -ge 1 && $1 != -- ]]; then
    [[ $1 != -* ]] || usage  # an option before `--` is not a folder
    venv=$1; shift
fi
if [[ $# -ge 1 ]]; then [[ $1 == -- ]] || usage; shift; fi
pytest_args=("$@")
[[ ${#pytest_args[@]} -gt 0 ]] || pytest_args=(-q)

root=$(realpath -- "$(dirname "$0")/..")
venv=$(realpath -m -- "$venv")
case "$venv/" in
    "$root"/*) echo "VENV_DIR must be outside the clone ($root)" >&2; exit 2 ;;
esac

start=$SECONDS
if [[ -x $venv/bin/python ]] && "$venv/bin/python" -c "import sys, torch; sys.exit(torch.__version__.split('+')[0] != '$version')" 2>/dev/null; then
    echo "reusing $venv (torch $version)"
else
    "$python" -m venv --clear "$venv"
    "$venv/bin/pip" install -q "torch==$version"
fi
# Editable, as the README's set-up: the tests run the clone's code, and the start-up hook is installed.
(cd "$root" && "$venv/bin/pip" install -q -e '.[test]')
install_s=$((SECONDS - start))

start=$SECONDS
set +e
(cd "$root" && "$venv/bin/python" -m pytest "${pytest_args[@]}") 2>&1 | tee "$venv/pytest.log"
status=${PIPESTATUS[0]}
set -e
suite_s=$((SECONDS - start))

summary=$(grep -E '^=*[ ]*[0-9]+ (passed|failed|skipped|error|deselected)|no tests ran' "$venv/pytest.log" | tail -1)
echo
"$venv/bin/python" -c 'import platform, torch; print(f"torch {torch.__version__}, Python {platform.python_version()}, CPU capability {torch.backends.cpu.get_cpu_capability()}")'
echo "venv: $venv"
echo "install: ${install_s}s  suite: ${suite_s}s  pytest exit status: $status"
echo "result: ${summary:-no pytest summary line (see $venv/pytest.log)}"
# pytest exits 5 when it collected no tests: that is a failure here too.
exit "$status"
