"""``gradequiv report``: render a report folder's JSON as Markdown, HTML or JUnit XML."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from gradequiv.harness.errors import InvalidArgument
from gradequiv.harness.reports.files import RENDERED, REPORT_FILE

#: Output formats and their default file names.
FORMATS = RENDERED


def run(args: Any) -> int:
    """Render the folder's JSON in the asked formats; writes are atomic, like the JSON's."""
    from gradequiv.harness.reports.bundle import load_bundle
    from gradequiv.harness.reports.files import write_text_through

    foreign, partial = (None, None) if args.require_run is None else \
        run_problems(_raw_report(args.folder), args.require_run)
    if foreign is not None:  # another run's verdict is never rendered (or read) as this one's
        print(f"gradequiv report: {foreign}", file=sys.stderr)
        return 1
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
    _refuse_foreign_views(args.folder, [] if args.output else
                          [args.folder / FORMATS[name] for name in formats])
    for name in formats:
        text = render(name, bundle)
        if args.output == "-":
            sys.stdout.write(text)
            continue
        path = Path(args.output) if args.output else args.folder / FORMATS[name]
        # Through a symlink, into a FIFO or a device as `>` would; a regular file atomically.
        write_text_through(path, text, name=f"--output={args.output!r}" if args.output
                           else repr(str(path)))
        print(f"gradequiv report: wrote {path}", file=sys.stderr)
    if partial is not None:
        print(f"gradequiv report: {partial}", file=sys.stderr)
        return 1
    if args.fail_on_verdict and bundle.verdict == "pass" and bundle.report is not None:
        from gradequiv.harness.reports.verified import why_unverified

        why = why_unverified(bundle.report)
        if why is not None:  # a pass over nothing, or over less than it says, gates nothing
            raise InvalidArgument(
                f"{str(args.folder / REPORT_FILE)!r} reads verdict 'pass' but {why}: it "
                f"verified nothing a gate can take; re-run `gradequiv check --report-dir "
                f"{args.folder}`")
    if args.fail_on_verdict and bundle.verdict != "pass":
        if bundle.verdict == "unchecked":  # a gate pointed at the wrong folder must not pass
            print(f"gradequiv report: {args.folder} holds no report.json nor mutants.json: "
                  f"nothing was checked, so --fail-on-verdict exits 1", file=sys.stderr)
        return 1
    return 0


def _refuse_foreign_views(folder: Path, paths: list[Path]) -> None:
    """In a folder a check run claimed (it keeps a manifest), a view is written only over
    one gradequiv wrote: the user's own junit.xml there is refused, exit 2, untouched."""
    from gradequiv.harness.reports.files import MANIFEST, not_written_by_us

    if not (folder / MANIFEST).is_file():
        return  # not a check's folder (a profile's, a mutants run's): its views are ours
    foreign = not_written_by_us(folder, [p for p in paths if p.exists() or p.is_symlink()])
    if foreign:
        names = ", ".join(p.name for p in foreign)
        raise InvalidArgument(f"{str(folder)!r} holds {names}, which gradequiv did not write "
                              f"(or which changed since); move it, or write the view "
                              f"elsewhere with --output PATH")


def write_views(folder: Path, names: tuple[str, ...] = tuple(FORMATS)) -> list[Path]:
    """The views (``names``: md, html, junit) beside the folder's report.json, as
    ``gradequiv report --format all`` renders them: a check's folder is whole without a
    second command. Nothing is written where there is no report.json to render."""
    from gradequiv.harness.reports.bundle import load_bundle
    from gradequiv.harness.reports.files import write_text_atomic

    if not (folder / REPORT_FILE).exists():
        return []
    bundle = load_bundle(folder)
    paths = [folder / FORMATS[name] for name in names]
    for name, path in zip(names, paths):
        write_text_atomic(path, render(name, bundle))
    return paths


def run_problems(report: dict[str, Any] | None, run_id: str) -> tuple[str | None, str | None]:
    """Why ``report`` is not run ``run_id``'s (first) or not its whole verdict (second)."""
    if report is None:
        return f"no report.json: run {run_id} wrote none (it ended before its first case?)", None
    written_by = (report.get("run") or {}).get("id")
    if written_by != run_id:
        return (f"report.json was written by run {written_by!r}, not by run {run_id!r}: a "
                f"stale or foreign report"), None
    if not report.get("complete"):
        return None, f"report.json of run {run_id} is incomplete: the run stopped before the end"
    return None, None


def _raw_report(folder: Path) -> dict[str, Any] | None:
    """report.json as it is, before the schema is checked (None when absent or not JSON):
    enough to tell whose run wrote it."""
    import json

    try:
        data = json.loads((folder / REPORT_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


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
