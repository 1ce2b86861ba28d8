"""What the shim did: calls handled per policy, passed through, guard skips per module (``report()``)."""

import functools
import os
import subprocess
import sys
import threading
import warnings

import pytest
import torch
from torch import nn

import amp_bn_fix
from _amp_bn_fix_boot import cli, settings
from _shared import SUBPROCESS_TIMEOUT, child_env, guarded_update
from amp_bn_fix import _record

# Every test on the CPU's route and on the route a CUDA call takes (see conftest).
pytestmark = pytest.mark.usefixtures("every_route", "fresh_record")


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Sequential(nn.BatchNorm2d(8)))


def image(bad=False):
    x = torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    if bad:
        x[0, 0, 0, 0] = float("inf")
    return x


def test_calls_are_counted_per_policy_and_passed_through():
    net = model()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        net(image())
        with amp_bn_fix.policy("input"):
            net(image())
        with amp_bn_fix.policy("off"):
            net(image())
    net(image())  # FP32, no autocast: two pass-throughs
    # fp32: the second BatchNorm gets the first one's FP32 output, which it passes through.
    assert amp_bn_fix.report() == {"handled": {"fp32": 1, "input": 2}, "passed_through": 5, "guard_skips": {}}


@pytest.mark.parametrize("spelling", ["by position", "by keyword"])
def test_a_call_that_raises_is_not_counted_as_handled(spelling):
    """torch's own argument error (stats of the wrong size) leaves the counts as they were."""
    x, mean, var = torch.randn(3, 4).bfloat16(), torch.zeros(5), torch.ones(5)
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(RuntimeError, match="5"):
        if spelling == "by position":
            torch.nn.functional.batch_norm(x, mean, var, None, None, True, 0.1, 1e-5)
        else:
            torch.nn.functional.batch_norm(x, mean, var, training=True)
    assert amp_bn_fix.report()["handled"] == {}


@pytest.mark.parametrize("stats", ["fp32", "16-bit-without-master"])
def test_guard_skips_are_counted_per_module_and_warned_once(every_route, stats):
    net = model()
    if stats != "fp32":  # the guard's FP32 copies of the stats, rounded into them
        amp_bn_fix.configure(keep_fp32="none")
        net.bfloat16()
    # A skip decided on the host is warned at once; one decided on a device is not known there
    # until the report reads the counters.
    first_skip = (
        pytest.warns(RuntimeWarning, match=r"guard left the running stats of 8 channels at 0x.* as they were.*report\(model\)")
        if every_route == "host" else warnings.catch_warnings()
    )
    with torch.autocast("cpu", dtype=torch.bfloat16), amp_bn_fix.policy("input"):  # both BatchNorms handled
        net(image())
        with first_skip:
            if every_route == "device":
                warnings.simplefilter("error")
            net(image(bad=True))  # inf reaches both BatchNorms
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            net(image(bad=True))  # counted, not warned again
    if every_route == "host":  # at the user's line, the model's call
        assert [warning.filename for warning in first_skip] == [__file__]
    assert amp_bn_fix.report(net)["guard_skips"] == {"1": 2, "3.0": 2}
    unnamed = amp_bn_fix.report()["guard_skips"]
    assert sorted(unnamed.values()) == [2, 2] and all(name.startswith("the running stats of 8 channels at 0x") for name in unnamed)


def test_the_first_skip_warning_names_the_line_that_runs_a_traced_model(every_route):
    # The code torch.fx generates is part of the model's call, not the user's line.
    traced = torch.fx.symbolic_trace(model())
    with warnings.catch_warnings(record=True) as caught, torch.autocast("cpu", dtype=torch.bfloat16):
        warnings.simplefilter("always")
        traced(image(bad=True))
    expected = [] if every_route == "device" else [__file__]  # the device's decisions are not read
    assert [warning.filename for warning in caught if "guard left" in str(warning.message)] == expected


def test_a_deleted_modules_skips_survive_a_new_tensor_taking_its_id():
    """Python reuses the ids of dead objects: a new running mean at a deleted one's id starts its
    own record, and the deleted module's skips still count."""
    bn = nn.BatchNorm2d(8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        bn(image(bad=True)[:, :1].expand(4, 8, 16, 16).bfloat16())
    assert sum(amp_bn_fix.report()["guard_skips"].values()) == 1
    dead_key = id(bn.running_mean)
    del bn
    newcomer = nn.BatchNorm2d(8)
    # The id a new tensor would take, were Python to hand out the freed one again.
    alive = _record._records.alive
    alive[id(newcomer.running_mean)] = alive.pop(dead_key)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        newcomer(image(bad=True)[:, :1].expand(4, 8, 16, 16).bfloat16())
        newcomer(image()[:, :1].expand(4, 8, 16, 16).bfloat16())
    skips = amp_bn_fix.report()["guard_skips"]
    assert sum(skips.values()) == 2, skips  # (the two modules may share an address, and so a name)


@pytest.mark.filterwarnings("ignore:amp_bn_fix. the guard left:RuntimeWarning")
@pytest.mark.parametrize("norm", [nn.BatchNorm2d, functools.partial(nn.InstanceNorm2d, track_running_stats=True)],
                         ids=["BatchNorm2d", "InstanceNorm2d"])
def test_a_module_s_skips_keep_its_name_through_casts(norm):
    # A cast puts new tensors in the module's buffers: its skips stay its own, named by its path.
    net = nn.Sequential(norm(8))
    bad = image(bad=True)[:, :1].expand(4, 8, 16, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        net(bad.bfloat16())
    for cast in (net.bfloat16, net.float, net.half, net.float):
        cast()
        assert amp_bn_fix.report(net)["guard_skips"] == {"0": 1}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        net(bad.bfloat16())
    assert amp_bn_fix.report(net)["guard_skips"] == {"0": 2}


def test_guard_off_counts_no_skips():
    amp_bn_fix.configure(guard=False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model()(image(bad=True))
    assert amp_bn_fix.report()["guard_skips"] == {}


def test_device_side_decisions_are_counted_without_reading_them():
    # The decision the guard makes on a device: a 0-dim tensor, added to a device counter.
    bn = nn.BatchNorm2d(4)

    def kernel(bad):
        def update(mean, var):
            mean.fill_(float("nan") if bad else 1.0)
            return mean
        return update

    calls = []
    original_item = torch.Tensor.item
    try:
        torch.Tensor.item = lambda self: calls.append(1) or original_item(self)
        for bad in (True, False, True):
            guarded_update(bn.running_mean, bn.running_var, False, kernel(bad))
        assert not calls  # nothing read while deciding and counting
    finally:
        torch.Tensor.item = original_item
    assert amp_bn_fix.report(nn.Sequential(bn))["guard_skips"] == {"0": 2}


def test_device_decisions_are_summed_on_the_device_past_the_fold():
    # More calls than are kept unsummed: the sums and the pending decisions together.
    bn = nn.BatchNorm2d(4)
    calls = 3 * _record._FOLD + 5
    for step in range(calls):
        finite = torch.tensor(step % 3 != 0)  # every third step skipped
        _record.checked_on_device(bn.running_mean, finite)
    assert len(_record._record_of(bn.running_mean).device[0]) == 5
    assert amp_bn_fix.report(nn.Sequential(bn))["guard_skips"] == {"0": len(range(0, calls, 3))}


def test_device_decisions_summed_under_inference_mode_go_on_outside_it():
    # A recalibration under inference_mode folds the first sums there (inference tensors); the
    # training after it adds to them.
    bn = nn.BatchNorm2d(4)
    calls = _record._FOLD + 1
    with torch.inference_mode():
        for step in range(calls):
            _record.checked_on_device(bn.running_mean, torch.tensor(step % 3 != 0))
        _record._record_of(bn.running_mean).fold()
    for step in range(calls, 2 * calls):
        _record.checked_on_device(bn.running_mean, torch.tensor(step % 3 != 0))
    _record._record_of(bn.running_mean).fold()
    assert amp_bn_fix.report(nn.Sequential(bn))["guard_skips"] == {"0": len(range(0, 2 * calls, 3))}


def test_the_report_setting_is_validated_like_the_others():
    assert settings.report_requested({"AMP_BN_FIX_REPORT": "1"}) is True
    with pytest.raises(ValueError, match="AMP_BN_FIX_REPORT='sometimes' is not valid"):
        settings.from_env({"AMP_BN_FIX_REPORT": "sometimes"})
    env = cli.environment({}, report=True)
    assert env["AMP_BN_FIX_REPORT"] == "1"


@pytest.mark.slow
def test_a_summary_line_at_exit():
    code = ("import torch, amp_bn_fix\nbn = torch.nn.BatchNorm1d(4)\n"
            "with torch.autocast('cpu', dtype=torch.bfloat16):\n    bn(torch.randn(8, 4, dtype=torch.bfloat16))\n")
    result = subprocess.run([sys.executable, "-c", code], env=child_env(AMP_BN_FIX_REPORT="1"), capture_output=True,
                            text=True, timeout=SUBPROCESS_TIMEOUT)
    assert result.returncode == 0, result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        "amp_bn_fix: calls handled: 1 fp32; passed through: 0; guard skips: 0")


_CHILDREN = """
import os, sys, torch, multiprocessing as mp
import amp_bn_fix

def calls(n):
    bn = torch.nn.BatchNorm1d(4)
    for _ in range(n):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            bn(torch.randn(3, 4, dtype=torch.bfloat16))

if __name__ == "__main__":
    torch.set_num_threads(1)
    calls(5)
    for start in ("fork", "forkserver", "spawn"):
        for n in (2, 0):  # a child that makes no call (a DataLoader worker) writes no line
            child = mp.get_context(start).Process(target=calls, args=(n,))
            child.start()
            child.join()
            assert child.exitcode == 0
    if os.fork() == 0:  # a plain fork's child counts its own calls, not the parent's
        calls(1)
        sys.exit(0)
    os.wait()
"""


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork on this platform")
def test_each_child_process_writes_its_own_summary_line(tmp_path):
    # Children started by fork and forkserver end with os._exit, which skips atexit.
    script = tmp_path / "children.py"
    script.write_text(_CHILDREN)
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                            env=child_env(AMP_BN_FIX_REPORT="1", OMP_NUM_THREADS="1"), timeout=SUBPROCESS_TIMEOUT)
    assert result.returncode == 0, result.stderr
    line = "amp_bn_fix: calls handled: {} fp32; passed through: 0; guard skips: 0"
    assert result.stderr.strip().splitlines() == [line.format(n) for n in (2, 2, 2, 1, 5)]


def test_a_reload_keeps_the_settings_and_the_one_summary_at_exit():
    # IPython's autoreload, or a notebook's importlib.reload: the process's settings stay, and the
    # exit summary is written once.
    code = ("import importlib, torch, amp_bn_fix\n"
            "amp_bn_fix.configure(policy='input', guard=False)\n"
            "importlib.reload(amp_bn_fix); importlib.reload(amp_bn_fix)\n"
            "config = amp_bn_fix.get_config()\n"
            "assert (config.policy, config.guard) == ('input', False), config\n"
            "with torch.autocast('cpu', dtype=torch.bfloat16):\n"
            "    assert torch.nn.BatchNorm1d(4)(torch.randn(8, 4, dtype=torch.bfloat16)).dtype is torch.bfloat16\n")
    result = subprocess.run([sys.executable, "-c", code], env=child_env(AMP_BN_FIX_REPORT="1"), capture_output=True,
                            text=True, timeout=SUBPROCESS_TIMEOUT)
    assert result.returncode == 0, result.stderr
    assert result.stderr.strip().splitlines() == ["amp_bn_fix: calls handled: 1 input; passed through: 0; guard skips: 0"]


def test_a_summary_names_the_rank_that_writes_it(monkeypatch):
    monkeypatch.setenv("RANK", "3")  # torchrun's, for a process without a process group yet
    assert _record.summary().startswith("amp_bn_fix (rank 3): calls handled:")
    monkeypatch.delenv("RANK")
    assert _record.summary().startswith("amp_bn_fix: calls handled:")


def test_report_of_a_bare_module_names_it_by_its_type():
    bn = nn.BatchNorm1d(4)
    x = torch.randn(8, 4, dtype=torch.bfloat16)
    x[0, 0] = float("nan")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the first skip's warning
        with torch.autocast("cpu", dtype=torch.bfloat16):
            bn(x)
    assert amp_bn_fix.report(bn)["guard_skips"] == {"BatchNorm1d": 1}


@pytest.mark.cuda
def test_cuda_guard_skips_are_counted_without_a_sync():
    bn = nn.BatchNorm2d(8).cuda()
    x = torch.randn(4, 8, 16, 16, device="cuda")
    x[0, 0, 0, 0] = float("inf")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.autocast("cuda", dtype=torch.float16):
            bn(x.half())
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert amp_bn_fix.report(nn.Sequential(bn))["guard_skips"] == {"0": 1}


@pytest.mark.filterwarnings("ignore:amp_bn_fix. the guard left:RuntimeWarning")
def test_what_is_kept_stays_bounded_when_the_stats_are_new_tensors_every_call(every_route):
    """``nn.DataParallel`` re-broadcasts its buffers to the replicas on every forward, and functional
    code passes fresh stats: the records of stats that died are folded, and every skip still counts."""
    _record.reset()
    calls, bad_every = 600, 7
    x, poisoned = image().bfloat16(), image(bad=True).bfloat16()
    for step in range(calls):
        mean, var = torch.zeros(3), torch.ones(3)  # new tensors each call, dead after it
        with torch.autocast("cpu", dtype=torch.bfloat16):
            torch.nn.functional.batch_norm(poisoned if step % bad_every == 0 else x, mean, var, None, None, True)
    assert len(_record._records.alive) <= 2 * _record._MIN_SWEEP
    assert len(_record._records.deleted) <= 1
    del mean, var
    assert amp_bn_fix.report()["guard_skips"] == {_record.DELETED: len(range(0, calls, bad_every))}


class _FakeStream:
    """Stands in for a CUDA stream: records which streams it was ordered after."""

    def __init__(self, name):
        self.name, self.waited = name, []

    def wait_stream(self, other):
        self.waited.append(other.name)


class _FakeFlag:
    """Stands in for a 0-dim CUDA flag: records the streams it was marked as used on."""

    device = "cuda:0"

    def __init__(self):
        self.used_on = []

    def record_stream(self, stream):
        self.used_on.append(stream.name)


def test_flags_made_on_another_stream_are_summed_after_it(monkeypatch):
    # A warm-up on a side stream, then report() on the default one: the sum runs on the current
    # stream once it waits for the side stream, and the flags' memory is kept for the current one.
    side, current = _FakeStream("side"), _FakeStream("current")
    monkeypatch.setattr(_record, "_cuda", type("cuda", (), {"current_stream": staticmethod(lambda device: current)}))
    flags = [_FakeFlag(), _FakeFlag()]
    streams = _record._after_streams(frozenset({side, current}), flags)
    assert current.waited == ["side"] and side.waited == []
    assert [f.used_on for f in flags] == [["current"], ["current"]]
    assert streams == {current}  # the sum is written on the current stream from now on
    # Made on the current stream alone: nothing to wait for.
    more = [_FakeFlag()]
    assert _record._after_streams(streams, more) == {current}
    assert current.waited == ["side"] and more[0].used_on == []


# --- threads ---------------------------------------------------------------------------------------


def _in_threads(work, threads=8, before=None):
    """Run ``work`` in ``threads`` threads at once, switching as often as the interpreter can (from
    ``before()`` on, if given); returns what they raised."""
    errors = []

    def run():
        try:
            work()
        except Exception as error:  # noqa: BLE001 - reported by the test
            errors.append(repr(error))

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        if before is not None:
            before()
        pool = [threading.Thread(target=run) for _ in range(threads)]
        for thread in pool:
            thread.start()
        for thread in pool:
            thread.join()
    finally:
        sys.setswitchinterval(interval)
    return errors


def _one_thread_each(work, times):
    """Run ``work`` ``times`` times, each in a thread of its own that ends before the next starts
    (a thread per request)."""
    for _ in range(times):
        thread = threading.Thread(target=work)
        thread.start()
        thread.join()


@pytest.mark.parametrize("stats", ["fp32", "bf16 without a master"])
def test_threads_with_running_stats_of_their_own_count_without_error(every_route, stats):
    # nn.DataParallel's replicas: a thread per device, new buffer tensors at every forward, whose
    # records die and are swept while other threads count theirs.
    dtype = torch.float32 if stats == "fp32" else torch.bfloat16
    x, weight = torch.randn(4, 3, dtype=torch.bfloat16), torch.ones(3)

    def replica():
        for _ in range(300):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                torch.nn.functional.batch_norm(x, torch.zeros(3, dtype=dtype), torch.ones(3, dtype=dtype), weight, None,
                                               True, 0.1, 1e-5)

    with amp_bn_fix.configure(keep_fp32="none"):
        assert _in_threads(replica) == []
    assert amp_bn_fix.report()["handled"] == {"fp32": 8 * 300}


def test_calls_in_threads_are_each_counted():
    x, running_mean, running_var = torch.randn(4, 3, dtype=torch.bfloat16), torch.zeros(3), torch.ones(3)
    x32 = x.float()

    def calls():
        for _ in range(500):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                torch.nn.functional.batch_norm(x, running_mean, running_var, None, None, False, 0.1, 1e-5)
            torch.nn.functional.batch_norm(x32, running_mean, running_var, None, None, False, 0.1, 1e-5)

    assert _in_threads(calls) == []
    report = amp_bn_fix.report()
    assert (report["handled"], report["passed_through"]) == ({"fp32": 8 * 500}, 8 * 500)


def test_calls_of_threads_that_ended_stay_counted_and_their_counts_go():
    # A thread per request: each thread counts into counts of its own, which a report adds to
    # those of the threads that ended before and lets go, so nothing grows with the threads.
    x, running_mean, running_var = torch.randn(4, 3, dtype=torch.bfloat16), torch.zeros(3), torch.ones(3)

    def calls():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            torch.nn.functional.batch_norm(x, running_mean, running_var, None, None, False, 0.1, 1e-5)
        torch.nn.functional.batch_norm(x.float(), running_mean, running_var, None, None, False, 0.1, 1e-5)

    registered = len(_record._threads[1])
    _one_thread_each(calls, 20)
    report = amp_bn_fix.report()
    assert (report["handled"], report["passed_through"]) == ({"fp32": 20}, 20)
    assert len(_record._threads[1]) <= registered


def test_report_while_new_threads_count_under_new_policies():
    # A thread adds a key to its own counts, unlocked, at its first call under a policy, while
    # another thread's report() reads them.
    bn, x = nn.BatchNorm1d(4).eval(), torch.randn(8, 4, dtype=torch.bfloat16)

    def request():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            bn(x)
            with amp_bn_fix.policy("input"):
                bn(x)

    errors = []

    def reports():
        while server.is_alive():
            try:
                amp_bn_fix.report()
            except RuntimeError as error:
                errors.append(repr(error))

    server = threading.Thread(target=_one_thread_each, args=(request, 100))
    assert _in_threads(reports, threads=1, before=server.start) == []
    server.join()
    assert errors == []
    assert amp_bn_fix.report()["handled"] == {"fp32": 100, "input": 100}


def test_a_report_stopped_half_way_leaves_every_call_counted_once(monkeypatch):
    # Ctrl-C, an error, or a signal handler's own report() while report() adds up the counts of
    # threads that ended: nothing it had added so far stands.
    x, running_mean, running_var = torch.randn(4, 3, dtype=torch.bfloat16), torch.zeros(3), torch.ones(3)

    def call():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            torch.nn.functional.batch_norm(x, running_mean, running_var, None, None, False, 0.1, 1e-5)

    _one_thread_each(call, 10)
    absorb, added = _record._Counts.absorb, []

    def stopping(self, other):
        added.append(other)
        if len(added) == 5:
            raise KeyboardInterrupt
        absorb(self, other)

    with monkeypatch.context() as patch:
        patch.setattr(_record._Counts, "absorb", stopping)
        with pytest.raises(KeyboardInterrupt):
            amp_bn_fix.report()
    assert amp_bn_fix.report()["handled"] == {"fp32": 10}


@pytest.mark.filterwarnings("ignore:amp_bn_fix. the guard left:RuntimeWarning")
@pytest.mark.parametrize("stop_at", [1, 2, 3])
def test_retiring_dead_records_stopped_half_way_loses_no_skip_and_counts_none_twice(monkeypatch, stop_at):
    # The records of running means that died are added up per device (here at a sweep, as when the
    # records have doubled); Ctrl-C or an error part-way leaves them to the next report, whole.
    def decided(skips_on_host, flags):
        stat = torch.zeros(3)
        for _ in range(skips_on_host):
            _record.skipped(stat)
        for kept in flags:
            _record.checked_on_device(stat, torch.tensor(kept))

    decided(2, [False, True])  # 3 skips
    decided(0, [False, False, False])  # 3 skips
    decided(1, [])  # 1 skip
    fold, folded = _record._GuardRecord.fold, []

    def stopping(self):
        folded.append(self)
        if len(folded) == stop_at:
            raise KeyboardInterrupt
        return fold(self)

    with monkeypatch.context() as patch:
        patch.setattr(_record._GuardRecord, "fold", stopping)
        with pytest.raises(KeyboardInterrupt):
            _record._sweep()
    assert amp_bn_fix.report()["guard_skips"] == {_record.DELETED: 7}
    _record._sweep()
    assert amp_bn_fix.report()["guard_skips"] == {_record.DELETED: 7}
