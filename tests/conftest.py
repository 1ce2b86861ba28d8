"""Every test starts from the documented defaults with the shim enabled, and leaves it so.

One exception: the FP32 fast path's size thresholds are lowered for the tests' small inputs.
"""

import os

import pytest

# Settings from the caller's environment must not leak into the tests (subprocess tests set their own).
for _name in [n for n in os.environ if n.startswith("AMP_BN_FIX")]:
    del os.environ[_name]

from _amp_bn_fix_boot import settings
from amp_bn_fix import _patch  # noqa: E402


@pytest.fixture(autouse=True)
def fast_paths_for_small_inputs(monkeypatch):
    """The FP32 training fast path starts at half a million values (more with more torch threads),
    which would keep the tests' small inputs off it: here it starts at any size (rows must still be
    long enough). ``test_fastpath`` checks the real thresholds."""
    from amp_bn_fix import _kernels

    monkeypatch.setattr(_kernels, "_MIN_VALUES", 0)
    monkeypatch.setattr(_kernels, "_MIN_PER_CHANNEL", 0)


@pytest.fixture(autouse=True)
def default_shim():
    _patch.configure(settings.Config())
    _patch.install()
    yield
    _patch._set_scopes(())
    _patch.configure(settings.Config())
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
    """``subprocess.run`` for a torchrun job, once more if a worker died of SIGABRT.

    gloo can abort a rank while the process group tears down on a loaded machine (a torch/gloo
    shutdown race, not this package); a real failure fails the second attempt too.
    """
    import subprocess

    def run(command, **kwargs):
        result = subprocess.run(command, **kwargs)
        if result.returncode != 0 and "SIGABRT" in (result.stderr or ""):
            result = subprocess.run(command, **kwargs)
        return result

    return run
