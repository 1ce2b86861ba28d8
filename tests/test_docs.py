"""The documentation: the public API's docstring examples run, every link resolves, and docs/ names
exactly the settings, commands and options the code has.

The code side comes from the code itself, through ``code_settings`` and ``code_commands`` below (the
settings table's ``ENV_NAMES``, the ``amp-bn-fix`` argparse parser): repoint those two if the
code moves. The docs side is read from the reference tables of docs/configuration.md and
docs/cli.md. A table row marked ``<!-- pending -->`` documents something that is not in the code
yet: it must not be in the code, and once it is, the marker has to go.
"""

import argparse
import doctest
import os
import pathlib
import re
import subprocess
import sys
import warnings

import pytest

import amp_bn_fix
import amp_bn_fix.testing
from _amp_bn_fix_boot import cli, settings

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
REPOSITORY = "https://github.com/amp-bn-fix/amp_bn_fix"
PENDING = "<!-- pending -->"


def code_settings():
    """The environment variables the code reads."""
    return set(settings.ENV_NAMES)


def code_commands():
    """{command: its long options} for ``amp-bn-fix`` ("" for the top level), from its argparse parser."""

    def options(parser):
        return {option for action in parser._actions if not isinstance(action, argparse._HelpAction)
                for option in action.option_strings if option.startswith("--")}

    parser = cli.build_parser()
    commands = {"": options(parser)}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            commands.update({name: options(sub) for name, sub in action.choices.items()})
    return commands


# ------------------------------------------------------------------------------ docstring examples

# Where the public API is documented: the package (Config included: it is public there, and says
# so in its __module__), its testing helpers, and the settings module it comes from.
MODULES = [amp_bn_fix, amp_bn_fix.testing, settings]


def examples(module):
    # Empty globals: an example that leans on a name it did not import or define fails.
    return [test for test in doctest.DocTestFinder().find(module, globs={}) if test.examples]


@pytest.fixture
def saved_settings():
    """The process-wide settings and the patch, put back as they were after the examples."""
    installed = amp_bn_fix.is_enabled()
    with amp_bn_fix.configure():
        yield
    (amp_bn_fix.enable if installed else amp_bn_fix.disable)()


@pytest.mark.parametrize("module", MODULES, ids=lambda m: m.__name__)
def test_docstring_examples(module, saved_settings):
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    for test in examples(module):
        runner.run(test)
    results = runner.summarize(verbose=False)
    assert results.failed == 0, f"{results.failed} of {results.attempted} docstring examples in {module.__name__} failed"


def test_the_public_api_is_documented_with_examples():
    documented = {test.name.rpartition(".")[2] for module in MODULES for test in examples(module)}
    for name in ("enable", "disable", "is_enabled", "get_policy", "set_policy", "policy", "configure", "get_config",
                 "Config", "describe", "device_route", "count_kernels", "kept_for_backward"):
        assert name in documented, f"{name} has no docstring example"


# ------------------------------------------------------------------------------------------- links

PAGES = [ROOT / "README.md", ROOT / "CHANGELOG.md", ROOT / "examples" / "README.md", *sorted(DOCS.glob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def anchors(page):
    """The heading anchors GitHub gives a Markdown page."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    titles = re.findall(r"^#{1,6} (.+)$", text, flags=re.M)
    return {re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-") for title in titles}


def links():
    for page in PAGES:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target in LINK.findall(text):
            yield page, target


def local_target(page, target):
    """The file and anchor ``target`` points to in this repository, or None for a link elsewhere."""
    for prefix in (f"{REPOSITORY}/blob/main/", f"{REPOSITORY}/tree/main/"):
        if target.startswith(prefix):
            path, _, anchor = target[len(prefix):].partition("#")
            return ROOT / path, anchor
    if re.match(r"[a-z]+:", target):
        return None
    path, _, anchor = target.partition("#")
    return (page.parent / path if path else page), anchor


def test_the_pages_exist():
    names = {page.name for page in DOCS.glob("*.md")}
    assert {"README.md", "configuration.md", "cli.md", "api.md", "how-it-works.md", "compatibility.md",
            "performance.md", "faq.md", "contributing.md"} <= names


def test_every_link_into_the_repository_resolves():
    broken = []
    for page, target in links():
        local = local_target(page, target)
        if local is None:
            continue
        path, anchor = local
        if not path.exists():
            broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_the_readme_links_absolutely_so_that_it_works_on_an_index_page():
    # The README is the package's long description: relative links would break there.
    relative = [target for page, target in links() if page.name == "README.md" and page.parent == ROOT
                and not re.match(r"[a-z]+:", target)]
    assert not relative, f"relative links in README.md: {relative}"


# ------------------------------------------------------------- settings, commands and options

def table_rows(text):
    """The first cell of each row of the Markdown tables in ``text``, with whether the row is pending."""
    for line in text.splitlines():
        if line.startswith("|") and not re.match(r"\|[-| :]+\|$", line):
            yield line.split("|")[1].strip(), PENDING in line


def documented(rows, pattern):
    """({names in the rows' first cells}, {those marked pending})."""
    names, pending = set(), set()
    for cell, is_pending in rows:
        match = re.match(pattern, cell)
        if match:
            (pending if is_pending else names).add(match.group(1))
    return names, pending


def cli_sections():
    """{command: its section of docs/cli.md} ("" for the ``amp-bn-fix`` section itself)."""
    parts = re.split(r"^## `amp-bn-fix ?([a-z-]*)`$", (DOCS / "cli.md").read_text(), flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


def test_every_setting_is_documented_and_every_documented_one_exists():
    names, pending = documented(table_rows((DOCS / "configuration.md").read_text()), r"`(AMP_BN_FIX\w*)`")
    code = code_settings()
    assert code - names - pending == set(), "settings the code reads but docs/configuration.md does not list"
    assert names - code == set(), "settings docs/configuration.md lists but the code does not read"
    assert pending & code == set(), f"in the code now: remove the {PENDING} marker of these rows"


def test_the_readme_lists_every_setting():
    readme, _ = documented(table_rows((ROOT / "README.md").read_text()), r"`(AMP_BN_FIX\w*)`")
    _, pending = documented(table_rows((DOCS / "configuration.md").read_text()), r"`(AMP_BN_FIX\w*)`")
    assert code_settings() - readme == set(), "settings missing from the README's table"
    assert readme - code_settings() - pending == set(), "settings in the README's table that the code does not read"


def test_every_command_and_option_is_documented_and_every_documented_one_exists():
    code, sections = code_commands(), cli_sections()
    assert set(sections) == set(code), "the commands of docs/cli.md (its `amp-bn-fix ...` sections) and the code's"
    for command, text in sections.items():
        names, pending = documented(table_rows(text), r"`(--[a-z0-9-]+)")
        where = f"amp-bn-fix {command}".strip()
        assert code[command] - names - pending == set(), f"options of {where} missing from docs/cli.md"
        assert names - code[command] == set(), f"options of {where} in docs/cli.md but not in the code"
        assert pending & code[command] == set(), f"in the code now: remove the {PENDING} marker of these rows"


def test_commands_named_anywhere_in_the_docs_exist():
    commands = set(code_commands()) - {""}
    for page in PAGES:
        for name in re.findall(r"\bamp-bn-fix ([a-z][a-z-]*)\b", page.read_text()):
            assert name in commands, f"{page.relative_to(ROOT)} names `amp-bn-fix {name}`"


def test_the_error_lines_the_docs_quote_are_the_commands():
    # docs/cli.md and docs/configuration.md show what a bad setting prints: the command's own line.
    quoted = [line for page in ("cli.md", "configuration.md") for line in (DOCS / page).read_text().splitlines()
              if line.strip().startswith("amp-bn-fix: error: ")]
    assert quoted, "no error line quoted"
    for line in quoted:
        variable, value = re.match(r"amp-bn-fix: error: (\w+)='(\w+)'", line.strip()).groups()
        (problem,) = settings.problems({variable: value})
        assert line.strip() == f"{cli.PROG}: error: {problem} (from the environment)"



# ------------------------------------------------------------------------- code examples in pages

# A Python block of a page, with what an HTML comment just before it gives: ``<!-- setup: CODE -->``
# runs first (names a fragment leans on: a model, a batch), ``<!-- requires: MODULE -->`` skips the
# block where that module is not installed.
BLOCK = re.compile(r"(?:<!-- (setup|requires): (.*?) -->\n)?```python\n(.*?)```", flags=re.S)
CODE_PAGES = [ROOT / "README.md", ROOT / "examples" / "README.md", *sorted(DOCS.glob("*.md"))]


def code_blocks():
    for page in CODE_PAGES:
        for number, (kind, value, code) in enumerate(BLOCK.findall(page.read_text())):
            yield pytest.param(kind, value, code, id=f"{page.relative_to(ROOT)}:{number}")


@pytest.mark.parametrize("kind, value, code", list(code_blocks()))
def test_every_python_example_in_the_pages_runs(kind, value, code, saved_settings, capsys):
    if kind == "requires":
        pytest.importorskip(value)
    namespace = {"__name__": "__doc_example__"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # CUDA examples on a machine without CUDA warn and run on CPU
        if kind == "setup":
            exec(compile(value, "<setup>", "exec"), namespace)
        exec(compile(code, "<example>", "exec"), namespace)


def test_the_examples_print_what_the_pages_say():
    # The outputs quoted in comments, for the examples whose output is stated exactly.
    for page, number, expected in [("README.md", 0, "[torch.bfloat16, torch.float32, torch.bfloat16]"),
                                   ("docs/see-it-work.md", 0, "{'1': torch.float32}"),
                                   ("docs/see-it-work.md", 1, "0 3 {}\n1 3 {'1': 1}")]:
        code = BLOCK.findall((ROOT / page).read_text())[number][2]
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                              env={k: v for k, v in os.environ.items() if not k.startswith("AMP_BN_FIX")})
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == expected, (page, number, done.stdout)
