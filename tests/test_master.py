"""A half model's FP32 master follows every write to its buffers, whatever its path (``_master``).

A master holds while the 16-bit buffers still hold its rounding, checked by value at each use. The
matrix crosses every way a program writes a BatchNorm's running stats with what comes next, on
both routes, against references built from the values written: plain torch's own kernel on them
(where the shim must be invisible) or float64 (where it computes).
"""

import copy

import pytest
import torch

import amp_bn_fix
from _bounds import assert_near
from _builders import fp64_batch_norm, half_model, seeded_input
from _shared import ORIGINAL, shim_disabled
from amp_bn_fix import _master

HALF = [torch.float16, torch.bfloat16]
C = 6


def _model(dtype):
    bn = half_model(dtype, 2, C)
    # A few training steps under autocast: the master now holds more than its buffers show.
    for step in range(3):
        x = seeded_input((8, C, 5, 5), dtype, seed=step, scale=0.5, shift=1.3)
        with torch.autocast("cpu", dtype=dtype):
            bn(x)
    assert not torch.equal(_master.peek(bn.running_mean, bn.running_var)[1].to(dtype).float(),
                           _master.peek(bn.running_mean, bn.running_var)[1])
    return bn


def _new_values(bn):
    g = torch.Generator().manual_seed(7)
    return ((torch.rand(C, generator=g) - 0.5).to(bn.running_mean.dtype),
            (torch.rand(C, generator=g) + 0.5).to(bn.running_var.dtype))


def _write_inplace(bn):
    mean, var = _new_values(bn)
    with torch.no_grad():
        bn.running_mean.copy_(mean)
        bn.running_var.mul_(0).add_(var)
    return bn


def _write_data_copy(bn):
    mean, var = _new_values(bn)
    bn.running_mean.data.copy_(mean)
    bn.running_var.data.copy_(var)
    return bn


def _write_data_assign(bn):
    mean, var = _new_values(bn)
    bn.running_mean.data = mean
    bn.running_var.data = var
    return bn


def _write_attribute(bn):
    bn.running_mean, bn.running_var = _new_values(bn)
    return bn


def _write_state_dict(bn, assign=False):
    mean, var = _new_values(bn)
    state = dict(bn.state_dict(), running_mean=mean, running_var=var)
    bn.load_state_dict(state, assign=assign)
    return bn


def _write_foreach(bn):
    mean, var = _new_values(bn)
    with torch.no_grad():
        torch._foreach_copy_([bn.running_mean, bn.running_var], [mean, var])
    return bn


def _write_reset(bn):
    bn.reset_running_stats()  # what torch.optim.swa_utils.update_bn starts with
    return bn


def _write_by_torch(bn):
    # torch's own 16-bit update, where the shim steps aside.
    x = seeded_input((8, C, 5, 5), bn.weight.dtype, seed=9, scale=3, shift=2)
    with amp_bn_fix.policy("off"):
        bn(x)
    return bn


WRITES = {
    "in-place": _write_inplace,
    "data-copy": _write_data_copy,
    "data-assign": _write_data_assign,
    "attribute": _write_attribute,
    "load_state_dict": _write_state_dict,
    "load_state_dict-assign": lambda bn: _write_state_dict(bn, assign=True),
    "foreach": _write_foreach,
    "reset_running_stats": _write_reset,
    "torch-update": _write_by_torch,
    "deepcopy": lambda bn: copy.deepcopy(bn),
}


def _input(dtype):
    return seeded_input((8, C, 5, 5), dtype, seed=11, scale=0.5, shift=1)


def _eval_plain(bn, written):
    # Outside autocast a half model's eval is plain torch's on the buffers, bit for bit.
    x = _input(bn.weight.dtype)
    out = bn.eval()(x)
    expected = ORIGINAL(x, written[0].clone(), written[1].clone(), bn.weight, bn.bias, False, 0.1, bn.eps)
    assert torch.equal(out, expected)


def _eval_autocast(bn, written):
    # Under autocast the master is read: it must hold the values written.
    x = _input(bn.weight.dtype)
    with torch.autocast("cpu", dtype=bn.weight.dtype):
        out = bn.eval()(x)
    expected = fp64_batch_norm(x, *written, bn.weight, bn.bias, False, 0.1, bn.eps)
    assert out.dtype is torch.float32
    assert_near(out, expected.out, 1)


def _trains_from(bn, start, autocast=True):
    """A training step's FP32 update starts from ``start`` (FP32 or 16-bit mean and var), and the
    buffers hold its rounding."""
    x = _input(bn.weight.dtype)
    with torch.autocast("cpu", dtype=bn.weight.dtype, enabled=autocast):
        bn.train()(x)
    expected = fp64_batch_norm(x, *start, None, None, True, 0.1, bn.eps)
    mean64, var64 = expected.running_mean, expected.running_var
    master = _master.peek(bn.running_mean, bn.running_var)
    assert master is not None
    n = x.numel() // C
    assert_near(master[0], mean64, n, scale=mean64.abs().max().item() + 1, what="mean")
    assert_near(master[1], var64, n, scale=var64.abs().max().item(), what="var")
    assert torch.equal(bn.running_mean, master[0].to(bn.running_mean.dtype))
    assert torch.equal(bn.running_var, master[1].to(bn.running_var.dtype))


def _train_step(autocast):
    # The FP32 update starts from the values written.
    return lambda bn, written: _trains_from(bn, written, autocast)


def _to_fp32(bn, written):
    # .float() gives the master's values: here exactly the values written.
    bn.float()
    assert torch.equal(bn.running_mean, written[0].float()) and torch.equal(bn.running_var, written[1].float())


def _to_other_half(bn, written):
    other = torch.bfloat16 if bn.running_mean.dtype is torch.float16 else torch.float16
    bn.to(other)
    assert torch.equal(bn.running_mean, written[0].float().to(other))
    assert torch.equal(bn.running_var, written[1].float().to(other))


NEXT = {
    "eval": _eval_plain,
    "eval-autocast": _eval_autocast,
    "train": _train_step(autocast=False),
    "train-autocast": _train_step(autocast=True),
    ".float()": _to_fp32,
    "other-16-bit": _to_other_half,
}


@pytest.mark.parametrize("then", list(NEXT))
@pytest.mark.parametrize("write", list(WRITES))
@pytest.mark.parametrize("dtype", HALF, ids=["fp16", "bf16"])
def test_the_master_follows_every_write(both_routes, dtype, write, then):
    bn = WRITES[write](_model(dtype))
    written = (bn.running_mean.detach().clone(), bn.running_var.detach().clone())
    NEXT[then](bn, written)


@pytest.mark.parametrize("dtype", HALF, ids=["fp16", "bf16"])
def test_a_write_that_leaves_the_rounding_as_it_was_keeps_the_master(dtype):
    bn = _model(dtype)
    master = _master.peek(bn.running_mean, bn.running_var).clone()
    with torch.no_grad():
        bn.running_var.copy_(bn.running_var.clone())
    assert torch.equal(_master.peek(bn.running_mean, bn.running_var), master)


@pytest.mark.parametrize("dtype", HALF, ids=["fp16", "bf16"])
def test_buffers_given_another_shape_through_data_start_a_new_master(both_routes, dtype):
    # Channel pruning through .data: the module's tensors keep their objects, with fewer channels.
    bn = _model(dtype)
    keep = [0, 2, 3, 5]
    for name in ("weight", "bias", "running_mean", "running_var"):
        getattr(bn, name).data = getattr(bn, name).data[keep].clone()
    written = (bn.running_mean.detach().clone(), bn.running_var.detach().clone())
    x = seeded_input((8, len(keep), 5, 5), dtype, seed=3)
    with torch.autocast("cpu", dtype=dtype):
        out = bn.train()(x)
    expected = fp64_batch_norm(x, *written, bn.weight, bn.bias, True, 0.1, bn.eps)
    n = x.numel() // len(keep)
    assert_near(out, expected.out, n, what="output")
    master = _master.peek(bn.running_mean, bn.running_var)
    assert master.shape == (2, len(keep))
    var64 = expected.running_var
    assert_near(master[1], var64, n, scale=var64.abs().max().item(), what="var")


@pytest.mark.parametrize("dtype", HALF, ids=["fp16", "bf16"])
def test_an_eval_call_leaves_the_master_and_restored_buffers_find_it(both_routes, dtype):
    # Validation with other stats swapped in (an EMA's), then the training state restored.
    bn = _model(dtype)
    master = _master.peek(bn.running_mean, bn.running_var).clone()
    saved = copy.deepcopy(bn.state_dict())
    _write_state_dict(bn)
    _eval_autocast(bn, (bn.running_mean.detach().clone(), bn.running_var.detach().clone()))
    bn.load_state_dict(saved)
    assert torch.equal(_master.peek(bn.running_mean, bn.running_var), master)
    _trains_from(bn, master)  # not from the values that were swapped in


CASTS_IN_PLACE = {
    "to-own-device": lambda bn: bn.to("cpu"),
    "to-own-dtype": lambda bn: bn.to(bn.running_mean.dtype),
    "own-16-bit-method": lambda bn: bn.half() if bn.running_mean.dtype is torch.float16 else bn.bfloat16(),
    "memory-format": lambda bn: bn.to(memory_format=torch.channels_last),
    "share_memory": lambda bn: bn.share_memory(),
    "to-own-device-in-inference-mode": lambda bn: _in_inference_mode(bn.to, "cpu"),
}


def _in_inference_mode(fn, *args):
    with torch.inference_mode():
        return fn(*args)


@pytest.mark.parametrize("cast", list(CASTS_IN_PLACE))
@pytest.mark.parametrize("dtype", HALF, ids=["fp16", "bf16"])
def test_a_cast_that_leaves_the_buffers_where_they_are_leaves_them_and_their_master(both_routes, dtype, cast):
    # As in plain torch: the same buffer objects (shared memory, ties and references stay), no
    # inference tensors made by a no-op move, and the master goes on.
    bn = _model(dtype)
    mean, var = bn.running_mean, bn.running_var
    master = _master.peek(mean, var).clone()
    CASTS_IN_PLACE[cast](bn)
    assert bn.running_mean is mean and bn.running_var is var
    assert not mean.is_inference()
    assert mean.is_shared() is (cast == "share_memory")
    assert torch.equal(_master.peek(mean, var), master)
    _trains_from(bn, master)


@pytest.mark.parametrize("wider", ["float", "double"])
@pytest.mark.parametrize("dtype", HALF, ids=["fp16", "bf16"])
def test_a_cast_back_to_a_wider_dtype_takes_the_master_s_values(both_routes, dtype, wider):
    bn = _model(dtype)  # its master holds more than its buffers show
    master = _master.peek(bn.running_mean, bn.running_var).clone()
    getattr(bn, wider)()
    target = {"float": torch.float32, "double": torch.float64}[wider]
    assert bn.running_mean.dtype is target and bn.weight.dtype is target
    assert torch.equal(bn.running_mean, master[0].to(target)) and torch.equal(bn.running_var, master[1].to(target))


@pytest.mark.parametrize("cast", ["float", "double", "other-16-bit"])
@pytest.mark.parametrize("dtype", HALF, ids=["fp16", "bf16"])
def test_a_cast_onto_a_device_type_left_out_is_torchs_own(both_routes, dtype, cast):
    # configuration.md: casts onto a device type left out of AMP_BN_FIX_DEVICES are torch's own,
    # back to a wider dtype too (the rounded values, widened), whatever master the stats have.
    bn = _model(dtype)
    assert _master.peek(bn.running_mean, bn.running_var) is not None
    target = {"float": torch.float32, "double": torch.float64,
              "other-16-bit": torch.bfloat16 if dtype is torch.float16 else torch.float16}[cast]
    expected = bn.running_mean.to(target), bn.running_var.to(target)
    amp_bn_fix.configure(devices=["cuda"])
    bn.to(target)
    assert torch.equal(bn.running_mean, expected[0]) and torch.equal(bn.running_var, expected[1])


@pytest.mark.parametrize("path", ["double", "half-double"])
@pytest.mark.parametrize("dtype", HALF, ids=["fp16", "bf16"])
def test_a_cast_to_16_bits_from_float64_makes_a_master_too(both_routes, dtype, path):
    # A float64 model cast to 16 bits (and a half model through float64 and back) gets its master
    # as one cast from FP32 does: the FP32 values, beyond float16's range too.
    bn = torch.nn.BatchNorm2d(C)
    with torch.no_grad():
        bn.running_mean.fill_(1.001)
        bn.running_var.fill_(1e5)  # inf in float16
    if path == "half-double":
        bn.to(dtype)
    bn.double().to(dtype)
    expected = torch.stack((torch.full((C,), 1.001), torch.full((C,), 1e5)))
    assert torch.equal(_master.peek(bn.running_mean, bn.running_var), expected)
    assert torch.equal(bn.float().running_var, expected[1])


@pytest.mark.parametrize("autocast", [True, False], ids=["autocast", "half-model-alone"])
@pytest.mark.parametrize("dtype", HALF, ids=["fp16", "bf16"])
def test_a_master_started_under_inference_mode_trains_on_after_it(both_routes, dtype, autocast):
    # A recalibration's first training call under inference_mode starts the master: it outlives
    # the block, and the training after it writes it in place (plain torch runs this sequence).
    bn = copy.deepcopy(half_model(dtype, 2, C))  # buffers of its own, with no master yet
    assert _master.peek(bn.running_mean, bn.running_var) is None
    with torch.inference_mode(), torch.autocast("cpu", dtype=dtype, enabled=autocast):
        bn.train()(_input(dtype))
    master = _master.peek(bn.running_mean, bn.running_var)
    assert master is not None and not master.is_inference()
    _trains_from(bn, master.clone(), autocast)


@pytest.mark.parametrize("later", ["none", "all", "stats"])
@pytest.mark.parametrize("dtype", HALF, ids=["fp16", "bf16"])
def test_a_model_cast_under_master_keeps_its_master_after_the_setting_changes(both_routes, dtype, later):
    # keep_fp32 applies to the casts made after it changes (say, of a second model in a
    # configure() block): a model cast before goes on with its master, in its updates and casts.
    bn = _model(dtype)
    with amp_bn_fix.configure(keep_fp32=later):
        # First a call of the same kind on buffers with no master (the setting makes none now),
        # whose plan the memo keeps: it is not the answer for buffers that have one.
        alone = copy.deepcopy(bn)
        with torch.autocast("cpu", dtype=dtype):
            alone.train()(_input(dtype))
        assert _master.peek(alone.running_mean, alone.running_var) is None
        _trains_from(bn, _master.peek(bn.running_mean, bn.running_var).clone())
        master = _master.peek(bn.running_mean, bn.running_var).clone()
        bn.float()
    assert torch.equal(bn.running_mean, master[0]) and torch.equal(bn.running_var, master[1])


@pytest.mark.parametrize("channels", [C - 2, C + 1, 40 * C], ids=["fewer", "more", "many"])
@pytest.mark.parametrize("affine", [True, False], ids=["affine", "no-affine"])
@pytest.mark.parametrize("autocast", [True, False], ids=["autocast", "half-model-alone"])
def test_an_input_of_other_channels_gets_torch_s_error_and_changes_nothing(both_routes, autocast, affine, channels):
    # The statistics op that updates a master checks no size: given an input of other channels
    # it wrote past the master (a crash, or silently wrong stats). torch must see such a call.
    x = seeded_input((4, channels, 3, 3), torch.bfloat16)
    with shim_disabled(), pytest.raises(RuntimeError) as theirs, torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        half_model(torch.bfloat16, 2, C, affine=affine).train()(x)
    bn = _model(torch.bfloat16) if affine else half_model(torch.bfloat16, 2, C, affine=False)
    kept = bn.running_mean.clone(), bn.running_var.clone(), _master.peek(bn.running_mean, bn.running_var)
    with pytest.raises(RuntimeError) as ours, torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        bn.train()(x)
    assert str(ours.value) == str(theirs.value)
    assert torch.equal(bn.running_mean, kept[0]) and torch.equal(bn.running_var, kept[1])
    master = _master.peek(bn.running_mean, bn.running_var)
    assert (master is None) is (kept[2] is None) and (master is None or torch.equal(master, kept[2]))


def test_disable_while_another_thread_frees_half_models():
    # A master leaves when its buffers die, from a callback run in whichever thread frees them: at
    # any moment of disable()'s own pass over the masters. Thread switches as often as possible.
    import sys
    import threading

    stop = threading.Event()

    def churn():
        while not stop.is_set():
            for _ in range(50):  # made and dropped at once
                torch.nn.BatchNorm1d(2).half()

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    thread = threading.Thread(target=churn)
    thread.start()
    try:
        for _ in range(400):
            amp_bn_fix.disable()
            amp_bn_fix.enable()
    finally:
        stop.set()
        thread.join()
        sys.setswitchinterval(interval)
        amp_bn_fix.enable()
