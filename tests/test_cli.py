"""The command line: ``amp-bn-fix demo``, ``python -m amp_bn_fix``, help and errors."""

import os
import shutil
import subprocess
import sys

import pytest
import torch.nn.functional as F

import amp_bn_fix
from _amp_bn_fix_boot import cli as launcher
from _shared import ORIGINAL, SUBPROCESS_TIMEOUT, child_env

CONSOLE_SCRIPT = shutil.which("amp-bn-fix", path=os.path.dirname(sys.executable))


def demo_rows(text):
    rows = [line.split() for line in text.splitlines()]
    return [r for r in rows if len(r) == 6 and r[0] in ("cpu", "cuda")]


def command(*args, env=None, module=False, flags=()):
    """``amp-bn-fix ARGS`` (or ``python -m amp_bn_fix ARGS``) in a fresh process with ``env`` added."""
    assert CONSOLE_SCRIPT, "the amp-bn-fix console script is not installed next to this interpreter"
    start = [sys.executable, *flags, "-m", "amp_bn_fix"] if module else [sys.executable, *flags, CONSOLE_SCRIPT]
    return subprocess.run(
        [*start, *args], env=child_env(**(env or {})), capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT
    )


def imported_torch(importtime_stderr):
    """Whether ``python -X importtime`` output shows an import of torch."""
    return any(line.rsplit("|", 1)[-1].strip() == "torch" for line in importtime_stderr.splitlines())


def test_demo_prints_the_bug_report_without_and_with_the_shim_and_what_is_expected(capsys):
    assert launcher.main(["demo"]) == 0
    out = capsys.readouterr().out
    cpu = [r for r in demo_rows(out) if r[0] == "cpu"]
    assert cpu == [
        ["cpu", "float16", "Linear", "float16", "float16", "float16"],
        ["cpu", "float16", "BatchNorm1d", "float16", "float32", "float32"],
        ["cpu", "float16", "Linear", "float16", "float16", "float16"],
        ["cpu", "bfloat16", "Linear", "bfloat16", "bfloat16", "bfloat16"],
        ["cpu", "bfloat16", "BatchNorm1d", "bfloat16", "float32", "float32"],
        ["cpu", "bfloat16", "Linear", "bfloat16", "bfloat16", "bfloat16"],
    ]
    assert "pytorch#88929" in out and "seed" not in out
    assert out.rstrip().splitlines()[-1].startswith("with the shim every layer has the expected dtype: BatchNorm1d returns float32")


@pytest.mark.parametrize("policy, bn_dtype", [("input", "bfloat16"), ("autocast", "bfloat16"), ("off", "bfloat16")])
def test_demo_with_another_policy_says_why_both_columns_match(capsys, policy, bn_dtype):
    with amp_bn_fix.policy(policy):
        assert launcher.main(["demo"]) == 0
    out = capsys.readouterr().out
    row = next(r for r in demo_rows(out) if r[:3] == ["cpu", "bfloat16", "BatchNorm1d"])
    assert row[3:] == [bn_dtype, bn_dtype, bn_dtype]
    verdict = out.rstrip().splitlines()[-1]
    assert f"both columns match because the policy is {policy}" in verdict and "fp32, returns float32" in verdict


def test_demo_with_the_device_left_out_expects_torch_s_dtypes_and_says_why(capsys):
    amp_bn_fix.configure(devices=["cuda"])
    assert launcher.main(["demo"]) == 0
    out = capsys.readouterr().out
    row = next(r for r in demo_rows(out) if r[:3] == ["cpu", "bfloat16", "BatchNorm1d"])
    assert row[3:] == ["bfloat16", "bfloat16", "bfloat16"]
    assert "AMP_BN_FIX_DEVICES leaves cpu to torch" in out.rstrip().splitlines()[-1]


def test_demo_fails_when_the_shim_does_not_give_the_expected_dtype(capsys, shim_decides_nothing):
    assert launcher.main(["demo"]) == 1
    assert capsys.readouterr().out.rstrip().splitlines()[-1].startswith("MISMATCH")


# A stand-in first on the path for a module that fails to import, and what the command says.
BROKEN_IMPORTS = {
    "torch missing": ("torch", "ImportError('No module named torch (a stand-in)')",
                      "needs torch, which {python} cannot import (No module named torch (a stand-in))"),
    # A CUDA build whose libraries are missing.
    "torch without its libraries": ("torch", "OSError('libcudart.so.12: cannot open shared object file')",
                                    "needs torch, which {python} cannot import (libcudart.so.12: cannot open shared "
                                    "object file)"),
    # pip install --no-deps where wrapt is not.
    "wrapt missing": ("wrapt", "ImportError('No module named wrapt (a stand-in)')",
                      "needs the amp_bn_fix package, which {python} cannot import (ImportError: No module named "
                      "wrapt (a stand-in))"),
}


@pytest.mark.parametrize("broken", list(BROKEN_IMPORTS))
@pytest.mark.parametrize("subcommand", ["demo", "check"])
def test_without_what_they_import_the_commands_say_so_in_one_line(tmp_path, subcommand, broken):
    module, error, said = BROKEN_IMPORTS[broken]
    stand_in = tmp_path / module  # first on the path: an interpreter that cannot import it
    stand_in.mkdir()
    (stand_in / "__init__.py").write_text(f"raise {error}\n")
    path = os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))
    result = subprocess.run(
        [sys.executable, "-c", f"import sys; from _amp_bn_fix_boot import cli; sys.exit(cli.main([{subcommand!r}]))"],
        env=child_env(PYTHONPATH=path), capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.strip() == (f"amp-bn-fix: error: {subcommand} {said.format(python=sys.executable)}; "
                                     "python -m _amp_bn_fix_boot.status says what start-up does without it")


def test_demo_leaves_the_patch_as_it_found_it():
    amp_bn_fix.disable()
    launcher.main(["demo"])
    assert F.batch_norm is ORIGINAL
    amp_bn_fix.enable()
    launcher.main(["demo"])
    assert F.batch_norm.__wrapped__ is ORIGINAL  # one wrapper, ours, as before


@pytest.mark.slow
def test_python_dash_m_runs_the_demo():
    result = command("demo", module=True)
    assert result.returncode == 0, result.stderr
    assert ["cpu", "bfloat16", "BatchNorm1d", "bfloat16", "float32", "float32"] in demo_rows(result.stdout)


@pytest.mark.parametrize("args", [["--help"], ["run", "--help"], ["demo", "--help"], [], ["bogus"], ["demo", "--bogus"],
                                  ["run", "--policy", "fp33", "--", "true"], ["run", "--"]])
def test_help_and_argument_errors_import_neither_torch_nor_amp_bn_fix(args):
    code = (
        "import sys\n"
        "from _amp_bn_fix_boot import cli as launcher\n"
        "try:\n"
        f"    launcher.main({args!r})\n"
        "except SystemExit as exc:\n"
        "    print(exc.code, 'torch' in sys.modules, 'amp_bn_fix' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], env=child_env(), capture_output=True, text=True,
                            timeout=SUBPROCESS_TIMEOUT)
    expected_code = "0" if "--help" in args else "2"
    assert result.stdout.split()[-3:] == [expected_code, "False", "False"], result.stdout + result.stderr


def test_the_console_script_help_does_not_import_torch():
    result = command("--help", flags=("-X", "importtime"))
    assert result.returncode == 0
    assert "demo" in result.stdout and "check" in result.stdout and "run" in result.stdout
    assert not imported_torch(result.stderr)


@pytest.mark.parametrize("via", ["amp-bn-fix", pytest.param("python -m amp_bn_fix", marks=pytest.mark.slow)])
@pytest.mark.parametrize("enable", [None, "1"], ids=["hook off", "hook on"])
@pytest.mark.parametrize("subcommand", ["demo", "check"])
def test_a_bad_setting_is_one_line_and_exit_2(enable, subcommand, via):
    env = {"AMP_BN_FIX_POLICY": "fp33", **({"AMP_BN_FIX": enable} if enable else {})}
    result = command(subcommand, env=env, module=via.startswith("python"))
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.splitlines()
    assert line == (
        "amp-bn-fix: error: AMP_BN_FIX_POLICY='fp33' is not valid; allowed values: fp32, input, autocast, off"
        " (from the environment)"
    )
    assert result.stdout == ""


@pytest.mark.slow
def test_python_dash_m_with_a_bad_setting_runs_the_commands_that_need_no_settings():
    # python -m amp_bn_fix imports the package first: its import leaves the bad setting to the command.
    result = command("--version", env={"AMP_BN_FIX_POLICY": "fp33"}, module=True)
    assert (result.returncode, result.stdout.split()[0], result.stderr) == (0, "amp-bn-fix", "")
    run = command("run", "--", sys.executable, "-c", "pass", env={"AMP_BN_FIX_POLICY": "fp33"}, module=True)
    assert run.returncode == 2 and "AMP_BN_FIX_POLICY='fp33' is not valid" in run.stderr
    assert "Traceback" not in run.stderr


@pytest.mark.parametrize("start", [["-um", "amp_bn_fix"], ["-mamp_bn_fix"], ["-Wdefault", "-bumamp_bn_fix"]],
                         ids=["-um name", "-mname", "-bumname"])
def test_python_dash_m_bundled_with_other_options_reports_a_bad_setting_as_one_line(start):
    result = subprocess.run([sys.executable, *start, "demo"], env=child_env(AMP_BN_FIX_POLICY="fp33"),
                            capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.startswith("amp-bn-fix: error: AMP_BN_FIX_POLICY='fp33' is not valid")


@pytest.mark.slow
@pytest.mark.parametrize("start", ["-c", "-m"])
def test_anywhere_else_the_import_raises_the_bad_setting(tmp_path, start):
    # Only python -m amp_bn_fix leaves a bad setting to the command: a program that imports the
    # package gets the ValueError, run as a script or with python -m (runpy on the stack, but for it).
    (tmp_path / "train.py").write_text("import amp_bn_fix\n")
    args = ["-c", "import train"] if start == "-c" else ["-m", "train"]
    result = subprocess.run([sys.executable, *args], env=child_env(AMP_BN_FIX_POLICY="fp33"), cwd=tmp_path,
                            capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT)
    assert result.returncode == 1 and "Traceback" in result.stderr
    assert result.stderr.splitlines()[-1] == (
        "ValueError: AMP_BN_FIX_POLICY='fp33' is not valid; allowed values: fp32, input, autocast, off"
    )


def test_a_bad_setting_costs_the_console_script_no_torch_import():
    result = command("demo", env={"AMP_BN_FIX": "1", "AMP_BN_FIX_POLICY": "fp33"}, flags=("-X", "importtime"))
    assert result.returncode == 2
    assert not imported_torch(result.stderr)


@pytest.mark.slow
def test_run_with_a_bad_switch_says_once_that_the_command_gets_the_shim():
    probe = "import torch, amp_bn_fix; print(amp_bn_fix.is_enabled())"
    result = command("run", "--", sys.executable, "-c", probe, env={"AMP_BN_FIX": "maybe"})
    assert (result.returncode, result.stdout.strip()) == (0, "True"), result.stderr
    (line,) = result.stderr.splitlines()
    assert "AMP_BN_FIX='maybe' is not valid" in line and "the command runs with AMP_BN_FIX=1" in line
    assert "running without the shim" not in line


def test_run_help_shows_the_default_policy_and_a_cost_per_policy(capsys):
    with pytest.raises(SystemExit) as exited:
        launcher.main(["run", "--help"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    assert "autocast, off (default fp32)" in " ".join(out.split())
    assert "policies (--policy; default fp32)" in out and "not yet measured on a GPU" in out
    costs = {line.split()[0]: line for line in out.splitlines() if line.startswith("  ") and line.split()[0] in POLICIES}
    assert set(costs) == set(POLICIES)
    assert "1.33x" in costs["fp32"] and "2.5x" in costs["fp32"]  # the count's figures (docs/performance.md)


POLICIES = ("fp32", "input", "autocast", "off")
