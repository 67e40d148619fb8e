"""``python -m composer_diloco.policy``: see :mod:`composer_diloco.policy.cli`."""

import sys

from composer_diloco.policy.cli import main

sys.exit(main())
