"""Every combination of settings, every state the shim leaves, every way it steps aside.

The matrix is generated: ``AMP_BN_FIX_POLICY`` x ``AMP_BN_FIX_DEVICES`` (all, cpu, cuda) x
``AMP_BN_FIX_KEEP_FP32`` x ``AMP_BN_FIX_GUARD``, for FP32, float16 and bfloat16 models (cast while
the shim is enabled), in training and eval, inside and outside autocast, run directly and along each
path where the shim steps aside: a ``policy("off")`` block, ``disable()``, a pickle loaded without
the shim, and TorchScript outside autocast (under autocast the shim's kernel at autocast's dispatch
key reaches it; a device type left out is the devices axis). Each run either gets the fix
(the policy's output dtype, FP32 running stats, values at FP32 accuracy against float64) or gives
what plain torch gives on a plain model of that dtype. The one documented exception is
``AMP_BN_FIX_KEEP_FP32=stats``: its 16-bit weights next to FP32 stats are a state torch's kernels
reject, so a model cast that way raises torch's own error wherever the shim cannot reach it.
"""

import io
import itertools
from typing import Dict, List, NamedTuple, Tuple

import pytest
import torch
from torch import nn

import amp_bn_fix
from _amp_bn_fix_boot.settings import DEVICE_TYPES, KEEP_MODES, POLICIES
from _bounds import assert_near, assert_within, rounding_bound
from _builders import fp64_batch_norm
from _shared import computed_stats, shim_disabled
from amp_bn_fix import Config

# TorchScript says it is deprecated; these tests script on purpose.
pytestmark = [
    pytest.mark.filterwarnings("ignore:`torch.jit.* is deprecated:DeprecationWarning"),
    # Every case on the CPU's route and on the route a CUDA call takes (see conftest).
    pytest.mark.usefixtures("both_routes"),
]

BF16 = torch.bfloat16
MODEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
DEVICES = {"all": None, "cpu": frozenset({"cpu"}), "cuda": frozenset({"cuda"})}
PATHS = ("direct", "policy-off", "disable", "pickle", "torchscript")
SETTINGS = [
    Config(policy=p, devices=DEVICES[d], keep_fp32=k, guard=g)
    for p, d, k, g in itertools.product(POLICIES, DEVICES, KEEP_MODES, (True, False))
]
assert set(DEVICES) - {"all"} <= set(DEVICE_TYPES)
# Not representable in 16 bits: a running stat rounded through half shows.
MEAN = torch.tensor([1 / 3, -2 / 7, 0.1, 1.7, -0.9, 1 / 9, 0.35, -1.3])
VAR = torch.tensor([1 / 7, 3.3333, 0.11, 2.1, 0.7, 1.3, 0.55, 1 / 3])
CHANNELS = len(MEAN)


def _id(config: Config) -> str:
    return "-".join(config.describe(name) for name in ("policy", "devices", "keep_fp32", "guard"))


def model(dtype: torch.dtype, training: bool) -> nn.Sequential:
    """Conv2d(3->8) + BatchNorm2d(8) with known running stats, cast to ``dtype`` as the settings say."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, CHANNELS, 3, padding=1), nn.BatchNorm2d(CHANNELS))
    with torch.no_grad():
        net[1].running_mean.copy_(MEAN)
        net[1].running_var.copy_(VAR)
        net[1].weight.uniform_(0.5, 1.5)
        net[1].bias.uniform_(-0.5, 0.5)
    return net.to(dtype).train(training)


def image(dtype: torch.dtype) -> torch.Tensor:
    # (4,3,16,16): 1024 values per BatchNorm channel in rows of 256, long enough for the CPU fast paths.
    return torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(1)).to(dtype)


class Run(NamedTuple):
    out: torch.Tensor
    mean: torch.Tensor
    var: torch.Tensor
    # What BatchNorm was called with: its input and its parameters and stats before the call.
    seen: Tuple[torch.Tensor, ...]


def autocast_dtype(dtype: torch.dtype) -> torch.dtype:
    """The autocast dtype a ``dtype`` model runs under: its own, bfloat16 for an FP32 model."""
    return BF16 if dtype is torch.float32 else dtype


def run(net: nn.Module, dtype: torch.dtype, training: bool, autocast: bool) -> Run:
    """One forward (and a backward in training) of ``net``, the BatchNorm call's arguments captured."""
    bn = getattr(net, "1")
    seen: List[torch.Tensor] = []

    def capture(module, args):
        # The stats the shim computes with: a 16-bit model's FP32 master where it keeps one.
        seen[:] = [args[0].detach().clone(), *computed_stats(module), module.weight.detach().clone(),
                   module.bias.detach().clone()]

    handle = bn.register_forward_pre_hook(capture) if not isinstance(net, torch.jit.ScriptModule) else None
    try:
        with torch.autocast("cpu", dtype=autocast_dtype(dtype), enabled=autocast):
            out = net(image(dtype))
        if training:
            out.float().square().mean().backward()
    finally:
        if handle is not None:
            handle.remove()
    return Run(out.detach(), bn.running_mean.detach().clone(), bn.running_var.detach().clone(), tuple(seen))


_plain_runs: Dict[Tuple[torch.dtype, bool, bool, bool], Run] = {}


def plain(dtype: torch.dtype, training: bool, autocast: bool, scripted: bool) -> Run:
    """The same run in plain torch: the shim disabled from the model's cast on (cached)."""
    key = (dtype, training, autocast, scripted)
    if key not in _plain_runs:
        with shim_disabled():
            net = model(dtype, training)
            _plain_runs[key] = run(torch.jit.script(net) if scripted else net, dtype, training, autocast)
    return _plain_runs[key]


def cast_kept_stats(config: Config, dtype: torch.dtype) -> bool:
    """Whether the shim's cast left FP32 running stats in this ``dtype`` model (``master`` keeps them beside it)."""
    return dtype is not torch.float32 and config.keep_fp32 in ("all", "stats") and config.policy != "off" and (
        config.devices is None or "cpu" in config.devices
    )


def fix_applies(config: Config, path: str, autocast: bool) -> bool:
    """Whether the shim handles the call: its policy in force, CPU selected, under autocast.

    TorchScript calls ATen's batch_norm, which the shim's kernel at autocast's key handles.
    """
    return (path in ("direct", "torchscript") and autocast and config.policy != "off"
            and (config.devices is None or "cpu" in config.devices))


def assert_fixed(result: Run, config: Config, dtype: torch.dtype, training: bool) -> None:
    """The policy's output dtype and FP32 statistics, against float64 on the very same input."""
    expected_dtype = torch.float32 if config.policy == "fp32" else autocast_dtype(dtype)
    assert result.out.dtype is expected_dtype
    assert result.seen[0].dtype in (torch.float16, BF16)  # autocast gave BatchNorm a 16-bit input
    ref = fp64_batch_norm(*result.seen, training=training)
    n = result.seen[0].numel() // CHANNELS
    # FP32 statistics of n values and an FP32 normalization, then one rounding to the output dtype.
    assert_near(result.out, ref.out, n, what="output")
    stats_dtype = torch.float32 if config.keep_fp32 in ("all", "stats") or dtype is torch.float32 else dtype
    assert result.mean.dtype is result.var.dtype is stats_dtype
    assert_near(result.mean, ref.running_mean, n, what="running mean")
    assert_near(result.var, ref.running_var, n, what="running var")


def assert_plain(result: Run, expected: Run) -> None:
    """Plain torch's output dtype, and its values up to the 16-bit roundings the two models differ by.

    The shim's model may hold FP32 running stats (and weight and bias) where plain torch's holds them
    rounded to 16 bits: each side is then off by a few roundings of the output dtype (eval
    normalizes with the stored stats) and by FP32 accuracy on statistics over n values.
    """
    assert result.out.dtype is expected.out.dtype
    dtype = expected.out.dtype
    n = expected.out.numel() // CHANNELS
    # 16 roundings of the output dtype and of the 16-bit stats (bfloat16 ones for an FP32 output
    # computed from 16-bit stats on plain torch's side), 8 FP32 sums.
    roundings = {dtype: 16}
    stats16 = dtype if dtype is not torch.float32 else BF16
    roundings[stats16] = roundings.get(stats16, 0) + 16
    bound = rounding_bound(expected.out.abs().max().item() + 1, roundings, n, sums=8)
    assert_within(result.out, expected.out, bound, what="output")
    stats_bound = (rounding_bound(expected.var.abs().max().item() + 1, {expected.mean.dtype: 8})
                   + rounding_bound(1, n=n, sums=8))
    for ours, theirs in ((result.mean, expected.mean), (result.var, expected.var)):
        assert_within(ours, theirs, stats_bound, what="running stat")


def run_path(path: str, config: Config, dtype: torch.dtype, training: bool, autocast: bool) -> Run:
    """Cast the model with ``config`` in force, then run it along ``path``."""
    net = model(dtype, training)
    if path == "direct":
        return run(net, dtype, training, autocast)
    if path == "policy-off":
        with amp_bn_fix.policy("off"):
            return run(net, dtype, training, autocast)
    if path == "torchscript":
        return run(torch.jit.script(net), dtype, training, autocast)
    buffer = io.BytesIO()
    torch.save(net, buffer)
    with shim_disabled():
        if path == "disable":
            return run(net, dtype, training, autocast)
        buffer.seek(0)
        return run(torch.load(buffer, weights_only=False), dtype, training, autocast)


@pytest.mark.parametrize("config", SETTINGS, ids=_id)
def test_every_setting_gives_the_fix_or_plain_torch(config):
    amp_bn_fix.configure(policy=config.policy, devices=config.devices, keep_fp32=config.keep_fp32, guard=config.guard)
    for dtype, training, autocast, path in itertools.product(MODEL_DTYPES, (True, False), (True, False), PATHS):
        case = f"{dtype} {'train' if training else 'eval'} autocast={autocast} {path}"
        expected = plain(dtype, training, autocast, scripted=path == "torchscript")
        out_of_reach = path in ("disable", "pickle") or (path == "torchscript" and not fix_applies(config, path, autocast))
        if cast_kept_stats(config, dtype) and config.keep_fp32 == "stats" and out_of_reach:
            # Documented: only the shim runs a model whose running stats alone stayed FP32.
            with pytest.raises(RuntimeError, match="expected scalar type|expected .* to have type"):
                run_path(path, config, dtype, training, autocast)
            continue
        result = run_path(path, config, dtype, training, autocast)
        try:
            if fix_applies(config, path, autocast) and path == "torchscript":
                # The same computation as the direct call (whose arguments the check above sees).
                direct = run_path("direct", config, dtype, training, autocast)
                assert result.out.dtype is direct.out.dtype and result.mean.dtype is direct.mean.dtype
                torch.testing.assert_close(result.out, direct.out, rtol=0, atol=0)
                torch.testing.assert_close((result.mean, result.var), (direct.mean, direct.var), rtol=0, atol=0)
            elif fix_applies(config, path, autocast):
                assert_fixed(result, config, dtype, training)
            else:
                assert_plain(result, expected)
        except AssertionError as exc:
            raise AssertionError(f"{case}: {exc}") from None
