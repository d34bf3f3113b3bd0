"""``python -m edgeinfer`` is the ``edgeinfer`` command."""

import sys

from .cli import main

sys.exit(main())
