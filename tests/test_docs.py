"""The examples in the docstrings of the public API run as written, each on its own."""

import doctest

import pytest

import amp_bn_fix
from amp_bn_fix import _config, _patch

# Where the public API is documented: the package, and Config (defined in _config).
MODULES = [amp_bn_fix, _config]


def examples(module):
    # Empty globals: an example that leans on a name it did not import or define fails.
    return [test for test in doctest.DocTestFinder().find(module, globs={}) if test.examples]


@pytest.fixture
def saved_settings():
    """The process-wide settings and the patch, put back as they were after the examples."""
    config, installed = _patch.current_config(), _patch.is_installed()
    yield
    _patch.configure(config)
    (_patch.install if installed else _patch.uninstall)()


@pytest.mark.parametrize("module", MODULES, ids=lambda m: m.__name__)
def test_docstring_examples(module, saved_settings):
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    for test in examples(module):
        runner.run(test)
    results = runner.summarize(verbose=False)
    assert results.failed == 0, f"{results.failed} of {results.attempted} docstring examples in {module.__name__} failed"


def test_the_public_api_is_documented_with_examples():
    documented = {test.name.rpartition(".")[2] for module in MODULES for test in examples(module)}
    for name in ("enable", "disable", "is_enabled", "get_policy", "set_policy", "policy", "get_config", "describe"):
        assert name in documented, f"{name} has no docstring example"
