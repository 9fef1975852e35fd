"""Print the README's set-up commands, one a line: the lines of the first code block of its
"Quick start", word for word, so that CI runs what a newcomer reads (ci/readme-setup.sh)."""

from __future__ import annotations

import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def setup_commands(text: str) -> list[str]:
    """The non-empty lines of the first fenced block after ``## Quick start``."""
    start = text.index("## Quick start")
    opening = text.index("```", start)
    body = text.index("\n", opening) + 1
    return [line for line in text[body:text.index("```", body)].splitlines() if line.strip()]


if __name__ == "__main__":
    sys.stdout.write("".join(f"{line}\n" for line in setup_commands(README.read_text("utf-8"))))
