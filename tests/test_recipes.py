"""docs/recipes.md: each launcher or trainer recipe, where its client is installed (else skipped, saying why).

torchrun and Lightning are tested elsewhere (tests/test_examples.py, tests/test_clients.py); here:
``accelerate launch`` of the accelerate client worker, timm's own ``BatchNormAct2d``, and that every
command of the page enables the shim the way the page says.
"""

from __future__ import annotations

import importlib.util
import json
import pathlib
import re
import subprocess
import sys

import pytest
import torch

import amp_bn_fix
from _shared import SUBPROCESS_TIMEOUT, child_env

ROOT = pathlib.Path(__file__).resolve().parent.parent
RECIPES = ROOT / "docs" / "recipes.md"
CLIENT_WORKER = ROOT / "tests" / "client_worker.py"


def test_every_command_of_the_recipes_enables_the_shim():
    commands = [line for block in re.findall(r"```bash\n(.*?)```", RECIPES.read_text(), flags=re.S)
                for line in block.splitlines() if line.strip()]
    assert len(commands) == 6
    for line in commands:
        assert line.startswith(("AMP_BN_FIX=1 ", "amp-bn-fix run -- ")), line


@pytest.mark.slow
def test_accelerate_launch(tmp_path):
    if importlib.util.find_spec("accelerate") is None:
        pytest.skip("accelerate not installed (pip install -e '.[clients]')")
    out = tmp_path / "accelerate.json"
    done = subprocess.run(
        [sys.executable, "-m", "accelerate.commands.launch", "--cpu", "--num_processes", "1",
         "--mixed_precision", "bf16", str(CLIENT_WORKER), "accelerate-bf16", str(out)],
        env=child_env(AMP_BN_FIX="1", OMP_NUM_THREADS="1"), cwd=tmp_path,
        capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT,
    )
    assert done.returncode == 0, done.stderr[-6000:]
    report = json.loads(out.read_text())
    assert report["shim"] == {"loaded": True, "enabled": True, "policy": "fp32"}
    assert report["stats_finite"] is True
    assert {call["out"] for call in report["calls"]} == {"torch.float32"}


@pytest.mark.parametrize("policy, out_dtype", [("fp32", torch.float32), ("input", torch.bfloat16)])
def test_timm_batchnormact2d(policy, out_dtype):
    if importlib.util.find_spec("timm") is None:
        pytest.skip("timm not installed: its BatchNormAct2d pattern is tested rebuilt from torch.nn in test_clients.py")
    from timm.layers import BatchNormAct2d

    bn = BatchNormAct2d(8)
    x = torch.randn(4, 8, 6, 6).bfloat16()
    with amp_bn_fix.policy(policy), torch.autocast("cpu", dtype=torch.bfloat16):
        y = bn(x)
    assert y.dtype is out_dtype
    assert bn.running_var.dtype is torch.float32 and torch.isfinite(bn.running_var).all()
