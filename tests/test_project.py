"""The README quick start and CI run the same commands."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent


def quick_start_commands():
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    return [block.strip() for block in re.findall(r"```bash\n(.*?)```", section, flags=re.S)]


def test_ci_runs_the_readme_quick_start_verbatim():
    commands = quick_start_commands()
    assert len(commands) == 2  # set-up + demo, then the tests
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    for command in commands:
        assert command in ci, f"{command!r} from README.md is not a line of .ci/run"
    assert "pytest" in commands[1]
