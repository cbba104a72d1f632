"""``python -m fastopt``: the ``fastopt`` command."""

import sys

from fastopt.cli import main

sys.exit(main())
