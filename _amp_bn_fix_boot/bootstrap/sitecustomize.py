"""Run at start-up by ``amp-bn-fix run``: start amp_bn_fix's hook, then the sitecustomize this shadows.

Python imports the first ``sitecustomize`` on the path; a system (Debian ships one) or a user's own
must still run, so this one imports the next one found once its own folder is off the path.
"""

import os
import sys


def _start_hook() -> None:
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
                sys.meta_path.insert(0, _SaysAtImportTorch(f"not installed for {sys.executable}"))
        else:
            sys.stderr.write(f"amp_bn_fix: start-up hook failed ({type(exc).__name__}: {exc}); "
                             "running without the shim\n")
        return
    hook.start()  # never raises


class _SaysAtImportTorch:
    """An import finder that finds nothing: the first time torch is looked for (imported, or
    ``importlib.util.find_spec``), it writes one warning line. It stays on ``sys.meta_path``:
    leaving it while the import system walks that list would skip the finder after it."""

    def __init__(self, problem: str) -> None:
        self.problem = problem

    def find_spec(self, name: str, path: object = None, target: object = None) -> None:
        if name == "torch" and self.problem:
            sys.stderr.write(f"amp_bn_fix: {self.problem}; running without the shim\n")
            self.problem = ""
        return None


def _chain() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    ours = sys.modules.pop("sitecustomize", None)
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    try:
        import sitecustomize  # noqa: F401  (the next one on the path)
    except ModuleNotFoundError as exc:
        if exc.name != "sitecustomize":
            raise
        if ours is not None:
            sys.modules["sitecustomize"] = ours


_start_hook()
_chain()
