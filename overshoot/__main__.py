"""`python -m overshoot` runs the command line."""

import sys

from overshoot.cli import main

sys.exit(main())
