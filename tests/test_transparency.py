"""PyTorch's own batch-norm samples, with the shim enabled and disabled in one process.

The samples are torch's: the ``nn.functional.batch_norm`` OpInfo (it has no error inputs) and the
BatchNorm1d/2d/3d ModuleInfos with their error inputs. Outside autocast the shim must not change
anything a program sees: outputs, gradients and errors are bitwise plain torch's, and so are the
running stats, but a 16-bit training call's, which the shim updates in FP32 (the model's master) and
rounds once. Under CPU autocast every policy is compared with a float64 computation of the same call.

Documented exception (README, "Policies"), by name:

* ``mixed-half-call``: a float16/bfloat16 input next to FP32 running stats or parameters outside
  autocast, as in a ``.half()`` model whose stats the shim keeps FP32. torch's CPU kernels reject
  most such calls; the shim computes them in FP32 and returns the input's dtype. Neither torch's
  samples nor its ModuleInfos make such a call (they build every tensor in one dtype), and the
  tests below check that, so no sample is exempted here.
"""

import copy

import pytest
import torch
import torch.nn.functional as F

import amp_bn_fix
from _bounds import assert_near, assert_within, batch_norm_scales, rounding_bound, same_computation_bound
from _shared import ORIGINAL

pytest.importorskip("expecttest")  # torch.testing._internal needs it
from torch.testing._internal.common_methods_invocations import op_db  # noqa: E402
from torch.testing._internal.common_modules import module_db  # noqa: E402

HALF = (torch.float16, torch.bfloat16)
OPS = [op for op in op_db if op.name == "nn.functional.batch_norm"]
MODULES = [m for m in module_db if m.module_cls.__name__ in ("BatchNorm1d", "BatchNorm2d", "BatchNorm3d")]
assert OPS and len(MODULES) == 3


def op_samples(dtype):
    torch.manual_seed(0)  # torch's sample functions draw from the global generator
    samples = []
    for op in OPS:
        samples += [(op.variant_test_name, s) for s in op.sample_inputs("cpu", dtype, requires_grad=True)]
    return samples


def is_mixed_half_call(input, tensors):
    """The documented exception: 16-bit input next to a tensor of another dtype."""
    return input.dtype in HALF and any(t is not None and t.dtype is not input.dtype for t in tensors)


def fresh(t, dtype=None):
    if t is None:
        return None
    return t.detach().to(dtype or t.dtype).clone().requires_grad_(t.requires_grad)


def run_call(fn, input, args, kwargs):
    """One call on fresh copies: ``("ok", output, input grad, weight grad, bias grad, mean, var)``
    or ``("error", type, message)``."""
    input, args = fresh(input), [fresh(a) for a in args]
    try:
        out = fn(input, *args, **kwargs)
        if out.requires_grad:
            out.backward(torch.ones_like(out))  # a fixed cotangent, in the output's dtype
    except Exception as exc:
        return "error", type(exc), str(exc)
    padded = args + [None] * (4 - len(args))
    grads = [None if t is None else t.grad for t in (input, padded[2], padded[3])]
    return ("ok", out.detach(), *grads, padded[0], padded[1])


def assert_bitwise(ours, theirs, stats=()):
    """Bitwise equal results; but the 16-bit running stats at the positions ``stats`` after a
    training call: the shim updates those in FP32 (their master) and rounds once, where torch
    updates them from batch statistics rounded to 16 bits, so the two lie within two 16-bit
    roundings of each other."""
    assert ours[0] == theirs[0], (ours, theirs)
    if ours[0] == "error":
        assert ours[1:] == theirs[1:]
        return
    for at, (a, b) in enumerate(zip(ours, theirs)):
        if at == 0:
            continue
        assert (a is None) == (b is None)
        if a is None:
            continue
        assert a.dtype is b.dtype and a.shape == b.shape
        if at in stats and a.dtype in HALF:
            assert_within(a, b, same_computation_bound(b, {a.dtype: 2}), what="running stat")
        else:
            assert torch.equal(a, b)


def current_batch_norm(*args, **kwargs):
    # Looked up at call time, as every caller does: the wrapper, or the original once disabled.
    return F.batch_norm(*args, **kwargs)


def with_and_without_shim(fn):
    ours = fn()
    amp_bn_fix.disable()
    try:
        theirs = fn()
    finally:
        amp_bn_fix.enable()
    return ours, theirs


# --- outside autocast: bitwise ----------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16], ids=str)
def test_op_samples_outside_autocast_are_bitwise_plain_torch(dtype):
    samples = op_samples(dtype)
    assert samples
    for name, s in samples:
        assert not is_mixed_half_call(s.input, s.args)  # no documented exception applies
        ours, theirs = with_and_without_shim(lambda: run_call(current_batch_norm, s.input, list(s.args), s.kwargs))
        assert_bitwise(ours, theirs, stats=(5, 6))


def module_runs(module_info, dtype, training):
    """Every ModuleInfo input of ``module_info``: build, forward, backward; results per input."""
    torch.manual_seed(0)
    inputs = module_info.module_inputs_func(
        module_info, device="cpu", dtype=dtype, requires_grad=True, training=training
    )
    cls = module_info.module_cls

    def run():
        results = []
        for mi in inputs:
            torch.manual_seed(1)
            # Built in its dtype, as torch's module tests do: a module built in 16 bits keeps 16-bit
            # stats (README), so no mixed call arises.
            module = cls(*mi.constructor_input.args, **mi.constructor_input.kwargs, dtype=dtype).train(training)
            x = fresh(mi.forward_input.args[0])
            try:
                out = module(x, *mi.forward_input.args[1:], **mi.forward_input.kwargs)
                out.backward(torch.ones_like(out))
            except Exception as exc:
                results.append(("error", type(exc), str(exc)))
                continue
            grads = [x.grad] + [p.grad for p in module.parameters()]
            buffers = [b.clone() for b in module.buffers()]
            results.append(("ok", out.detach(), *grads, *buffers))
        return results

    return inputs, run


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("module_info", MODULES, ids=lambda m: m.module_cls.__name__)
def test_module_inputs_outside_autocast_are_bitwise_plain_torch(module_info, dtype, training):
    inputs, run = module_runs(module_info, dtype, training)
    assert inputs
    ours, theirs = with_and_without_shim(run)
    assert len(ours) == len(theirs) == len(inputs)
    for a, b in zip(ours, theirs):
        assert_bitwise(a, b, stats=range(len(a) - 3, len(a)))  # the buffers come last


@pytest.mark.parametrize("under_autocast", [False, True], ids=["plain", "autocast"])
@pytest.mark.parametrize("module_info", MODULES, ids=lambda m: m.module_cls.__name__)
def test_module_error_inputs_raise_torchs_errors(module_info, under_autocast):
    if module_info.module_error_inputs_func is None:
        pytest.skip("this torch's BatchNorm ModuleInfos have no error inputs")
    errors = list(module_info.module_error_inputs_func(
        module_info, device="cpu", dtype=torch.float32, requires_grad=False, training=True
    ))
    assert errors

    def run():
        seen = []
        for e in errors:
            mi = e.module_error_input
            x = mi.forward_input.args[0]
            if under_autocast:
                x = x.bfloat16()  # a handled call, were it valid
            try:
                module = module_info.module_cls(*mi.constructor_input.args, **mi.constructor_input.kwargs)
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=under_autocast):
                    module(x, *mi.forward_input.args[1:], **mi.forward_input.kwargs)
            except Exception as exc:
                seen.append((type(exc), str(exc)))
                assert isinstance(exc, e.error_type)
            else:
                seen.append(None)
        return seen

    ours, theirs = with_and_without_shim(run)
    assert ours == theirs and None not in ours


# --- under autocast: every policy against float64 ---------------------------------------------


POLICIES = ["fp32", "input", "autocast", "off"]


def expected_dtype(policy, input_dtype, autocast_dtype):
    return {"fp32": torch.float32, "input": input_dtype, "autocast": autocast_dtype, "off": input_dtype}[policy]


def fp64_call(input, args, kwargs):
    return run_call(ORIGINAL, fresh(input, torch.float64), [fresh(a, torch.float64) for a in args], kwargs)


def values_per_channel(x):
    return x.numel() // x.shape[1] if x.dim() > 1 and x.shape[1] else max(x.numel(), 1)


def assert_close_to_fp64(ours, ref, out_dtype, policy, x, args, kwargs):
    """``run_call``'s results for the call ``x, args, kwargs`` against float64's."""
    assert ours[0] == ref[0], (ours, ref)
    if ours[0] == "error":
        assert ours[1:] == ref[1:]  # the same error as the float64 call: torch's, for the same reason
        return
    out, ref_out = ours[1], ref[1]
    assert out.dtype is out_dtype
    # FP32 arithmetic throughout; the output rounded once to its dtype. The running stats are
    # computed in FP32 by every handled policy (and by torch's mixed kernel for ``off``).
    n = values_per_channel(x)
    if policy == "off":
        # torch's own 16-bit kernel: a few roundings of its dtype (no FP32-then-round-once promise).
        assert_within(out, ref_out, rounding_bound(ref_out.abs().max().item(), {out_dtype: 4}), what="output")
    else:
        assert_near(out, ref_out, n, what="output")
    for a, b in zip(ours[5:], ref[5:]):
        if a is not None:
            assert a.dtype is torch.float32
            assert_near(a, b, n, what="running stat")
    if policy == "fp32":
        # Gradients flow back in the input's and parameters' own dtypes. The cotangent of ones
        # cancels in the input and weight gradients: errors relative to what the backward sums.
        mean, var, weight = (list(args) + [None] * 3)[:3]
        running = None if kwargs.get("training", False) else (mean, var)
        _, input_scale, param_scale = batch_norm_scales(x, weight, torch.ones_like(ref_out),
                                                        kwargs.get("eps", 1e-5), running)
        for a, b, scale in zip(ours[2:5], ref[2:5], (input_scale, param_scale, param_scale)):
            if a is not None:
                assert_near(a, b, n, scale=scale, what="gradient")


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("autocast_dtype", [torch.bfloat16, torch.float16], ids=str)
def test_op_samples_under_autocast_match_fp64(autocast_dtype, policy):
    amp_bn_fix.set_policy(policy)
    checked = 0
    for name, s in op_samples(torch.float32):
        # An FP32 model under autocast: the input arrives in autocast's dtype, the rest FP32.
        x = fresh(s.input, autocast_dtype)
        with torch.autocast("cpu", dtype=autocast_dtype):
            ours = run_call(F.batch_norm, x, list(s.args), s.kwargs)
        ref = fp64_call(x, list(s.args), s.kwargs)
        if ours[0] == "ok" and ours[1].numel() == 0:
            assert ref[0] == "ok" and ours[1].shape == ref[1].shape
            continue
        assert_close_to_fp64(ours, ref, expected_dtype(policy, autocast_dtype, autocast_dtype), policy, x, list(s.args),
                             s.kwargs)
        checked += ours[0] == "ok"
    assert checked >= 8


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("autocast_dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("module_info", MODULES, ids=lambda m: m.module_cls.__name__)
def test_module_inputs_under_autocast_match_fp64(module_info, autocast_dtype, policy):
    amp_bn_fix.set_policy(policy)
    for training in (True, False):
        torch.manual_seed(0)
        inputs = module_info.module_inputs_func(
            module_info, device="cpu", dtype=torch.float32, requires_grad=True, training=training
        )
        for mi in inputs:
            torch.manual_seed(1)
            module = module_info.module_cls(*mi.constructor_input.args, **mi.constructor_input.kwargs).train(training)
            reference = copy.deepcopy(module).double()
            x = fresh(mi.forward_input.args[0], autocast_dtype)
            with torch.autocast("cpu", dtype=autocast_dtype):
                out = module(x)
            ref = reference(fresh(x, torch.float64))
            assert out.dtype is expected_dtype(policy, autocast_dtype, autocast_dtype), mi.desc
            n = values_per_channel(x)
            assert_near(out, ref, n, what=f"{mi.desc} output")
            for ours, theirs in zip(module.buffers(), reference.buffers()):
                if ours.is_floating_point():
                    assert ours.dtype is torch.float32
                    assert_near(ours, theirs, n, what=f"{mi.desc} buffer")
                else:
                    assert torch.equal(ours, theirs)  # num_batches_tracked


@pytest.mark.parametrize("autocast_dtype", [torch.bfloat16, torch.float16], ids=str)
def test_policy_off_under_autocast_is_bitwise_plain_torch(autocast_dtype):
    amp_bn_fix.set_policy("off")
    for name, s in op_samples(torch.float32):
        x = fresh(s.input, autocast_dtype)

        def run():
            with torch.autocast("cpu", dtype=autocast_dtype):
                return run_call(current_batch_norm, x, list(s.args), s.kwargs)

        assert_bitwise(*with_and_without_shim(run))
