"""``python -m gradequiv.harness`` runs the command line."""

from gradequiv.harness.cli import entry

entry()
