"""The start-up hook: ``AMP_BN_FIX=1`` enables the shim in a fresh interpreter, with no import.

Each test starts a new interpreter of this environment, where the package (and so
``amp_bn_fix.pth``) is installed.
"""

import base64
import hashlib
import json
import os
import pathlib
import pkgutil
import shutil
import site
import subprocess
import sys
import sysconfig
import zipfile

import pytest

from _amp_bn_fix_boot import hook
from amp_bn_fix import _config

ROOT = pathlib.Path(__file__).resolve().parent.parent
START_FILES = ("amp_bn_fix.pth", "amp_bn_fix.start")

LOADED = """
import json, sys
names = ("torch", "wrapt", "amp_bn_fix", "_amp_bn_fix_boot", "_amp_bn_fix_boot.hook")
print(json.dumps({name: name in sys.modules for name in names}))
"""

# Runs the seed's layers under CPU autocast and reports what the shim did.
SEED = """
import json, sys
import torch
import torch.nn.functional as F
import wrapt
from torch import nn

depth, function = 0, F.batch_norm
while isinstance(function, wrapt.FunctionWrapper):
    depth, function = depth + 1, function.__wrapped__
net = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 5))
with torch.autocast("cpu", dtype=torch.bfloat16):
    bn_out = net[1](net[0](torch.randn(8, 4)))
print(json.dumps({"wrappers": depth, "bn_out": str(bn_out.dtype), "stats": str(net[1].running_mean.dtype)}))
"""


def python(code, env=None, *flags, **kwargs):
    """Run ``code`` in a new interpreter with ``env`` added to this (AMP_BN_FIX-free) environment."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run(
        [sys.executable, *flags, "-c", code], env=full_env, capture_output=True, text=True, timeout=120, **kwargs
    )


def report(result):
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def warning_lines(result):
    return [line for line in result.stderr.splitlines() if line.strip()]


def test_the_start_files_are_installed_in_this_environment():
    directories = site.getsitepackages() + ([site.getusersitepackages()] if site.ENABLE_USER_SITE else [])
    for name in START_FILES:
        installed = [pathlib.Path(d, name) for d in directories if pathlib.Path(d, name).is_file()]
        assert installed, f"{name} is not in {directories}: reinstall the package"
        assert installed[0].read_text() == (ROOT / name).read_text()


@pytest.mark.parametrize("value", [None, *_config._FALSE])
def test_off_loads_nothing(value):
    result = python(LOADED, {} if value is None else {"AMP_BN_FIX": value})
    assert not any(report(result).values())
    assert result.stderr == ""


def test_off_leaves_torch_alone():
    assert report(python(SEED))["bn_out"] == "torch.bfloat16"


def test_on_loads_neither_torch_nor_amp_bn_fix_at_start_up():
    loaded = report(python(LOADED, {"AMP_BN_FIX": "1"}))
    assert loaded["_amp_bn_fix_boot.hook"] is True  # the hook ran...
    assert loaded["torch"] is False and loaded["amp_bn_fix"] is False  # ...and imported neither


@pytest.mark.parametrize(
    "env, bn_out",
    [
        ({"AMP_BN_FIX": "1"}, "torch.float32"),
        ({"AMP_BN_FIX": "yes", "AMP_BN_FIX_POLICY": "input"}, "torch.bfloat16"),
        ({"AMP_BN_FIX": "1", "AMP_BN_FIX_DEVICES": "cuda"}, "torch.bfloat16"),
    ],
)
def test_on_enables_the_shim_with_the_environment_settings_when_torch_is_imported(env, bn_out):
    got = report(python(SEED, env))
    assert got == {"wrappers": 1, "bn_out": bn_out, "stats": "torch.float32"}


@pytest.mark.parametrize(
    "before",
    ["import amp_bn_fix", "import torch, amp_bn_fix", "import torch, amp_bn_fix; amp_bn_fix.enable()"],
)
def test_one_wrapper_with_an_explicit_import(before):
    assert report(python(before + "\n" + SEED, {"AMP_BN_FIX": "1"}))["wrappers"] == 1


@pytest.mark.parametrize(
    "env, names",
    [
        ({"AMP_BN_FIX": "maybe"}, ["AMP_BN_FIX=", "'maybe'", "0/false/no/off"]),
        ({"AMP_BN_FIX": "1", "AMP_BN_FIX_POLICY": "bogus"}, ["AMP_BN_FIX_POLICY", "'bogus'", "fp32, input, autocast, off"]),
        ({"AMP_BN_FIX": "1", "AMP_BN_FIX_DEVICES": "gpu"}, ["AMP_BN_FIX_DEVICES", "'gpu'", "cuda"]),
    ],
)
def test_a_bad_setting_is_one_warning_line_and_the_program_runs_on(env, names):
    result = python("import sys, torch; print(type(torch.nn.functional.batch_norm).__name__); sys.exit(3)", env)
    assert result.returncode == 3
    assert result.stdout.strip() == "function"  # not patched
    (line,) = warning_lines(result)
    assert all(name in line for name in names), line


def test_a_setting_broken_after_start_up_is_one_warning_line_at_torch_import():
    code = (
        "import os, sys; os.environ['AMP_BN_FIX_POLICY'] = 'bogus'\n"
        "import torch\n"
        "print(type(torch.nn.functional.batch_norm).__name__); sys.exit(4)"
    )
    result = python(code, {"AMP_BN_FIX": "1"})
    assert (result.returncode, result.stdout.strip()) == (4, "function")
    (line,) = warning_lines(result)
    assert "AMP_BN_FIX_POLICY='bogus'" in line


def test_an_unexpected_error_is_one_warning_line_and_the_program_runs_on(tmp_path):
    (tmp_path / "wrapt.py").write_text("raise RuntimeError('broken wrapt')\n")
    result = python("import sys; print('ran'); sys.exit(5)", {"AMP_BN_FIX": "1", "PYTHONPATH": str(tmp_path)})
    assert (result.returncode, result.stdout.strip()) == (5, "ran")
    (line,) = warning_lines(result)
    assert "start-up hook failed (RuntimeError: broken wrapt)" in line


def test_an_explicit_import_with_a_bad_setting_still_raises():
    result = python("import amp_bn_fix", {"AMP_BN_FIX": "1", "AMP_BN_FIX_POLICY": "bogus"})
    assert result.returncode == 1
    assert "ValueError: AMP_BN_FIX_POLICY='bogus'" in result.stderr


def test_the_start_file_names_the_function_the_pth_file_calls():
    (entry,) = (ROOT / "amp_bn_fix.start").read_text().split()
    assert pkgutil.resolve_name(entry) is hook.start
    assert "_amp_bn_fix_boot.hook').hook.start()" in (ROOT / "amp_bn_fix.pth").read_text()


def test_the_start_file_entry_point_enables_the_shim_as_python_3_15_would_call_it():
    # Without site (so without amp_bn_fix.pth), call the entry point the way PEP 829's site does.
    (entry,) = (ROOT / "amp_bn_fix.start").read_text().split()
    paths = [str(ROOT), sysconfig.get_paths()["purelib"]]
    code = f"import pkgutil, sys; sys.path[:0] = {paths!r}; pkgutil.resolve_name({entry!r})()\n" + SEED
    assert report(python(code, {"AMP_BN_FIX": "1"}, "-S"))["bn_out"] == "torch.float32"


@pytest.mark.parametrize("build", ["build_wheel", "build_editable"])
def test_wheels_ship_the_start_files_at_the_root_and_in_record(tmp_path, build):
    project = tmp_path / "project"
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
    project.mkdir()
    for name in ("setup.py", "setup.cfg", "pyproject.toml", "README.md", *START_FILES):
        shutil.copy(ROOT / name, project / name)
    for package in ("amp_bn_fix", "_amp_bn_fix_boot"):
        shutil.copytree(ROOT / package, project / package, ignore=ignore)
    result = subprocess.run(
        [sys.executable, "-c", f"from setuptools import build_meta; print(build_meta.{build}({str(tmp_path / 'dist')!r}))"],
        cwd=project, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    wheel = zipfile.ZipFile(tmp_path / "dist" / result.stdout.strip().splitlines()[-1])
    record = next(n for n in wheel.namelist() if n.endswith(".dist-info/RECORD"))
    lines = wheel.read(record).decode().splitlines()
    for name in START_FILES:
        data = wheel.read(name)  # at the root: installed into site-packages itself
        assert data == (ROOT / name).read_bytes()
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        assert f"{name},sha256={digest},{len(data)}" in lines  # so uninstalling removes it
    if build == "build_wheel":
        assert "_amp_bn_fix_boot/bootstrap/sitecustomize.py" in wheel.namelist()
