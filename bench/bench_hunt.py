"""Hang hunting's speed: runs per second of ``--torch-hang-hunt``, next to a fresh pytest per run.

Two tests are hunted, as users run it (``--torch-hang-hunt=N --torch-hang-timeout=60
--torch-hang-hunt-all``): a trivial test, and one that takes two batches from a 4-worker
FakeData DataLoader. The alternative, taking turns with it: a shell loop that starts
``pytest`` once per run. Goal (issue 12): at least 20 runs/s for the trivial test. ``--quick``
hunts the trivial test alone, in a file that does not import torch.
Per run = (session with N runs - session with 1 run) / (N - 1): pytest's and torch's start-up
are paid once per hunt, and this leaves them out.

Then the rare hangs of tests/corpus/corpus_rare.py (issue 24), in one stressed hunt
(``--torch-hang-hunt=2N --torch-hang-hunt-stress --torch-hang-hunt-all``: the odd runs
stressed, the even ones plain): each race's plain and stressed rate with its 95% Wilson
interval, and how much longer a stressed run that did not hang took than a plain one. Goal:
each race hangs in at least 40% of stressed runs, and more often than plain.
Run: ``python bench/bench_hunt.py [--runs N] [--corpus-runs N] [--only-corpus] [--race NAME]``.
"""

from __future__ import annotations

import json
import tempfile
import textwrap
from collections.abc import Sequence
from pathlib import Path

from _common import machine, median, parser, run_session, table

RARE = Path(__file__).resolve().parent.parent / "tests" / "corpus" / "corpus_rare.py"

TRIVIAL = textwrap.dedent(
    """
    def test_trivial():
        assert 1 + 1 == 2
    """
)
LOADER = textwrap.dedent(
    """
    import torch
    from torch.utils.data import DataLoader
    from torchvision import transforms
    from torchvision.datasets import FakeData


    def test_loader():
        data = FakeData(size=64, image_size=(3, 32, 32), transform=transforms.ToTensor())
        for index, _batch in enumerate(DataLoader(data, batch_size=16, num_workers=4)):
            if index == 1:
                break
    """
)


def _pct(tally: dict[str, object]) -> str:
    low, high = tally["ci95"]  # type: ignore[misc]
    share = 100 * float(tally["rate"])  # type: ignore[arg-type]
    return f"{tally['hangs']}/{tally['runs']} {share:.0f}% ({100 * low:.0f}-{100 * high:.0f}%)"


def rare_hangs(
    runs_each: int, timeout_s: float, races: Sequence[str] = (), with_torch: bool = False
) -> None:
    """The corpus of rare hangs (or only ``races``), plain and stressed, in one hunt; one row a
    race. ``with_torch``: the test file imports torch first, as a user's does, so the session's
    forks are a large process's (tens of ms each: a race between two children needs the
    stress's waits to span that)."""
    with tempfile.TemporaryDirectory(prefix="bench-rare-") as tmp:
        root = Path(tmp)
        head = "import torch  # noqa: F401\n" if with_torch else ""
        (root / "test_corpus_rare.py").write_text(head + RARE.read_text())
        session = run_session(
            root,
            [
                f"--torch-hang-timeout={timeout_s}",
                "-p",
                "no:randomly",
                "-o",
                "python_functions=rare_*",
                f"--torch-hang-hunt={2 * runs_each}",
                "--torch-hang-hunt-stress",
                "--torch-hang-hunt-all",
                f"--torch-hang-report-dir={root / 'reports'}",
                *(
                    [f"test_corpus_rare.py::rare_{race}" for race in races]
                    or ["test_corpus_rare.py"]
                ),
            ],
            expect=(0, 1),
            timeout=3600,
        )
        rows = []
        for path in sorted((root / "reports").glob("*-hunt.json")):
            hunt = json.loads(path.read_text())
            plain, stressed = hunt["plain"], hunt["stressed"]
            plain_s, stressed_s = (t["seconds_per_passing_run"] for t in (plain, stressed))
            slower = f"{stressed_s / plain_s:.1f}x" if plain_s and stressed_s else "-"
            name = hunt["test_id"].split("::")[-1].removeprefix("rare_")
            rows.append((name, _pct(plain), _pct(stressed), slower))
    print()
    print(
        f"rare hangs (tests/corpus/corpus_rare.py{', importing torch' if with_torch else ''}), "
        f"{runs_each} plain + {runs_each} stressed runs each, timeout {timeout_s}s, one hunt "
        f"of {session.wall_s:.0f}s ({machine()})"
    )
    table(
        ["race", "plain hung (95% CI)", "stressed hung (95% CI)", "stressed run / plain"],
        rows,
        first=40,
    )


def main() -> None:
    args_parser = parser(__doc__)
    args_parser.add_argument("--runs", type=int, default=200, help="Runs of the trivial test")
    args_parser.add_argument("--rounds", type=int, default=3, help="Sessions of each kind")
    args_parser.add_argument(
        "--corpus-runs", type=int, default=40, help="Plain and stressed runs of each rare hang"
    )
    args_parser.add_argument(
        "--only-corpus", action="store_true", help="Measure the rare hangs only"
    )
    args_parser.add_argument(
        "--race",
        action="append",
        default=[],
        help="Only this race of the corpus (its name without rare_; repeatable)",
    )
    args_parser.add_argument(
        "--with-torch",
        action="store_true",
        help="The rare hangs' test file imports torch first (a user's session: slower forks)",
    )
    args = args_parser.parse_args()
    corpus_runs = 3 if args.quick else args.corpus_runs
    if args.only_corpus:
        rare_hangs(corpus_runs, 2.0, args.race, args.with_torch)
        return
    rounds = 1 if args.quick else args.rounds
    # --quick: the trivial test alone (its file does not import torch), for CI
    runs = {"test_trivial": 50} if args.quick else {"test_trivial": args.runs, "test_loader": 20}
    fresh_runs = 2 if args.quick else 5
    guard = ["--torch-hang-timeout=60", "-p", "no:randomly", "-W", "ignore::UserWarning"]
    per_run: dict[str, list[float]] = {name: [] for name in runs}
    fresh: dict[str, list[float]] = {name: [] for name in runs}
    with tempfile.TemporaryDirectory(prefix="bench-hunt-") as tmp:
        root = Path(tmp)
        (root / "test_trivial.py").write_text(TRIVIAL)
        (root / "test_loader.py").write_text(LOADER)
        for _ in range(rounds):
            for name, n in runs.items():
                hunt = [*guard, "--torch-hang-hunt-all", f"{name}.py"]
                one = run_session(root, [*hunt, "--torch-hang-hunt=1"]).wall_s
                many = run_session(root, [*hunt, f"--torch-hang-hunt={n}"]).wall_s
                per_run[name].append((many - one) / (n - 1))
                walls = [
                    run_session(root, [*guard, f"{name}.py"]).wall_s for _ in range(fresh_runs)
                ]
                fresh[name].append(median(walls))
    print(f"hang hunting: time per run ({machine()})")
    print(f"{rounds} round(s); hunted runs: {runs}; fresh sessions: {fresh_runs} a round")
    rows = []
    for name in runs:
        hunted, alone = median(per_run[name]), median(fresh[name])
        rows.append((name, hunted, 1 / hunted, alone, alone / hunted))
    table(["test", "s/run hunted", "runs/s", "s/run fresh", "x faster"], rows, first=20)
    print(f"trivial test: {rows[0][2]:.0f} runs/s hunted (goal: at least 20)")
    rare_hangs(corpus_runs, 2.0, args.race, args.with_torch)


if __name__ == "__main__":
    main()
