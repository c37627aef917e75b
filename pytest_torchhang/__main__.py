"""``python -m pytest_torchhang show REPORT.json``, ``merge-hunts DIR...`` (reports off-line) and
``examples [PYTEST ARGS]`` (the example suite, from the installed package)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from .report import merge, views
from .report.model import HangReport

#: Exit statuses: a bad input is not a hang.
BAD_INPUT = 2
#: After Ctrl-C, how long the example session may take to report and clean up before it is killed.
EXAMPLES_INTERRUPT_GRACE_S = 60.0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m pytest_torchhang",
        description="Render saved hang reports, join hunts, run the example suite",
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
    # Parsed by main() itself: every argument after `examples` is pytest's (-k, --help included).
    commands.add_parser(
        "examples",
        add_help=False,
        usage="python -m pytest_torchhang examples [PYTEST ARGS]",
        help="Run the example suite shipped in the package, from a temporary copy; the rest of "
        "the command line goes to pytest (its hangs/ tests hang on purpose: the run fails)",
    )
    return parser


def examples_dir() -> Path | None:
    """The example suite: the wheel's copy inside the package, else a source checkout's."""
    package = Path(__file__).resolve().parent
    shipped = package / "examples"
    if (shipped / "conftest.py").is_file():
        return shipped
    checkout = package.parent
    if (checkout / "pyproject.toml").is_file() and (
        checkout / "examples" / "conftest.py"
    ).is_file():
        return checkout / "examples"
    return None


def run_examples(pytest_args: list[str]) -> int:
    """Run the example suite under pytest with ``pytest_args``; pytest's exit status.

    The suite runs from a temporary copy, so that pytest writes its caches and bytecode there
    rather than into the installed package. pytest runs in the current directory with the copy
    as its test path: the copy's ``pytest.ini`` is the session's, and relative paths given to
    pytest (``--torch-hang-report-dir=DIR``, ``--junitxml=FILE``) are the current directory's, as
    usual; tests are chosen with ``-k``.
    """
    source = examples_dir()
    if source is None:
        print(
            "python -m pytest_torchhang examples: this installation has no example suite "
            f"(looked in {Path(__file__).resolve().parent / 'examples'}); reinstall "
            "pytest-torchhang from its wheel, or run `python -m pytest examples` in a checkout",
            file=sys.stderr,
        )
        return BAD_INPUT
    if importlib.util.find_spec("torchvision") is None:
        print(
            "python -m pytest_torchhang examples: the example suite needs torchvision, which is "
            "not installed: pip install 'pytest-torchhang[examples]'",
            file=sys.stderr,
        )
        return BAD_INPUT
    with tempfile.TemporaryDirectory(prefix="pytest-torchhang-") as tmp:
        suite = Path(tmp) / "examples"
        shutil.copytree(
            source, suite, ignore=shutil.ignore_patterns("__pycache__", ".pytest_cache")
        )
        command = [sys.executable, "-m", "pytest", str(suite), *pytest_args]
        print(f"the example suite, copied from {source}: {shlex.join(command)}", flush=True)
        with subprocess.Popen(command) as session:
            try:
                return session.wait()
            except KeyboardInterrupt:
                # The session got the same Ctrl-C (one process group): it reports what it has and
                # its guard cleans up. It gets a bound for that, then it goes with the copy.
                try:
                    return session.wait(timeout=EXAMPLES_INTERRUPT_GRACE_S)
                except subprocess.TimeoutExpired:
                    session.kill()
                    session.wait()
                    raise KeyboardInterrupt from None


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
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["examples"]:
        return run_examples(argv[1:])
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
