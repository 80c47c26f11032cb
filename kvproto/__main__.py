"""``python -m kvproto``: the ``kvproto`` command (``kvproto.cli``)."""

import sys

from kvproto.cli import main

sys.exit(main())
