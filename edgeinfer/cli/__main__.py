"""``python -m edgeinfer.cli`` is the ``edgeinfer`` command."""

import sys

from .main import main

sys.exit(main())
