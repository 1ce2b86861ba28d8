"""The examples run as a user runs them (a fresh interpreter, no arguments but smaller sizes) and show the fix."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import List

import pytest

from _shared import SUBPROCESS_TIMEOUT, child_env

# Each example starts fresh interpreters (the numerics study and torchrun several): seconds to minutes.
pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def run_example(name: str, *args: str, timeout: float = SUBPROCESS_TIMEOUT, run=subprocess.run, cwd=None) -> str:
    done = run(
        [sys.executable, str(EXAMPLES / name), *args],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        timeout=timeout,
        env=child_env(),
    )
    assert done.returncode == 0, f"{name} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def table_rows(output: str, first: str) -> List[List[str]]:
    """Rows of a printed table whose first cell starts with ``first``, split on runs of two spaces."""
    return [[c.strip() for c in line.split("  ") if c.strip()] for line in output.splitlines() if line.startswith(first)]


def test_bug_report_batchnorm_after_linear_is_float32_only_with_the_shim():
    out = run_example("bug_report.py")
    rows = [r for r in table_rows(out, "2:") if r[3] == "BatchNorm1d"]
    assert {r[2] for r in rows} >= {"float16", "bfloat16"}
    for _, _, autocast, _, without, with_shim, expected in rows:
        assert without == autocast  # torch's native behaviour: the report's complaint
        assert with_shim == expected == "float32"
    assert "every layer has the expected dtype" in out


def test_numerics_study_small(tmp_path):
    # No --out: the plot goes to the current directory, never over the committed examples/numerics_study.png.
    committed = (EXAMPLES / "numerics_study.png").read_bytes()
    plot, results = tmp_path / "numerics_study.png", tmp_path / "study.json"
    out = run_example("numerics_study.py", "--steps", "12", "--train-size", "512", "--eval-size", "256",
                      "--json", str(results), cwd=tmp_path)
    assert (EXAMPLES / "numerics_study.png").read_bytes() == committed
    assert "eval acc" in out and "ms/step" in out
    if importlib.util.find_spec("matplotlib") is not None:
        assert plot.stat().st_size > 10_000 and plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:
        assert "no plot" in out

    data = json.loads(results.read_text())
    runs = {r["run"]: r for r in data["results"]}
    assert runs["autocast, native"]["bn_out_dtype"] == "bfloat16"
    assert runs["autocast + shim (fp32)"]["bn_out_dtype"] == "float32"
    assert runs["autocast + shim (input)"]["bn_out_dtype"] == "bfloat16"
    # .half() without the shim: float16 running_var overflows (the 12-bit inputs' variance is ~1e6).
    half, fixed = runs[".half(), native"], runs[".half() + shim"]
    assert half["stats_dtype"] == "float16" and not all(map(math.isfinite, half["variances"][-1]))
    assert fixed["stats_dtype"] == "float32" and max(fixed["tracking"]) < 1e-5
    assert max(runs["autocast + shim (fp32)"]["tracking"]) < 1e-5

    guard = data["guard"]
    assert not all(map(math.isfinite, guard["autocast, native"]["variances"][-1]))
    assert not all(map(math.isfinite, guard["autocast + shim, guard off"]["variances"][-1]))
    on = guard["autocast + shim, guard on"]
    clean = runs["autocast + shim (fp32)"]
    assert on["means"][-1] == clean["means"][-1] and on["variances"][-1] == clean["variances"][-1]


def test_torchrun_ddp_enabled_by_the_environment_only(run_torchrun):
    source = (EXAMPLES / "torchrun_ddp.py").read_text()
    assert "import amp_bn_fix" not in source
    out = run_example("torchrun_ddp.py", "--steps", "3", run=run_torchrun)
    # The report's rows have six cells; gloo's connection messages from the two ranks can interleave
    # into lines that start with a rank number too.
    rows = [r for r in table_rows(out, "0 ") + table_rows(out, "1 ") if len(r) == 6]
    assert len(rows) == 2, out
    for rank, state, bn_out, stats, finite, _ in rows:
        assert (state, bn_out, stats, finite) == ("on, policy fp32", "float32", "float32", "yes"), out


def run_see_it_work(*args: str, **env: str) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, str(EXAMPLES / "see_it_work.py"), *args], capture_output=True, text=True,
                          timeout=SUBPROCESS_TIMEOUT, env=child_env(**env))
    assert done.returncode == 0, done.stderr
    return done


def epochs(out: str) -> List[str]:
    return [line.split(": ", 1)[1] for line in out.splitlines() if line.startswith("epoch ")]


def test_see_it_work_shows_the_dtypes_the_epochs_and_the_exit_line():
    # docs/see-it-work.md quotes these lines.
    done = run_see_it_work(AMP_BN_FIX_REPORT="1")
    assert "BatchNorm output dtypes: {'1': 'float32', '4': 'float32'}" in done.stdout
    assert epochs(done.stdout) == ["BatchNorm calls handled 8, guard skips none",
                                   "BatchNorm calls handled 8, guard skips {'1': 1, '4': 1}",
                                   "BatchNorm calls handled 8, guard skips none"]
    assert "running stats finite: yes" in done.stdout
    assert "RuntimeWarning: amp_bn_fix: the guard left the running stats of 16 channels" in done.stderr
    assert done.stderr.splitlines()[-1] == ("amp_bn_fix: calls handled: 24 fp32; passed through: 0; "
                                            "guard skips: 2 (2 in running stats no longer alive)")


def test_see_it_work_with_the_input_policy_returns_bfloat16():
    done = run_see_it_work(AMP_BN_FIX_POLICY="input")
    assert "BatchNorm output dtypes: {'1': 'bfloat16', '4': 'bfloat16'}" in done.stdout


def test_see_it_work_on_the_cuda_route_skips_silently_until_report():
    done = run_see_it_work("--route", "device")
    assert epochs(done.stdout)[1] == "BatchNorm calls handled 8, guard skips {'1': 1, '4': 1}"
    assert "RuntimeWarning" not in done.stderr


def test_see_it_work_compiled_counts_what_was_traced():
    done = run_see_it_work("--compile", "aot_eager")
    lines = epochs(done.stdout)
    assert lines[0].startswith("BatchNorm calls handled") and lines[1:] == ["BatchNorm calls handled 0, guard skips none"] * 2
    assert "running stats finite: yes" in done.stdout  # the guard ran in the compiled code, uncounted
