"""``python -m lockstep`` is the ``lockstep`` command."""

import sys

from lockstep.cli.main import main

sys.exit(main())
