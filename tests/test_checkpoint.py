"""Programs that replay or interrupt a forward see exactly the running-stat updates plain torch makes.

Activation checkpointing recomputes a forward in backward. Non-reentrant checkpointing stops the
recompute as soon as the tensors saved for backward are recovered (by raising out of the op that
saved the last one): torch's kernels have updated their running stats by then, so a handled call's
update must not wait for anything after its kernel. Each flavour runs the same program with the
shim and with plain torch: the module is called as often in both, and the shim's statistics are
those calls' updates replayed in float64, at FP32 accuracy (a lost or doubled update would be off
by the momentum's share, about 50%).
"""

import functools

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import amp_bn_fix
from _bounds import assert_near
from _shared import assert_stats_replayed, record_inputs
from amp_bn_fix import _patch

pytestmark = pytest.mark.usefixtures("both_routes")


def _selective():
    try:
        from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
    except ImportError:  # torch 2.4: selective checkpointing's policy API came in 2.5
        pytest.skip("this torch has no torch.utils.checkpoint.CheckpointPolicy")

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.PREFER_RECOMPUTE

    return functools.partial(create_selective_checkpoint_contexts, policy)


FLAVOURS = {
    "non-reentrant": lambda f, x: checkpoint(f, x, use_reentrant=False),
    "reentrant": lambda f, x: checkpoint(f, x, use_reentrant=True),
    "non-reentrant-no-early-stop": lambda f, x: _no_early_stop(f, x),
    "selective": lambda f, x: checkpoint(f, x, use_reentrant=False, context_fn=_selective()),
    "save-on-cpu": lambda f, x: _save_on_cpu(f, x),
    "plain": lambda f, x: f(x),
}


def _no_early_stop(f, x):
    with torch.utils.checkpoint.set_checkpoint_early_stop(False):
        return checkpoint(f, x, use_reentrant=False)


def _save_on_cpu(f, x):
    with torch.autograd.graph.save_on_cpu():
        return f(x)


def _run(flavour, steps=3):
    """A conv + BatchNorm block trained a few steps under bfloat16 autocast; its BatchNorm's state,
    and the input of each of its calls (recomputes too)."""
    torch.manual_seed(0)
    conv, bn = nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)
    inputs = record_inputs(bn)
    for step in range(steps):
        x = torch.randn(4, 8, 8, 8, generator=torch.Generator().manual_seed(step)).requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = FLAVOURS[flavour](lambda t: bn(conv(t)) + t, x)
        y.float().sum().backward()
    return bn.running_mean.clone(), bn.running_var.clone(), int(bn.num_batches_tracked), bn.running_mean.dtype, inputs


@pytest.mark.parametrize("policy", ["fp32", "input"])
@pytest.mark.parametrize("flavour", list(FLAVOURS))
def test_running_stats_see_the_updates_plain_torch_makes(flavour, policy):
    amp_bn_fix.set_policy(policy)
    with _patch.uninstalled():
        plain_tracked = _run(flavour)[2]
    mean, var, tracked, dtype, inputs = _run(flavour)
    assert dtype is torch.float32
    assert tracked == plain_tracked == len(inputs)
    assert_stats_replayed((mean, var), inputs)  # every call's update, and only those


def test_a_recompute_counts_as_an_update_of_its_own():
    # Non-reentrant checkpointing (early stop) updates twice per step, as plain torch does.
    once_mean, *_ = _run("plain", steps=1)
    twice_mean, *_ = _run("non-reentrant", steps=1)
    ratio = (twice_mean / once_mean).mean().item()
    assert 1.85 < ratio < 1.95  # (1 - 0.9 ** 2) / 0.1 = 1.9


def test_functional_call_under_grad_updates_the_buffers_it_is_given():
    # torch.func: the stats passed to functional_call receive the update (traced route, in place).
    from torch.func import functional_call, grad

    bn = nn.BatchNorm1d(6)
    x = torch.randn(16, 6, generator=torch.Generator().manual_seed(3)).bfloat16()
    params = {k: v.detach().clone() for k, v in bn.named_parameters()}
    buffers = {k: v.clone() for k, v in bn.named_buffers()}

    def loss(params, buffers):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return functional_call(bn, (params, buffers), (x,)).float().sum()

    grad(loss)(params, buffers)
    expected = 0.1 * x.double().mean(0)
    assert_near(buffers["running_mean"], expected, x.shape[0], what="running mean")
    assert buffers["running_mean"].dtype is torch.float32 and int(buffers["num_batches_tracked"]) == 1
