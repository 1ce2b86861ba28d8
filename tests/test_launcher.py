"""``amp-bn-fix run -- CMD``: the command and every Python process it starts get the shim."""

import ast
import json
import os
import pathlib
import shutil
import subprocess
import sys
import sysconfig

import pytest

from _amp_bn_fix_boot import cli as launcher
from _shared import SUBPROCESS_TIMEOUT, child_env

ROOT = pathlib.Path(__file__).resolve().parent.parent
CONSOLE_SCRIPT = shutil.which("amp-bn-fix", path=os.path.dirname(sys.executable))

# What a Python process started by the launcher sees.
PROBE = """
import builtins, json, os, sys
import torch
import torch.nn.functional as F
import wrapt
from torch import nn

depth = len(list(wrapt.wrapper_chain(F.batch_norm))) - 1  # the wrappers above torch's function
net = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
with torch.autocast("cpu", dtype=torch.bfloat16):
    out = net(torch.randn(8, 4))
print(json.dumps({
    "wrappers": depth,
    "bn_out": str(out.dtype),
    "sitecustomize": getattr(sys.modules.get("sitecustomize"), "__file__", None),
    "user_sitecustomize": getattr(builtins, "USER_SITECUSTOMIZE", None),
}))
"""


def amp_bn_fix(*args, env=None):
    assert CONSOLE_SCRIPT, "the amp-bn-fix console script is not installed next to this interpreter"
    return subprocess.run(
        [CONSOLE_SCRIPT, *args], env=child_env(**(env or {})), capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT
    )


def report(result):
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_run_enables_the_shim_in_the_command_with_the_given_settings():
    got = report(amp_bn_fix("run", "--policy", "input", "--", sys.executable, "-c", PROBE))
    # The installed .pth and the launcher's sitecustomize both start the hook: still one wrapper.
    assert got["wrappers"] == 1
    assert got["bn_out"] == "torch.bfloat16"
    # The installed launcher's copy: under `python -m pytest` in a clone with a non-editable install,
    # the clone's _amp_bn_fix_boot (imported here) is another copy of the same file.
    installed = pathlib.Path(got["sitecustomize"])
    bootstrap = pathlib.Path(launcher.BOOTSTRAP_DIR, "sitecustomize.py")
    assert installed.parts[-3:] == bootstrap.parts[-3:]
    assert installed.read_bytes() == bootstrap.read_bytes()


@pytest.mark.slow
def test_the_bootstrap_sitecustomize_alone_enables_the_shim():
    # -S: no site, so no amp_bn_fix.pth; import the bootstrap sitecustomize as site would.
    paths = [launcher.BOOTSTRAP_DIR, str(ROOT), sysconfig.get_paths()["purelib"]]
    code = f"import sys; sys.path[:0] = {paths!r}; import sitecustomize\n" + PROBE
    result = subprocess.run(
        [sys.executable, "-S", "-c", code],
        env=child_env(AMP_BN_FIX="1"), capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT,
    )
    got = report(result)
    assert (got["wrappers"], got["bn_out"]) == (1, "torch.float32")


# A finder another package's .pth file puts first on sys.meta_path (before sitecustomize runs).
FIRST_FINDER = """
import importlib.machinery, sys
class Vendored:
    def find_spec(self, name, path=None, target=None):
        return importlib.machinery.PathFinder.find_spec(name, [{folder!r}]) if name == "torch" else None
sys.meta_path.insert(0, Vendored())
"""


@pytest.mark.parametrize("program, switch", [("nothing", "1"), ("import", "1"), ("import", "0"), ("vendored", "1"),
                                             ("import, stderr closed", "1")])
def test_the_bootstrap_sitecustomize_warns_once_where_amp_bn_fix_is_not_installed(tmp_path, program, switch):
    # As in an interpreter of another environment: nothing of the package on its path. A program
    # that never imports torch hears nothing, one that does one line, unless it turned the shim
    # off; the import finds torch wherever it did without the bootstrap (here through a finder put
    # first on sys.meta_path, as a .pth file of another package may). A process started with its
    # stderr closed (Python sets sys.stderr to None) hears nothing, and imports torch all the same.
    folder = tmp_path / ("vendored" if program == "vendored" else "path")
    (folder / "torch").mkdir(parents=True)
    (folder / "torch" / "__init__.py").write_text("FOUND = True\n")  # that environment's torch
    code = f"exec({FIRST_FINDER.format(folder=str(folder))!r}); " if program == "vendored" else ""
    code += "import sys; sys.stderr = None; " if program == "import, stderr closed" else ""
    code += f"import sys; sys.path.insert(0, {launcher.BOOTSTRAP_DIR!r}); import sitecustomize; "
    if program != "vendored":
        code += f"sys.path.insert(0, {str(folder)!r}); "
    code += ("" if program == "nothing" else "import torch, torch; assert torch.FOUND; ") + "print('ran')"
    env = child_env(AMP_BN_FIX=switch)
    env.pop("PYTHONPATH", None)  # where a run of these tests puts the package on it
    result = subprocess.run([sys.executable, "-S", "-c", code], env=env, cwd=tmp_path,
                            capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT)
    assert (result.returncode, result.stdout.strip()) == (0, "ran"), result.stderr
    if program in ("nothing", "import, stderr closed") or switch == "0":
        assert result.stderr == ""
        return
    (line,) = result.stderr.strip().splitlines()
    assert line == f"amp_bn_fix: not installed for {sys.executable}; running without the shim"


# Syntax a Python 3 parser takes that Python 2's rejects (beyond what ``_py2_unreadable`` checks by hand).
PYTHON_3_ONLY = (ast.JoinedStr, ast.AnnAssign, ast.Nonlocal, ast.YieldFrom, ast.AsyncFunctionDef, ast.Await,
                 ast.NamedExpr, ast.Starred, ast.MatMult)


def _py2_unreadable(source):
    """The nodes of ``source`` that Python 2 cannot parse: f-strings, annotations, keyword-only arguments..."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, PYTHON_3_ONLY):
            found.append(node)
        elif isinstance(node, ast.FunctionDef):
            args = node.args
            if (node.returns is not None or args.kwonlyargs or args.posonlyargs
                    or any(a.annotation is not None for a in args.args)):
                found.append(node)
    return found


def test_the_bootstrap_sitecustomize_is_written_in_syntax_python_2_reads_too():
    # Every Python a command run by the launcher starts reads it: a Python 2 tool's too, whose
    # own sitecustomize must still run, with nothing said.
    source = (pathlib.Path(launcher.BOOTSTRAP_DIR) / "sitecustomize.py").read_text()
    assert _py2_unreadable(source) == []
    assert _py2_unreadable("def f(x: int) -> None:\n    print(f'{x}')\n")  # the check finds what it looks for


def python_2():
    """A Python 2 on PATH that runs (a version manager's shim may stand there without one), or None."""
    for name in ("python2.7", "python2"):
        found = shutil.which(name)
        if found and subprocess.run([found, "-c", "import sys; sys.exit(sys.version_info[0] != 2)"],
                                    capture_output=True, timeout=SUBPROCESS_TIMEOUT).returncode == 0:
            return found
    return None


def test_a_python_2_tool_under_the_launcher_runs_its_own_sitecustomize_and_hears_nothing(tmp_path):
    python = python_2()
    if python is None:
        pytest.skip("no Python 2 on PATH")
    (tmp_path / "sitecustomize.py").write_text("import sys; sys.stdout.write('own sitecustomize\\n')\n")
    env = launcher.environment(child_env(PYTHONPATH=str(tmp_path)))
    result = subprocess.run([python, "-c", "print('ran')"], env=env, capture_output=True, text=True,
                            timeout=SUBPROCESS_TIMEOUT)
    assert (result.returncode, result.stdout.split(), result.stderr) == (0, ["own", "sitecustomize", "ran"], "")


@pytest.mark.slow
def test_run_chains_to_the_sitecustomize_it_shadows(tmp_path):
    (tmp_path / "sitecustomize.py").write_text("import builtins\nbuiltins.USER_SITECUSTOMIZE = __file__\n")
    got = report(amp_bn_fix("run", "--", sys.executable, "-c", PROBE, env={"PYTHONPATH": str(tmp_path)}))
    assert got["user_sitecustomize"] == str(tmp_path / "sitecustomize.py")
    assert got["sitecustomize"] == str(tmp_path / "sitecustomize.py")
    assert got["bn_out"] == "torch.float32"


@pytest.mark.slow
def test_child_processes_inherit_it():
    code = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {PROBE!r}], check=True)"
    got = report(amp_bn_fix("run", "--devices", "cpu", "--", sys.executable, "-c", code))
    assert (got["wrappers"], got["bn_out"]) == (1, "torch.float32")


@pytest.mark.parametrize("via", ["console script", pytest.param("python -m amp_bn_fix", marks=pytest.mark.slow)])
def test_the_exit_code_is_the_commands(via):
    command = ["run", "--", sys.executable, "-c", "raise SystemExit(7)"]
    if via == "console script":
        result = amp_bn_fix(*command)
    else:
        result = subprocess.run([sys.executable, "-m", "amp_bn_fix", *command], capture_output=True, text=True,
                                timeout=SUBPROCESS_TIMEOUT)
    assert result.returncode == 7, result.stderr


@pytest.mark.parametrize(
    "args, env, message",
    [
        (["--policy", "bogus", "--", "true"], {},
         "argument --policy: 'bogus' is not valid; allowed values: fp32, input, autocast, off"),
        (["--devices", "gpu", "--", "true"], {}, "argument --devices: 'gpu' is not valid; allowed values: 'all' or"),
        (["--guard", "maybe", "--", "true"], {}, "argument --guard: 'maybe' is not valid"),
        (["--guard", "", "--", "true"], {}, "argument --guard: '' is not valid"),  # not the off word
        (["--"], {}, "missing the command"),
        (["--", "true"], {"AMP_BN_FIX_POLICY": "bogus"}, "AMP_BN_FIX_POLICY='bogus' is not valid"),
    ],
)
def test_bad_arguments_are_clear_errors(args, env, message):
    result = amp_bn_fix("run", *args, env=env)
    assert result.returncode == 2
    assert message in result.stderr and "Traceback" not in result.stderr


def test_run_names_every_bad_inherited_setting():
    result = amp_bn_fix("run", "--", "true", env={"AMP_BN_FIX_POLICY": "x", "AMP_BN_FIX_KEEP_FP32": "y"})
    assert result.returncode == 2
    assert [line.split(" is not valid")[0] for line in result.stderr.splitlines()] == [
        "amp-bn-fix: error: AMP_BN_FIX_POLICY='x'", "amp-bn-fix: error: AMP_BN_FIX_KEEP_FP32='y'"]


def test_a_missing_command_exits_127():
    result = amp_bn_fix("run", "--", "no-such-command-amp-bn-fix")
    assert result.returncode == 127
    assert "no-such-command-amp-bn-fix" in result.stderr


def test_run_imports_neither_torch_nor_amp_bn_fix():
    code = (
        "import os, sys\n"
        "os.execvpe = lambda file, args, env: sys.exit(print(args, 'torch' in sys.modules, 'amp_bn_fix' in sys.modules))\n"
        "from _amp_bn_fix_boot import cli as launcher\n"
        "launcher.main(['run', '--', 'true'])\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT)
    assert result.stdout.split() == ["['true']", "False", "False"], result.stderr


def test_environment_switches_the_shim_on_and_puts_the_bootstrap_first_once():
    base = {"PYTHONPATH": os.pathsep.join(["/somewhere", launcher.BOOTSTRAP_DIR])}
    env = launcher.environment(base, policy="input", devices="cpu")
    assert (env["AMP_BN_FIX"], env["AMP_BN_FIX_POLICY"], env["AMP_BN_FIX_DEVICES"]) == ("1", "input", "cpu")
    assert env["PYTHONPATH"].split(os.pathsep) == [launcher.BOOTSTRAP_DIR, "/somewhere"]
    assert launcher.environment({})["PYTHONPATH"] == launcher.BOOTSTRAP_DIR


def test_run_has_an_option_for_each_setting_read_as_its_variable_reads_it(monkeypatch):
    # The options come from the settings table: values are case-insensitive, as in the environment,
    # and reach the command spelled as the variables spell them.
    from _amp_bn_fix_boot import settings

    seen = {}
    monkeypatch.setattr(os, "execvpe", lambda file, args, env: seen.update(env) or sys.exit(0))
    with pytest.raises(SystemExit):
        launcher.main(["run", "--policy", "Input", "--devices", "CUDA, cpu", "--keep-fp32", "STATS", "--guard", "off",
                       "--report", "--", "true"])
    assert {name: seen[name] for name in settings.ENV_NAMES} == {
        "AMP_BN_FIX": "1", "AMP_BN_FIX_POLICY": "input", "AMP_BN_FIX_DEVICES": "cpu,cuda",
        "AMP_BN_FIX_KEEP_FP32": "stats", "AMP_BN_FIX_GUARD": "0", "AMP_BN_FIX_REPORT": "1",
    }
    with pytest.raises(TypeError, match="unexpected setting 'enable'"):
        launcher.environment({}, enable="1")


def test_a_misspelled_option_names_the_closest_valid_one(capsys):
    with pytest.raises(SystemExit) as exit_info:
        launcher.main(["run", "--polcy", "input", "--", "true"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "unrecognized arguments: --polcy" in err and "(did you mean --policy?)" in err


@pytest.mark.parametrize("args, hint", [
    (["demo", "--policy", "input"], "(--policy is an option of run, not of demo)"),
    (["check", "--version"], "(--version goes before the command: amp-bn-fix --version)"),
    (["check", "--polcy=input"], None),  # check has no option close to it: no suggestion
])
def test_an_option_of_another_command_says_where_it_goes(capsys, args, hint):
    with pytest.raises(SystemExit) as exit_info:
        launcher.main(args)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("amp-bn-fix: error: unrecognized arguments:")
    assert err.endswith(hint) if hint else "(" not in err, err


def test_version_costs_no_torch_import(capsys):
    from _amp_bn_fix_boot._version import __version__

    with pytest.raises(SystemExit) as exit_info:
        launcher.main(["--version"])
    assert exit_info.value.code == 0 and capsys.readouterr().out.strip() == f"amp-bn-fix {__version__}"
