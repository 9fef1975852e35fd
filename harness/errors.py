"""The one exception type for a caller's mistake."""

from __future__ import annotations


class InvalidArgument(ValueError):
    """A bad value from the caller: the message names it, the rule and a fix.

    The command line turns it into exit code 2 and one line of text.
    """
