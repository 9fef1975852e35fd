"""The one exception type for a caller's mistake, and the exit codes (a contract)."""

from __future__ import annotations


class InvalidArgument(ValueError):
    """A bad value from the caller: the message names it, the rule and a fix.

    The command line turns it into exit code 2 and one line of text.
    """


#: 0 every property held; 1 a property failed; 2 a usage error (an InvalidArgument);
#: 130 interrupted (Ctrl-C or SIGTERM).
EXIT_PASS, EXIT_FAIL, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
