"""``gradequiv report``: render a report folder's JSON as Markdown, HTML or JUnit XML."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from gradequiv.harness.errors import InvalidArgument

#: Output formats and their default file names.
FORMATS = {"md": "report.md", "html": "report.html", "junit": "junit.xml"}


def run(args: Any) -> int:
    """Render the folder's JSON in the asked formats; writes are atomic, like the JSON's."""
    from gradequiv.harness.reports.bundle import load_bundle
    from gradequiv.harness.reports.report import write_text_atomic

    bundle = load_bundle(args.folder)
    formats = list(FORMATS) if args.format == "all" else [args.format]
    if args.output is not None and len(formats) > 1:
        raise InvalidArgument(f"--output={args.output!r} names one file but --format=all "
                              f"writes {len(formats)}; add --format md, html or junit")
    if "junit" in formats and bundle.report is None:
        if args.format == "junit":
            raise InvalidArgument(f"--format junit needs {args.folder / 'report.json'}, "
                                  f"written by `gradequiv check --report-dir {args.folder}`")
        formats.remove("junit")
    for name in formats:
        text = render(name, bundle)
        if args.output == "-":
            sys.stdout.write(text)
            continue
        path = Path(args.output) if args.output else args.folder / FORMATS[name]
        write_text_atomic(path, text)
        print(f"gradequiv report: wrote {path}", file=sys.stderr)
    if args.fail_on_verdict and bundle.verdict != "pass":
        return 1
    return 0


def render(name: str, bundle: Any) -> str:
    """One format of a loaded report folder."""
    if name == "md":
        from gradequiv.harness.reports.markdown import render_markdown

        return render_markdown(bundle)
    if name == "html":
        from gradequiv.harness.reports.html_page import render_html

        return render_html(bundle)
    from gradequiv.harness.reports.junit import render_junit

    return render_junit(bundle.report)
