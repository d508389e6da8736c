"""``python -m tokenmill.engines.simulated --bind ENDPOINT ...``: the command line of :mod:`.cli`."""

import sys

from tokenmill.engines.simulated.cli import main

sys.exit(main())
