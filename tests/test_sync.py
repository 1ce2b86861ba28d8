"""SyncBatchNorm's syncing path goes through the policy too.

Its kernels are CUDA-only, so on CPU the sync function is replaced by a recorder that does what it
does for one rank (batch statistics, running-stat update, normalization) and notes what it got.
At the end, real ``nn.SyncBatchNorm`` training across two gloo ranks (tests/sync_worker.py): on CPU,
its CUDA-only ops replaced by CPU stand-ins in the worker processes, on the CPU's route and on the
route a CUDA call takes; and both ranks on one GPU, with torch's own kernels.
"""

import pathlib
import signal
import subprocess
import sys
import time

import pytest
import torch
import wrapt
from torch.nn.modules import _functions
from torch.nn.modules import batchnorm as batchnorm_module

import amp_bn_fix
from _bounds import assert_near, batch_norm_scales
from _builders import batch_norm, fp64_batch_norm, seeded_input
from _shared import SUBPROCESS_TIMEOUT, child_env
from amp_bn_fix import _state

EPS, MOMENTUM = 1e-5, 0.1
N = 8 * 4  # values per channel in make()'s input


class Recorder:
    """Stands in for ``SyncBatchNorm.apply`` with one rank; keeps the arguments of each call."""

    def __init__(self):
        self.calls = []

    def __call__(self, cls, input, weight, bias, running_mean, running_var, eps, momentum, group, world_size):
        self.calls.append(
            dict(
                args=(input, weight, bias, running_mean, running_var),
                # Whether autocast would recast ops inside (mm is on its lower-precision list).
                autocast=(torch.ones(1, 1) @ torch.ones(1, 1)).dtype is not torch.float32,
                world_size=world_size,
            )
        )
        return torch.batch_norm(input, weight, bias, running_mean, running_var, True, momentum, eps, False)


@pytest.fixture
def recorder(monkeypatch):
    """The recorder in place of the real function, with the shim's wrapper on top of it."""
    record = Recorder()
    amp_bn_fix.disable()
    monkeypatch.setattr(_functions.SyncBatchNorm, "apply", classmethod(record))
    amp_bn_fix.enable()
    yield record
    amp_bn_fix.disable()  # before monkeypatch restores the real function under it


def make(dtype=torch.float32, channels=3):
    """A bfloat16 input and ``dtype`` weight, bias (these three requiring grad) and running stats."""
    gen = torch.Generator().manual_seed(0)
    bn = batch_norm(1, channels, seeded_stats=True, seed=gen)
    weight, bias = (p.detach().to(dtype).requires_grad_() for p in (bn.weight, bn.bias))
    mean, var = (s.to(dtype) for s in (bn.running_mean, bn.running_var))
    x = seeded_input((8, channels, 4), torch.bfloat16, seed=gen, scale=3, shift=1).requires_grad_()
    return x, weight, bias, mean, var


def sync_apply(x, weight, bias, mean, var):
    # Exactly how nn.SyncBatchNorm.forward calls it (through the name batchnorm.py imported).
    return batchnorm_module.sync_batch_norm.apply(x, weight, bias, mean, var, EPS, MOMENTUM, None, 2)


def test_install_wraps_the_sync_function_and_uninstall_restores_it():
    assert isinstance(_functions.SyncBatchNorm.__dict__.get("apply"), wrapt.FunctionWrapper)
    amp_bn_fix.disable()
    assert "apply" not in _functions.SyncBatchNorm.__dict__  # inherited from Function again
    amp_bn_fix.enable()
    assert isinstance(_functions.SyncBatchNorm.__dict__.get("apply"), wrapt.FunctionWrapper)


@pytest.mark.parametrize(
    "policy, out_dtype", [("fp32", torch.float32), ("input", torch.bfloat16), ("autocast", torch.float16)]
)
def test_half_input_reaches_the_sync_function_in_fp32(recorder, policy, out_dtype):
    x, weight, bias, mean, var = make()
    expected = fp64_batch_norm(x, mean, var, weight, bias, True, MOMENTUM, EPS)
    autocast_dtype = torch.float16 if policy == "autocast" else torch.bfloat16
    with torch.autocast("cpu", dtype=autocast_dtype), amp_bn_fix.policy(policy):
        out = sync_apply(x, weight, bias, mean, var)
    (call,) = recorder.calls
    assert [t.dtype for t in call["args"]] == [torch.float32] * 5
    assert call["autocast"] is False
    assert call["world_size"] == 2
    assert torch.equal(call["args"][0], x.detach().float())
    assert call["args"][1] is weight and call["args"][2] is bias  # FP32 params go in as they are
    assert out.dtype == out_dtype
    assert_near(out, expected.out, N, what="output")
    assert mean.dtype == var.dtype == torch.float32
    assert_near(mean, expected.running_mean, N, what="running mean")
    assert_near(var, expected.running_var, N, what="running var")


def test_gradients_flow_back_in_the_input_dtype(recorder):
    x, weight, bias, mean, var = make()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = sync_apply(x, weight, bias, mean, var)
    out.pow(2).sum().backward()
    # The loss's gradient in float64: 2 * the float64 output.
    out64 = fp64_batch_norm(x, None, None, weight, bias, True, MOMENTUM, EPS).out
    expected = fp64_batch_norm(x, None, None, weight, bias, True, MOMENTUM, EPS, grad_out=2 * out64)
    assert x.grad.dtype == torch.bfloat16 and weight.grad.dtype == torch.float32
    # The loss's gradient 2 * out cancels in the input gradient (to about 0): its error is relative
    # to the magnitude of what the backward sums.
    _, input_scale, param_scale = batch_norm_scales(x, weight, 2 * out, EPS)
    assert_near(x.grad, expected.grad_input, N, scale=input_scale, what="input gradient")
    assert_near(weight.grad, expected.grad_weight, N, scale=param_scale, what="weight gradient")


def test_half_parameters_and_stats_are_computed_in_fp32_and_written_back(recorder):
    x, weight, bias, mean, var = make(torch.bfloat16)
    expected = fp64_batch_norm(x, mean, var, weight, bias, True, MOMENTUM, EPS)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        sync_apply(x, weight, bias, mean, var)
    (call,) = recorder.calls
    assert [t.dtype for t in call["args"]] == [torch.float32] * 5
    assert mean.dtype == torch.bfloat16  # the caller's tensors keep their dtype, updated in place
    # The FP32 update, rounded once to bfloat16.
    assert_near(mean, expected.running_mean, N, what="running mean")
    assert_near(var, expected.running_var, N, what="running var")


@pytest.mark.filterwarnings("ignore:amp_bn_fix. the guard left:RuntimeWarning")  # tests/test_record.py checks it
def test_guard_keeps_running_stats_when_the_batch_is_not_finite(recorder):
    x, weight, bias, mean, var = make()
    x = x.detach().clone()
    x[0, 0, 0] = float("inf")
    before = mean.clone(), var.clone()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        sync_apply(x, weight, bias, mean, var)
    assert torch.equal(mean, before[0]) and torch.equal(var, before[1])


def test_a_half_model_trained_through_the_syncing_path_keeps_its_master(recorder):
    """Its FP32 master takes the update, as on every other door: eval reads it, ``.float()`` returns it."""
    from amp_bn_fix import _master

    bn = torch.nn.SyncBatchNorm(3).half()  # 16-bit buffers with an FP32 master
    x, weight, bias, _, _ = make()
    mean64, var64 = bn.running_mean.double(), bn.running_var.double()
    for _ in range(3):
        with torch.autocast("cpu", dtype=torch.float16):
            sync_apply(x, weight, bias, bn.running_mean, bn.running_var)
        expected = fp64_batch_norm(x, mean64, var64, None, None, True, MOMENTUM, EPS)
        mean64, var64 = expected.running_mean, expected.running_var
    master = _master.peek(bn.running_mean, bn.running_var)
    assert master is not None, "the syncing path dropped the master"
    assert_near(master[0], mean64, N, what="master's running mean")
    assert_near(master[1], var64, N, what="master's running var")
    # The 16-bit buffers are the master, rounded.
    assert torch.equal(bn.running_mean, master[0].half()) and torch.equal(bn.running_var, master[1].half())
    bn.float()
    assert torch.equal(bn.running_mean, master[0]) and torch.equal(bn.running_var, master[1])


def test_a_call_that_raises_is_not_counted_as_handled(recorder, monkeypatch):
    """Counted once computed, as on every other door."""
    x, weight, bias, mean, var = make()
    before = amp_bn_fix.report()["handled"]

    def fails(self, *args):
        raise RuntimeError("the process group went away")

    monkeypatch.setattr(Recorder, "__call__", fails)
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(RuntimeError, match="went away"):
        sync_apply(x, weight, bias, mean, var)
    assert amp_bn_fix.report()["handled"] == before


@pytest.mark.parametrize("case", ["fp32 input", "policy off", "device not selected", "no autocast", "re-entered"])
def test_calls_it_does_not_handle_pass_through_untouched(recorder, case):
    x, weight, bias, mean, var = make()
    if case == "fp32 input":
        x = x.detach().float()
    elif case == "policy off":
        amp_bn_fix.set_policy("off")
    elif case == "device not selected":
        amp_bn_fix.configure(devices=["cuda"])
    elif case == "no autocast":  # all in bfloat16: the caller chose it, as F.batch_norm leaves it
        weight, bias, mean, var = (t.detach().to(torch.bfloat16) for t in (weight, bias, mean, var))
    _state.thread.inside = case == "re-entered"
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=case != "no autocast"):
            out = sync_apply(x, weight, bias, mean, var)
    finally:
        _state.thread.inside = False
    (call,) = recorder.calls
    assert all(got is given for got, given in zip(call["args"], (x, weight, bias, mean, var)))
    assert out.dtype == x.dtype
    # Control: without the condition, the same call is handled.
    amp_bn_fix.configure(policy="fp32", devices=None)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        sync_apply(x.detach().to(torch.bfloat16), weight, bias, mean, var)
    assert recorder.calls[1]["args"][0].dtype == torch.float32


@pytest.mark.cuda
def test_real_sync_function_on_cuda(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        x = (torch.randn(16, 4, 6, device="cuda") * 3 + 1).half().requires_grad_()
        weight = (torch.rand(4, device="cuda") + 0.5).requires_grad_()
        bias = torch.randn(4, device="cuda").requires_grad_()
        mean, var = torch.zeros(4, device="cuda"), torch.ones(4, device="cuda")
        expected = fp64_batch_norm(x, mean, var, weight, bias, True, MOMENTUM, EPS)
        with torch.autocast("cuda", dtype=torch.float16):
            out = _functions.SyncBatchNorm.apply(x, weight, bias, mean, var, EPS, MOMENTUM, dist.group.WORLD, 1)
        assert out.dtype == torch.float32 and mean.dtype == torch.float32
        torch.testing.assert_close(out.double(), expected.out, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(mean.double(), expected.running_mean, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(var.double(), expected.running_var, rtol=1e-5, atol=1e-5)
        out.sum().backward()
        assert x.grad.dtype == torch.float16 and torch.isfinite(x.grad).all()
    finally:
        dist.destroy_process_group()


# ---- nn.SyncBatchNorm itself, across two gloo ranks: tests/sync_worker.py -----------------------
#
# Real training through SyncBatchNorm.apply with world size 2: its all_gather and all_reduce run
# over a gloo group on the loopback interface, and the shim's wrapper is the syncing door. On CPU
# its CUDA-only ops are replaced by CPU stand-ins in the worker processes only (see the worker's
# docstring), on the CPU's route and on the device route; on a GPU both ranks share it.

SYNC_WORKER = pathlib.Path(__file__).resolve().parent / "sync_worker.py"
RANKS, STEPS, BNS = 2, 3, 2  # the worker's: two SyncBatchNorms, three steps


def _start_ranks(out, route):
    env = child_env(OMP_NUM_THREADS="1")
    if sys.platform.startswith("linux"):
        env["GLOO_SOCKET_IFNAME"] = "lo"  # gloo's pairs connect over the loopback interface only
    store = out / "store"  # the rendezvous is a file: no TCP store either
    if store.exists():
        store.unlink()
    return [
        subprocess.Popen([sys.executable, str(SYNC_WORKER), str(store), str(out), str(rank), str(RANKS), route],
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for rank in range(RANKS)
    ]


def _finish_ranks(procs, timeout):
    """Each rank's return code and output; past ``timeout`` s every rank still running is killed,
    and has the code None."""
    deadline = time.monotonic() + timeout
    results = []
    for proc in procs:
        try:
            output, _ = proc.communicate(timeout=max(deadline - time.monotonic(), 1))
        except subprocess.TimeoutExpired:
            for other in procs:
                other.kill()
            return results + [(None, other.communicate()[0]) for other in procs[len(results):]]
        results.append((proc.returncode, output))
    return results


@pytest.fixture(scope="module", params=["cpu", "device-route", pytest.param("cuda", marks=pytest.mark.cuda)])
def ranks(request, tmp_path_factory):
    """Every rank's record of tests/sync_worker.py's scenarios on one route (one run of the pair, shared)."""
    out = tmp_path_factory.mktemp(f"sync-ranks-{request.param}")
    # gloo can abort a rank, or leave one waiting for ever, while the group tears down on a loaded
    # machine (see conftest's run_torchrun): the pair runs once more then, each time with half the time.
    results = _finish_ranks(_start_ranks(out, request.param), SUBPROCESS_TIMEOUT / 2)
    if any(code is None or code == -signal.SIGABRT for code, _ in results):
        results = _finish_ranks(_start_ranks(out, request.param), SUBPROCESS_TIMEOUT / 2)
    for rank, (code, output) in enumerate(results):
        assert code == 0, f"rank {rank} exited with {code} (None: ran past {SUBPROCESS_TIMEOUT / 2} s):\n{output[-6000:]}"
    records = [torch.load(out / f"rank{rank}.pt", weights_only=True) for rank in range(RANKS)]
    for rank, record in enumerate(records):
        assert record["rank"] == rank and record["route"] == request.param
        assert record["shim"] == {"enabled": True, "policy": "fp32", "keep_fp32": "master", "guard": True}
    return records


def _steps(ranks, scenario, bn):
    """The calls of SyncBatchNorm number ``bn``, step by step, as one tuple of every rank's call."""
    per_rank = [[call for call in record[scenario]["calls"] if call["bn"] == bn] for record in ranks]
    assert len({len(calls) for calls in per_rank}) == 1
    return list(zip(*per_rank))


def _union(calls, key="x"):
    """float64 values of every rank's batch, as the one batch SyncBatchNorm normalizes."""
    return torch.cat([call[key].double() for call in calls])


def _replayed(steps):
    """float64 running stats after each step, from the initial zeros and ones, of the union of the batches;
    and the largest magnitude the running mean sums (every value of every batch)."""
    channels = steps[0][0]["x"].shape[1]
    mean, var = torch.zeros(channels, dtype=torch.float64), torch.ones(channels, dtype=torch.float64)
    after, magnitude = [], 0.0
    for calls in steps:
        x = _union(calls)
        expected = fp64_batch_norm(x, mean, var, None, None, True, MOMENTUM, EPS)
        mean, var = expected.running_mean, expected.running_var
        after.append((mean, var))
        magnitude = max(magnitude, x.abs().max().item())
    return after, magnitude


def _assert_stats(mean, var, expected, n, magnitude, what):
    # The running mean's error is relative to the values its sums add up, not to the mean (which
    # may be small next to them); the variance's to the variance (its sums are of squared deviations).
    assert_near(mean, expected[0], n, scale=magnitude, what=f"{what}: running mean")
    assert_near(var, expected[1], n, what=f"{what}: running var")


def test_sync_batchnorm_trains_across_two_ranks_in_fp32(ranks):
    """FP32 model under bfloat16 autocast, policy fp32: every call reaches the syncing function in FP32
    with autocast off inside, gathers two ranks' statistics, returns FP32, and keeps FP32 stats that
    are the same on both ranks and the float64 update of the global batch's statistics."""
    for record in ranks:
        seen = record["fp32"]["seen"]
        if record["route"] != "cuda":  # what the CPU stand-ins were given
            assert seen["gathered_rows"] == [RANKS] * (STEPS * BNS)  # world size 2: one row per rank
            assert seen["stats"] == [{"dtype": "torch.float32", "autocast": False}] * (STEPS * BNS)
    for bn in range(BNS):
        steps = _steps(ranks, "fp32", bn)
        assert len(steps) == STEPS
        expected, magnitude = _replayed(steps)
        for (mean64, var64), calls in zip(expected, steps):
            x = _union(calls)
            n = x.numel() // x.shape[1]
            # Gradients are averaged over the ranks after each step: one model on both.
            for key in ("weight", "bias", "mean", "var"):  # and the same stats, gathered alike
                assert torch.equal(calls[0][key], calls[1][key]), key
            weight, bias = calls[0]["weight"], calls[0]["bias"]
            for call in calls:
                assert call["x"].dtype == torch.bfloat16
                assert call["out"].dtype == call["mean"].dtype == call["var"].dtype == torch.float32
                assert call["master"] is None
            _assert_stats(calls[0]["mean"], calls[0]["var"], (mean64, var64), n, magnitude, f"bn {bn}")

            # The output and the input gradient: one float64 batch norm over the union of the batches,
            # its gradient from every rank's output gradient (SyncBatchNorm all-reduces their sums).
            grad_out = _union(calls, "grad_out")
            exact = fp64_batch_norm(x, None, None, weight, bias, True, MOMENTUM, EPS, grad_out=grad_out)
            out_scale, input_scale, _ = batch_norm_scales(x, weight, grad_out, EPS)
            rows = [call["x"].shape[0] for call in calls]
            for call, out_rows, grad_rows in zip(calls, exact.out.split(rows), exact.grad_input.split(rows)):
                assert_near(call["out"], out_rows, n, scale=out_scale, what=f"bn {bn}: output")
                assert call["grad_in"].dtype == torch.bfloat16  # back in the input's dtype
                assert_near(call["grad_in"], grad_rows, n, scale=input_scale, what=f"bn {bn}: input gradient")


def test_a_half_model_keeps_its_master_through_sync_batchnorm(ranks):
    """``model.half()`` under float16 autocast: the stats' FP32 master takes every synced update."""
    for bn in range(BNS):
        steps = _steps(ranks, "half", bn)
        expected, magnitude = _replayed(steps)
        x = _union(steps[0])
        n = x.numel() // x.shape[1]
        for call in (call for calls in steps for call in calls):
            assert call["x"].dtype == torch.float16 and call["out"].dtype == torch.float32  # policy fp32
        finals = [record["half"]["final"][bn] for record in ranks]
        for record, final in zip(ranks, finals):
            master = final["master"]
            assert master is not None, "the syncing path dropped the master"
            assert master.dtype == torch.float32 and final["mean"].dtype == torch.float16
            _assert_stats(master[0], master[1], expected[-1], n, magnitude, f"rank {record['rank']}, bn {bn}: master")
            # The 16-bit buffers are the master, rounded; .float() gives the master's values.
            assert torch.equal(final["mean"], master[0].half()) and torch.equal(final["var"], master[1].half())
            as_float = record["half"]["as_float"][bn]
            assert torch.equal(as_float["mean"], master[0]) and torch.equal(as_float["var"], master[1])
            # Every step's update went to the master, not only the last.
            for (mean64, var64), call in zip(expected, (calls[record["rank"]] for calls in steps)):
                _assert_stats(call["master"][0], call["master"][1], (mean64, var64), n, magnitude, f"bn {bn}: master")
        assert torch.equal(finals[0]["master"], finals[1]["master"])
        # A master the syncing path left stale (the initial zeros and ones) fails those bounds.
        mean, var = finals[0]["master"]
        with pytest.raises(AssertionError, match="running mean"):
            _assert_stats(torch.zeros_like(mean), var, expected[-1], n, magnitude, "stale")
        with pytest.raises(AssertionError, match="running var"):
            _assert_stats(mean, torch.ones_like(var), expected[-1], n, magnitude, "stale")


@pytest.mark.parametrize("scenario, calls", [("fp32", STEPS * BNS), ("half", STEPS * BNS), ("nonfinite", 2 * BNS)])
def test_report_counts_the_syncing_calls_as_handled(ranks, scenario, calls):
    for record in ranks:
        run = record[scenario]
        assert run["handled"] == {"fp32": calls}
        assert run["passed_through"] == 0
        if record["route"] != "cuda":
            assert len(run["seen"]["gathered_rows"]) == calls  # each one the syncing function's


@pytest.mark.filterwarnings("ignore:amp_bn_fix. the guard left:RuntimeWarning")
def test_a_non_finite_batch_on_one_rank_leaves_both_ranks_stats(ranks):
    """An inf in rank 1's batch: the gathered statistics are not finite on either rank, so the guard
    keeps both ranks' running stats as they were after the previous (finite) step, bit for bit. The
    CPU's route warns at the first skip; the device route counts without reading the device."""
    for record in ranks:
        run = record["nonfinite"]
        for bn, (before, after) in enumerate(zip(run["before"], run["after"])):
            assert not torch.equal(before["mean"], torch.zeros_like(before["mean"]))  # a step was taken before
            for stat in ("mean", "var"):
                assert after[stat].dtype == torch.float32
                assert torch.equal(after[stat].view(torch.int32), before[stat].view(torch.int32)), (bn, stat)
        assert run["guard_skips"] == {"1": 1, "4": 1}  # each SyncBatchNorm, by its path in the model
        if record["route"] == "cpu":
            assert len(run["warnings"]) == 1 and "not finite" in run["warnings"][0]
        else:
            assert run["warnings"] == []
        # Rank 0's own batch is finite: its output is not, since the statistics are rank 1's too.
        last_first_bn = [call for call in run["calls"] if call["bn"] == 0][-1]
        assert not torch.isfinite(last_first_bn["out"]).all()
    assert torch.equal(ranks[0]["nonfinite"]["after"][0]["mean"], ranks[1]["nonfinite"]["after"][0]["mean"])


def test_a_broadcast_of_a_half_model_s_buffers_reaches_every_rank_s_master(ranks):
    """``dist.broadcast`` writes the buffers without a version bump: the receiving rank's master
    starts again from the values received, so both ranks hold rank 0's buffers and evaluate as
    plain torch does outside autocast, bit for bit. Under autocast each reads its master: rank 0's
    own, rank 1's the values received, within half a bfloat16 step of each other."""
    sent, received = (record["broadcast"] for record in ranks)
    for stat in ("mean", "var"):
        assert torch.equal(sent["buffers"][stat], received["buffers"][stat])
    assert torch.equal(received["master"], torch.stack((received["buffers"]["mean"], received["buffers"]["var"])).float())
    assert torch.equal(sent["master"].bfloat16(), received["master"].bfloat16())
    assert not torch.equal(sent["master"], received["master"])  # rank 0 trained on its own batches
    assert torch.equal(sent["eval_plain"], received["eval_plain"])
    assert sent["eval_autocast"].dtype is torch.float32
    step = torch.finfo(torch.bfloat16).eps
    apart = (sent["eval_autocast"] - received["eval_autocast"]).abs().max().item()
    assert apart <= step * (sent["eval_autocast"].abs().max().item() + 1)
