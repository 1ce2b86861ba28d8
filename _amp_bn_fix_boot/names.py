"""Every name amp_bn_fix's start-up and settings share, spelled once.

Imported by the start-up hook, the settings parser, the command line, ``setup.py`` (which writes
the start files from :data:`PTH_TEXT` and :data:`START_TEXT`) and the package itself. Imports
nothing but ``os``, so the ``.pth`` line and the hook stay cheap. The settings' own variables are
in the settings table (``settings.SETTINGS``); only the hook's switch, which the ``.pth`` line
reads, is spelled here.
"""

import os

PACKAGE = "amp_bn_fix"
COMMAND = "amp-bn-fix"

# The start-up hook's switch; every other variable amp_bn_fix reads is named AMP_BN_FIX_<SETTING>.
ENV_ENABLE = "AMP_BN_FIX"

ON_WORDS = ("1", "true", "yes", "on")
OFF_WORDS = ("0", "false", "no", "off", "")

# The one line a start-up problem is reported as (on stderr, written directly).
WARNING = PACKAGE + ": {problem}; running without the shim"

HOOK_MODULE = "_amp_bn_fix_boot.hook"
HOOK_FUNCTION = "start"
# Python reads these from a site directory itself (``.start`` from 3.15 on, PEP 829).
PTH_FILE = PACKAGE + ".pth"
START_FILE = PACKAGE + ".start"
START_FILES = (PTH_FILE, START_FILE)
# The folder ``amp-bn-fix run`` puts first on PYTHONPATH: its sitecustomize starts the hook.
BOOTSTRAP_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bootstrap")

# One line, as a .pth file needs: with AMP_BN_FIX off it is one environment lookup. Any failure
# (BaseException too: see hook.start) is one warning line, where the process has a stderr (closed,
# a failed write would make site print a traceback on stdout); None in sys.modules then stops a
# retry (Python 3.11 reads a venv's .pth files twice) and the launcher's sitecustomize from trying again.
PTH_TEXT = (
    "# {package}: with {enable}=1, enable the shim when torch is imported ({hook}).\n"
    "import os, sys; os.environ.get({enable!r}, '').strip().lower() in {off!r} or {hook!r} in sys.modules or "
    "exec(\"try: __import__({hook!r}).{attr}.{function}()\\nexcept BaseException as e:\\n "
    "sys.modules[{hook!r}] = None\\n try: sys.stderr.write({warning!r}.format(problem='start-up hook failed (%s: %s)' "
    "% (type(e).__name__, e)) + '\\\\n')\\n except Exception: pass\")\n"
).format(
    package=PACKAGE, enable=ENV_ENABLE, off=OFF_WORDS, hook=HOOK_MODULE, attr=HOOK_MODULE.rpartition(".")[2],
    function=HOOK_FUNCTION, warning=WARNING,
)
START_TEXT = f"{HOOK_MODULE}:{HOOK_FUNCTION}\n"
