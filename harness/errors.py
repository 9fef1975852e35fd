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


#: Refusals torch's own checkpoint makes by design, loudly, of a training pattern its
#: kind cannot serve: the words of its message, and what it refuses. A case that meets one
#: is not applicable, never a failure, where torch's code raised it; the same words raised
#: by a user's code still need a declaration. (The reentrant checkpoint's refusal of
#: torch.autograd.grad is not one: a checkpoint chose that kind, and declares it.)
_TORCH_REFUSALS = (
    ("Trying to backward an extra time",
     "torch's selective activation checkpoint refuses a second backward pass over one "
     "forward, by design"),
)
#: The file torch's checkpoint is written in, as a traceback names it.
_TORCH_CHECKPOINT = re.compile(r'File "[^"]*[\\/]torch[\\/]utils[\\/]checkpoint\.py"')


def torch_refusal(traceback: str) -> str:
    """What torch's own checkpoint refused by design where ``traceback`` was raised in its
    code (its innermost frame), with torch's message; "" for any other error."""
    frames = [line for line in traceback.splitlines() if line.lstrip().startswith("File ")]
    if not frames or not _TORCH_CHECKPOINT.search(frames[-1]):
        return ""
    raised = exception_line(traceback)
    return next((f"{what} ({raised})" for words, what in _TORCH_REFUSALS if words in raised),
                "")
