"""The project around the code: the README quick start and CI, packaging metadata, licence, changelog."""

import configparser
import pathlib
import re
import subprocess
import sys
import tarfile
import zipfile

import pytest

import amp_bn_fix
from _shared import SUBPROCESS_TIMEOUT

ROOT = pathlib.Path(__file__).resolve().parent.parent


def readme_section(title):
    return (ROOT / "README.md").read_text().split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def quick_start_lines():
    blocks = re.findall(r"```bash\n(.*?)```", readme_section("Quick start"), flags=re.S)
    return [line.strip() for block in blocks for line in block.splitlines() if line.strip()]


def setup_cfg():
    parser = configparser.ConfigParser()
    parser.read(ROOT / "setup.cfg")
    return parser


def test_ci_runs_the_readme_quick_start_verbatim():
    lines = quick_start_lines()
    clone = [line for line in lines if line.startswith("git clone")]
    quick = [line for line in lines if "not slow" in line]
    commands = [line for line in lines if line not in clone + quick]
    assert len(commands) == 2  # set-up + demo, then the tests
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    for command in commands:
        assert command in ci, f"{command!r} from README.md is not a line of .ci/run"
    assert ci.index(commands[0]) < ci.index(commands[1])
    assert "amp-bn-fix demo" in commands[0]
    assert "pytest" in commands[1] and " -m " not in commands[1].split("pytest", 1)[1]  # the whole suite
    assert "set -euo pipefail" in (ROOT / ".ci" / "run").read_text()  # a failing command fails CI


def test_ci_runs_the_suite_on_the_oldest_and_newest_python_and_torch():
    (floor,) = re.findall(r"^torch>=([\d.]+)$", setup_cfg()["options"]["install_requires"], flags=re.M)
    runs = re.findall(r"tools/test_on_torch\.sh --python \"\$\(find_python ([\d.]+)\)\" (\S+)$",
                      (ROOT / ".ci" / "run").read_text(), flags=re.M)
    (oldest_python, oldest_torch), (newest_python, _) = runs
    assert oldest_torch.startswith(floor + ".")
    classifiers = setup_cfg()["metadata"]["classifiers"]
    claimed = re.findall(r"Programming Language :: Python :: (3\.\d+)$", classifiers, flags=re.M)
    assert (oldest_python, newest_python) == (claimed[0], claimed[-1])  # the range the classifiers claim


def test_the_torch_version_script_keeps_its_environment_outside_the_clone():
    script = ROOT / "tools" / "test_on_torch.sh"
    result = subprocess.run([str(script), "2.4.1", str(ROOT / "venv")], capture_output=True, text=True,
                            timeout=SUBPROCESS_TIMEOUT)
    assert result.returncode == 2 and "outside the clone" in result.stderr
    assert not (ROOT / "venv").exists()


def test_the_quick_start_clones_the_project_url_and_has_a_quick_loop():
    lines = quick_start_lines()
    (clone,) = [line for line in lines if line.startswith("git clone")]
    url = setup_cfg()["metadata"]["url"]
    # Into a folder that is not the package's name, which would shadow the installed package.
    assert clone == f"git clone {url} amp-bn-fix && cd amp-bn-fix"
    (quick,) = [line for line in lines if "not slow" in line]
    assert quick == '.venv/bin/python -m pytest -q -m "not slow"'
    assert "slow:" in (ROOT / "pyproject.toml").read_text()  # the marker is registered


def test_metadata():
    config = setup_cfg()
    metadata, options = config["metadata"], config["options"]
    assert metadata["license_expression"] == "BSD-3-Clause" and metadata["license_files"].split() == ["LICENSE"]
    assert "license" not in metadata  # PEP 639: the SPDX expression alone
    assert metadata["author"] == "amp_bn_fix authors"
    classifiers = metadata["classifiers"].split("\n")
    for wanted in ("Framework :: PyTorch", "Typing :: Typed", "Programming Language :: Python :: 3.11"):
        assert wanted in classifiers
    assert not [c for c in classifiers if c.startswith("License ::")]  # deprecated by PEP 639
    assert options["python_requires"] == ">=3.10"
    # Each tested Python version's classifier is within python_requires.
    versions = [c.rsplit(" :: ", 1)[1] for c in classifiers if re.fullmatch(r"Programming Language :: Python :: 3\.\d+", c)]
    assert all(tuple(map(int, v.split("."))) >= (3, 10) for v in versions)


def test_the_extras_have_what_the_tests_and_the_examples_import():
    extras = setup_cfg()["options.extras_require"]
    names = {extra: {re.split(r"[<>=!~ ]", line.strip())[0] for line in extras[extra].splitlines() if line.strip()}
             for extra in extras}
    assert {"pytest", "hypothesis", "setuptools", "numpy", "expecttest"} <= names["test"]
    assert {"matplotlib", "tqdm"} <= names["examples"]


def test_licence_and_changelog():
    licence = (ROOT / "LICENSE").read_text()
    assert licence.startswith("BSD 3-Clause License") and "the amp_bn_fix authors" in licence
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert "Keep a Changelog" in changelog
    assert f"## [{amp_bn_fix.__version__}]" in changelog


@pytest.mark.slow
def test_the_wheel_and_the_sdist_carry_the_licence(tmp_path):
    # The backend as pip would call it, on a copy of the project as a clone has it.
    project = tmp_path / "project"
    tracked = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True)
    files = tracked.stdout.split() if tracked.returncode == 0 else []
    if not files:
        pytest.skip("not a git checkout")
    for name in files:
        source = ROOT / name
        if source.is_file():
            (project / name).parent.mkdir(parents=True, exist_ok=True)
            (project / name).write_bytes(source.read_bytes())
    dist = tmp_path / "dist"
    code = ("import sys; from setuptools import build_meta as b; "
            "out = sys.argv[1]; w = b.build_wheel(out); s = b.build_sdist(out); print('built', w, s)")
    result = subprocess.run([sys.executable, "-c", code, str(dist)], cwd=project, capture_output=True, text=True,
                            timeout=SUBPROCESS_TIMEOUT)
    assert result.returncode == 0, result.stderr[-3000:]
    wheel_name, sdist_name = result.stdout.strip().splitlines()[-1].split()[1:]
    licence = (ROOT / "LICENSE").read_bytes()

    wheel = zipfile.ZipFile(dist / wheel_name)
    (in_wheel,) = [n for n in wheel.namelist() if n.endswith("LICENSE") and ".dist-info/" in n]
    assert wheel.read(in_wheel) == licence
    metadata = wheel.read(next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    assert "Author: amp_bn_fix authors" in metadata and "Requires-Python: >=3.10" in metadata
    assert "Classifier: Framework :: PyTorch" in metadata and "Provides-Extra: examples" in metadata
    assert "License-Expression: BSD-3-Clause" in metadata and "Classifier: License" not in metadata

    with tarfile.open(dist / sdist_name) as sdist:
        names = sdist.getnames()
        (in_sdist,) = [n for n in names if n.count("/") == 1 and n.endswith("/LICENSE")]
        assert sdist.extractfile(in_sdist).read() == licence
        assert any(n.endswith("/CHANGELOG.md") for n in names)
        # The whole test tree or none: the tests import conftest.py and their helper scripts.
        shipped = {n.split("/", 1)[1] for n in names if "/" in n}
        assert {str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("*.py")} <= shipped
