"""Programs that replay or interrupt a forward see exactly the running-stat updates plain torch makes,
and replay it under the policy it ran under.

Activation checkpointing recomputes a forward in backward. Non-reentrant checkpointing stops the
recompute as soon as the tensors saved for backward are recovered (by raising out of the op that
saved the last one): torch's kernels have updated their running stats by then, so a handled call's
update must not wait for anything after its kernel. Each flavour runs the same program with the
shim and with plain torch: the module is called as often in both, and the shim's statistics are
those calls' updates replayed in float64, at FP32 accuracy (a lost or doubled update would be off
by the momentum's share, about 50%).

A ``policy()`` scope lives in a ContextVar, which checkpointing does not restore for its recompute:
backward after the block, in another thread (autograd's device threads on CUDA) or under another
scope must still recompute under the scopes of the forward, bit for bit what a run without
checkpointing computes.
"""

import contextlib
import functools
import sys
import threading
import types

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, checkpoint_sequential

import amp_bn_fix
from _bounds import assert_near, assert_within, same_computation_bound
from _builders import fp64_batch_norm
from _shared import assert_stats_replayed, computed_stats, record_inputs, shim_disabled
from amp_bn_fix import _checkpoint, _state

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


# The BatchNorm's dtype, and whether it runs under autocast: a half model outside autocast gets
# torch's own output and then its master's update, which must stand when the recompute stops there.
MODELS = {"fp32": (torch.float32, True), "half": (torch.bfloat16, True), "half-outside-autocast": (torch.bfloat16, False)}


def _run(flavour, steps=3, model="fp32"):
    """A conv + BatchNorm block trained a few steps under bfloat16 autocast (or as a half model
    outside it); the running stats the shim computes with, its BatchNorm's step count and buffer
    dtype, and the input of each of its calls (recomputes too)."""
    dtype, autocast = MODELS[model]
    torch.manual_seed(0)
    conv, bn = nn.Conv2d(8, 8, 3, padding=1, bias=False).to(dtype), nn.BatchNorm2d(8).to(dtype)
    inputs = record_inputs(bn)
    for step in range(steps):
        x = torch.randn(4, 8, 8, 8, generator=torch.Generator().manual_seed(step)).to(dtype).requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            y = FLAVOURS[flavour](lambda t: bn(conv(t)) + t, x)
        y.float().sum().backward()
    return (*computed_stats(bn), int(bn.num_batches_tracked), bn.running_mean.dtype, inputs)


# Selective checkpointing runs the forward under a TorchDispatch mode of its own, which the shim
# treats as a tracer: a half model's update there goes into its 16-bit buffers, not its FP32
# master (docs/how-it-works.md), so it is not at FP32 accuracy.
# Outside autocast the policy does not apply (a half model's output is torch's own): one is enough.
CASES = [(flavour, model, policy) for flavour in FLAVOURS for model in MODELS for policy in ("fp32", "input")
         if not (flavour == "selective" and model != "fp32")
         and not (model == "half-outside-autocast" and policy != "fp32")]


@pytest.mark.parametrize("flavour, model, policy", CASES)
def test_running_stats_see_the_updates_plain_torch_makes(flavour, policy, model):
    amp_bn_fix.set_policy(policy)
    with shim_disabled():
        plain_tracked = _run(flavour, model=model)[2]
    mean, var, tracked, dtype, inputs = _run(flavour, model=model)
    assert dtype is MODELS[model][0]
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
    # One training call's update from zeros and ones.
    expected = fp64_batch_norm(x, torch.zeros(6), torch.ones(6)).running_mean
    assert_near(buffers["running_mean"], expected, x.shape[0], what="running mean")
    assert buffers["running_mean"].dtype is torch.float32 and int(buffers["num_batches_tracked"]) == 1


# --- policy() scopes in the recompute -------------------------------------------------------------

BF16 = torch.bfloat16
# Each scope's policy over a process-wide one with another output dtype, so that a recompute under
# the wrong one computes something else.
UNDER = {"input": "fp32", "autocast": "fp32", "fp32": "input"}
OUTPUT_DTYPE = {"input": BF16, "autocast": BF16, "fp32": torch.float32}
RUN = {
    "non-reentrant": lambda f, x: checkpoint(f, x, use_reentrant=False),
    "reentrant": lambda f, x: checkpoint(f, x, use_reentrant=True),
    "plain": lambda f, x: f(x),
}
# Where backward runs, out of the forward's scopes: after the block; inside it, in another thread (a
# fresh context, with no scope, as autograd's device threads on CUDA) or in this one under a scope
# of another policy.
WHERE = ["after-the-block", "another-thread", "same-thread-another-scope"]


class Square(nn.Module):
    """An FP32 square: it saves BatchNorm's output as the policy returned it, rounded or not."""

    def forward(self, t):
        return t.float().square()


def conv_or_linear_bn(kind):
    """A conv or linear layer and a BatchNorm after it, and an input for them."""
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    if kind == "BatchNorm1d":
        return nn.Sequential(nn.Linear(6, 8, bias=False), nn.BatchNorm1d(8)), torch.randn(16, 6, generator=generator)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)), torch.randn(4, 3, 6, 6, generator=generator)


def output_dtypes(bn):
    """The dtype of each output of ``bn`` from now on (recomputes too)."""
    dtypes = []
    bn.register_forward_hook(lambda module, args, out: dtypes.append(out.dtype))
    return dtypes


def backward(loss, where, other_policy):
    """``loss.backward()`` run inside the block, as ``where`` says."""
    if where == "another-thread":
        errors = []

        def run():
            try:
                backward_keeping_the_scopes(loss)
            except BaseException as error:  # raised again in the test's thread
                errors.append(error)

        thread = threading.Thread(target=run)
        thread.start()
        thread.join()
        if errors:
            raise errors[0]
    elif where == "same-thread-another-scope":
        with amp_bn_fix.policy(other_policy):
            backward_keeping_the_scopes(loss)
    elif where == "same-thread":
        backward_keeping_the_scopes(loss)


def backward_keeping_the_scopes(loss):
    """``loss.backward()``; the scopes open here are those after it too."""
    before = _state.scopes.get()
    loss.backward()
    assert _state.scopes.get() == before


def scoped_step(kind, flavour, scope, where):
    """One training step of a conv/linear + BatchNorm segment (then an FP32 square) under bfloat16
    autocast and ``policy(scope)``, over another process-wide policy; backward where ``where`` says."""
    model, x = conv_or_linear_bn(kind)
    x.requires_grad_()
    bn = model[1]
    inputs, dtypes = record_inputs(bn), output_dtypes(bn)
    amp_bn_fix.set_policy(UNDER[scope])
    with amp_bn_fix.policy(scope):
        with torch.autocast("cpu", dtype=BF16):
            y = RUN[flavour](lambda t: Square()(model(t)), x)
        loss = y.mean()
        backward(loss, where, UNDER[scope])
    if where == "after-the-block":
        backward_keeping_the_scopes(loss)
    results = {"output": y.detach(), "input gradient": x.grad, "weight gradient": model[0].weight.grad,
               "BatchNorm weight gradient": bn.weight.grad, "BatchNorm bias gradient": bn.bias.grad}
    return results, (bn.running_mean.clone(), bn.running_var.clone()), int(bn.num_batches_tracked), inputs, dtypes


def check_scoped_step(kind, flavour, scope, where):
    results, stats, tracked, inputs, dtypes = scoped_step(kind, flavour, scope, where)
    # The forward and its recompute both under the scope's policy.
    assert dtypes == [OUTPUT_DTYPE[scope]] * 2
    # Bit for bit what the same program computes without checkpointing.
    expected, *_ = scoped_step(kind, "plain", scope, where)
    for what, value in results.items():
        assert value.dtype is expected[what].dtype and torch.equal(value, expected[what]), what
    # Two updates of the running stats (the forward's and the recompute's), as plain torch makes.
    with shim_disabled():
        plain_tracked = scoped_step(kind, flavour, scope, where)[2]
    assert tracked == plain_tracked == len(inputs) == 2
    assert stats[0].dtype is torch.float32
    assert_stats_replayed(stats, inputs)


@pytest.mark.parametrize("kind", ["BatchNorm1d", "BatchNorm2d"])
@pytest.mark.parametrize("scope", list(UNDER))
@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("flavour", ["non-reentrant", "reentrant"])
def test_recompute_runs_under_the_scopes_of_its_forward(flavour, where, scope, kind):
    check_scoped_step(kind, flavour, scope, where)


@pytest.mark.parametrize("kind", ["BatchNorm1d", "BatchNorm2d"])
@pytest.mark.parametrize("scope", list(UNDER))
@pytest.mark.parametrize("flavour", ["non-reentrant", "reentrant"])
def test_backward_in_the_scope_of_the_forward_recomputes_as_before(flavour, scope, kind):
    # In the forward's own thread and block the recompute sees its scopes with or without the shim's
    # help: what the shim hands torch there must change nothing.
    check_scoped_step(kind, flavour, scope, "same-thread")


@pytest.mark.parametrize("flavour", ["non-reentrant", "reentrant"])
def test_checkpoint_sequential_recomputes_under_the_scopes_of_its_forward(flavour):
    # checkpoint_sequential checkpoints every segment but the last: the first BatchNorm is recomputed.
    def step(checkpointed):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 8, bias=False), nn.BatchNorm1d(8), Square(),
                              nn.Linear(8, 8, bias=False), nn.BatchNorm1d(8), Square())
        x = torch.randn(16, 6, generator=torch.Generator().manual_seed(1)).requires_grad_()
        first, last = output_dtypes(model[1]), output_dtypes(model[4])
        amp_bn_fix.set_policy("fp32")
        with amp_bn_fix.policy("input"):
            with torch.autocast("cpu", dtype=BF16):
                if checkpointed:
                    y = checkpoint_sequential(model, 2, x, use_reentrant=flavour == "reentrant")
                else:
                    y = model(x)
            backward(y.mean(), "another-thread", None)
        return (y.detach(), x.grad, model[0].weight.grad, model[1].weight.grad), first, last, model

    (y, *grads), first, last, model = step(True)
    (expected_y, *expected_grads), *_ = step(False)
    assert first == [BF16, BF16] and last == [BF16]
    assert torch.equal(y, expected_y)
    for grad, expected in zip(grads, expected_grads):
        assert torch.equal(grad, expected)
    assert int(model[1].num_batches_tracked) == 2 and int(model[4].num_batches_tracked) == 1


@pytest.mark.parametrize("scoped", [False, True], ids=["no-scope", "scope"])
@pytest.mark.parametrize("flavour", ["non-reentrant", "reentrant"])
def test_without_a_scope_torch_gets_the_very_function_it_was_given(flavour, scoped):
    # Who calls the checkpointed function, in the forward and in the recompute: torch's own code
    # when no scope is open; the shim's runner of the scopes for what it hands torch otherwise.
    model, x = conv_or_linear_bn("BatchNorm1d")
    callers = []

    def segment(t):
        callers.append(sys._getframe(1).f_code.co_filename)
        return Square()(model(t))

    with amp_bn_fix.policy("input") if scoped else contextlib.nullcontext():
        with torch.autocast("cpu", dtype=BF16):
            y = RUN[flavour](segment, x.requires_grad_())
    y.mean().backward()
    torch_file, shim_file = torch.utils.checkpoint.__file__, _checkpoint.__file__
    if not scoped:
        assert callers == [torch_file, torch_file]
    elif flavour == "reentrant":
        assert callers == [shim_file, shim_file]
    else:  # non-reentrant checkpoint runs the forward itself; its recompute runs what it was handed
        assert callers == [torch_file, shim_file]


@pytest.mark.parametrize("scope", [None, "input"], ids=["no-scope", "input-scope"])
@pytest.mark.parametrize("flavour", ["non-reentrant", "reentrant"])
def test_compiled_checkpoint_compiles_without_a_graph_break(flavour, scope):
    # Dynamo compiles torch.utils.checkpoint.checkpoint as a higher-order op, recognised by
    # identity: the shim leaves that function alone, so every name bound to it, before the patch
    # or after, is still the one dynamo knows.
    assert type(torch.utils.checkpoint.checkpoint) is types.FunctionType  # torch's own, no wrapper
    torch._dynamo.reset()
    _state.compiled_policies.clear()  # with the code earlier tests compiled
    model, x = conv_or_linear_bn("BatchNorm2d")

    def segment(t):
        out = model(t)
        return out, Square()(out)

    def step(x):
        with torch.autocast("cpu", dtype=BF16):
            return checkpoint(segment, x, use_reentrant=flavour == "reentrant")

    amp_bn_fix.set_policy("fp32")
    results = []
    for run in (step, torch.compile(step, backend="aot_eager", fullgraph=True)):
        x.grad = None
        with amp_bn_fix.policy(scope) if scope else contextlib.nullcontext():
            out, y = run(x.requires_grad_())
            backward(y.mean(), "another-thread", None)
        results.append((out.detach(), x.grad))
    (eager_out, eager_grad), (out, grad) = results
    assert out.dtype is eager_out.dtype is OUTPUT_DTYPE[scope or "fp32"]
    # The same computation traced: its FP32 roundings, and then one to bfloat16, may fall apart.
    assert_within(out, eager_out, same_computation_bound(eager_out, {BF16: 2}), what="output")
    assert_within(grad, eager_grad, same_computation_bound(eager_grad, {BF16: 4}), what="input gradient")
