"""``python -m amp_bn_fix``: the ``amp-bn-fix`` command line."""

import sys

from _amp_bn_fix_boot.cli import main

sys.exit(main())
