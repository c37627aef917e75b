"""A chatty child's cost: a child process that writes many lines to stderr, guarded and bare.

A guarded test's children keep the tail of their stderr for the hang report (``PID.stderr``,
inject/hook.py's ``StderrTail``). Issue 29: a child writing 200,000 lines ran 4-5x slower
guarded than bare (a system call a line). Each configuration runs the same generated test in a
fresh ``pytest`` (``--torch-hang-timeout=60``, and ``-p no:torchhang``), taking turns; the test
starts ``python -c CHILD`` with stderr to a file, and the child times its own writes (its
start-up is left out). The table shows the medians and guarded / bare.

Run: ``python bench/bench_stderr.py [--lines N] [--rounds R]``; ``--quick``: 20,000 lines, once.
"""

from __future__ import annotations

import tempfile
import textwrap
from pathlib import Path

from _common import OUT_ENV, machine, median, parser, run_session, spread, table

CHILD = textwrap.dedent(
    """
    import sys, time
    began = time.perf_counter()
    for n in range({lines}):
        print(f"line {{n}} of a chatty child's progress", file=sys.stderr)
    print(time.perf_counter() - began)
    """
)
TEST = textwrap.dedent(
    """
    import json, os, subprocess, sys

    def test_a_chatty_child(tmp_path):
        with open(tmp_path / "stderr.txt", "w") as err:
            done = subprocess.run(
                [sys.executable, "-c", {child!r}], stderr=err, stdout=subprocess.PIPE,
                text=True, check=True,
            )
        with open(os.environ[{out!r}], "w") as out:
            json.dump({{"child_s": float(done.stdout)}}, out)
    """
)
CONFIGS = {
    "bare (-p no:torchhang)": ["-p", "no:torchhang"],
    "guarded (--torch-hang-timeout=60)": ["--torch-hang-timeout=60"],
}


def main() -> None:
    args_parser = parser(__doc__)
    args_parser.add_argument("--lines", type=int, default=200_000, help="Lines the child writes")
    args_parser.add_argument("--rounds", type=int, default=3, help="Sessions of each kind")
    args = args_parser.parse_args()
    lines, rounds = (20_000, 1) if args.quick else (args.lines, args.rounds)
    times: dict[str, list[float]] = {name: [] for name in CONFIGS}
    with tempfile.TemporaryDirectory(prefix="bench-stderr-") as tmp:
        root = Path(tmp)
        child = CHILD.format(lines=lines)
        (root / "test_chatty.py").write_text(TEST.format(child=child, out=OUT_ENV))
        for turn in range(rounds):
            order = list(CONFIGS.items())
            for name, options in order[turn % 2 :] + order[: turn % 2]:  # take turns
                session = run_session(root, [*options, "-p", "no:randomly", "test_chatty.py"])
                times[name].append(float(session.figures["child_s"]))  # type: ignore[arg-type]
    bare = median(times[next(iter(CONFIGS))])
    print(f"a child writing {lines:,} lines to stderr, {rounds} round(s) ({machine()})")
    table(
        ["configuration", "child s (median)", "spread", "vs bare"],
        [
            (name, f"{median(t):.3f}", spread(t), f"{median(t) / bare:.2f}x")
            for name, t in times.items()
        ],
    )


if __name__ == "__main__":
    main()
