"""``python -m app.cli``: the ``tandem`` command."""

import sys

from app.cli import main

sys.exit(main())
