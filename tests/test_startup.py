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

from _amp_bn_fix_boot import hook, names, settings
from _shared import SUBPROCESS_TIMEOUT, child_env

ROOT = pathlib.Path(__file__).resolve().parent.parent
# What setup.py writes into every wheel, from the names module.
START_FILES = {names.PTH_FILE: names.PTH_TEXT, names.START_FILE: names.START_TEXT}

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

depth = len(list(wrapt.wrapper_chain(F.batch_norm))) - 1  # the wrappers above torch's function
net = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 5))
with torch.autocast("cpu", dtype=torch.bfloat16):
    bn_out = net[1](net[0](torch.randn(8, 4)))
print(json.dumps({"wrappers": depth, "bn_out": str(bn_out.dtype), "stats": str(net[1].running_mean.dtype)}))
"""


def python(code, env=None, *flags, **kwargs):
    """Run ``code`` in a new interpreter with ``env`` added to this (AMP_BN_FIX-free) environment."""
    return subprocess.run(
        [sys.executable, *flags, "-c", code], env=child_env(**(env or {})), capture_output=True, text=True,
        timeout=SUBPROCESS_TIMEOUT, **kwargs
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
        assert installed[0].read_text() == START_FILES[name]


@pytest.mark.parametrize("value", [None, *names.OFF_WORDS, " Off ", "NO"])
def test_off_loads_nothing(value):
    result = python(LOADED, {} if value is None else {"AMP_BN_FIX": value})
    assert not any(report(result).values())
    assert result.stderr == ""


@pytest.mark.slow
def test_off_leaves_torch_alone():
    assert report(python(SEED))["bn_out"] == "torch.bfloat16"


# The hook called by hand (no site, so no .pth deciding first): its own reading of the switch.
HOOK_ALONE = f"""
import json, sys; sys.path.insert(0, {str(ROOT)!r})
from _amp_bn_fix_boot import hook
hook.start()
print(json.dumps(hook.registered()))
"""


@pytest.mark.parametrize("value", [*names.OFF_WORDS, " Off ", *names.ON_WORDS, " ON "])
def test_the_hook_reads_the_switch_as_the_settings_do(value):
    expected = settings.parse_flag(value, names.ENV_ENABLE)
    assert expected is (value.strip().lower() in names.ON_WORDS)
    assert report(python(HOOK_ALONE, {"AMP_BN_FIX": value}, "-S")) is expected


def test_on_loads_neither_torch_nor_wrapt_nor_amp_bn_fix_at_start_up():
    loaded = report(python(LOADED, {"AMP_BN_FIX": "1"}))
    assert loaded["_amp_bn_fix_boot.hook"] is True  # the hook ran...
    assert not (loaded["torch"] or loaded["wrapt"] or loaded["amp_bn_fix"])  # ...and imported none


# Watches the hook's finder through a torch lookup, an unrelated reload and two imports of torch.
WATCH = """
import importlib, importlib.util, json, sys, types
from _amp_bn_fix_boot import hook

def finders():
    return sum(type(f).__name__ == "_TorchFinder" for f in sys.meta_path)

calls, incomplete = [], []
enable = hook._enable
def counting_enable(torch):
    calls.append(torch.__name__)
    incomplete.append(set(vars(torch)))  # the names torch has when the shim is enabled
    enable(torch)
hook._enable = counting_enable

got = {"before": {n: n in sys.modules for n in ("torch", "wrapt", "amp_bn_fix")}, "finders": finders()}
spec = importlib.util.find_spec("torch")  # a lookup, not an import: nothing fires
got["spec"] = [spec.origin.endswith("__init__.py"), bool(spec.submodule_search_locations), spec.loader.is_package("torch")]
importlib.reload(json)
got["after lookup"] = [list(calls), finders()]
import torch
import torch.nn
import torch
import amp_bn_fix, wrapt
import torch.nn.functional as F
missing = [n for n, v in vars(torch).items() if n not in incomplete[0] and not isinstance(v, types.ModuleType)]
got.update(calls=calls, finders_after=finders(), missing=missing)
got.update(enabled=amp_bn_fix.is_enabled(), registered=hook.registered())
got["loader"] = [type(torch.__loader__).__name__, torch.__spec__.loader is torch.__loader__]
got["wrappers"] = len(list(wrapt.wrapper_chain(F.batch_norm))) - 1  # the wrappers above torch's function
print(json.dumps(got))
"""


def test_the_hook_waits_for_the_end_of_import_torch_and_enables_the_shim_once():
    got = report(python(WATCH, {"AMP_BN_FIX": "1"}))
    assert got["before"] == {"torch": False, "wrapt": False, "amp_bn_fix": False}
    assert got["finders"] == 1
    assert got["spec"] == [True, True, True]  # torch's spec as the usual finders give it
    assert got["after lookup"] == [[], 1]
    assert got["calls"] == ["torch"] and got["wrappers"] == 1 and got["enabled"] and got["registered"]
    assert got["missing"] == []  # torch's __init__ had run to the end
    assert got["finders_after"] == 0  # the finder removed itself
    assert got["loader"] == ["SourceFileLoader", True]  # torch keeps its own loader


def test_the_hook_enables_the_shim_at_once_when_torch_is_already_imported():
    # Without site, so the hook starts only when called, after torch's import.
    paths = [str(ROOT), sysconfig.get_paths()["purelib"]]
    code = (
        f"import sys; sys.path[:0] = {paths!r}\n"
        "import torch, wrapt\n"
        "from _amp_bn_fix_boot import hook\n"
        "hook.start()\n"
        "waiting = any(type(f).__name__ == '_TorchFinder' for f in sys.meta_path)\n"
        "print(sys.modules['amp_bn_fix'].is_enabled(), waiting)"
    )
    result = python(code, {"AMP_BN_FIX": "1"}, "-S")
    assert (result.returncode, result.stdout.split(), result.stderr) == (0, ["True", "False"], "")


@pytest.mark.slow
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


def test_an_error_enabling_the_shim_is_one_warning_line_and_torch_imports(tmp_path):
    (tmp_path / "wrapt.py").write_text("raise RuntimeError('broken wrapt')\n")
    code = "import sys, torch; print(type(torch.nn.functional.batch_norm).__name__); sys.exit(5)"
    result = python(code, {"AMP_BN_FIX": "1", "PYTHONPATH": str(tmp_path)})
    assert (result.returncode, result.stdout.strip()) == (5, "function")
    (line,) = warning_lines(result)
    assert "enabling failed (RuntimeError: broken wrapt)" in line


def test_a_package_that_exits_is_one_warning_line_at_torch_import(tmp_path):
    # A broken amp_bn_fix ahead of the installed one.
    (tmp_path / "amp_bn_fix").mkdir()
    (tmp_path / "amp_bn_fix" / "__init__.py").write_text("raise SystemExit(3)\n")
    code = "import torch; print(type(torch.nn.functional.batch_norm).__name__)"
    result = python(code, {"AMP_BN_FIX": "1", "PYTHONPATH": str(tmp_path)}, cwd=tmp_path)
    assert (result.returncode, result.stdout.strip()) == (0, "function")
    (line,) = warning_lines(result)
    assert "enabling failed (SystemExit: 3)" in line


@pytest.mark.parametrize(
    "source, error",
    [
        ("raise RuntimeError('broken')", "RuntimeError: broken"),
        ("raise SystemExit(9)", "SystemExit: 9"),
        ("raise KeyboardInterrupt", "KeyboardInterrupt: "),
        ("def (", "SyntaxError: "),
    ],
)
@pytest.mark.parametrize("via", ["pth", "pth and launcher", "launcher only"])
def test_a_broken_boot_package_is_one_warning_line_and_a_normal_run(tmp_path, source, error, via):
    # A broken _amp_bn_fix_boot ahead of the installed one, seen by amp_bn_fix.pth and/or, with the
    # launcher's bootstrap folder on the path, by its sitecustomize.
    (tmp_path / "_amp_bn_fix_boot").mkdir()
    (tmp_path / "_amp_bn_fix_boot" / "__init__.py").write_text(source + "\n")
    paths = [str(tmp_path), str(ROOT / "_amp_bn_fix_boot" / "bootstrap")]
    if via == "launcher only":  # no site, so no .pth: import the sitecustomize as site would
        code = f"import sys; sys.path[:0] = {paths!r}; import sitecustomize; print('ran')"
        result = python(code, {"AMP_BN_FIX": "1"}, "-S", cwd=tmp_path)
    else:
        env = {"AMP_BN_FIX": "1", "PYTHONPATH": os.pathsep.join(paths if via == "pth and launcher" else paths[:1])}
        result = python("print('ran')", env, cwd=tmp_path)
    assert (result.returncode, result.stdout.strip()) == (0, "ran")
    (line,) = warning_lines(result)
    assert f"amp_bn_fix: start-up hook failed ({error}" in line


@pytest.mark.parametrize("stderr", ["open", "closed"])
def test_a_moved_source_tree_is_one_warning_line_and_a_normal_run(tmp_path, stderr):
    # The .pth file in a site directory from which _amp_bn_fix_boot cannot be imported, as after
    # moving an editable install's source tree; read twice, as site does in a venv on Python 3.11.
    # With stderr closed (Python sets sys.stderr to None) nothing is said, and nothing lands on
    # stdout (site prints a .pth line's error there then).
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / names.PTH_FILE).write_text(names.PTH_TEXT)
    code = "import site, sys\n" + ("sys.stderr = None\n" if stderr == "closed" else "")
    code += f"for _ in range(2): site.addsitedir({str(tmp_path / 'site')!r})\nprint('ran')"
    # No PYTHONPATH either: a run of these tests from a source tree puts the package on it.
    result = python(code, {"AMP_BN_FIX": "1", "PYTHONPATH": ""}, "-S", cwd=tmp_path)
    assert (result.returncode, result.stdout) == (0, "ran\n"), result.stdout
    if stderr == "closed":
        assert result.stderr == ""
        return
    (line,) = warning_lines(result)
    assert "amp_bn_fix: start-up hook failed (ModuleNotFoundError: No module named '_amp_bn_fix_boot')" in line


def test_the_pth_file_is_one_import_line():
    lines = [line for line in names.PTH_TEXT.splitlines() if not line.startswith("#")]
    assert len(lines) == 1 and lines[0].startswith("import ")


def test_an_explicit_import_with_a_bad_setting_still_raises():
    result = python("import amp_bn_fix", {"AMP_BN_FIX": "1", "AMP_BN_FIX_POLICY": "bogus"})
    assert result.returncode == 1
    assert "ValueError: AMP_BN_FIX_POLICY='bogus'" in result.stderr


def test_the_start_file_names_the_function_the_pth_file_calls():
    (entry,) = names.START_TEXT.split()
    assert pkgutil.resolve_name(entry) is hook.start
    assert "_amp_bn_fix_boot.hook').hook.start()" in names.PTH_TEXT


def test_the_start_file_entry_point_enables_the_shim_as_python_3_15_would_call_it():
    # Without site (so without amp_bn_fix.pth), call the entry point the way PEP 829's site does.
    (entry,) = names.START_TEXT.split()
    paths = [str(ROOT), sysconfig.get_paths()["purelib"]]
    code = f"import pkgutil, sys; sys.path[:0] = {paths!r}; pkgutil.resolve_name({entry!r})()\n" + SEED
    assert report(python(code, {"AMP_BN_FIX": "1"}, "-S"))["bn_out"] == "torch.float32"


@pytest.mark.slow
@pytest.mark.parametrize("build", ["build_wheel", "build_editable"])
def test_wheels_ship_the_start_files_at_the_root_and_in_record(tmp_path, build):
    project = tmp_path / "project"
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
    project.mkdir()
    for name in ("setup.py", "setup.cfg", "pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, project / name)
    for package in ("amp_bn_fix", "_amp_bn_fix_boot"):
        shutil.copytree(ROOT / package, project / package, ignore=ignore)
    result = subprocess.run(
        [sys.executable, "-c", f"from setuptools import build_meta; print(build_meta.{build}({str(tmp_path / 'dist')!r}))"],
        cwd=project, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    wheel = zipfile.ZipFile(tmp_path / "dist" / result.stdout.strip().splitlines()[-1])
    record = next(n for n in wheel.namelist() if n.endswith(".dist-info/RECORD"))
    lines = wheel.read(record).decode().splitlines()
    for name in START_FILES:
        data = wheel.read(name)  # at the root: installed into site-packages itself
        assert data == START_FILES[name].encode()
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        assert f"{name},sha256={digest},{len(data)}" in lines  # so uninstalling removes it
    if build == "build_wheel":
        assert "_amp_bn_fix_boot/bootstrap/sitecustomize.py" in wheel.namelist()
