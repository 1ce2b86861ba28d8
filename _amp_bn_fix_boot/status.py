"""What start-up does in this environment, found without importing torch or amp_bn_fix.

``python -m _amp_bn_fix_boot.status`` prints one line and exits 0 when a Python process of this
environment gets the shim at ``import torch``, 1 when it does not; :func:`gather` returns the facts
to a program. ``amp-bn-fix check`` reports them too.
"""

from __future__ import annotations

import importlib.machinery
import importlib.metadata
import importlib.util
import os
import re
import site
import sys
from typing import List, NamedTuple, Optional, Tuple

from . import settings
from .names import BOOTSTRAP_DIR, ENV_ENABLE, PACKAGE, START_FILES


class StartupStatus(NamedTuple):
    start_files: List[str]  # the start files found in this interpreter's site directories
    bootstrap_on_path: bool  # ``amp-bn-fix run``'s bootstrap folder is on PYTHONPATH
    switch: Optional[str]  # AMP_BN_FIX as set, None when unset
    requested: bool  # AMP_BN_FIX asks for the shim
    switch_readable: bool  # AMP_BN_FIX is unset or a valid value
    unknown: List[Tuple[str, Optional[str]]]  # misspelled AMP_BN_FIX_* names, with the closest valid one
    problems: List[str]  # why a process asking for the shim would not get it
    policy_off: bool  # AMP_BN_FIX_POLICY=off: the hook's import of the package installs nothing

    @property
    def broken(self) -> bool:
        """Whether a process asking for the shim would not get it, or ``AMP_BN_FIX`` cannot be read
        (``amp-bn-fix check`` exits with 1). Without ``AMP_BN_FIX`` nothing asks, and nothing is broken."""
        return not self.switch_readable or (self.requested and bool(self.problems))

    @property
    def will_enable(self) -> bool:
        """Whether ``import torch`` enables the shim in a process of this environment."""
        return self.requested and not self.problems and not self.policy_off


def shadowing_folder(path: Optional[List[str]] = None) -> Optional[str]:
    """The folder that ``import amp_bn_fix`` takes for the package, if it is not the package: in
    this process (``path`` None), or at the first import of a process whose search path is ``path``.

    A folder named ``amp_bn_fix`` without an ``__init__.py`` on the search path (a clone of that
    name seen from its parent, the working directory) imports as an empty namespace package: the
    path finder comes before the finder an editable install adds.
    """
    if path is None:
        spec = importlib.util.find_spec(PACKAGE)
    else:
        spec = importlib.machinery.PathFinder.find_spec(PACKAGE, path)
    if spec is None or spec.origin not in (None, "namespace"):
        return None
    locations = list(spec.submodule_search_locations or [])
    return locations[0] if locations else None


def describe_shadowing(folder: str) -> str:
    return (f"the folder {folder} shadows the installed {PACKAGE} package (it has no __init__.py): "
            "run from another directory, or rename it")


def missing_requirements() -> List[str]:
    """The requirements of the installed package (its metadata's; the extras' left out) of which no
    module of that name can be imported here (torch, wrapt: each module named as its distribution,
    found also where it was put on the path without metadata): ``import torch`` would not get the
    shim without them (a ``pip install --no-deps``). Versions are not compared; the hook says what
    fails at import."""
    try:
        required = importlib.metadata.requires(PACKAGE) or []
    except importlib.metadata.PackageNotFoundError:  # a source tree on the path: no metadata
        return []
    names = {requirement: re.split(r"[\s<>=!~\[(]", requirement, maxsplit=1)[0]
             for requirement in required if ";" not in requirement}  # not an extra's (or a marker's)
    return [requirement for requirement, name in names.items() if importlib.util.find_spec(name) is None]


def _site_directories() -> List[str]:
    directories = list(site.getsitepackages()) if hasattr(site, "getsitepackages") else []
    if site.ENABLE_USER_SITE:
        directories.append(site.getusersitepackages())
    return directories


def gather(environ: Optional[dict] = None) -> StartupStatus:
    environ = dict(os.environ if environ is None else environ)
    files = [os.path.join(d, n) for d in _site_directories() for n in START_FILES if os.path.isfile(os.path.join(d, n))]
    bootstrap = BOOTSTRAP_DIR in environ.get("PYTHONPATH", "").split(os.pathsep)
    problems: List[str] = []
    requested, switch_readable = False, True
    try:
        requested = settings.hook_requested(environ)
    except ValueError as exc:
        problems.append(str(exc))
        switch_readable = False
    policy_off = False
    try:
        policy_off = settings.from_env(environ).policy == "off"
    except ValueError as exc:
        problems.append(str(exc))
    if not files and not bootstrap:
        problems.append(
            f"the start-up hook is not in a site directory of {sys.executable} ({PACKAGE} installed with "
            f"--target, or copied): reinstall it with {sys.executable} -m pip, or start the program "
            "with amp-bn-fix run"
        )
    for requirement in missing_requirements():
        problems.append(f"{PACKAGE} needs {requirement}, which is not installed for {sys.executable}")
    # A process started here with ``-c`` or ``-m`` searches the working directory first; this one may
    # be a console script (its own folder first) that has imported the package already.
    folder = shadowing_folder([os.getcwd(), *sys.path[1:]])
    if folder is not None:
        problems.append(describe_shadowing(folder))
    return StartupStatus(files, bootstrap, environ.get(ENV_ENABLE), requested, switch_readable,
                         settings.unknown_names(environ), problems, policy_off)


def summary(status: StartupStatus) -> str:
    """One line: whether ``import torch`` enables the shim here, and if not, why."""
    if status.will_enable:
        return f"{PACKAGE}: the shim is enabled when a Python process of this environment imports torch"
    if status.requested or not status.switch_readable:
        if status.problems:
            return f"{PACKAGE}: not enabled at import torch: " + "; ".join(status.problems)
        return f"{PACKAGE}: off: {settings.BY_NAME['policy'].env}=off (import torch loads it, and it installs nothing)"
    # Nothing asks for the shim: that is the reason; what else stands in the way follows it.
    given = [s.env for s in settings.SETTINGS if s.scope != "hook" and s.env in os.environ]
    note = f" ({', '.join(given)} set, but they apply only with it)" if given else ""
    also = f"; with it, also: {'; '.join(status.problems)}" if status.problems else ""
    return f"{PACKAGE}: off: {ENV_ENABLE} is not set to 1{note}{also}"


def main() -> int:
    status = gather()
    print(summary(status))
    if status.unknown:
        print(f"{PACKAGE}: {settings.describe_unknown(status.unknown)}")
    return 0 if status.will_enable else 1


if __name__ == "__main__":
    sys.exit(main())
