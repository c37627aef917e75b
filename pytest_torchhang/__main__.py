"""``python -m pytest_torchhang show REPORT.json`` and ``merge-hunts DIR...``: reports off-line."""

from __future__ import annotations

import argparse
import json
import sys

from .report import merge, views
from .report.model import HangReport

#: Exit statuses: a bad input is not a hang.
BAD_INPUT = 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m pytest_torchhang", description="Render saved hang reports, join hunts"
    )
    commands = parser.add_subparsers(dest="command", required=True)
    show = commands.add_parser("show", help="Render a saved JSON hang report")
    show.add_argument("report", metavar="REPORT.json")
    show.add_argument(
        "--format",
        choices=sorted(views.FORMATS),
        default="text",
        help="text (as the terminal showed it), markdown (as in the CI job summary), mermaid, "
        "or dot (Graphviz: pipe it to `dot -Tsvg`)",
    )
    hunts = commands.add_parser(
        "merge-hunts", help="Join the *-hunt.json summaries of several machines; exit 1 if any hung"
    )
    hunts.add_argument("paths", nargs="+", metavar="DIR_OR_FILE")
    return parser


def load_report(path: str) -> HangReport:
    """A saved report, or ``merge.InputError`` with a one-line reason that names ``path``."""
    try:
        with open(path, encoding="utf-8") as source:
            doc = json.load(source)
    except FileNotFoundError:
        raise merge.InputError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise merge.InputError(f"{path}: cannot be read: {exc}") from None
    except json.JSONDecodeError as exc:
        raise merge.InputError(f"{path}: not JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise merge.InputError(f"{path}: not a pytest-torchhang hang report (not a JSON object)")
    try:
        return HangReport.from_json(doc)
    except ValueError as exc:
        raise merge.InputError(f"{path}: {exc}") from None
    except TypeError as exc:  # a field this version does not know, or one missing
        raise merge.InputError(f"{path}: not a hang report this version reads ({exc})") from None


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "show":
            sys.stdout.write(views.render(load_report(args.report), args.format))
            return 0
        tests = merge.merge(args.paths)
    except merge.InputError as exc:
        print(f"python -m pytest_torchhang {args.command}: {exc}", file=sys.stderr)
        return BAD_INPUT
    sys.stdout.write("\n".join(merge.merged_lines(tests)))
    return 1 if any(t.hangs for t in tests) else 0


if __name__ == "__main__":
    sys.exit(main())
