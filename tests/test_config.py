"""The settings: the table, the environment's parsing and validation (torch-free), and the Python API."""

import copy
import dataclasses
import inspect
import os
import pickle
import subprocess
import sys
import typing

import pytest

import amp_bn_fix
from _amp_bn_fix_boot import cli, settings
from _shared import SUBPROCESS_TIMEOUT, child_env


def test_defaults():
    config = settings.from_env({})
    assert (config.policy, config.devices, config.keep_fp32, config.guard) == ("fp32", None, "master", True)
    assert set(config.sources.values()) == {"default"}


def test_values_are_parsed_case_insensitively_and_sources_recorded():
    config = settings.from_env(
        {
            "AMP_BN_FIX_POLICY": " Input ",
            "AMP_BN_FIX_DEVICES": "CUDA, cpu",
            "AMP_BN_FIX_KEEP_FP32": "ALL",
            "AMP_BN_FIX_GUARD": "off",
        }
    )
    assert config.policy == "input"
    assert config.devices == frozenset({"cuda", "cpu"})
    assert config.keep_fp32 == "all" and config.guard is False
    assert dict(config.sources) == {"policy": "env", "devices": "env", "keep_fp32": "env", "guard": "env"}
    assert config.describe("devices") == "cpu,cuda" and config.describe("guard") == "0"


def test_all_devices_and_empty_values_mean_default():
    assert settings.from_env({"AMP_BN_FIX_DEVICES": "all", "AMP_BN_FIX_POLICY": ""}).devices is None
    assert settings.from_env({"AMP_BN_FIX_POLICY": "  "}).policy == "fp32"


@pytest.mark.parametrize(
    "name, value, allowed",
    [
        ("AMP_BN_FIX_POLICY", "fp16", "fp32, input, autocast, off"),
        ("AMP_BN_FIX_DEVICES", "gpu", "'all' or a comma list of: cpu, cuda"),
        ("AMP_BN_FIX_DEVICES", "cuda,,cpu", "'all' or a comma list"),
        ("AMP_BN_FIX_DEVICES", "all,cpu", "'all' or a comma list"),
        ("AMP_BN_FIX_KEEP_FP32", "weights", "master, all, stats, none"),
        ("AMP_BN_FIX_GUARD", "maybe", "1/true/yes/on or 0/false/no/off"),
    ],
)
def test_bad_values_name_the_variable_the_value_and_the_choices(name, value, allowed):
    with pytest.raises(ValueError) as error:
        settings.from_env({name: value})
    message = str(error.value)
    assert f"{name}={value!r}" in message and allowed in message


def test_replace_records_the_source():
    config = settings.Config().replace(policy="off")
    assert config.policy == "off" and config.sources["policy"] == "API" and config.sources["guard"] == "default"


def test_hook_switch():
    assert not settings.hook_requested({})
    assert settings.hook_requested({"AMP_BN_FIX": "1"})
    assert not settings.hook_requested({"AMP_BN_FIX": "0"})
    with pytest.raises(ValueError, match="AMP_BN_FIX='maybe'"):
        settings.hook_requested({"AMP_BN_FIX": "maybe"})


def run_python(code, **env):
    return subprocess.run([sys.executable, "-c", code], env=child_env(**env), capture_output=True, text=True,
                          timeout=SUBPROCESS_TIMEOUT)


def test_the_torch_free_layer_imports_neither_torch_nor_amp_bn_fix():
    code = ("import sys; from _amp_bn_fix_boot import cli, hook, names, settings, status; settings.from_env(); "
            "cli.build_parser(); status.gather(); print(sorted(m for m in ('torch', 'wrapt', 'amp_bn_fix') if m in sys.modules))")
    result = run_python(code)
    assert result.stdout.strip() == "[]", result.stderr


def test_unknown_names_warn_with_the_closest_valid_one():
    unknown = settings.unknown_names({"AMP_BN_FIX_POLCY": "input", "AMP_BN_FIX_GAURD": "0", "AMP_BN_FIX_XYZZY": "1",
                                      "AMP_BN_FIX_POLICY": "fp32"})
    assert unknown == [("AMP_BN_FIX_GAURD", "AMP_BN_FIX_GUARD"), ("AMP_BN_FIX_POLCY", "AMP_BN_FIX_POLICY"),
                       ("AMP_BN_FIX_XYZZY", None)]
    line = settings.describe_unknown(unknown)
    assert "AMP_BN_FIX_POLCY (did you mean AMP_BN_FIX_POLICY?)" in line and "AMP_BN_FIX_XYZZY" in line


@pytest.mark.slow
def test_import_warns_once_about_an_unknown_name():
    result = run_python("import warnings; warnings.simplefilter('error'); import amp_bn_fix", AMP_BN_FIX_POLCY="input")
    assert result.returncode != 0
    assert "RuntimeWarning: amp_bn_fix: unknown setting AMP_BN_FIX_POLCY (did you mean AMP_BN_FIX_POLICY?)" in result.stderr


@pytest.mark.slow
def test_import_with_a_bad_value_raises_loudly():
    result = run_python("import amp_bn_fix", AMP_BN_FIX_POLICY="fp16")
    assert result.returncode != 0
    assert "ValueError: AMP_BN_FIX_POLICY='fp16' is not valid; allowed values: fp32, input, autocast, off" in result.stderr


@pytest.mark.slow
def test_import_reads_the_environment():
    code = "import amp_bn_fix; print(amp_bn_fix.is_enabled(), amp_bn_fix.get_policy(), amp_bn_fix.get_config().sources['policy'])"
    assert run_python(code, AMP_BN_FIX_POLICY="Autocast").stdout.split() == ["True", "autocast", "env"]
    assert run_python(code, AMP_BN_FIX_POLICY="off").stdout.split() == ["False", "off", "env"]
    assert run_python(code).stdout.split() == ["True", "fp32", "default"]


def test_config_is_immutable_and_hashable():
    config = settings.from_env({"AMP_BN_FIX_POLICY": "input"})
    with pytest.raises(TypeError):
        config.sources["policy"] = "API"  # type: ignore[index]
    assert config.sources["policy"] == "env"
    assert hash(config) == hash(settings.Config(policy="input")) and config == settings.Config(policy="input")


def test_config_and_the_previous_settings_copy_and_pickle_like_plain_values():
    # Logged with dataclasses.asdict, deep-copied, handed to a spawned worker.
    config = settings.from_env({"AMP_BN_FIX_POLICY": "input"}).replace(guard=False)
    assert dataclasses.asdict(config) == {"policy": "input", "devices": None, "keep_fp32": "master", "guard": False,
                                          "sources": {"policy": "env", "devices": "default",
                                                      "keep_fp32": "default", "guard": "API"}}
    for copied in (copy.deepcopy(config), pickle.loads(pickle.dumps(config))):
        assert copied == config and copied.sources == config.sources
        with pytest.raises(TypeError):
            copied.sources["guard"] = "env"  # type: ignore[index]
    previous = amp_bn_fix.configure(policy="autocast")
    try:
        for copied in (copy.deepcopy(previous), pickle.loads(pickle.dumps(previous))):
            assert copied == dict(previous) and set(copied) == {"policy", "devices", "keep_fp32", "guard"}
            assert copied.config == previous.config and copied.config.sources == previous.config.sources
    finally:
        amp_bn_fix.configure(**previous)


# ------------------------------------------------------------------------------ the settings table

def test_every_variable_and_config_field_comes_from_the_table():
    assert settings.ENV_NAMES == ("AMP_BN_FIX", "AMP_BN_FIX_POLICY", "AMP_BN_FIX_DEVICES", "AMP_BN_FIX_KEEP_FP32",
                                  "AMP_BN_FIX_GUARD", "AMP_BN_FIX_REPORT")
    assert [s.name for s in settings.SETTINGS if s.scope == "config"] == ["policy", "devices", "keep_fp32", "guard"]
    assert list(settings.Config().sources) == list(settings.CONFIG_NAMES)
    assert settings.POLICIES == typing.get_args(amp_bn_fix.PolicyName) == ("fp32", "input", "autocast", "off")


def test_run_takes_one_option_per_setting_but_the_switch():
    run = next(a for a in cli.build_parser()._actions if a.dest == "command").choices["run"]
    options = [o for action in run._actions for o in action.option_strings if o.startswith("--")]
    assert options == ["--help", "--policy", "--devices", "--keep-fp32", "--guard", "--report"]


def test_problems_lists_every_bad_setting_where_from_env_raises_the_first():
    environ = {"AMP_BN_FIX_POLICY": "fp33", "AMP_BN_FIX_DEVICES": "cpu", "AMP_BN_FIX_GUARD": "maybe",
               "AMP_BN_FIX_REPORT": "often", "AMP_BN_FIX": "2"}  # the hook's switch is the hook's to report
    assert settings.problems(environ) == [
        "AMP_BN_FIX_POLICY='fp33' is not valid; allowed values: fp32, input, autocast, off",
        "AMP_BN_FIX_GUARD='maybe' is not valid; allowed values: 1/true/yes/on or 0/false/no/off",
        "AMP_BN_FIX_REPORT='often' is not valid; allowed values: 1/true/yes/on or 0/false/no/off",
    ]
    with pytest.raises(ValueError, match="AMP_BN_FIX_POLICY='fp33'"):
        settings.from_env(environ)
    assert settings.problems({"AMP_BN_FIX_POLICY": "input", "AMP_BN_FIX_GUARD": ""}) == []


def test_describe_refuses_a_name_that_is_not_a_setting():
    with pytest.raises(ValueError, match="'sources' is not a setting; the settings are policy, devices, keep_fp32, guard"):
        settings.Config().describe("sources")


# ---------------------------------------------------------------------------- the public namespace

def test_the_namespace_holds_the_public_api_and_private_names_only():
    import amp_bn_fix.testing  # noqa: F401  (the one public submodule, once imported)

    public = {name for name in dir(amp_bn_fix) if not name.startswith("_")}
    assert public == set(amp_bn_fix.__all__) - {"__version__"} | {"testing"}
    assert "configure" in public and "PolicyName" in public


def test_config_reads_as_public():
    assert amp_bn_fix.Config.__module__ == "amp_bn_fix" and repr(amp_bn_fix.Config) == "<class 'amp_bn_fix.Config'>"
    assert amp_bn_fix.Config.describe.__module__ == "amp_bn_fix"
    # Its annotations resolve although amp_bn_fix's namespace holds none of the typing names.
    assert typing.get_type_hints(amp_bn_fix.Config)["policy"] == amp_bn_fix.PolicyName


def test_the_api_takes_the_policy_names_as_a_literal_type():
    policy_name = typing.Literal["fp32", "input", "autocast", "off"]
    assert typing.get_type_hints(amp_bn_fix.set_policy)["name"] == policy_name
    assert typing.get_type_hints(amp_bn_fix.policy)["name"] == policy_name
    assert typing.get_type_hints(amp_bn_fix.enable)["policy"] == typing.Optional[policy_name]
    assert typing.get_type_hints(amp_bn_fix.get_policy)["return"] == policy_name
    hints = typing.get_type_hints(amp_bn_fix.configure)
    assert hints["policy"] == policy_name and hints["keep_fp32"] == typing.Literal["master", "all", "stats", "none"]


# ----------------------------------------------------------------------------------- configure()

def test_configure_takes_each_setting_of_the_table_by_keyword_only():
    parameters = inspect.signature(amp_bn_fix.configure).parameters
    assert list(parameters) == list(settings.CONFIG_NAMES)
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in parameters.values())
    with pytest.raises(TypeError):
        amp_bn_fix.configure("input")  # type: ignore[misc]


def test_configure_changes_what_it_is_given_records_api_and_returns_what_was_before():
    previous = amp_bn_fix.configure(guard=False, keep_fp32="STATS")
    assert previous == {"policy": "fp32", "devices": None, "keep_fp32": "master", "guard": True}
    config = amp_bn_fix.get_config()
    assert (config.policy, config.devices, config.keep_fp32, config.guard) == ("fp32", None, "stats", False)
    assert dict(config.sources) == {"policy": "default", "devices": "default", "keep_fp32": "API", "guard": "API"}
    assert amp_bn_fix.configure() == {"policy": "fp32", "devices": None, "keep_fp32": "stats", "guard": False}
    amp_bn_fix.configure(**previous)
    assert amp_bn_fix.get_config() == settings.Config()


@pytest.mark.parametrize("devices, expected", [
    (None, None), ("all", None), ("cuda, CPU", {"cuda", "cpu"}), (["cuda"], {"cuda"}), (("cpu", "xpu"), {"cpu", "xpu"}),
    ({"mps"}, {"mps"}), (frozenset({"cuda"}), {"cuda"}), ((name for name in ["cuda", "cpu"]), {"cuda", "cpu"}),
])
def test_configure_takes_the_devices_as_the_variable_does_or_as_names(devices, expected):
    amp_bn_fix.configure(devices=devices)
    got = amp_bn_fix.get_config().devices
    assert got == (None if expected is None else frozenset(expected))
    assert amp_bn_fix.get_config().sources["devices"] == "API"


@pytest.mark.parametrize("value, expected", [(False, False), (True, True), (0, False), (1, True), ("off", False),
                                             (" Yes ", True)])
def test_configure_takes_the_guard_as_a_bool_or_as_the_variable_spells_it(value, expected):
    amp_bn_fix.configure(guard=not expected)
    amp_bn_fix.configure(guard=value)
    assert amp_bn_fix.get_config().guard is expected


@pytest.mark.parametrize("argument, value, allowed", [
    ("policy", "fp16", "fp32, input, autocast, off"),
    ("policy", None, "fp32, input, autocast, off"),
    ("devices", "gpu", "'all' or a comma list of: cpu, cuda"),
    ("devices", ["cuda", 0], "'all' or a comma list of: cpu, cuda"),
    ("devices", [], "'all' or a comma list of: cpu, cuda"),
    ("keep_fp32", "weights", "master, all, stats, none"),
    ("guard", "maybe", "1/true/yes/on or 0/false/no/off"),
    ("guard", 2, "1/true/yes/on or 0/false/no/off"),
])
def test_configure_rejects_what_the_variable_rejects_with_the_same_message_and_changes_nothing(argument, value, allowed):
    assert allowed in rejected_and_nothing_changed(argument, value)


@pytest.mark.parametrize("argument", settings.CONFIG_NAMES)
@pytest.mark.parametrize("value", ["", "  "])
def test_a_blank_value_given_in_code_is_an_error_not_the_default_nor_an_off_word(argument, value):
    # In the environment a blank value means the default; given in code it means nothing, and
    # guard="" would otherwise read as AMP_BN_FIX's off word, turning the guard off.
    rejected_and_nothing_changed(argument, value)


def rejected_and_nothing_changed(argument, value):
    """``configure``'s error for ``value``, checked to name the argument, the value and the allowed
    values, and to change nothing; its message."""
    before = amp_bn_fix.get_config()
    with pytest.raises(ValueError) as error:
        amp_bn_fix.configure(**{"guard": False, argument: value})
    assert str(error.value) == f"{argument}={value!r} is not valid; allowed values: " + settings.BY_NAME[argument].allowed
    after = amp_bn_fix.get_config()
    assert after == before and after.sources == before.sources  # nor the good value beside it
    return str(error.value)


def test_configure_in_a_with_block_restores_every_setting_and_its_source_even_on_an_error():
    amp_bn_fix.configure(keep_fp32="stats")
    before = amp_bn_fix.get_config()
    with pytest.raises(RuntimeError):
        with amp_bn_fix.configure(policy="input", guard=False) as previous:
            assert previous["policy"] == "fp32" and amp_bn_fix.get_policy() == "input"
            amp_bn_fix.set_policy("autocast")
            amp_bn_fix.configure(devices="cuda")
            raise RuntimeError("in the block")
    after = amp_bn_fix.get_config()
    assert after == before and dict(after.sources) == dict(before.sources) == {
        "policy": "default", "devices": "default", "keep_fp32": "API", "guard": "default"}


def test_configure_does_not_enable_the_shim_and_set_policy_goes_through_it():
    amp_bn_fix.disable()
    amp_bn_fix.configure(policy="input")
    assert not amp_bn_fix.is_enabled()
    amp_bn_fix.enable("autocast")
    assert amp_bn_fix.is_enabled() and amp_bn_fix.get_config().policy == "autocast"
    with pytest.raises(ValueError, match="^policy='fast' is not valid; allowed values: fp32, input, autocast, off$"):
        amp_bn_fix.set_policy("fast")  # type: ignore[arg-type]



# Run in a fresh interpreter: threads that other tests leave behind (compile workers) may hold
# locks of their own at a fork, which is no concern of the shim's.
FORK_WHILE_HELD = """
import os, signal, threading, time
import torch
import amp_bn_fix
from amp_bn_fix import _state

held, release = threading.Event(), threading.Event()

def holder():
    with torch.autocast("cpu", dtype=torch.bfloat16):  # a thread that has counted calls of its own
        torch.nn.functional.batch_norm(torch.randn(4, 3).bfloat16(), None, None, training=True)
    with _state.lock, _state.record_lock:
        held.set()
        release.wait()

thread = threading.Thread(target=holder)
thread.start()
assert held.wait(60)
pid = os.fork()
if pid == 0:  # the child: a hang ends it by SIGALRM
    signal.alarm(30)
    with amp_bn_fix.policy("input"):
        amp_bn_fix.set_policy(amp_bn_fix.get_policy())
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = torch.nn.functional.batch_norm(torch.randn(4, 3).bfloat16(), None, None, training=True)
    os._exit(0 if out.dtype is torch.bfloat16 and amp_bn_fix.report()["handled"] else 2)
release.set()
thread.join()
# A child stuck inside os.fork() never sets its alarm: the parent ends it.
deadline = time.monotonic() + 60
while True:
    done, status = os.waitpid(pid, os.WNOHANG)
    if done:
        raise SystemExit(os.waitstatus_to_exitcode(status))
    if time.monotonic() > deadline:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        raise SystemExit("the child hung")
    time.sleep(0.05)
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork on this platform")
def test_a_fork_while_another_thread_holds_the_locks_leaves_the_child_working():
    """A DataLoader starts its workers by fork while another thread, which has counted calls of its
    own, changes the settings or a guard record: the child changes settings and counts calls of
    its own, as the parent does."""
    result = subprocess.run([sys.executable, "-c", FORK_WHILE_HELD], env=child_env(), capture_output=True, text=True,
                            timeout=SUBPROCESS_TIMEOUT)
    assert result.returncode == 0, result.stderr


def test_an_import_that_raised_starts_again_at_the_next_import():
    """``import amp_bn_fix`` under ``-W error`` with a misspelled variable raises; the next import
    (the user's own, after a start-up hook's failed one) raises again rather than leave the shim
    silently off, and once it succeeds the shim is on."""
    code = (
        "import warnings\n"
        "import torch\n"
        "warnings.simplefilter('error', RuntimeWarning)\n"
        "for attempt in range(2):\n"
        "    try:\n"
        "        import amp_bn_fix\n"
        "    except RuntimeWarning as warning:\n"
        "        assert 'AMP_BN_FIX_POLCY' in str(warning), warning\n"
        "    else:\n"
        "        raise SystemExit(f'import {attempt} did not raise')\n"
        "warnings.simplefilter('ignore', RuntimeWarning)\n"
        "import amp_bn_fix\n"
        "assert amp_bn_fix.is_enabled()\n"
    )
    result = subprocess.run([sys.executable, "-c", code], env=child_env(AMP_BN_FIX_POLCY="input"), capture_output=True,
                            text=True, timeout=SUBPROCESS_TIMEOUT)
    assert result.returncode == 0, result.stderr
