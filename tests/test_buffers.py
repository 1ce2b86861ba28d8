"""``AMP_BN_FIX_KEEP_FP32=all`` and ``stats``: casting a model to 16 bits keeps BatchNorm FP32 inside it.

The default, ``master``, leaves the model as torch casts it (tests/test_half_models.py); these
modes are for apex-O2-style training and FSDP units, and every test here runs with ``all`` unless
it says otherwise.
"""

import contextlib
import io
import subprocess
import sys

import pytest
import torch
import torch.nn.utils.parametrizations
import torch.nn.utils.parametrize
import torch.nn.utils.prune
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

import amp_bn_fix
from _amp_bn_fix_boot import settings
from _bounds import assert_near
from _shared import SUBPROCESS_TIMEOUT, child_env, shim_disabled

BF16 = torch.bfloat16


@pytest.fixture(autouse=True)
def keep_all():
    amp_bn_fix.configure(keep_fp32="all")

# Not representable in float16/bfloat16: a round trip through half would change them.
MEAN = torch.tensor([1 / 3, -2 / 7, 1e-4 + 1 / 9, 1000.1])
VAR = torch.tensor([1 / 7, 3.3333, 1e-5 + 0.1, 2048.3])

CASTS = {
    "half": lambda m: m.half(),
    "bfloat16": lambda m: m.bfloat16(),
    "to(float16)": lambda m: m.to(torch.float16),
    "to(device, float16)": lambda m: m.to("cpu", torch.float16),
    "to(dtype=bfloat16)": lambda m: m.to(dtype=torch.bfloat16),
    "to(tensor)": lambda m: m.to(torch.zeros(1, dtype=torch.float16)),
    "type(float16)": lambda m: m.type(torch.float16),
}
CAST_DTYPES = {
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "to(float16)": torch.float16,
    "to(device, float16)": torch.float16,
    "to(dtype=bfloat16)": torch.bfloat16,
    "to(tensor)": torch.float16,
    "type(float16)": torch.float16,
}


def _materialized_lazy() -> nn.Module:
    bn = nn.LazyBatchNorm1d()
    bn(torch.randn(8, 4))
    return bn


BN_FACTORIES = {
    "BatchNorm1d": lambda: nn.BatchNorm1d(4),
    "BatchNorm2d": lambda: nn.BatchNorm2d(4),
    "BatchNorm3d": lambda: nn.BatchNorm3d(4),
    "SyncBatchNorm": lambda: nn.SyncBatchNorm(4),
    "LazyBatchNorm1d": _materialized_lazy,
}


def _model(kind: str = "BatchNorm1d") -> nn.Sequential:
    """A BN module with known stats inside a container, so the parent's recursive cast reaches it."""
    bn = BN_FACTORIES[kind]()
    with torch.no_grad():
        bn.running_mean.copy_(MEAN)
        bn.running_var.copy_(VAR)
        bn.num_batches_tracked.fill_(7)
    return nn.Sequential(nn.Linear(4, 4), bn)


def _keep(mode: str) -> None:
    amp_bn_fix.configure(keep_fp32=mode)


@pytest.mark.parametrize("kind", sorted(BN_FACTORIES))
@pytest.mark.parametrize("cast", sorted(CASTS))
def test_cast_keeps_running_stats_fp32_with_exact_values(cast, kind):
    model = CASTS[cast](_model(kind))
    bn = model[1]
    assert bn.running_mean.dtype == torch.float32 and bn.running_var.dtype == torch.float32
    # Exactly the FP32 values from before: no round trip through half.
    assert torch.equal(bn.running_mean, MEAN) and torch.equal(bn.running_var, VAR)
    assert bn.running_mean.device.type == "cpu"
    # BatchNorm's weight and bias stay FP32 too (the default, AMP_BN_FIX_KEEP_FP32=all); other
    # layers' parameters are cast as in torch; the step counter is untouched.
    assert bn.weight.dtype == bn.bias.dtype == torch.float32 and model[0].weight.dtype == CAST_DTYPES[cast]
    # Module.type() casts integer buffers too, as in torch; every other cast leaves them alone.
    count_dtype = torch.float16 if cast == "type(float16)" else torch.long
    assert bn.num_batches_tracked.dtype == count_dtype and bn.num_batches_tracked.item() == 7


@pytest.mark.cuda
@pytest.mark.parametrize("cast", [lambda m: m.cuda().half(), lambda m: m.to("cuda", torch.bfloat16)])
def test_cast_to_cuda_keeps_fp32_stats_on_the_new_device(cast):
    bn = cast(_model())[1]
    assert bn.running_mean.device.type == "cuda" and bn.running_mean.dtype == torch.float32
    assert torch.equal(bn.running_mean.cpu(), MEAN) and torch.equal(bn.running_var.cpu(), VAR)


def test_without_the_shim_torch_casts_running_stats_to_half():
    """The behaviour the shim changes (so the test above would fail without it)."""
    amp_bn_fix.disable()
    bn = _model()[1].half()
    assert bn.running_mean.dtype == torch.float16
    assert not torch.equal(bn.running_mean.float(), MEAN)


def test_lazy_module_cast_before_materialization_gets_fp32_stats():
    bn = nn.LazyBatchNorm1d().half()
    out = bn(torch.randn(8, 4).half())
    assert bn.running_mean.dtype == torch.float32 and bn.running_var.dtype == torch.float32
    assert bn.weight.dtype == torch.float32 and out.dtype == torch.float16


def test_meta_model_materialized_with_to_empty_gets_fp32_stats():
    with shim_disabled():
        bn = nn.BatchNorm1d(4, device="meta").half()  # 16-bit meta stats from before the shim
    bn.to_empty(device="cpu")
    bn.reset_running_stats()
    assert bn.running_mean.device.type == "cpu" and bn.running_mean.dtype == torch.float32
    assert torch.equal(bn.running_var, torch.ones(4))


@pytest.mark.parametrize(
    "cast",
    [
        lambda m: m.double(),
        lambda m: m.float(),
        lambda m: m.to(torch.float64),
        lambda m: m.half().float(),
        lambda m: m.half().double(),
        lambda m: m.cpu(),
    ],
)
def test_float32_and_float64_casts_behave_as_in_torch(cast):
    shimmed = cast(_model())
    with shim_disabled():
        plain = cast(_model())
    for name in ("running_mean", "running_var", "weight", "bias", "num_batches_tracked"):
        got, want = getattr(shimmed[1], name), getattr(plain[1], name)
        assert got.dtype == want.dtype, name
    # The shim kept FP32 stats through .half(), so nothing was rounded on the way back up.
    assert torch.equal(shimmed[1].running_mean.double(), MEAN.double())


def test_instance_norm_is_out_of_scope():
    """F.instance_norm is not shimmed, so its stats must follow its (16-bit) input as in torch."""
    norm = nn.InstanceNorm1d(4, track_running_stats=True).half()
    assert norm.running_mean.dtype == torch.float16


@pytest.mark.parametrize("conversion", ["set_data", "overwrite", "swap"])
def test_keep_all_keeps_weight_bias_and_grads_fp32_like_apex_o2(conversion):
    _keep("all")
    overwrite, swap = conversion == "overwrite", conversion == "swap"
    old_overwrite = torch.__future__.get_overwrite_module_params_on_conversion()
    old_swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_overwrite_module_params_on_conversion(overwrite)
    torch.__future__.set_swap_module_params_on_conversion(swap)
    try:
        model = _model()
        bn = model[1]
        with torch.no_grad():
            bn.weight.copy_(MEAN)
        model(torch.randn(8, 4)).sum().backward()
        weight, grad = bn.weight, bn.weight.grad
        grad_values = grad.clone()
        model.half()
    finally:
        torch.__future__.set_overwrite_module_params_on_conversion(old_overwrite)
        torch.__future__.set_swap_module_params_on_conversion(old_swap)
    bn = model[1]
    for tensor in (bn.weight, bn.bias, bn.weight.grad, bn.bias.grad, bn.running_mean, bn.running_var):
        assert tensor.dtype == torch.float32
    assert torch.equal(bn.weight, MEAN) and torch.equal(bn.weight.grad, grad_values)
    assert model[0].weight.dtype == torch.float16 and model[0].weight.grad.dtype == torch.float16
    # Parameter objects are kept exactly where torch keeps them (not under "overwrite").
    assert (bn.weight is weight) is (not overwrite)
    assert bn.weight.grad is grad


class _Abs(nn.Module):
    def forward(self, weight):
        return weight.abs()


def _parametrized(bn):
    torch.nn.utils.parametrize.register_parametrization(bn, "weight", _Abs())
    return bn


def _parametrized_bias(bn):
    torch.nn.utils.parametrize.register_parametrization(bn, "bias", _Abs())
    return bn


class _OwnWeightG(nn.BatchNorm2d):
    """A subclass with a parameter of its own named like weight norm's: nothing computes from it."""

    def __init__(self, channels):
        super().__init__(channels)
        self.weight_g = nn.Parameter(torch.ones(channels))


WEIGHT_TRANSFORMS = {
    "parametrize": _parametrized,
    "parametrize bias": _parametrized_bias,
    "parametrizations.weight_norm": lambda bn: torch.nn.utils.parametrizations.weight_norm(bn, dim=0),
    "parametrizations.spectral_norm": lambda bn: torch.nn.utils.parametrizations.spectral_norm(bn),
    "prune": lambda bn: torch.nn.utils.prune.l1_unstructured(bn, "weight", amount=0.5),
    "weight_norm": lambda bn: torch.nn.utils.weight_norm(bn, dim=0),
    "spectral_norm": lambda bn: torch.nn.utils.spectral_norm(bn),
    "a parameter named weight_g": lambda bn: _OwnWeightG(4),
}


@pytest.mark.filterwarnings("ignore:torch.nn.utils.weight_norm is deprecated")
@pytest.mark.parametrize("transform", list(WEIGHT_TRANSFORMS))
def test_keep_all_keeps_what_a_computed_weight_is_made_of(transform):
    """A weight that torch computes from other tensors (parametrize, pruning, weight norm) comes out
    FP32 from FP32 ones: a model cast under ``all`` runs without the shim too."""
    _keep("all")
    bn = WEIGHT_TRANSFORMS[transform](nn.BatchNorm2d(4)).half()
    x = torch.randn(2, 4, 5, 5).half()
    with shim_disabled():  # torch's own kernel: "expected scalar type Half but found Float" on a mix
        bn.train()(x)
        out = bn.eval()(x)
    assert out.dtype == torch.float16
    assert bn.weight.dtype == bn.bias.dtype == bn.running_mean.dtype == torch.float32
    if transform == "a parameter named weight_g":
        assert bn.weight_g.dtype == torch.float16  # cast as torch casts it


def test_keep_all_optimizer_still_updates_the_kept_parameters():
    _keep("all")
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model.half()
    before = model[1].weight.detach().clone()
    model(torch.randn(8, 4).half()).float().pow(2).sum().backward()
    optimizer.step()
    assert model[1].weight.dtype == torch.float32
    assert not torch.equal(model[1].weight.detach(), before)


def test_keep_stats_leaves_weight_and_bias_to_torch():
    _keep("stats")
    model = _model().half()
    assert model[1].weight.dtype == torch.float16 and model[1].bias.dtype == torch.float16
    assert model[1].running_var.dtype == torch.float32


def test_keep_none_is_torchs_behaviour():
    _keep("none")
    bn = _model()[1].half()
    assert bn.running_mean.dtype == torch.float16 and torch.equal(bn.running_mean, MEAN.half())


def test_keep_mode_is_read_at_cast_time():
    model = _model()
    _keep("none")
    model.half()
    assert model[1].running_mean.dtype == torch.float16
    _keep("stats")
    model.bfloat16()  # a later cast upcasts the already 16-bit stats (exactly)
    assert model[1].running_mean.dtype == torch.float32
    assert torch.equal(model[1].running_mean, MEAN.half().float())


def test_policy_off_casts_as_in_torch():
    """Policy off runs BatchNorm natively: casts are torch's too."""
    amp_bn_fix.set_policy("off")
    assert _model()[1].half().running_mean.dtype == torch.float16
    with amp_bn_fix.policy("fp32"):
        assert _model()[1].half().running_mean.dtype == torch.float32


def test_env_keep_stats_is_honoured_at_import():
    code = (
        "import torch, amp_bn_fix\n"
        "bn = torch.nn.BatchNorm1d(3).half()\n"
        "print(bn.weight.dtype, bn.running_mean.dtype)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env=child_env(AMP_BN_FIX_KEEP_FP32="stats"), capture_output=True,
                         text=True, check=True, timeout=SUBPROCESS_TIMEOUT)
    assert out.stdout.split() == ["torch.float16", "torch.float32"]


@pytest.mark.parametrize("keep", ["all", "stats"])
def test_cast_onto_a_device_type_left_out_is_torchs(keep):
    """The shim leaves calls on an excluded device type to torch, so their casts are torch's too."""
    amp_bn_fix.configure(keep_fp32=keep, devices=["cuda"])
    bn = _model()[1].half()
    assert bn.running_mean.dtype == bn.weight.dtype == torch.float16
    amp_bn_fix.configure(keep_fp32=keep, devices=["cuda", "cpu"])
    assert _model()[1].half().running_mean.dtype == torch.float32


def test_bad_keep_value_names_the_allowed_ones():
    with pytest.raises(ValueError, match="AMP_BN_FIX_KEEP_FP32='half'.*master, all, stats, none"):
        settings.from_env({"AMP_BN_FIX_KEEP_FP32": "half"})


def test_disable_restores_torchs_cast_and_enable_brings_it_back():
    amp_bn_fix.disable()
    # The very original: inherited from Module.
    assert "_apply" not in _BatchNorm.__dict__ and "_apply" not in nn.modules.instancenorm._InstanceNorm.__dict__
    assert _model()[1].half().running_mean.dtype == torch.float16
    amp_bn_fix.enable()
    assert _model()[1].half().running_mean.dtype == torch.float32


def _round_trip(state_dict):
    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    buffer.seek(0)
    return torch.load(buffer)


def test_checkpoint_from_shimmed_half_model_loads_into_plain_torch():
    shimmed = _model().half()
    state = _round_trip(shimmed.state_dict())
    assert state["1.running_mean"].dtype == torch.float32
    amp_bn_fix.disable()
    plain_fp32 = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    plain_fp32.load_state_dict(state)  # strict: same keys
    assert torch.equal(plain_fp32[1].running_mean, MEAN) and torch.equal(plain_fp32[1].running_var, VAR)
    assert plain_fp32[1].num_batches_tracked.item() == 7
    plain_half = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)).half()
    plain_half.load_state_dict(state)
    assert plain_half[1].running_mean.dtype == torch.float16
    assert torch.equal(plain_half[1].running_mean, MEAN.half())
    assert torch.equal(plain_half[1].weight, shimmed[1].weight)


def test_old_all_half_checkpoint_loads_into_shimmed_model_as_fp32_stats():
    with shim_disabled():
        old = _round_trip(_model().half().state_dict())
    assert old["1.running_mean"].dtype == torch.float16
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)).half()
    model.load_state_dict(old)
    bn = model[1]
    assert bn.running_mean.dtype == torch.float32 and bn.running_var.dtype == torch.float32
    assert torch.equal(bn.running_mean, old["1.running_mean"].float())
    assert torch.equal(bn.running_var, old["1.running_var"].float())
    assert bn.num_batches_tracked.item() == 7


def test_fp32_checkpoint_into_shimmed_half_model_loses_nothing():
    with shim_disabled():
        state = _round_trip(_model().state_dict())
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)).half()
    model.load_state_dict(state)
    assert torch.equal(model[1].running_mean, MEAN) and torch.equal(model[1].running_var, VAR)


def _stats_after_training(model: nn.Module, batches, dtype) -> torch.Tensor:
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    for x in batches:
        optimizer.zero_grad()
        model(x.to(dtype)).float().pow(2).mean().backward()
        optimizer.step()
    return torch.stack([model.running_mean.double(), model.running_var.double()])


@pytest.mark.slow
def test_half_model_running_stats_track_fp64_far_better_than_torch():
    """Features with a large offset: updates smaller than a float16 step are lost in half stats."""
    generator = torch.Generator().manual_seed(0)
    channels = 16
    offset = torch.linspace(50, 500, channels)
    scale = torch.linspace(1, 30, channels)
    batches = [(offset + scale * torch.randn(64, channels, generator=generator)).half() for _ in range(300)]

    reference = _stats_after_training(nn.BatchNorm1d(channels).double(), batches, torch.float64)
    shimmed = _stats_after_training(nn.BatchNorm1d(channels).half(), batches, torch.float16)
    amp_bn_fix.disable()
    plain = _stats_after_training(nn.BatchNorm1d(channels).half(), batches, torch.float16)

    def rel_error(stats):
        return ((stats - reference).abs() / reference.abs()).max().item()

    shim_error, torch_error = rel_error(shimmed), rel_error(plain)
    print(f"\nmax relative error of running stats vs fp64 after 300 steps: "
          f"shim (FP32 stats) {shim_error:.2e}, torch all-half {torch_error:.2e}, "
          f"ratio {torch_error / shim_error:.0f}x")
    # Each update is an FP32 computation over a batch of 64, and earlier updates' errors decay with
    # the momentum: each channel's stats within the FP32 bound of their own magnitude.
    assert_near(shimmed, reference, 64, scale=reference.abs(), what="running stats")
    assert torch_error > 100 * shim_error


def _half_model(shim: bool, keep: str, seed: int) -> nn.Sequential:
    """A bfloat16 conv + BatchNorm, cast with the shim (``keep``) or by plain torch, stats moved off 0/1."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
    with torch.no_grad():
        model[1].running_mean.copy_(MEAN)
        model[1].running_var.copy_(VAR)
    if shim:
        _keep(keep)
        return model.bfloat16()
    with shim_disabled():
        return model.bfloat16()


@pytest.mark.parametrize("assign", [False, True], ids=["copy", "assign"])
@pytest.mark.parametrize("keep", ["all", "stats", "none"])
@pytest.mark.parametrize("saved_by, loaded_by", [("shim", "plain"), ("plain", "shim"), ("shim", "shim")])
def test_state_dicts_load_either_way(saved_by, loaded_by, keep, assign):
    """A checkpoint made with or without the shim loads into a model made either way and runs there.

    ``load_state_dict`` copies into the model's own tensors (their dtypes stay); with ``assign=True``
    the model takes the checkpoint's. The one state that runs only through the shim is ``stats``'s:
    16-bit weights next to FP32 running stats, handed to a plain model by ``assign=True``.
    """
    source = _half_model(saved_by == "shim", keep, seed=0)
    target = _half_model(loaded_by == "shim", keep, seed=1)
    dtypes = {name: t.dtype for name, t in target.state_dict().items()}
    target.load_state_dict(source.state_dict(), assign=assign)
    loaded = target.state_dict()
    for name, tensor in source.state_dict().items():
        expected_dtype = tensor.dtype if assign else dtypes[name]
        assert loaded[name].dtype is expected_dtype, name
        # Every value arrives: exactly where the dtype stays, rounded once where it narrows.
        assert torch.equal(loaded[name], tensor.to(loaded[name].dtype)), name
    x = torch.randn(4, 3, 8, 8, dtype=BF16)
    # Otherwise the shim stays enabled, as every test starts.
    with shim_disabled() if loaded_by == "plain" else contextlib.nullcontext():
        if loaded_by == "plain" and assign and saved_by == "shim" and keep == "stats":
            with pytest.raises(RuntimeError, match="expected scalar type"):
                target(x)
        else:
            assert target(x).dtype is BF16


def test_a_patch_of_module_apply_made_after_the_shim_sees_batch_norm_casts_too(monkeypatch):
    # A library (or a test's spy) that patches nn.Module._apply after the shim is enabled tracks
    # every module's casts, BatchNorm's included, as in plain torch; the master is still made.
    from amp_bn_fix import _master

    original, seen = nn.Module._apply, []

    def tracking(self, fn, recurse=True):
        seen.append(type(self).__name__)
        return original(self, fn, recurse)

    amp_bn_fix.configure(keep_fp32="master")
    monkeypatch.setattr(nn.Module, "_apply", tracking)
    bn = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)).half()[1]
    assert seen == ["Sequential", "Linear", "BatchNorm1d"]
    assert bn.running_mean.dtype is torch.float16 and _master.peek(bn.running_mean, bn.running_var) is not None


@pytest.mark.filterwarnings("ignore:amp_bn_fix. the guard left:RuntimeWarning")
@pytest.mark.parametrize("model", ["half-model", "fp32-model-after-a-skip", "instance-norm-after-a-skip"])
def test_load_state_dict_swapping_tensors_loads_batch_norm_stats(model):
    # torch's swap mode swaps the loaded tensors into the module's, and refuses a tensor with weak
    # references: the master's and the guard record's give way for the load.
    from amp_bn_fix import _master

    amp_bn_fix.configure(keep_fp32="master")
    if model == "half-model":
        bn = nn.BatchNorm1d(4).half()
        with torch.autocast("cpu", dtype=torch.float16):
            bn(torch.randn(8, 4).half())
        assert _master.peek(bn.running_mean, bn.running_var) is not None
    else:
        bn = nn.InstanceNorm1d(4, track_running_stats=True) if model.startswith("instance") else nn.BatchNorm1d(4)
        x = torch.randn(8, 4, 3)
        x[0, 0] = float("inf")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            bn(x.bfloat16())
    skips = amp_bn_fix.report(bn)["guard_skips"]
    assert model == "half-model" or skips[type(bn).__name__] == 1
    dtype = bn.running_mean.dtype
    state = {name: value.clone() for name, value in bn.state_dict().items()}
    state["running_mean"], state["running_var"] = MEAN.to(dtype), VAR.to(dtype)
    old = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        mean = bn.running_mean
        bn.load_state_dict(state)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(old)
    assert bn.running_mean is mean and torch.equal(bn.running_mean, MEAN.to(dtype))
    assert amp_bn_fix.report(bn)["guard_skips"] == skips  # the record still knows its module
    if model == "half-model":  # the next eval call reads the loaded values, not the old master
        peeked = _master.peek(bn.running_mean, bn.running_var)
        assert torch.equal(peeked[0], MEAN.to(dtype).float())
