"""The one exception type for a caller's mistake, the exit codes (a contract), and the line
of a traceback that names what was raised."""

from __future__ import annotations

import re


class InvalidArgument(ValueError):
    """A bad value from the caller: the message names it, the rule and a fix.

    The command line turns it into exit code 2 and one line of text.
    """


#: 0 every property held; 1 a property failed; 2 a usage error (an InvalidArgument);
#: 130 interrupted (Ctrl-C or SIGTERM).
EXIT_PASS, EXIT_FAIL, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


#: A line naming a raised exception: ``RuntimeError: ...``, ``torch.utils.checkpoint.
#: CheckpointError: ...``, ``KeyboardInterrupt``.
_RAISED = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt|Warning)\b(:|$)")


def exception_line(traceback: str) -> str:
    """The last line of ``traceback`` that names the exception raised, where a message
    runs over several lines (torch's checkpoint ends its own with tips); else its last
    line."""
    lines = [line.strip() for line in traceback.strip().splitlines() if line.strip()]
    return next((line for line in reversed(lines) if _RAISED.match(line)),
                lines[-1] if lines else "")
