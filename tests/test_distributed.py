"""torchrun with two CPU ranks (gloo): ``AMP_BN_FIX=1`` alone enables the shim in every worker.

DDP, FSDP2, FSDP1 and SyncBatchNorm; the workers (ddp_worker.py, dist_worker.py) never import amp_bn_fix.
"""

import json
import math
import pathlib
import subprocess
import sys

import pytest
import torch

from _bounds import assert_within, rounding_bound
from _shared import SUBPROCESS_TIMEOUT, child_env

pytestmark = pytest.mark.slow

WORKER = pathlib.Path(__file__).resolve().parent / "ddp_worker.py"
RANKS = 2


@pytest.mark.parametrize("policy, bn_out", [("fp32", "torch.float32"), ("input", "torch.bfloat16")])
def test_torchrun_ddp_workers_get_the_shim_from_the_environment(tmp_path, policy, bn_out, run_torchrun):
    env = child_env(AMP_BN_FIX="1", AMP_BN_FIX_POLICY=policy, OMP_NUM_THREADS="1")
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(RANKS),
        str(WORKER), str(tmp_path),
    ]
    result = run_torchrun(command, env=env, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT)
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


# ---- FSDP2, FSDP1, DDP without buffer broadcast, SyncBatchNorm: tests/dist_worker.py ------------

DIST_WORKER = pathlib.Path(__file__).resolve().parent / "dist_worker.py"
# One torchrun job per policy. "autocast" is left out: with bfloat16 autocast and bfloat16 inputs
# it returns what "input" returns, through the same code (its own dtype rule is tested in-process).
POLICIES = ["fp32", "input", "off"]
# Errors torch raises on CPU, with or without the shim: exact on the version they were read from,
# only that there is one elsewhere (older releases word some differently, or fail in another check).
ERRORS_READ_ON = "2.13."
BF16_WEIGHT_FP32_STATS = "RuntimeError: expected scalar type BFloat16 but found Float"
FSDP1_NEEDS_DEVICE_ID = "RuntimeError: FSDP needs a non-CPU accelerator device, but no accelerator device is detected."
DDP_SYNCBN_ON_CPU = "ValueError: SyncBatchNorm layers only work with GPU modules"
SYNCBN_TRAIN_ON_CPU = "ValueError: SyncBatchNorm expected input tensor to be on GPU or XPU or privateuseone"

_dist_reports = {}


def dist_reports(policy, run_torchrun, tmp_path_factory, ranks=RANKS, scenarios=()):
    """Every rank's reports of dist_worker.py's scenarios (all by default) under ``policy``.

    One torchrun job per policy, rank count and scenario list, shared by the tests that read it.
    """
    key = (policy, ranks, tuple(scenarios))
    if key not in _dist_reports:
        out = tmp_path_factory.mktemp(f"dist-{policy}-{ranks}")
        env = child_env(AMP_BN_FIX="1", AMP_BN_FIX_POLICY=policy, OMP_NUM_THREADS="1")
        command = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
            str(DIST_WORKER), str(out), *scenarios,
        ]
        result = run_torchrun(command, env=env, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT)
        assert result.returncode == 0, result.stderr[-6000:]
        _dist_reports[key] = [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(ranks)]
    reports = _dist_reports[key]
    for report in reports:  # the environment alone set the shim up in every worker
        assert report["shim"] == {"loaded": True, "enabled": policy != "off", "policy": policy}
    return reports


def assert_error(run, expected):
    assert "error" in run, run
    if torch.__version__.startswith(ERRORS_READ_ON):
        assert run["error"] == expected


def expected_out(policy, autocast):
    """BatchNorm's output dtype for a bfloat16 input next to FP32 running stats."""
    if autocast and policy == "fp32":
        return "torch.float32"
    # Under autocast: the input's (input) or autocast's (autocast) dtype, both bfloat16 here. Outside
    # autocast (FSDP's param_dtype is no autocast region) a bfloat16 input with FP32 running stats is a
    # mixed call: computed in FP32 and returned in the input's dtype, whatever the policy.
    return "torch.bfloat16"


def assert_trained_in_fp32(scenario, reports, out_dtype, weight_dtype, input_dtype="torch.bfloat16"):
    """Every call as described, checked against float64; stats FP32, finite, averaged by the sync."""
    for report in reports:
        run = report["scenarios"][scenario]
        assert "error" not in run, (scenario, run["error"])
        assert len(run["losses"]) == 3 and all(math.isfinite(loss) for loss in run["losses"]), (scenario, run)
        assert len(run["calls"]) == 2 * 3  # two BatchNorms, three steps
        for call in run["calls"]:
            assert (call["input"], call["weight"], call["stats"], call["out"]) == (
                input_dtype, weight_dtype, "torch.float32", out_dtype
            ), (scenario, call)
            # FP32 arithmetic, the output rounded once (bn_probe.Watch measures it against float64).
            assert call["out_excess"] <= 0, (scenario, call)
            # An FP32 running-stat update from FP32 statistics: bfloat16 arithmetic would be ~1e-3 off.
            assert call["stats_excess"] <= 0, (scenario, call)
        assert run["stats_finite"] is True
    assert_synchronised(scenario, reports)


def assert_synchronised(scenario, reports):
    """Each rank's stats come from its own batches; after the all-reduce they are all the mean."""
    before = [report["scenarios"][scenario]["stats_before_sync"] for report in reports]
    after = [report["scenarios"][scenario]["stats_after_sync"] for report in reports]
    assert before[0] != before[1], scenario
    assert after[0] == after[1], scenario
    for i, stat in enumerate(after[0]):
        mean = torch.tensor([sum(rank[i][c] for rank in before) / len(before) for c in range(len(stat))],
                            dtype=torch.float64)
        # The all-reduce's FP32 sum, then its division: a rounding each.
        assert_within(torch.tensor(stat), mean, rounding_bound(mean.abs(), {torch.float32: 2}), what=scenario)


@pytest.mark.skipif(
    tuple(int(part) for part in torch.__version__.split(".")[:2]) < (2, 8),
    reason="FSDP2 needs CUDA streams on torch 2.4 and 2.6, with or without the shim (2.4: torch.cuda.Stream "
    "raises a CUDA error; 2.6: 'Stream' object has no attribute 'record_event'); 2.8 runs it on CPU, 2.7 "
    "was not tried",
)
@pytest.mark.parametrize("policy", POLICIES)
def test_fsdp2_bf16_params_batchnorm_in_fp32_with_fp32_stats(policy, run_torchrun, tmp_path_factory):
    """fully_shard with MixedPrecisionPolicy(param_dtype=bfloat16), outside and inside autocast.

    BatchNorm's weight and bias arrive in bfloat16, its running stats (buffers, which FSDP2 leaves
    alone) stay FP32: torch's CPU kernel rejects that mix, the shim computes it in FP32.
    """
    reports = dist_reports(policy, run_torchrun, tmp_path_factory)
    for scenario, autocast in [("fsdp2", False), ("fsdp2-autocast", True)]:
        if policy == "off":  # torch's own behaviour, the same without the shim
            for report in reports:
                run = report["scenarios"][scenario]
                assert_error(run, BF16_WEIGHT_FP32_STATS)
                assert run["losses"] == []
            continue
        assert_trained_in_fp32(scenario, reports, expected_out(policy, autocast), "torch.bfloat16")


@pytest.mark.parametrize("policy", POLICIES)
def test_fsdp1_mixed_precision_on_cpu(policy, run_torchrun, tmp_path_factory):
    """FullyShardedDataParallel with MixedPrecision(param_dtype=bfloat16) and device_id=cpu."""
    reports = dist_reports(policy, run_torchrun, tmp_path_factory)
    for report in reports:
        # Without device_id FSDP1 refuses a CPU-only machine before it looks at the model.
        assert_error(report["scenarios"]["fsdp1-no-device-id"], FSDP1_NEEDS_DEVICE_ID)

    # One FSDP unit for the whole model, or an auto_wrap_policy with MixedPrecision(...,
    # _module_classes_to_ignore=()): BatchNorm gets bfloat16 weights next to FP32 stats, as in FSDP2.
    for scenario, autocast in [("fsdp1", False), ("fsdp1-autocast", True), ("fsdp1-autowrap-bn-mixed-autocast", True)]:
        if policy == "off":
            for report in reports:
                assert_error(report["scenarios"][scenario], BF16_WEIGHT_FP32_STATS)
            continue
        assert_trained_in_fp32(scenario, reports, expected_out(policy, autocast), "torch.bfloat16")

    # With an auto_wrap_policy, FSDP1 wraps each BatchNorm in its own unit without mixed precision
    # (MixedPrecision._module_classes_to_ignore) and casts its input to FP32 and its output back to
    # the input's dtype: BatchNorm never sees bfloat16, so every policy gives FSDP's bfloat16.
    assert_trained_in_fp32(
        "fsdp1-autowrap-autocast", reports, "torch.bfloat16", "torch.float32", input_dtype="torch.float32"
    )

    # buffer_dtype=bfloat16 makes the running stats bfloat16: FSDP1 casts buffers itself, not
    # through Module._apply, so the shim cannot keep them FP32. It still computes in FP32 and
    # writes the update back into the bfloat16 buffers.
    for report in reports:
        run = report["scenarios"]["fsdp1-buffer-bf16-autocast"]
        assert "error" not in run and all(math.isfinite(loss) for loss in run["losses"])
        for call in run["calls"]:
            assert call["stats"] == "torch.bfloat16"
            assert call["out"] == ("torch.bfloat16" if policy == "off" else expected_out(policy, True))
        assert run["stats_finite"] is True


@pytest.mark.parametrize("policy", POLICIES)
def test_ddp_without_buffer_broadcast(policy, run_torchrun, tmp_path_factory):
    """DDP(broadcast_buffers=False): each rank keeps its own FP32 stats until they are averaged."""
    reports = dist_reports(policy, run_torchrun, tmp_path_factory)
    # The model is FP32 under autocast: a bfloat16 input with FP32 weight and stats. With the policy
    # off it is torch's mixed-dtype kernel (bfloat16 out, FP32 arithmetic and stats).
    out_dtype = "torch.bfloat16" if policy == "off" else expected_out(policy, True)
    assert_trained_in_fp32("ddp-no-broadcast", reports, out_dtype, "torch.float32")


@pytest.mark.parametrize("policy", POLICIES)
def test_sync_batchnorm_on_cpu(policy, run_torchrun, tmp_path_factory):
    """SyncBatchNorm's syncing path refuses CPU; its non-syncing path goes through the shim."""
    reports = dist_reports(policy, run_torchrun, tmp_path_factory)
    out_dtype = "torch.bfloat16" if policy == "off" else expected_out(policy, True)
    for report in reports:
        runs = report["scenarios"]
        # Whatever broadcast_buffers says, DDP refuses a CPU model with SyncBatchNorm layers ...
        assert_error(runs["ddp-syncbn"], DDP_SYNCBN_ON_CPU)
        # ... and SyncBatchNorm itself, training with a process group, refuses a CPU input before it
        # looks at the world size (one rank as well), before reaching F.batch_norm or the sync function.
        assert_error(runs["syncbn-train"], SYNCBN_TRAIN_ON_CPU)
        assert runs["syncbn-train"]["kinds"] == ["SyncBatchNorm"]

        # Eval mode never syncs: F.batch_norm with the running stats, under the policy.
        run = runs["syncbn-eval"]
        assert run["kinds"] == ["SyncBatchNorm"] and run["stats_unchanged"] is True
        assert len(run["calls"]) == 2
        for call in run["calls"]:
            assert (call["input"], call["stats"], call["out"]) == ("torch.bfloat16", "torch.float32", out_dtype)
            assert call["training"] is False and call["out_excess"] <= 0, call

        # Training before init_process_group (a single process) does not sync either.
        run = runs["syncbn-no-group"]
        assert run["kinds"] == ["SyncBatchNorm"] and "error" not in run
        assert len(run["losses"]) == 3 and all(math.isfinite(loss) for loss in run["losses"])
        for call in run["calls"]:
            assert (call["input"], call["stats"], call["out"]) == ("torch.bfloat16", "torch.float32", out_dtype)
            assert call["out_excess"] <= 0 and call["stats_excess"] <= 0, call


def test_sync_batchnorm_on_cpu_with_one_rank(run_torchrun, tmp_path_factory):
    """World size 1 does not help on CPU: the device check comes before the world-size check."""
    (report,) = dist_reports("fp32", run_torchrun, tmp_path_factory, 1, ["ddp-syncbn", "syncbn-train", "syncbn-eval"])
    runs = report["scenarios"]
    assert_error(runs["ddp-syncbn"], DDP_SYNCBN_ON_CPU)
    assert_error(runs["syncbn-train"], SYNCBN_TRAIN_ON_CPU)
    assert [call["out"] for call in runs["syncbn-eval"]["calls"]] == ["torch.float32"] * 2
    assert all(call["out_excess"] <= 0 for call in runs["syncbn-eval"]["calls"])


# ---- a 16-bit cast model in FSDP: the keep_fp32 trade-off --------------------------------------

FSDP_CAST_PROBE = r"""
import json, os, sys, torch, torch.distributed as dist
from torch import nn
import amp_bn_fix
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
from torch.distributed.fsdp import FullyShardedDataParallel
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
try:
    from torch.distributed.fsdp import fully_shard
except ImportError:  # torch < 2.6
    from torch.distributed._composable.fsdp import fully_shard

def model():
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU()).bfloat16()

def fsdp1(bn_unit):
    wrap = ModuleWrapPolicy({nn.BatchNorm2d}) if bn_unit else None
    return FullyShardedDataParallel(model(), device_id=torch.device("cpu"), auto_wrap_policy=wrap)

def fsdp2(bn_unit):
    net = model()
    if bn_unit:
        fully_shard(net[1])
    fully_shard(net)
    return net

report = {}
for keep in ("all", "stats"):
    amp_bn_fix.configure(keep_fp32=keep)
    for name, make in (("fsdp1", fsdp1), ("fsdp2", fsdp2)):
        for bn_unit in (False, True):
            key = f"{keep}-{name}-{'bn-unit' if bn_unit else 'one-unit'}"
            try:
                out = make(bn_unit)(torch.randn(4, 3, 16, 16, dtype=torch.bfloat16))
                out.float().sum().backward()
                report[key] = str(out.dtype)
            except Exception as exc:
                report[key] = type(exc).__name__ + ": " + str(exc)
dist.destroy_process_group()
print(json.dumps(report))
"""


@pytest.mark.skipif(tuple(int(p) for p in torch.__version__.split(".")[:2]) < (2, 8),
                    reason="FSDP2 needs CUDA streams before torch 2.8, with or without the shim")
def test_fsdp_units_of_a_16_bit_cast_model(tmp_path):
    """``keep_fp32=all`` gives BatchNorm FP32 parameters in a 16-bit model; FSDP flattens (FSDP1) or
    groups (FSDP2) one dtype per unit, so BatchNorm needs a unit of its own, as FSDP's own
    MixedPrecision gives it. ``stats`` keeps every parameter 16-bit: one unit works."""
    result = subprocess.run([sys.executable, "-c", FSDP_CAST_PROBE, str(tmp_path / "store")], env=child_env(),
                            capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT)
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout.splitlines()[-1])
    for key, outcome in report.items():
        keep, name, unit = key.split("-", 2)
        if keep == "all" and unit == "one-unit":
            assert "uniform" in outcome and "dtype" in outcome, (key, outcome)  # FSDP's own check
        else:
            assert outcome == "torch.bfloat16", (key, outcome)
