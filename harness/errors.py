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


#: A frame of a formatted traceback or stack: its file, line and function, and the source
#: line under it where Python printed one.
_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<function>.+)$')
#: The packages whose frames are no user's code: the harness's own, torch's, the test
#: runner's and Python's.
_NOT_USERS = ("torch", "_pytest", "pytest", "pluggy", "hypothesis", "typing_extensions")


def user_frames(traceback: str, *, limit: int = 3) -> list[str]:
    """The frames of ``traceback`` in the user's code (an implementation's file, a model's),
    innermost last, each ``file:line in function: source``; at most ``limit`` of them, the
    innermost ones. A traceback from a case runs through the harness and torch; the frame
    that says which line of the user's own file did it is what a reader needs."""
    lines = traceback.splitlines()
    found = []
    for i, line in enumerate(lines):
        match = _FRAME.match(line)
        if match is None or not is_users(match["file"]):
            continue
        source = lines[i + 1].strip() if i + 1 < len(lines) else ""
        if _FRAME.match(source) or not source or source.startswith(("^", "~")):
            source = ""
        said = f"{match['file']}:{match['line']} in {match['function']}"
        found.append(f"{said}: {source}" if source else said)
    return found[-limit:] if limit else []


def is_users(path: str) -> bool:
    """Whether a source file is the user's: not the harness's (``gradequiv.harness``,
    ``gradequiv.properties``, the segment router), not torch's nor the test runner's, not
    Python's own. A model's file is the user's, the reference models' included."""
    import sysconfig
    from pathlib import Path

    if path.startswith("<"):  # <frozen ...>, <string>
        return False
    here = Path(__file__).resolve().parent
    file = Path(path)
    # the router that calls a segment through the implementation is the harness's too
    ours = (here, here.parent / "properties", here.parent / "models" / "segments.py")
    if any(file.is_relative_to(mine) for mine in ours):
        return False
    parts = file.parts
    for marker in ("site-packages", "dist-packages"):
        if marker in parts:
            after = parts[parts.index(marker) + 1:]
            return not after or after[0].split(".")[0] not in _NOT_USERS
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return not file.is_relative_to(stdlib)
