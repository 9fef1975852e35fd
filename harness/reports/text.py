"""Text a run brings into its reports, made fit for every one of them: bounded, encodable,
printable.

Exception messages, what an implementation printed and the names of a user's modules are
the implementation's, not ours: a 5 MB message copied into every record made a report.json
of 2.7 GB, a lone surrogate ended the run before report.md was written, and an ESC
sequence cleared the terminal. Records are bounded where they are made
(:func:`bounded_texts`), and each writer shows text through :func:`printable` or its own
escaping.
"""

from __future__ import annotations

import re
from typing import Any, TypeVar

__all__ = ["FIELD_CHARS", "REPEAT_CHARS", "bounded", "bounded_texts", "encodable", "printable",
           "spelled"]

#: The most characters a report keeps of one text (a message, a traceback, a sentence).
FIELD_CHARS = 4096
#: The most it keeps of a long text that repeats one kept before it (the same exception in
#: every case, every minimal failure and every diagnosis): the text is in the report once.
REPEAT_CHARS = 512
#: Fields that are a command or a case to run again: kept whole, never cut.
WHOLE = frozenset({"reproduce", "reproduce_file", "command", "case", "minimal_case"})
#: Fields that tell one fault from another (a diagnosis's sentence): bounded, never cut
#: as a repeat, so the same fault reads the same wherever it is said.
NAMING = frozenset({"sentence"})

_SURROGATE = re.compile("[\ud800-\udfff]")
#: C0 controls but newline and tab, DEL, C1 controls (0x9b starts a terminal sequence too),
#: and lone surrogates
_UNPRINTABLE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\ud800-\udfff]")
#: a window of a kept text; a text sharing a run of twice this with one is a repeat
_WINDOW = REPEAT_CHARS // 2

Data = TypeVar("Data")


def bounded(text: str, limit: int = FIELD_CHARS) -> str:
    """``text`` whole if it has at most ``limit`` characters, else cut to ``limit`` with
    each cut said where it was made ("[... N characters cut]"): first each line longer than
    a quarter of it (a traceback keeps its frames and the line that says what was raised),
    then the middle of what is left (a message says what it is first, a traceback what was
    raised last)."""
    if len(text) <= limit:
        return text
    if "\n" in text:
        text = "\n".join(_cut(line, limit // 4) for line in text.split("\n"))
    return _cut(text, limit)


def _cut(text: str, limit: int) -> str:
    """``text``'s start and end, the cut said between them: ``limit`` characters in all."""
    if len(text) <= limit:
        return text
    room = max(limit - len(f" [... {len(text)} characters cut] "), 0)
    head, tail = (room + 1) // 2, room // 2
    cut = len(text) - head - tail
    return f"{text[:head]} [... {cut} characters cut] {text[len(text) - tail:]}"


def encodable(text: str) -> str:
    """``text`` with each lone surrogate (which no UTF-8 file can hold) replaced by U+FFFD."""
    return _SURROGATE.sub("\ufffd", text)


def printable(text: str) -> str:
    """``text`` safe to show in a terminal or a page: control characters but newline and tab
    spelled out (ESC as ``\\x1b``, CR as ``\\x0d``: neither moves a cursor) and lone
    surrogates as ``\\udxxx``."""
    return _UNPRINTABLE.sub(spelled, text)


def spelled(match: re.Match[str]) -> str:
    """The character ``match`` found, spelled out: ``\\x1b``, ``\\ud800``."""
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def bounded_texts(data: Data, *, first: tuple[str, ...] = (),
                  apart: tuple[str, ...] = ()) -> Data:
    """A copy of ``data`` (a record, a failure, a report: JSON-like) with every text in it
    :func:`encodable` and :func:`bounded`, and each long text that repeats a run of one
    before it cut to :data:`REPEAT_CHARS` (but :data:`NAMING` ones). The keys in ``first``
    are read first: theirs are the texts kept. The texts under a key in ``apart`` are
    compared among themselves only: a text is kept once there and once in the rest.
    Commands and cases (:data:`WHOLE`) are kept whole. Applied again, it changes nothing."""
    def walk(value: Any, key: str, seen: set[str]) -> Any:
        if isinstance(value, str):
            return value if key in WHOLE else _kept(value, seen, key not in NAMING)
        if isinstance(value, list):
            return [walk(item, key, seen) for item in value]
        if isinstance(value, dict):
            order = [k for k in first if k in value] + [k for k in value if k not in first]
            done = {k: value[k] if k in WHOLE else
                    walk(value[k], k, set() if k in apart else seen) for k in order}
            return {k: done[k] for k in value}  # the keys in their own order
        return value

    return walk(data, "", set())  # type: ignore[no-any-return]


def _kept(text: str, seen: set[str], cut_repeat: bool) -> str:
    """``text`` bounded and encodable, or cut short where it repeats a kept one (its windows
    in ``seen``)."""
    if len(text) <= REPEAT_CHARS:
        return encodable(text)
    kept = encodable(bounded(text))
    if cut_repeat and any(kept[i:i + _WINDOW] in seen for i in range(len(kept) - _WINDOW + 1)):
        return encodable(bounded(text, REPEAT_CHARS))
    seen.update(kept[i:i + _WINDOW] for i in range(0, len(kept) - _WINDOW + 1, _WINDOW))
    return kept
