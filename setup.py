"""Ship ``amp_bn_fix.pth`` and ``amp_bn_fix.start`` (the start-up hook) at the top of site-packages.

Python only reads these files from a site directory itself, where package data cannot go. Their
text comes from ``_amp_bn_fix_boot/names.py``. build_py writes them next to the packages of a
wheel; setuptools' editable wheel ships no build output, so the files are added to it afterwards
(listed in RECORD, so uninstalling removes them). Everything else is in setup.cfg.
"""

import base64
import hashlib
import os
import sys
import zipfile
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # the build environment has not installed the (torch-free) boot package
from _amp_bn_fix_boot import names as NAMES  # noqa: E402

START_FILES = {NAMES.PTH_FILE: NAMES.PTH_TEXT.encode(), NAMES.START_FILE: NAMES.START_TEXT.encode()}


class build_py_with_start_files(build_py):
    def run(self):
        super().run()
        for name, data in START_FILES.items():
            Path(self.build_lib, name).write_bytes(data)

    def get_outputs(self, include_bytecode=True):
        return [*super().get_outputs(include_bytecode), *(os.path.join(self.build_lib, n) for n in START_FILES)]


class editable_wheel_with_start_files(editable_wheel):
    def run(self):
        super().run()
        wheels = list(Path(self.dist_dir).glob("*.whl"))
        if not wheels:
            raise RuntimeError(f"no editable wheel found in {self.dist_dir}")
        for wheel in wheels:
            add_to_wheel(wheel, START_FILES)


def add_to_wheel(wheel: Path, files) -> None:
    """Rewrite ``wheel`` with ``files`` (name: bytes) at its root and in its RECORD."""
    with zipfile.ZipFile(wheel) as old:
        members = [(info, old.read(info)) for info in old.infolist()]
    entries = []
    added = []
    for name, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        entries.append(f"{name},sha256={digest},{len(data)}\n".encode())
        added.append((name, data))
    temporary = wheel.with_name(wheel.name + ".part")
    with zipfile.ZipFile(temporary, "w", zipfile.ZIP_DEFLATED) as new:
        for name, data in added:
            new.writestr(name, data)
        for info, data in members:
            if info.filename.endswith(".dist-info/RECORD"):
                data = data.rstrip(b"\n") + b"\n" + b"".join(entries)
            new.writestr(info, data)
    temporary.replace(wheel)


setup(cmdclass={"build_py": build_py_with_start_files, "editable_wheel": editable_wheel_with_start_files})
