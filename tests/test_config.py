"""Environment parsing and validation (no torch needed by the module under test)."""

import subprocess
import sys

import pytest

from _amp_bn_fix_boot import settings


def test_defaults():
    config = settings.from_env({})
    assert (config.policy, config.devices, config.keep_fp32, config.guard) == ("fp32", None, "all", True)
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
        ("AMP_BN_FIX_KEEP_FP32", "weights", "stats, all, none"),
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
    import os

    environ = {k: v for k, v in os.environ.items() if not k.startswith("AMP_BN_FIX")}
    environ.update(env)
    return subprocess.run([sys.executable, "-c", code], env=environ, capture_output=True, text=True, timeout=120)


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
