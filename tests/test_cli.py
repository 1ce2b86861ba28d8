"""The command line: ``amp-bn-fix demo`` and ``python -m amp_bn_fix``."""

import subprocess
import sys

import torch.nn.functional as F

import amp_bn_fix
from amp_bn_fix import _cli


def demo_rows(text):
    rows = [line.split() for line in text.splitlines()]
    return [r for r in rows if len(r) == 5 and r[0] in ("cpu", "cuda")]


def test_demo_prints_the_seed_without_and_with_the_shim(capsys):
    assert _cli.main(["demo"]) == 0
    rows = demo_rows(capsys.readouterr().out)
    cpu = [r for r in rows if r[0] == "cpu"]
    assert cpu == [
        ["cpu", "float16", "Linear", "float16", "float16"],
        ["cpu", "float16", "BatchNorm1d", "float16", "float32"],
        ["cpu", "float16", "Linear", "float16", "float16"],
        ["cpu", "bfloat16", "Linear", "bfloat16", "bfloat16"],
        ["cpu", "bfloat16", "BatchNorm1d", "bfloat16", "float32"],
        ["cpu", "bfloat16", "Linear", "bfloat16", "bfloat16"],
    ]


def test_demo_leaves_the_patch_as_it_found_it():
    original = F.batch_norm.__wrapped__
    amp_bn_fix.disable()
    _cli.main(["demo"])
    assert F.batch_norm is original
    amp_bn_fix.enable()
    _cli.main(["demo"])
    assert F.batch_norm.__wrapped__ is original


def test_python_dash_m_runs_the_demo():
    result = subprocess.run([sys.executable, "-m", "amp_bn_fix", "demo"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert ["cpu", "bfloat16", "BatchNorm1d", "bfloat16", "float32"] in demo_rows(result.stdout)
