"""The shim under the training code users already run.

Clients (slow): Lightning and HF accelerate run a few real training steps on CPU in a subprocess
(tests/client_worker.py) where only the environment, ``AMP_BN_FIX=1``, enables the shim; skipped
when the client is not installed (``pip install -e '.[clients]'``).

Model patterns: torchvision's and timm's wheels on the package index need the CUDA build of torch,
so their BatchNorm patterns are rebuilt from torch.nn (tests/bn_probe.py) and checked here, in
process, against float64: a ResNet basic block, a MobileNet-style depthwise block and timm's
``BatchNormAct2d``, which calls ``F.batch_norm`` itself.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import math
import pathlib
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import amp_bn_fix
from _bounds import assert_near, assert_within, fp32_bound, rounding_bound, same_computation_bound
from _builders import fp64_module
from _shared import SUBPROCESS_TIMEOUT, child_env
from bn_probe import BatchNormAct2d, Watch, bn_modules, mobilenet, resnet

CLIENT_WORKER = pathlib.Path(__file__).resolve().parent / "client_worker.py"
POLICIES = ["fp32", "input", "autocast", "off"]
# Under bfloat16 autocast, for a bfloat16 input: what each policy returns ("off" is torch's own).
OUT_DTYPE = {"fp32": torch.float32, "input": torch.bfloat16, "autocast": torch.bfloat16, "off": torch.bfloat16}


# ---- clients, in a subprocess ------------------------------------------------------------------


def skip_unless_installed(*names: str) -> None:
    """``pytest.importorskip`` without the import: the client runs in a subprocess, and importing
    Lightning here (seconds, and torch._dynamo with it) would only change the test process."""
    if not any(importlib.util.find_spec(name) is not None for name in names):
        pytest.skip(f"{' or '.join(names)} not installed (pip install -e '.[clients]')")


def run_client(client: str, policy: str, tmp_path: pathlib.Path, stats: str = "torch.float32") -> dict:
    out = tmp_path / f"{client}.json"
    done = subprocess.run(
        [sys.executable, str(CLIENT_WORKER), client, str(out)],
        env=child_env(AMP_BN_FIX="1", AMP_BN_FIX_POLICY=policy, OMP_NUM_THREADS="1"),
        cwd=tmp_path, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT,
    )
    assert done.returncode == 0, done.stderr[-6000:]
    report = json.loads(out.read_text())
    # The environment alone enabled the shim in the client's process, with the policy asked for.
    assert report["shim"] == {"loaded": True, "enabled": True, "policy": policy}
    assert report["losses_finite"] is True and len(report["losses"]) == 3
    assert report["stats_dtypes"] == [stats] and report["stats_finite"] is True
    assert report["stats_moved"] is True
    assert len(report["calls"]) == 6 * 3  # six BatchNorms, three steps
    return report


def assert_calls(report: dict, autocast: bool, weight: str, out: str, input: str = "torch.bfloat16",
                 stats: str = "torch.float32") -> None:
    for call in report["calls"]:
        assert call["training"] is True and call["autocast"] is autocast, call
        assert (call["input"], call["weight"], call["stats"], call["out"]) == (input, weight, stats, out), call
        # Under autocast FP32 arithmetic, the output rounded once (bn_probe.Watch measures it against
        # float64); outside it torch's own output (bit for bit: test_half_models checks that).
        assert call["out_excess"] <= 0 or not autocast, call
        # FP32 running-stat updates (bfloat16 stats, as torch keeps them in a bfloat16 model, are ~5e-3 off).
        assert call["stats_excess"] <= 0, call


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["fp32", "input"])
def test_lightning_bf16_mixed(policy, tmp_path):
    """Trainer(precision="bf16-mixed"): training_step under CPU autocast, an FP32 model."""
    skip_unless_installed("lightning", "pytorch_lightning")
    report = run_client("lightning-bf16-mixed", policy, tmp_path)
    assert report["precision"] == "bf16-mixed" and report["param_dtypes"] == ["torch.float32"]
    assert_calls(report, autocast=True, weight="torch.float32", out=str(OUT_DTYPE[policy]))


@pytest.mark.slow
@pytest.mark.parametrize("precision, dtype", [("bf16-true", "torch.bfloat16"), ("16-true", "torch.float16")])
@pytest.mark.parametrize("policy", ["fp32", "input"])
def test_lightning_true_half_precision(policy, precision, dtype, tmp_path):
    """Trainer(precision="bf16-true" / "16-true"): the model is cast to 16 bits, no autocast.

    Lightning casts with ``module.to(dtype)`` while the shim is enabled: the model is all 16-bit, as
    torch makes it, and the shim keeps the running stats' FP32 master. BatchNorm's calls outside
    autocast return torch's own output, in the input's dtype whatever the policy, and update the
    master in FP32 (``stats_excess`` measures it).
    """
    skip_unless_installed("lightning", "pytorch_lightning")
    report = run_client(f"lightning-{precision}", policy, tmp_path, stats=dtype)
    assert report["precision"] == precision and report["param_dtypes"] == [dtype]
    assert_calls(report, autocast=False, weight=dtype, out=dtype, input=dtype, stats=dtype)


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["fp32", "input"])
def test_accelerate_bf16_on_cpu(policy, tmp_path):
    """Accelerator(mixed_precision="bf16", cpu=True): prepare() runs forward under CPU autocast."""
    skip_unless_installed("accelerate")
    report = run_client("accelerate-bf16", policy, tmp_path)
    assert report["precision"] == "bf16" and report["param_dtypes"] == ["torch.float32"]
    assert_calls(report, autocast=True, weight="torch.float32", out=str(OUT_DTYPE[policy]))


# ---- torchvision / timm patterns, in process -----------------------------------------------------


def images(n: int = 8, size: int = 16) -> torch.Tensor:
    return torch.randn(n, 3, size, size, generator=torch.Generator().manual_seed(1)) * 20 + 50


@pytest.mark.parametrize("make", [resnet, mobilenet], ids=["resnet-basic-block", "mobilenet-depthwise"])
def test_model_patterns_under_autocast_per_policy(make):
    torch.manual_seed(0)
    model = make()
    watched = [m for m in bn_modules(model) if type(m) is torch.nn.BatchNorm2d]  # BatchNormAct2d: below
    assert len(watched) >= 4
    for policy in POLICIES:
        trained = copy.deepcopy(model)
        watch = Watch([m for m in bn_modules(trained) if type(m) is torch.nn.BatchNorm2d])
        with torch.autocast("cpu", dtype=torch.bfloat16), amp_bn_fix.policy(policy):
            logits = trained(images())
        loss = F.cross_entropy(logits.float(), torch.arange(8) % 4)
        loss.backward()
        assert math.isfinite(loss.item())
        assert len(watch.calls) == len(watched)
        for call in watch.calls:
            assert call["input"] == "torch.bfloat16" and call["stats"] == "torch.float32", (policy, call)
            assert call["out"] == str(OUT_DTYPE[policy]), (policy, call)
            assert call["out_excess"] <= 0 and call["stats_excess"] <= 0, (policy, call)
        assert all(torch.isfinite(p.grad).all() and p.grad.dtype == torch.float32 for p in trained.parameters())


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_batchnorm_subclass_calling_f_batch_norm_itself(training):
    """timm's BatchNormAct2d: the shim reaches F.batch_norm inside a subclass's own forward."""
    torch.manual_seed(0)
    bn = BatchNormAct2d(8)
    with torch.no_grad():
        bn.running_mean.copy_(torch.linspace(40, 60, 8))
        bn.running_var.copy_(torch.linspace(300, 500, 8))
        bn.weight.copy_(torch.linspace(0.5, 1.5, 8))
        bn.bias.copy_(torch.linspace(-1, 1, 8))
    bn.train(training)
    x = (torch.randn(8, 8, 6, 6, generator=torch.Generator().manual_seed(2)) * 20 + 50).to(torch.bfloat16)
    ref = fp64_module(bn, x)
    normalized = ref.out
    expected = F.silu(normalized)
    n = x[:, 0].numel()
    for policy in POLICIES:
        module = copy.deepcopy(bn)
        with torch.autocast("cpu", dtype=torch.bfloat16), amp_bn_fix.policy(policy):
            out = module(x)
        assert out.dtype == OUT_DTYPE[policy], policy
        # FP32 arithmetic; a 16-bit output is rounded once, and the SiLU computes in 16 bits from it
        # (a rounding of its input and of its own output, relative to the normalized values).
        bound = fp32_bound(expected, n, out.dtype, scale=normalized.abs().max().item())
        if out.dtype is not torch.float32:
            bound = bound + rounding_bound(normalized.abs(), {out.dtype: 2})
        assert_within(out, expected, bound, what=policy)
        assert module.running_mean.dtype == module.running_var.dtype == torch.float32
        assert_near(module.running_mean, ref.running_mean, n, what=f"{policy} running mean")
        assert_near(module.running_var, ref.running_var, n, what=f"{policy} running var")


@pytest.mark.slow
def test_compiled_resnet_under_autocast_has_no_graph_break():
    """torch.compile of the ResNet pattern under autocast: one graph, and it matches eager."""
    torch.manual_seed(0)
    model = resnet()
    stem = torch.nn.Sequential(*model[:2])

    def step(net, stem, x):
        # The logits, and the stem's BatchNorm output, whose dtype is the policy's.
        return net(x), stem(x)

    x = images()
    torch._dynamo.reset()
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            explained = torch._dynamo.explain(step)(copy.deepcopy(model), copy.deepcopy(stem), x)
        assert explained.graph_break_count == 0, explained.break_reasons
        assert explained.graph_count == 1

        eager_model, compiled_model = copy.deepcopy(model), copy.deepcopy(model)
        eager_stem = torch.nn.Sequential(*eager_model[:2])
        compiled_stem = torch.nn.Sequential(*compiled_model[:2])
        compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            want_logits, want_bn = step(eager_model, eager_stem, x)
            got_logits, got_bn = compiled(compiled_model, compiled_stem, x)
        assert got_bn.dtype == want_bn.dtype == torch.float32  # the default policy, fp32
        # One computation run two ways: FP32 values a few roundings apart; what passes through
        # bfloat16 convolutions an ulp (two roundings) apart where it rounds the other way.
        assert_within(got_bn, want_bn, same_computation_bound(want_bn, {torch.float32: 8}), what="stem output")
        assert_within(got_logits, want_logits, same_computation_bound(want_logits, {torch.bfloat16: 2}), what="logits")
        got_logits.float().sum().backward()
        want_logits.float().sum().backward()
        for got, want in zip(bn_modules(compiled_model), bn_modules(eager_model)):
            assert got.running_var.dtype == torch.float32
            stats_bound = same_computation_bound(want.running_var, {torch.float32: 8})
            grad_bound = same_computation_bound(want.weight.grad, {torch.bfloat16: 2})
            assert_within(got.running_var, want.running_var, stats_bound, what="running var")
            assert_within(got.weight.grad, want.weight.grad, grad_bound, what="weight gradient")
    finally:
        torch._dynamo.reset()
