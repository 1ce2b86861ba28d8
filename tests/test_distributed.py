"""torchrun with two CPU ranks (gloo): ``AMP_BN_FIX=1`` alone enables the shim in every worker."""

import json
import os
import pathlib
import sys

import pytest

WORKER = pathlib.Path(__file__).resolve().parent / "ddp_worker.py"
RANKS = 2


@pytest.mark.parametrize("policy, bn_out", [("fp32", "torch.float32"), ("input", "torch.bfloat16")])
def test_torchrun_ddp_workers_get_the_shim_from_the_environment(tmp_path, policy, bn_out, run_torchrun):
    env = {**os.environ, "AMP_BN_FIX": "1", "AMP_BN_FIX_POLICY": policy, "OMP_NUM_THREADS": "1"}
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(RANKS),
        str(WORKER), str(tmp_path),
    ]
    result = run_torchrun(command, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[:6000]
    reports = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(RANKS)]
    for report in reports:
        assert report["patch_active"] is True and report["policy"] == policy
        assert report["bn_out"] == [bn_out] * 4
        assert report["stats_dtype"] == ["torch.float32", "torch.float32"]
        assert report["stats_finite"] is True
        assert report["weight_grad_dtype"] == "torch.float32"
    # DDP broadcasts rank 0's buffers before each forward: every rank sees the same FP32 stats,
    # and they move from step to step.
    stats = [report["stats_at_forward"] for report in reports]
    assert stats[0] == stats[1]
    assert stats[0][0] != stats[0][-1]
