"""Torch-free code of amp_bn_fix: the start-up hook and the ``amp-bn-fix`` command line.

Importing ``amp_bn_fix`` imports torch and enables the shim, so what must run before torch (or
without it) lives in this separate top-level package: the hook, and the command's arguments, help,
errors and ``run``. Nothing here imports torch or wrapt at import time.
"""
