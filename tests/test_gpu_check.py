"""tools/gpu_check.sh without a GPU: its dry run goes through every step and writes its summary, and
its preflight stops the check at once, saying why, when the environment cannot run it.

The dry run installs the clone (editable, offline) into the interpreter running these tests, as the
script does into the one it checks.
"""

import configparser
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tools" / "gpu_check.sh"
TIMEOUT = 600  # a busy 2-core machine; the dry run takes about a minute alone

CORRECTNESS = ["environment", "bug-report", "demo", "test-cuda", "sync-debug", "cuda-graph",
               "compile-reduce-overhead", "cuda-marked-tests"]
CUDA_TESTS = ["test-cuda", "sync-debug", "cuda-graph", "compile-reduce-overhead", "cuda-marked-tests"]


def run_check(*args, tmp_path, pythonpath=None):
    env = {name: value for name, value in os.environ.items() if not name.startswith("AMP_BN_FIX")}
    env.update(PYTHON=sys.executable, TMPDIR=str(tmp_path))
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=env,
                          timeout=TIMEOUT, cwd=ROOT)


def requirement(section, option, name):
    """The version range setup.cfg gives ``name`` (e.g. '>=2.5,<3')."""
    config = configparser.ConfigParser(interpolation=None)
    config.read(ROOT / "setup.cfg")
    for line in config.get(section, option).split():
        if line.startswith(name) and not line[len(name):][:1].isalnum():
            return line[len(name):]
    raise AssertionError(f"setup.cfg has no requirement on {name}")


def summary_rows(text):
    """{step: outcome} of the summary's table."""
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        if line.startswith("| ") and len(cells) == 5 and cells[0] not in ("step", "---"):
            rows[cells[0]] = cells[1]
    return rows


@pytest.mark.slow
@pytest.mark.tools
def test_the_dry_run_goes_through_every_step_and_writes_its_summary(tmp_path):
    out = tmp_path / "out"
    result = run_check("--dry-run", "--out", str(out), tmp_path=tmp_path)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-4000:]
    summary = (out / "gpu-check-summary.md").read_text()
    rows = summary_rows(summary)
    # Every step, in order: the preflight and the install, the correctness sections, the benchmark last.
    assert list(rows) == ["preflight", "install", *CORRECTNESS, "benchmark", "report"], summary
    assert {rows[name] for name in CUDA_TESTS} == {"skipped: no CUDA (dry run)"}, summary
    assert all(rows[name] == "passed" for name in rows if name not in CUDA_TESTS), summary
    assert "- Failed: none" in summary
    assert f"- Logs: {out / 'gpu-check-logs'}/" in summary
    # Printed last, as written.
    assert result.stdout.rstrip().endswith(f"summary: {out / 'gpu-check-summary.md'}")
    assert summary.strip() in result.stdout
    # Every log in --out.
    logs = out / "gpu-check-logs"
    assert {"preflight.log", "install.log", "report.log", "sections.tsv", "bench.json"} <= {p.name for p in logs.iterdir()}
    assert "no CUDA" in (logs / "preflight.log").read_text()
    report = json.loads((out / "cuda-dry-run-on-cpu.json").read_text())
    assert report["failed"] == [] and report["skipped"] == CUDA_TESTS
    # The benchmark's CUDA rows ran on tiny CPU tensors, and the report has them.
    rows = {row["row"] for row in report["bench"]["rows"]} | {f["row"] for f in report["bench"]["figures"]}
    assert {"cuda-bn", "cuda-resnet50", "cuda-bandwidth", "cuda-memory", "tiny-train", "aten-ops", "traffic"} <= rows
    assert "cuda-bn" in (out / "cuda-dry-run-on-cpu.md").read_text()


@pytest.mark.parametrize("package, module_text, says", [
    ("wrapt", "__version__ = '1.0.0'", "wrapt 1.0.0 (at {fake}) is outside the range setup.cfg's install_requires "
                                       "asks for: wrapt{range}"),
    ("torch", "__version__ = '0.1.0'", "torch 0.1.0 (at {fake}) is outside the range setup.cfg's install_requires "
                                       "asks for: torch{range}"),
    ("pytest", "raise ImportError('not here')", "pytest is missing (ImportError: not here); setup.cfg's test extra "
                                                "asks for pytest{range}"),
], ids=["wrapt-outside-the-range", "torch-below-the-floor", "no-pytest"])
def test_the_preflight_stops_the_check_and_says_how_to_bring_the_wheel(tmp_path, package, module_text, says):
    # The module the checked Python would import: first on its path, ahead of the installed one.
    fake = tmp_path / "fake"
    (fake / package).mkdir(parents=True)
    (fake / package / "__init__.py").write_text(module_text + "\n")
    extra = "options.extras_require" if package == "pytest" else "options"
    spec = requirement(extra, "test" if package == "pytest" else "install_requires", package)
    out = tmp_path / "out"
    result = run_check("--dry-run", "--out", str(out), tmp_path=tmp_path, pythonpath=fake)
    assert result.returncode == 2, result.stdout[-6000:] + result.stderr[-4000:]
    assert "problem: " + says.format(fake=fake / package, range=spec) in result.stdout
    assert f"pip download --only-binary=:all: --python-version {sys.version_info.major}.{sys.version_info.minor}" \
           in result.stdout
    assert f"-m pip install --no-index --find-links wheels/ '{package}{spec}'" in result.stdout
    # Nothing after the preflight ran; the summary says why.
    assert sorted(p.name for p in (out / "gpu-check-logs").iterdir()) == ["preflight.log"]
    summary = (out / "gpu-check-summary.md").read_text()
    assert summary_rows(summary) == {"preflight": "failed"}
    assert "The preflight failed, so nothing else ran" in summary and f"{package}" in summary
    assert "gpu_check: the preflight failed" in result.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given where there is no CUDA")
def test_without_cuda_the_preflight_stops_a_real_run(tmp_path):
    out = tmp_path / "out"
    result = run_check("--out", str(out), tmp_path=tmp_path)
    assert result.returncode == 2, result.stdout[-6000:] + result.stderr[-4000:]
    assert "problem: no CUDA: torch " in result.stdout and "--dry-run" in result.stdout
    assert sorted(p.name for p in (out / "gpu-check-logs").iterdir()) == ["preflight.log"]
