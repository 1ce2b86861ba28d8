"""``amp-bn-fix check``: versions, devices, settings and their sources, start-up hook, self-test."""

import importlib.metadata
import importlib.util
import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
import wrapt

import amp_bn_fix
from _amp_bn_fix_boot import cli as launcher
from _bounds import assert_near
from _builders import fp64_batch_norm
from _shared import ORIGINAL, SUBPROCESS_TIMEOUT, child_env
from amp_bn_fix import _check, _demo

ROOT = pathlib.Path(__file__).resolve().parent.parent


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
    assert field(out, "policy") == ["fp32", "default"]
    assert field(out, "guard") == ["1", "default"]
    assert "a fresh interpreter here (import torch): torch is plain (no shim)" in out  # AMP_BN_FIX unset


@pytest.mark.slow
def test_check_reports_where_each_setting_came_from(capsys):
    amp_bn_fix.set_policy("input")
    _, out = check(capsys)
    assert field(out, "policy") == ["input", "API"]
    result = subprocess.run(
        [sys.executable, "-m", "amp_bn_fix", "check"],
        env=child_env(AMP_BN_FIX_POLICY="autocast", AMP_BN_FIX_DEVICES="cpu"),
        capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT,
    )
    assert result.returncode == 0, result.stderr
    assert field(result.stdout, "policy") == ["autocast", "env"]
    assert field(result.stdout, "devices") == ["cpu", "env"]
    assert field(result.stdout, "keep_fp32") == ["master", "default"]


@pytest.mark.slow
def test_check_reports_the_start_up_hook(capsys):
    _, out = check(capsys)
    installed = out.split("installed", 1)[1].split("AMP_BN_FIX", 1)[0].split()
    assert [os.path.basename(p) for p in installed] == ["amp_bn_fix.pth", "amp_bn_fix.start"]
    assert field(out, "AMP_BN_FIX") == ["unset", "(off)"]
    result = subprocess.run(
        [sys.executable, "-m", "amp_bn_fix", "check"],
        env=child_env(AMP_BN_FIX="1"), capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT,
    )
    assert field(result.stdout, "AMP_BN_FIX") == ["'1'", "(on)"]
    assert result.returncode == 0, result.stdout
    assert "a fresh interpreter here (import torch): the shim is enabled" in result.stdout


def test_the_self_test_passes_on_each_device_and_leaves_the_patch_as_it_was(capsys):
    amp_bn_fix.disable()
    code, out = check(capsys)
    assert code == 0
    rows = [line.split()[:3] for line in out.splitlines() if line.strip().startswith("cpu ")]
    assert rows == [["cpu", "float16", "ok"], ["cpu", "bfloat16", "ok"]]
    assert F.batch_norm is ORIGINAL


def test_the_self_test_fails_and_check_exits_non_zero_when_the_shim_does_nothing(capsys, shim_decides_nothing):
    code, out = check(capsys)
    assert code == 1
    assert "FAIL" in out and "BatchNorm1d output is float16, expected float32" in out


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_self_test_output_matches_float64(dtype):
    result = _check.self_test("cpu", dtype)
    assert result.ok, result.detail
    hidden, weight, bias, mean, var = result.tensors[:5]
    out, new_mean, new_var = result.tensors[5:]
    expected = fp64_batch_norm(hidden, mean, var, weight, bias)
    assert out.dtype is torch.float32
    n = hidden.shape[0]  # values per channel (BatchNorm1d on a batch of rows)
    assert_near(out, expected.out, n, what="output")
    assert_near(new_mean, expected.running_mean, n, what="running mean")
    assert_near(new_var, expected.running_var, n, what="running var")


@pytest.mark.parametrize("devices, expected", [("cuda", "passed through: cpu is not among the devices (cuda)"),
                                               ("cpu", "policy fp32")])
def test_the_self_test_follows_the_configured_devices(devices, expected):
    amp_bn_fix.configure(devices=[devices])
    result = _check.self_test("cpu", torch.bfloat16)
    assert result.ok and expected in result.detail, result.detail
    assert result.tensors[5].dtype is (torch.bfloat16 if devices == "cuda" else torch.float32)


def run_check(env, cwd=None):
    script = os.path.join(os.path.dirname(sys.executable), "amp-bn-fix")
    return subprocess.run([script, "check"], env=child_env(**env), cwd=cwd,
                          capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT)


@pytest.mark.slow
def test_check_fails_where_the_environment_would_not_get_the_shim(tmp_path):
    bad_switch = run_check({"AMP_BN_FIX": "2"})
    assert bad_switch.returncode == 1 and "AMP_BN_FIX='2' is not valid" in bad_switch.stdout
    assert "'2' (not valid: the start-up hook says so and stays off)" in bad_switch.stdout
    (tmp_path / "amp_bn_fix").mkdir()  # a folder of that name in the working directory
    shadowed = run_check({"AMP_BN_FIX": "1"}, cwd=tmp_path)
    assert shadowed.returncode == 1 and f"{tmp_path / 'amp_bn_fix'} shadows the installed amp_bn_fix" in shadowed.stdout
    assert run_check({"AMP_BN_FIX": "1"}).returncode == 0


def test_check_fails_where_the_hook_is_not_in_a_site_directory(tmp_path, monkeypatch, capsys):
    # pip install --target DIR with PYTHONPATH=DIR: no site directory holds the start files.
    from _amp_bn_fix_boot import status

    monkeypatch.setattr(status, "_site_directories", lambda: [str(tmp_path)])
    monkeypatch.setenv("AMP_BN_FIX", "1")
    code, out = check(capsys)
    assert code == 1
    assert "the start-up hook is not in a site directory" in out
    assert "installed   no (not in a site directory of this interpreter)" in out


def test_check_run_as_a_console_script_sees_a_shadowing_folder_in_the_working_directory(tmp_path, monkeypatch, capsys):
    # ``amp-bn-fix check`` has its own folder first on sys.path, and has imported the package: a
    # fresh ``python`` started here searches the working directory first, and gets the empty folder.
    # (The package is found as an installed one would be: not through a folder on sys.path, as the
    # source tree is in this test run.)
    (tmp_path / "amp_bn_fix").mkdir()
    monkeypatch.chdir(tmp_path)
    source_tree = os.path.dirname(os.path.dirname(amp_bn_fix.__file__))
    installed = [p for p in sys.path[1:] if p and os.path.abspath(p) != source_tree]
    monkeypatch.setattr(sys, "path", [os.path.dirname(sys.executable), *installed])
    monkeypatch.setenv("AMP_BN_FIX", "1")
    monkeypatch.setattr(_check, "fresh_interpreter", lambda: _check.FreshInterpreter(False, []))
    code, out = check(capsys)
    summary = [line.strip() for line in out.splitlines() if line.strip().startswith("amp_bn_fix:")]
    assert code == 1
    assert summary == [f"amp_bn_fix: not enabled at import torch: the folder {tmp_path / 'amp_bn_fix'} shadows "
                       "the installed amp_bn_fix package (it has no __init__.py): run from another directory, or rename it"]


def test_without_amp_bn_fix_set_a_hook_outside_the_site_directories_is_said_not_a_failure(tmp_path, monkeypatch, capsys):
    # pip install --target DIR, and nothing asks for the shim: import amp_bn_fix works, check passes.
    from _amp_bn_fix_boot import status

    monkeypatch.setattr(status, "_site_directories", lambda: [str(tmp_path)])
    monkeypatch.delenv("AMP_BN_FIX", raising=False)
    monkeypatch.setattr(_check, "fresh_interpreter", lambda: _check.FreshInterpreter(False, []))
    code, out = check(capsys)
    assert code == 0, out
    assert "the start-up hook is not in a site directory" in out


def test_the_policy_off_is_off_as_asked_not_a_failure(monkeypatch, capsys):
    # AMP_BN_FIX=1 with AMP_BN_FIX_POLICY=off: the hook loads the package, which installs nothing.
    from _amp_bn_fix_boot import status

    env = dict(os.environ, AMP_BN_FIX="1", AMP_BN_FIX_POLICY="off")
    found = status.gather(env)
    assert found.requested and not found.problems and not found.will_enable
    assert status.summary(found) == "amp_bn_fix: off: AMP_BN_FIX_POLICY=off (import torch loads it, and it installs nothing)"
    monkeypatch.setenv("AMP_BN_FIX", "1")
    monkeypatch.setenv("AMP_BN_FIX_POLICY", "off")
    monkeypatch.setattr(_check, "fresh_interpreter", lambda: _check.FreshInterpreter(False, []))
    amp_bn_fix.configure(policy="off")
    code, out = check(capsys)
    assert code == 0, out
    assert "AMP_BN_FIX_POLICY=off" in out and "the shim is enabled when" not in out


def test_a_requirement_missing_here_means_no_shim_at_import_torch(monkeypatch):
    # amp_bn_fix installed with pip --no-deps where wrapt is not: the hook's import of the package
    # fails at import torch (one warning line), so the status must not promise the shim.
    from _amp_bn_fix_boot import status

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wrapt" else find_spec(name, *a))
    found = status.gather(dict(os.environ, AMP_BN_FIX="1"))
    assert found.broken and not found.will_enable
    (wrapt,) = [r for r in importlib.metadata.requires("amp_bn_fix") if r.startswith("wrapt")]
    assert status.summary(found) == (f"amp_bn_fix: not enabled at import torch: amp_bn_fix needs {wrapt}, which is not "
                                     f"installed for {sys.executable}")


def test_this_environment_has_every_requirement():
    from _amp_bn_fix_boot import status

    assert status.missing_requirements() == []


def test_without_amp_bn_fix_set_that_is_the_reason_given_first(tmp_path, monkeypatch):
    # A folder shadowing the package, and nothing asking for the shim: the shim is off because
    # AMP_BN_FIX is not set; the folder would keep it off with it.
    from _amp_bn_fix_boot import status

    (tmp_path / "amp_bn_fix").mkdir()
    monkeypatch.chdir(tmp_path)
    # The package found as an installed one is, not through the source tree on sys.path.
    source_tree = os.path.dirname(os.path.dirname(amp_bn_fix.__file__))
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p and os.path.abspath(p) != source_tree])
    env = {k: v for k, v in os.environ.items() if k != "AMP_BN_FIX"}
    line = status.summary(status.gather(env))
    assert line.startswith("amp_bn_fix: off: AMP_BN_FIX is not set to 1; with it, also: the folder ")
    assert f"{tmp_path / 'amp_bn_fix'} shadows the installed amp_bn_fix package" in line


def test_check_with_a_bad_setting_is_a_clean_error():
    result = subprocess.run(
        [sys.executable, "-c", "import sys; from _amp_bn_fix_boot import cli as launcher; sys.exit(launcher.main(['check']))"],
        env=child_env(AMP_BN_FIX_POLICY="bogus"), capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT,
    )
    assert result.returncode == 2
    assert "AMP_BN_FIX_POLICY='bogus' is not valid" in result.stderr and "Traceback" not in result.stderr


# Every spelling of the command that docs/ gives: the console script, and python -m with the package
# (whose import, run as the command, leaves the bad setting to it).
SPELLINGS = {
    "amp-bn-fix check": [os.path.join(os.path.dirname(sys.executable), "amp-bn-fix"), "check"],
    "python -m amp_bn_fix check": [sys.executable, "-m", "amp_bn_fix", "check"],
}


@pytest.mark.slow
@pytest.mark.parametrize("spelling", sorted(SPELLINGS))
def test_check_names_every_bad_setting_without_a_traceback(spelling):
    env = child_env(AMP_BN_FIX="1", AMP_BN_FIX_POLICY="fp33", AMP_BN_FIX_GUARD="maybe")
    result = subprocess.run(SPELLINGS[spelling], env=env, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT)
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [
        "amp-bn-fix: error: AMP_BN_FIX_POLICY='fp33' is not valid; allowed values: fp32, input, autocast, off"
        " (from the environment)",
        "amp-bn-fix: error: AMP_BN_FIX_GUARD='maybe' is not valid; allowed values: 1/true/yes/on or 0/false/no/off"
        " (from the environment)",
    ]
    assert result.stdout == ""


def test_the_docs_give_no_other_spelling_of_check():
    # A spelling the docs add must be added to SPELLINGS above, and tested.
    texts = [(ROOT / "README.md").read_text(), *(page.read_text() for page in (ROOT / "docs").glob("*.md"))]
    found = {re.sub(r"^\S*python\S*", "python", match) for text in texts
             for match in re.findall(r"(?:\S*python\S* -m \w+|amp-bn-fix) check", text)}
    assert found <= {"python -m amp_bn_fix check", "amp-bn-fix check"}, found


def test_check_states_what_has_run_on_a_gpu_where_cuda_is_present(capsys, monkeypatch):
    # CUDA faked: the status line is the point; the self-test keeps to the CPU this machine has.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(_demo, "autocast_devices", lambda: ["cpu", "cuda"])
    monkeypatch.setattr(_demo, "cases", lambda: iter([("cpu", torch.bfloat16)]))
    code, out = check(capsys)
    assert code == 0
    assert f"GPU status: {_check.GPU_STATUS}" in out
    assert "has not run on a GPU yet" in out and "tools/gpu_check.sh" in out


def test_check_says_nothing_about_gpus_without_cuda(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    _, out = check(capsys)
    assert "GPU status" not in out


def test_the_docs_state_the_gpu_status_check_prints():
    # The same fact in every place a GPU user meets it; change them together when a GPU run happens.
    for page in ("README.md", "docs/faq.md", "docs/README.md", "docs/compatibility.md", "CHANGELOG.md"):
        text = " ".join((ROOT / page).read_text().split())
        assert "not run on a GPU yet" in text, page
