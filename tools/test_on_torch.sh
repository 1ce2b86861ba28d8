#!/usr/bin/env bash
# Run the test suite on a given torch version, in a virtual environment outside the clone.
#
#   tools/test_on_torch.sh VERSION [VENV_DIR] [-- PYTEST_ARGS...]
#
# VENV_DIR defaults to ${TMPDIR:-/tmp}/amp_bn_fix-torch-VERSION and is reused while it holds that
# torch version. PYTEST_ARGS default to the README's test command (-q); e.g. `-- -q -m "not slow"`.
# Needs python3 (>= 3.10) and the package index. torch from PyPI is a CUDA build on Linux: it runs on
# CPU, but its nvidia-* packages (several GB) are required, since torch loads their libraries when
# it is imported.
set -euo pipefail

usage() { sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
[[ $# -ge 1 && $1 != -* ]] || usage
version=$1; shift
venv=${TMPDIR:-/tmp}/amp_bn_fix-torch-$version
if [[ $# -ge 1 && $1 != -- ]]; then venv=$1; shift; fi
if [[ $# -ge 1 ]]; then [[ $1 == -- ]] || usage; shift; fi
pytest_args=("$@")
[[ ${#pytest_args[@]} -gt 0 ]] || pytest_args=(-q)

root=$(realpath "$(dirname "$0")/..")
venv=$(realpath -m "$venv")
case "$venv/" in
    "$root"/*) echo "VENV_DIR must be outside the clone ($root)" >&2; exit 2 ;;
esac

start=$SECONDS
if [[ -x $venv/bin/python ]] && "$venv/bin/python" -c "import sys, torch; sys.exit(torch.__version__.split('+')[0] != '$version')" 2>/dev/null; then
    echo "reusing $venv (torch $version)"
else
    python3 -m venv --clear "$venv"
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
echo "torch $("$venv/bin/python" -c 'import torch; print(torch.__version__)') in $venv"
echo "install: ${install_s}s  suite: ${suite_s}s  pytest exit status: $status"
echo "result: ${summary:-no pytest summary line (see $venv/pytest.log)}"
# pytest exits 5 when it collected no tests: that is a failure here too.
exit "$status"
