"""Run at start-up by ``amp-bn-fix run``: start amp_bn_fix's hook, then the sitecustomize this shadows.

Python imports the first ``sitecustomize`` on the path; a system (Debian ships one) or a user's own
must still run, so this one imports the next one found once its own folder is off the path.

Every Python the command starts reads this file, a Python 2 tool's too: it is written in the
syntax both read (no annotations, no f-strings), and starts the hook only on Python 3.6 and later.
"""

import os
import sys


def _say(line):
    """``line`` on stderr, written directly, where the process has one (not with stderr closed)."""
    try:
        sys.stderr.write(line + "\n")
    except (AttributeError, OSError, ValueError):
        pass


def _start_hook():
    if "_amp_bn_fix_boot.hook" in sys.modules and sys.modules["_amp_bn_fix_boot.hook"] is None:
        return  # amp_bn_fix.pth failed to import the hook and said so
    # As amp_bn_fix.pth: any failure, BaseException included (why: hook.start), is one warning line.
    try:
        from _amp_bn_fix_boot import hook
    except BaseException as exc:
        # The warning format lives in the package that could not be imported: the same line by hand.
        if isinstance(exc, ModuleNotFoundError) and exc.name == "_amp_bn_fix_boot":
            # Another environment's interpreter, which a program started by ``amp-bn-fix run`` may
            # run too (a tool of its own): said when it looks for torch, where the shim is missed,
            # unless the process turned it off (the words amp_bn_fix.pth reads as off).
            if os.environ.get("AMP_BN_FIX", "").strip().lower() not in ("0", "false", "no", "off", ""):
                sys.meta_path.insert(0, _SaysAtImportTorch("not installed for " + sys.executable))
        else:
            _say("amp_bn_fix: start-up hook failed (%s: %s); running without the shim" % (type(exc).__name__, exc))
        return
    hook.start()  # never raises


class _SaysAtImportTorch(object):
    """An import finder that finds nothing: the first time torch is looked for (imported, or
    ``importlib.util.find_spec``), it writes one warning line. It stays on ``sys.meta_path``:
    leaving it while the import system walks that list would skip the finder after it."""

    def __init__(self, problem):
        self.problem = problem

    def find_spec(self, name, path=None, target=None):
        if name == "torch" and self.problem:
            _say("amp_bn_fix: %s; running without the shim" % self.problem)
            self.problem = ""
        return None


def _chain():
    here = os.path.dirname(os.path.abspath(__file__))
    ours = sys.modules.pop("sitecustomize", None)
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    try:
        import sitecustomize  # noqa: F401  (the next one on the path)
    except ImportError as exc:
        # Python 2's ImportError names no module: its message does.
        if getattr(exc, "name", None) != "sitecustomize" and str(exc) != "No module named sitecustomize":
            raise
        if ours is not None:
            sys.modules["sitecustomize"] = ours


if sys.version_info >= (3, 6):  # ModuleNotFoundError; amp_bn_fix itself needs 3.10
    _start_hook()
_chain()
