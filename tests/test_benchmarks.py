"""The benchmark and the GPU check keep working: every row runs in quick mode, the CUDA rows and the
GPU check's script run as a dry run on CPU, and the results are written. No timing is asserted
(speed belongs in ``benchmarks/``, never in timed tests): only that each row ran.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from _shared import child_env

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks" / "bench.py"
GPU_CHECK = ROOT / "tools" / "gpu_check.sh"
TIMEOUT = 900  # a busy 2-core machine; the quick run takes about a minute alone


def env():
    return child_env(PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))


def run(*args, timeout=TIMEOUT):
    return subprocess.run([sys.executable, str(BENCH), *args], capture_output=True, text=True, env=env(),
                          timeout=timeout, cwd=ROOT)


@pytest.fixture
def bench(monkeypatch):
    """The benchmark's CLI module, imported in this process."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import bench

    return bench


def names(bench, device):
    return [spec.name for spec in bench.ROWS if device in spec.home]


def test_the_gpu_check_script_parses():
    result = subprocess.run(["bash", "-n", str(GPU_CHECK)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_only_selects_rows_by_name_and_pattern_and_rejects_unknown_ones(bench):
    import argparse

    parser = argparse.ArgumentParser()
    assert [s.name for s in bench.select("aten-ops,tiny-eval", "cpu", parser)] == ["tiny-eval", "aten-ops"]
    assert {s.name for s in bench.select("cuda-*", "cpu", parser)} == {"cuda-bn", "cuda-resnet50", "cuda-bandwidth",
                                                                         "cuda-memory"}
    assert {s.name for s in bench.select(None, "cuda", parser)} >= {"tiny-train", "cuda-bn"}
    with pytest.raises(SystemExit):
        bench.select("tiny-train,no-such-row", "cpu", parser)


def test_the_gpu_check_report_records_failed_sections(bench, tmp_path):
    import _report

    log = tmp_path / "log"
    log.write_text("Traceback ...\nRuntimeError: operation not permitted when stream is capturing\n")
    sections = tmp_path / "sections.tsv"
    sections.write_text(f"bug-report\tpassed\t0\t4\t{log}\ncuda-graph\tfailed\t1\t7\t{log}\n")
    assert _report.main(["gpu-check", "--sections", str(sections), "--gpu", "NVIDIA H200",
                         "--out-stem", str(tmp_path / "cuda-nvidia-h200")]) == 0
    data = json.loads((tmp_path / "cuda-nvidia-h200.json").read_text())
    assert data["failed"] == ["cuda-graph"] and data["bench"] is None
    md = (tmp_path / "cuda-nvidia-h200.md").read_text()
    assert "NVIDIA H200" in md and "operation not permitted when stream is capturing" in md
    assert _report.slug("NVIDIA H200 NVL") == "nvidia-h200-nvl"


@pytest.mark.slow
@pytest.mark.tools
def test_quick_mode_runs_every_cpu_row(bench):
    result = run("--quick", "--threads", "1")  # every row once: the thread sweep adds time, not rows
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    for name in names(bench, "cpu"):
        assert f"[{name}] done in" in result.stdout, f"row {name} did not run"
        assert f"ERROR in {name}" not in result.stdout
