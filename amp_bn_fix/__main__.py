"""``python -m amp_bn_fix``: the command-line interface."""

import sys

from ._cli import main

sys.exit(main())
