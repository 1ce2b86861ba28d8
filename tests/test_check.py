"""``amp-bn-fix check``: versions, devices, settings and their sources, start-up hook, self-test."""

import os
import re
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
import wrapt

import amp_bn_fix
from _amp_bn_fix_boot import launcher
from amp_bn_fix import _check, _policy


def check(capsys):
    code = launcher.main(["check"])
    return code, capsys.readouterr().out


def field(out, name):
    match = re.search(rf"^\s+{re.escape(name)}\s+(.*)$", out, flags=re.M)
    assert match, f"no {name!r} line in:\n{out}"
    return match.group(1).split()


def test_check_reports_versions_devices_patch_and_config(capsys):
    code, out = check(capsys)
    assert code == 0
    assert field(out, "torch") == [torch.__version__]
    assert field(out, "wrapt") == [wrapt.__version__]
    assert field(out, "amp_bn_fix") == [amp_bn_fix.__version__]
    assert "autocast devices: cpu" in out
    assert "patch: active in this process" in out
    assert field(out, "policy") == ["fp32", "default"]
    assert field(out, "repr(F.batch_norm)")[0] == "<ShimWrapper"
    assert "amp_bn_fix.is_enabled()" in out
    assert field(out, "guard") == ["1", "default"]


@pytest.mark.slow
def test_check_reports_where_each_setting_came_from(capsys):
    amp_bn_fix.set_policy("input")
    _, out = check(capsys)
    assert field(out, "policy") == ["input", "API"]
    result = subprocess.run(
        [sys.executable, "-m", "amp_bn_fix", "check"],
        env={**os.environ, "AMP_BN_FIX_POLICY": "autocast", "AMP_BN_FIX_DEVICES": "cpu"},
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert field(result.stdout, "policy") == ["autocast", "env"]
    assert field(result.stdout, "devices") == ["cpu", "env"]
    assert field(result.stdout, "keep_fp32") == ["stats", "default"]


@pytest.mark.slow
def test_check_reports_the_start_up_hook(capsys):
    _, out = check(capsys)
    installed = out.split("installed", 1)[1].split("AMP_BN_FIX", 1)[0].split()
    assert [os.path.basename(p) for p in installed] == ["amp_bn_fix.pth", "amp_bn_fix.start"]
    assert field(out, "AMP_BN_FIX") == ["unset", "(off)"]
    result = subprocess.run(
        [sys.executable, "-m", "amp_bn_fix", "check"],
        env={**os.environ, "AMP_BN_FIX": "1"}, capture_output=True, text=True, timeout=120,
    )
    assert field(result.stdout, "AMP_BN_FIX") == ["'1'", "(on)"]
    assert " ".join(field(result.stdout, "python processes")) == "enable the shim when they import torch"
    assert " ".join(field(out, "python processes")).startswith("run without the shim unless they import amp_bn_fix")


def test_the_self_test_passes_on_each_device_and_leaves_the_patch_as_it_was(capsys):
    original = F.batch_norm.__wrapped__
    amp_bn_fix.disable()
    code, out = check(capsys)
    assert code == 0
    assert "patch: not active in this process" in out
    assert field(out, "repr(F.batch_norm)")[0] == "<function"
    rows = [line.split()[:3] for line in out.splitlines() if line.strip().startswith("cpu ")]
    assert rows == [["cpu", "float16", "ok"], ["cpu", "bfloat16", "ok"]]
    assert F.batch_norm is original


def test_the_self_test_fails_and_check_exits_non_zero_when_the_shim_does_nothing(capsys, monkeypatch):
    monkeypatch.setattr(_policy, "output_dtype", lambda policy, call: None)  # every call runs natively
    code, out = check(capsys)
    assert code == 1
    assert "FAIL" in out and "BatchNorm1d output is float16, expected float32" in out


def test_the_self_test_compares_against_float64():
    result = _check.self_test("cpu", torch.bfloat16)
    assert result.ok, result.detail
    error = float(re.search(r"max \|error\| (\S+)", result.detail).group(1))
    assert error < 1e-5


def test_check_with_a_bad_setting_is_a_clean_error():
    result = subprocess.run(
        [sys.executable, "-c", "import sys; from _amp_bn_fix_boot import launcher; sys.exit(launcher.main(['check']))"],
        env={**os.environ, "AMP_BN_FIX_POLICY": "bogus"}, capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 2
    assert "AMP_BN_FIX_POLICY='bogus' is not valid" in result.stderr and "Traceback" not in result.stderr
