"""Every test starts from the documented defaults with the shim enabled, and leaves it so.

One exception: the FP32 fast path's size thresholds are lowered for the tests' small inputs.
"""

import contextlib
import os

import pytest

# Settings from the caller's environment must not leak into the tests (subprocess tests set their own).
for _name in [n for n in os.environ if n.startswith("AMP_BN_FIX")]:
    del os.environ[_name]

import amp_bn_fix  # noqa: E402
from amp_bn_fix import _config, _patch  # noqa: E402


@pytest.fixture(autouse=True)
def fast_paths_for_small_inputs(monkeypatch):
    """The FP32 routes without an input copy start at half a million values on the host (more with
    more torch threads) and a million on the device route, which would keep the tests' small inputs
    off them: here they start at any size (rows must still be long enough on the host).
    ``test_fastpath`` and ``test_cost`` check the real thresholds."""
    from amp_bn_fix import _tuning

    monkeypatch.setattr(_tuning, "MIN_VALUES", 0)
    monkeypatch.setattr(_tuning, "MIN_PER_CHANNEL", 0)
    monkeypatch.setattr(_tuning, "DEVICE_MIN_VALUES", 0)


@pytest.fixture
def fresh_record():
    """An empty record around the test: its counts, and no guard record of a tensor that died, whose
    id a new tensor may take (that record is folded then, with ops on its device)."""
    from amp_bn_fix import _record

    _record.reset()
    yield
    _record.reset()


@pytest.fixture(params=["host", "device"], ids=["host-route", "device-route"])
def both_routes(request, monkeypatch):
    """The test runs on the host route (CPU reads, fast paths) and on the route a CUDA call takes.

    ``amp_bn_fix.testing.device_route()`` makes CPU calls take the device route: no host reads of
    tensor values, no CPU fast paths. So the CUDA logic runs wherever the suite runs.
    """
    yield from _take_route(request.param)


@pytest.fixture(params=["host", "host-by-ops", "device"], ids=["host-route", "host-route-by-ops", "device-route"])
def every_route(request, monkeypatch):
    """:func:`both_routes`, and the host route again with its guard's ops at every channel count.

    The host guard keeps a few channels' stats as Python floats (``_guard.LISTED_CHANNELS``) and
    more by ops; tests of the guard take both ways whatever their channel count.
    """
    if request.param == "host-by-ops":
        from amp_bn_fix import _guard

        monkeypatch.setattr(_guard, "LISTED_CHANNELS", 0)
    yield from _take_route("device" if request.param == "device" else "host")


def _take_route(route):
    from amp_bn_fix.testing import device_route

    with device_route() if route == "device" else contextlib.nullcontext():
        yield route


@pytest.fixture
def shim_decides_nothing(monkeypatch):
    """Every call runs natively: none is the common one, and the full decision leaves each to torch."""
    from amp_bn_fix import _doors

    monkeypatch.setattr(_doors, "plan", lambda *args, **kwargs: None)


@pytest.fixture(autouse=True)
def default_shim():
    # The defaults with "default" as their source (amp_bn_fix.configure would record "API"),
    # which the tests of get_config().sources and of amp-bn-fix check expect.
    _config.configure(amp_bn_fix.Config())
    _patch.install()
    yield
    _config.set_scopes(())
    _config.configure(amp_bn_fix.Config())
    _patch.install()


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def run_torchrun():
    """``subprocess.run`` for a torchrun job, once more if a worker died of SIGABRT or the job hung.

    gloo can abort a rank, or leave one waiting for ever in ``destroy_process_group`` (seen with
    torch 2.4), while the process group tears down (a torch/gloo shutdown race, not this package);
    a real failure fails the second attempt too. Each attempt has half the time, and a hung one is
    killed with every process under it, leaving nothing behind: torchrun starts each worker in a
    session of its own, so killing the job's process group alone would leave the workers running
    and holding the output pipes open, and reading them would wait for ever.
    """
    import signal
    import subprocess

    def attempt(command, timeout, capture_output=False, **kwargs):
        if capture_output:
            kwargs.update(stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        process = subprocess.Popen(command, start_new_session=True, **kwargs)
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            doomed = _descendants(process.pid)  # listed before any dies and is reparented
            os.killpg(process.pid, signal.SIGKILL)
            for pid in doomed:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            process.communicate()
            raise
        return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)

    def run(command, timeout, **kwargs):
        try:
            result = attempt(command, timeout / 2, **kwargs)
        except subprocess.TimeoutExpired:
            return attempt(command, timeout / 2, **kwargs)
        if result.returncode != 0 and "SIGABRT" in (result.stderr or ""):
            result = attempt(command, timeout / 2, **kwargs)
        return result

    return run


def _descendants(pid):
    """The pids of every process under ``pid``, from Linux's ``/proc`` (none where it has none)."""
    children = {}
    for entry in os.scandir("/proc") if os.path.isdir("/proc") else ():
        if entry.name.isdigit():
            try:
                with open(os.path.join(entry.path, "stat")) as stat:
                    # "pid (comm) state ppid ...": comm may hold spaces and parentheses
                    parent = int(stat.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue  # the process ended while being read
            children.setdefault(parent, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        found.extend(todo)
        todo = [child for parent in todo for child in children.get(parent, ())]
    return found[1:]
