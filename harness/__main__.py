"""``python -m gradequiv.harness`` runs the command line."""

import sys

from gradequiv.harness.cli import main

sys.exit(main())
