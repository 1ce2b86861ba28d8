"""torch.func transforms: a 16-bit BatchNorm input under autocast gets the policy whatever transform runs it.

Whether autocast casts an op under ``vmap`` depends on the op's batching rule and on what is batched
(a convolution of a batched input stays FP32; under ``jacfwd`` only the tangents are batched, and
the primal convolution is cast as in eager mode). So the shim reads the call: a float16/bfloat16
input with autocast enabled gets the policy, an FP32 one is torch's.

Each case runs a small Conv-BatchNorm-Tanh-pool model under one transform (or composition) inside
CPU autocast, and compares the outputs and derivatives with the same model whose BatchNorm is
written by hand (``bn(x.float())`` with FP32 parameters and stats, then the policy's cast), run
under the same transform on plain torch; with the policy ``off``, with plain torch bit for bit.
"""

from __future__ import annotations

import copy
import itertools
import random
from typing import Callable, Dict, List, Optional, Tuple, Union

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, hessian, jacfwd, jacrev, jvp, stack_module_state, vmap
from torch.utils._pytree import tree_leaves

import amp_bn_fix
from _bounds import assert_near, assert_within, same_computation_bound
from _shared import ORIGINAL, shim_disabled

# torch's forward-mode AD scripts its decompositions when it first needs them (torch.jit.script warns:
# DeprecationWarning, FutureWarning from torch 2.15).
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated")

F32 = torch.float32
HALF = (torch.float16, torch.bfloat16)
AUTOCAST = {"fp16": torch.float16, "bf16": torch.bfloat16}
N, C_IN, C, SIDE = 3, 2, 3, 4
BN = "1"  # the BatchNorm's name in the model
Params = Dict[str, torch.Tensor]
Results = Tuple[torch.Tensor, ...]


class _HandBatchNorm2d(nn.BatchNorm2d):
    """BatchNorm written by hand: ``bn(x.float())`` with FP32 parameters and stats, then ``out_dtype``
    (None: the input's dtype); an FP32 input is torch's call. Records the input dtypes it saw."""

    out_dtype: Optional[torch.dtype] = None
    seen: List[torch.dtype]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(x.dtype)
        training = self.training or self.running_mean is None
        if x.dtype not in HALF:
            return ORIGINAL(x, self.running_mean, self.running_var, self.weight, self.bias, training, 0.0, self.eps)
        mean, var, weight, bias = (None if t is None else t.float()
                                   for t in (self.running_mean, self.running_var, self.weight, self.bias))
        out = ORIGINAL(x.float(), mean, var, weight, bias, training, 0.0, self.eps)
        return out.to(self.out_dtype or x.dtype)


def _model(half_model: bool, training: bool, dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(C_IN, C, 3, padding=1), nn.BatchNorm2d(C, track_running_stats=not training),
                          nn.Tanh(), nn.AdaptiveAvgPool2d(1), nn.Flatten())
    bn = model[1]
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-0.5, 0.5)
        if not training:
            # Values every 16-bit dtype holds: a half model's FP32 master (read in plain eager mode)
            # and its buffers (read under a transform) hold the same stats.
            bn.running_mean.uniform_(-0.5, 0.5).copy_(bn.running_mean.bfloat16())
            bn.running_var.uniform_(0.5, 2.0).copy_(bn.running_var.bfloat16())
    model.train(training)
    return model.to(dtype) if half_model else model


def _by_hand(model: nn.Module, out_dtype: Optional[torch.dtype]) -> nn.Module:
    hand = copy.deepcopy(model)
    bn = hand[1]
    bn.__class__ = _HandBatchNorm2d
    bn.out_dtype, bn.seen = out_dtype, []
    return hand


def _input(half_model: bool, dtype: torch.dtype, *batch: int, seed: int = 1) -> torch.Tensor:
    x = torch.randn(*batch, N, C_IN, SIDE, SIDE, generator=torch.Generator().manual_seed(seed)) * 2 + 1
    return x.to(dtype) if half_model else x


# --- the transforms: each takes the model and its input, and returns what it computes ------------

def _functional(model: nn.Module) -> Tuple[Params, Callable[[Params, torch.Tensor], torch.Tensor]]:
    state = {**dict(model.named_parameters()), **dict(model.named_buffers())}

    def run(params: Params, x: torch.Tensor) -> torch.Tensor:
        return functional_call(model, params, (x,))

    return state, run


def _transform(name: str, model: nn.Module, x: torch.Tensor) -> Results:
    state, run = _functional(model)
    weight = state[f"{BN}.weight"]

    def out(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return run({**state, f"{BN}.weight": w}, x)

    def loss(x: torch.Tensor, w: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        y = out(x, w)
        return y.float().sum(), y

    g = torch.Generator().manual_seed(2)
    tangent = (torch.rand(x.shape, generator=g) - 0.5).to(x.dtype)
    tangent_w = (torch.rand(weight.shape, generator=g) - 0.5).to(weight.dtype)
    if name == "functional_call":
        return (out(x, weight),)
    if name == "grad":
        return tuple(tree_leaves(grad(loss, argnums=(0, 1), has_aux=True)(x, weight)))
    if name == "jacrev":
        return jacrev(out, argnums=(0, 1))(x, weight)
    if name == "jacfwd":
        return jacfwd(out, argnums=(0, 1))(x, weight)
    if name == "jvp":
        return jvp(out, (x, weight), (tangent, tangent_w))
    if name == "hessian":
        return tuple(tree_leaves(hessian(lambda x, w: loss(x, w)[0], argnums=(0, 1))(x, weight)))
    if name == "vmap":  # over the inputs: a convolution of a batched input is not cast
        return (vmap(out, in_dims=(0, None))(torch.stack((x, x.flip(0))), weight),)
    if name == "vmap-vmap":
        xs = torch.stack((x, x.flip(0), -x, x.flip(1))).view(2, 2, *x.shape)
        return (vmap(vmap(out, in_dims=(0, None)), in_dims=(0, None))(xs, weight),)
    if name == "vmap-bn-weight":  # the BatchNorm's input is not batched, its weight is
        return (vmap(out, in_dims=(None, 0))(x, torch.stack((weight, weight.flip(0)))),)
    if name == "vmap-ensemble":  # stack_module_state: every parameter batched
        second = copy.deepcopy(model)
        with torch.no_grad():
            for p in second.parameters():
                p.mul_(0.75)
        params, buffers = stack_module_state([model, second])
        return (vmap(lambda p, b: functional_call(model, (p, b), (x,)))(params, buffers),)
    if name == "vmap-grad":  # per-sample gradients
        xs = torch.stack((x, x.flip(0)))
        return tuple(tree_leaves(vmap(grad(loss, argnums=(0, 1), has_aux=True), in_dims=(0, None))(xs, weight)))
    if name == "grad-vmap":  # one loss over a batch of BatchNorm weights

        def batched_loss(weights: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
            y = vmap(out, in_dims=(None, 0))(x, weights)
            return y.float().sum(), y

        return tuple(tree_leaves(grad(batched_loss, has_aux=True)(torch.stack((weight, weight.flip(0))))))
    if name == "jvp-grad":  # forward over reverse
        return tuple(tree_leaves(jvp(lambda x: grad(loss, has_aux=True)(x, weight), (x,), (tangent,))))
    raise AssertionError(name)


TRANSFORMS = ["functional_call", "grad", "jacrev", "jacfwd", "jvp", "hessian", "vmap", "vmap-vmap",
              "vmap-bn-weight", "vmap-ensemble", "vmap-grad", "grad-vmap", "jvp-grad"]
POLICIES = ["fp32", "input", "autocast", "off"]


def _cases() -> List[Tuple[str, str, str, str, str]]:
    """Every transform with both model kinds and every policy; eval or training and the autocast
    dtype drawn so that each transform and model kind meets each of their four pairs once (a fixed
    seed: crossing them all too would add cases, not coverage)."""
    rng = random.Random(42)
    pairs = list(itertools.product(["eval", "train"], AUTOCAST))
    cases = []
    for transform, model_kind in itertools.product(TRANSFORMS, ["fp32-model", "half-model"]):
        rng.shuffle(pairs)
        cases += [(transform, model_kind, policy, mode, autocast) for policy, (mode, autocast) in zip(POLICIES, pairs)]
    return cases


def _outcome(fn: Callable[[], Results]) -> Union[Results, Tuple[type, str]]:
    """``fn()``'s results, or its error as (type, message)."""
    try:
        return fn()
    except RuntimeError as error:
        return type(error), str(error)


@pytest.mark.parametrize("transform, model_kind, policy, mode, autocast", _cases())
def test_a_16_bit_input_under_autocast_gets_the_policy_under_every_transform(transform, model_kind, policy, mode,
                                                                             autocast):
    """Outputs and derivatives are those of the model with BatchNorm written by hand (FP32
    arithmetic, the policy's dtype out) wherever BatchNorm gets a 16-bit input, computed by the
    shim under the policy; plain torch's, bit for bit, where it gets an FP32 one or the policy is ``off``."""
    dtype, half_model, training = AUTOCAST[autocast], model_kind == "half-model", mode == "train"
    model = _model(half_model, training, dtype)
    x = _input(half_model, dtype)

    def under_autocast(model: nn.Module) -> Results:
        with torch.autocast("cpu", dtype=dtype):
            return tuple(t.detach() for t in _transform(transform, model, x))

    before = amp_bn_fix.report()["handled"]
    with amp_bn_fix.policy(policy):
        ours = _outcome(lambda: under_autocast(model))
    computed = {name: calls - before.get(name, 0) for name, calls in amp_bn_fix.report()["handled"].items()}
    if policy == "off":
        with shim_disabled():
            theirs = _outcome(lambda: under_autocast(model))
        assert type(ours) is type(theirs)
        if isinstance(theirs, tuple) and isinstance(theirs[0], type):
            assert ours == theirs
            return
        for a, b in zip(ours, theirs, strict=True):
            assert a.dtype is b.dtype and torch.equal(a, b)
        return
    out_dtype = {"fp32": F32, "input": None, "autocast": dtype}[policy]
    hand = _by_hand(model, out_dtype)
    with shim_disabled():
        expected = under_autocast(hand)
    assert not isinstance(ours[0], type), ours
    assert len(ours) == len(expected)
    for i, (a, e) in enumerate(zip(ours, expected)):
        assert a.dtype is e.dtype, (i, a.dtype, e.dtype)
        # The same FP32 computation; a 16-bit result may round the other way once.
        roundings = {F32: 8, **({a.dtype: 1} if a.dtype in HALF else {})}
        assert_within(a, e, same_computation_bound(e, roundings), what=f"result {i}")
    if set(hand[1].seen) & set(HALF):
        # Computed by the shim, under the policy (not as a call outside autocast).
        assert computed.get(policy, 0) > 0 and sum(computed.values()) == computed[policy], computed
    else:
        # BatchNorm saw only FP32 inputs (autocast cast nothing there): torch's own call, bit for bit.
        assert not any(computed.values()), computed
        with shim_disabled():
            plain = under_autocast(model)
        for a, b in zip(ours, plain):
            assert a.dtype is b.dtype and torch.equal(a, b)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("model_kind", ["fp32-model", "half-model"])
def test_running_stats_vmap_cannot_update_get_torchs_error(model_kind, policy):
    """A training call with running stats under ``vmap`` of the inputs is one torch's batching rule
    refuses (the unbatched stats cannot take a batched update): the same error, the stats untouched."""
    half_model = model_kind == "half-model"
    results = []
    for shimmed in (True, False):
        model = _model(half_model, False, torch.bfloat16).train()
        stats = model[1].running_mean, model[1].running_var
        before = [t.clone() for t in stats]
        xs = _input(half_model, torch.bfloat16, 2)
        state, run = _functional(model)
        with (amp_bn_fix.policy(policy) if shimmed else shim_disabled()), torch.autocast("cpu"):
            results.append(_outcome(lambda: vmap(run, in_dims=(None, 0))(state, xs)))
        assert all(torch.equal(a, b) for a, b in zip(before, stats))
    ours, theirs = results
    assert isinstance(theirs[0], type) and ours == theirs


@pytest.mark.parametrize("stats_dtype", [F32, torch.bfloat16], ids=["fp32-stats", "bf16-stats"])
@pytest.mark.parametrize("captured", ["both", "views-of-both", "var-only"])
@pytest.mark.parametrize("transform", ["grad", "jvp"])
def test_running_stats_a_differentiating_transform_captured_are_updated_and_guarded(transform, captured, stats_dtype):
    """``grad`` and ``jvp`` refuse in-place ops on tensors the transformed function captured from
    outside (and on views of them), which plain torch's kernel updates inside its op: the guard
    writes them back through an op's ``out=`` argument, which they take."""
    stats = torch.stack((torch.zeros(C), torch.ones(C))).to(stats_dtype)
    given_mean = stats[0].clone()

    def loss(t: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
        if captured == "views-of-both":
            mean, var = stats[0], stats[1]
        else:
            mean, var = (stats[0] if captured == "both" else mean), stats[1]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = torch.nn.functional.batch_norm(t, mean, var, training=True, momentum=0.5)
        assert out.dtype is F32  # the policy's
        return out.sum()

    def step(x: torch.Tensor) -> None:
        if transform == "grad":
            grad(loss)(x, given_mean)
        else:
            jvp(loss, (x, given_mean), (torch.ones_like(x), torch.zeros_like(given_mean)))

    if captured == "both":  # stats[0] and stats[1] are views made outside: captured tensors of their own
        stats = stats.unbind()
    x = torch.randn(8, C, generator=torch.Generator().manual_seed(0)).bfloat16()
    mean = given_mean if captured == "var-only" else stats[0]
    start64 = mean.double(), stats[1].double()
    step(x)
    x64 = x.double()
    expected = (0.5 * start64[0] + 0.5 * x64.mean(0), 0.5 * start64[1] + 0.5 * x64.var(0))
    for stat, stat64 in zip((mean, stats[1]), expected):
        assert stat.dtype is stats_dtype
        assert_near(stat, stat64, x.shape[0])
    before = mean.clone(), stats[1].clone()
    x[0, 0] = float("inf")
    step(x)  # a non-finite batch leaves them bit for bit
    assert torch.equal(mean, before[0]) and torch.equal(stats[1], before[1])
