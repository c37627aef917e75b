"""Score the world corpus (``corpus/``: real hangs written from public reports) as the project is judged.

For each case of ``corpus/manifest.json``: the hanging test fails as a hang within the timeout
(bounded), every expected frame is shown in its terminal report, the passing sibling passes,
nothing of the batch's tree is left running (a marker variable in the children's environment),
and the hint names the cause in its own words (``_judge.py``: quoted source, places and the
case's own names removed, then every regex of the case must match). Then the totals and the
precision of each hint rule: how often it fired on the corpus, and how often its own text named
the case's cause. Cases run in batches, one pytest session per batch (torch-free cases apart
from those that import torch).

Run: ``python bench/score_corpus.py [--timeout 8] [--only SUBSTR] [--json OUT] [--record DIR]``.
``--record DIR`` keeps each case's hang report, unedited, as ``DIR/<case>.json``, and beside them
``recording.json`` (what the diagnosis reads from this machine's disk; see tests/unit/record.py)
and ``scores.json`` (this run's verdicts): the unit tier replays them (tests/unit/test_world_corpus.py).
``--repeat N`` runs every case N times and tells whether its first hint is the same each time
(numbers aside). ``--quick`` scores two torch-free cases (what tests/test_bench.py runs).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _common import answered, clean_env, machine, parser, pytest_command, table
from _judge import defined_names, frames_missing, hints_of, judge_hints

ROOT = Path(__file__).resolve().parent.parent
MANIFEST = ROOT / "corpus" / "manifest.json"
#: Set in every process of a batch's session, to find what is left running afterwards.
MARK_ENV = "TORCHHANG_WORLD_MARK"
#: Past the timeout: the report, the kill and a loaded machine (the judges allow 15 s).
SLACK_S = 15
#: Family names shortened for the table.
SHORT = {"distributed-gloo": "gloo", "multiprocessing": "mp"}
QUICK = ("test_queue_join_missed_task_done.py", "test_asyncio_lock_reentered.py")


@dataclass
class Case:
    """One manifest entry, with what the scoring needs."""

    entry: dict[str, Any]
    path: Path
    test: str
    sibling: str
    uses_torch: bool
    row: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, entry: dict[str, Any], base: Path) -> Case:
        path = base / entry["file"]
        sibling = entry.get("sibling_test", "").split("::")[-1]
        torch = bool(re.search(r"^\s*(import|from) torch", path.read_text(), re.M))
        return cls(entry, path, entry["test"].split("::")[-1], sibling, torch)


def marked_pids(mark: str) -> list[int]:
    """Live processes whose environment holds ``mark`` (this script's excluded)."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as fh:
                if mark.encode() in fh.read():
                    found.append(int(name))
        except OSError:
            continue
    return found


def run_batch(cases: list[Case], timeout: float, reports: Path) -> tuple[str, int, bool]:
    """One pytest session over ``cases``: its output, how many of its processes were left
    running (then killed), and whether it finished by itself."""
    mark = f"{MARK_ENV}_{uuid.uuid4().hex}"
    # in-repo cases by their relative path (node ids as in the suite); another corpus by its own
    files = [
        str(c.path.relative_to(ROOT) if c.path.is_relative_to(ROOT) else c.path) for c in cases
    ]
    args = ["-rA", f"--torch-hang-timeout={timeout}", f"--torch-hang-report-dir={reports}"]
    env = clean_env(**{MARK_ENV: mark, "PYTHONUNBUFFERED": "1"})
    proc = subprocess.Popen(
        pytest_command(*args, *files),
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # the session and anything it left can be killed as a group
    )
    limit = len(cases) * (timeout + SLACK_S) + 60
    try:
        out, _ = proc.communicate(timeout=limit)
        finished = True
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        finished = False
    time.sleep(1.0)  # a killed tree's last processes are being reaped
    left = marked_pids(mark)
    for pid in left:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    text = out.decode("utf-8", "replace")
    answered(f"the corpus batch {files}", bool(re.search(r"\d+ (passed|hang|failed)", text)), text)
    return text, len(left), finished


def section(output: str, test: str) -> list[str]:
    """The lines of the terminal report of ``test`` (from its ``___ test ___`` header on)."""
    lines = output.splitlines()
    head = re.compile(r"^_{3,} (?:\S+::|\S+\.)?" + re.escape(test) + r" _{3,}$")
    for i, line in enumerate(lines):
        if head.match(line):
            end = next(
                (
                    j
                    for j in range(i + 1, len(lines))
                    if re.match(r"^(_{3,} \S.* _{3,}|={5,})", lines[j])
                ),
                len(lines),
            )
            return lines[i:end]
    return []


def reports_by_test(folder: Path) -> dict[str, dict[str, Any]]:
    """The first hang report of each test in ``folder``, by ``file::test``."""
    found: dict[str, dict[str, Any]] = {}
    for path in sorted(folder.glob("*.json")):
        doc = json.loads(path.read_text())
        key = "::".join([Path(doc["test_id"].split("::")[0]).name, doc["test_id"].split("::")[-1]])
        if key not in found or doc.get("created", 0) < found[key].get("created", 0):
            found[key] = doc
    return found


def score(
    case: Case, output: str, report: dict[str, Any] | None, timeout: float, left: int
) -> None:
    """Fill ``case.row`` with the verdicts of one case."""
    name = case.path.name
    hung = re.search(rf"^(HANG|FAILED|ERROR) \S*{re.escape(name)}::{case.test}\b", output, re.M)
    elapsed = float(report["elapsed_s"]) if report else None
    bounded = bool(hung) and elapsed is not None and elapsed <= timeout + SLACK_S
    missing = frames_missing(case.entry.get("expected_frames", []), section(output, case.test))
    sibling = bool(re.search(rf"^PASSED \S*{re.escape(name)}::{case.sibling}\b", output, re.M))
    hints = hints_of(report) if report else []
    right, per_rule = judge_hints(
        hints, case.entry.get("expected_hint_all", []), defined_names(case.path)
    )
    case.row = {
        "case": case.path.stem,
        "family": case.entry.get("family", "?"),
        "bounded": bounded,
        "elapsed_s": elapsed,
        "frames_missing": missing,
        "frames_total": len(case.entry.get("expected_frames", [])),
        "sibling_passed": sibling,
        "left_running": left,
        "hint_right": right,
        "rules": per_rule,
        "hints": [text for _, text in hints],
    }


def record(folder: Path, cases: list[Case], reports: dict[str, dict[str, Any]]) -> None:
    """Keep the reports of ``cases`` in ``folder`` for the unit tier's replay; the recordings of
    other cases already there (an ``--only`` run) are kept."""
    sys.path.insert(0, str(ROOT / "tests" / "unit"))
    from record import sources  # type: ignore[import-not-found]

    from conftest import diagnosis_digest  # type: ignore[import-not-found]  # the unit tier's

    folder.mkdir(parents=True, exist_ok=True)
    docs = []
    for case in cases:
        doc = reports.get(f"{case.path.name}::{case.test}")
        if doc is not None:
            (folder / f"{case.path.stem}.json").write_text(json.dumps(doc, indent=1) + "\n")
            docs.append(doc)
    old = folder / "recording.json"
    recording = json.loads(old.read_text()) if old.exists() else {"sources": {}}
    for name, text in sources(docs).items():  # a library file: the longer of the two
        if len(text) > len(recording["sources"].get(name, "")):
            recording["sources"][name] = text
    recording.update(
        diagnose_sha256=diagnosis_digest(),
        python=sys.version.split()[0],
        stdlib=os.path.realpath(sysconfig.get_paths()["stdlib"]),
    )
    old.write_text(json.dumps(recording, indent=1, sort_keys=True) + "\n")
    path = folder / "scores.json"
    scores = json.loads(path.read_text()) if path.exists() else {}
    for c in cases:
        scores[c.path.stem] = {k: c.row[k] for k in ("hint_right", "rules", "bounded")}
    path.write_text(json.dumps(scores, indent=1, sort_keys=True) + "\n")


def print_results(cases: list[Case]) -> None:
    rows = [
        (
            c.row["case"],
            SHORT.get(c.row["family"], c.row["family"]),
            "yes" if c.row["bounded"] else "NO",
            f"{c.row['frames_total'] - len(c.row['frames_missing'])}/{c.row['frames_total']}",
            "yes" if c.row["sibling_passed"] else "NO",
            c.row["left_running"],
            "right" if c.row["hint_right"] else "no",
            ",".join(rule for rule, _ in c.row["rules"]) or "-",
        )
        for c in cases
    ]
    table(["case", "family", "bounded", "frames", "sibling", "left", "hint", "rules"], rows, 48)
    n = len(cases)
    frames = sum(c.row["frames_total"] - len(c.row["frames_missing"]) for c in cases)
    print(
        f"\ntotals over {n} cases: bounded {sum(c.row['bounded'] for c in cases)}/{n}; frames "
        f"{frames}/{sum(c.row['frames_total'] for c in cases)}; siblings passed "
        f"{sum(c.row['sibling_passed'] for c in cases)}/{n}; left running "
        f"{sum(c.row['left_running'] for c in cases)}; right cause in own words "
        f"{sum(c.row['hint_right'] for c in cases)}/{n}"
    )
    fired: Counter[str] = Counter()
    right: Counter[str] = Counter()
    for c in cases:
        for rule, ok in c.row["rules"]:
            fired[rule] += 1
            right[rule] += ok
    print("\nper-rule precision (a fired rule is right when its own text names the case's cause):")
    table(
        ["rule", "fired", "right", "precision"],
        [
            (r, fired[r], right[r], right[r] / fired[r])
            for r in sorted(fired, key=lambda r: -fired[r])
        ],
        24,
    )
    print(f"\n{machine()}")


def first_hint(row: dict[str, Any]) -> str:
    """The first hint of a run, with what differs between runs of the same hang (pids, fds,
    pipe inodes, times: every number) left out."""
    return re.sub(r"\d+(\.\d+)?", "N", row["hints"][0]) if row["hints"] else ""


def print_stability(cases: list[Case]) -> None:
    """How many runs of each case gave the first hint of its first run."""
    rows = []
    for c in cases:
        runs = c.row["first_hint_runs"]
        rows.append((c.row["case"], sum(h == runs[0] for h in runs), len(runs)))
    print("\nthe same first hint in every run (numbers aside):")
    table(["case", "same", "runs"], rows, 48)
    stable = sum(same == n for _, same, n in rows)
    print(f"stable first hint: {stable}/{len(rows)} cases")


def main() -> int:
    args = parser(__doc__)
    args.add_argument("--manifest", type=Path, default=MANIFEST)
    args.add_argument("--timeout", type=float, default=8.0, help="--torch-hang-timeout per case")
    args.add_argument("--only", default="", help="Score the cases whose file name contains this")
    args.add_argument("--json", type=Path, help="Write every case's verdicts here")
    args.add_argument("--record", type=Path, help="Keep the reports here for the unit tier")
    args.add_argument("--batch", type=int, default=6, help="Cases per pytest session")
    args.add_argument(
        "--repeat", type=int, default=1, help="Run every case N times: is the first hint the same?"
    )
    options = args.parse_args()
    base = options.manifest.resolve().parent
    cases = [Case.of(e, base) for e in json.loads(options.manifest.read_text())]
    cases = [c for c in cases if c.entry.get("hangs_here", True) is True]
    if options.quick:
        cases = [c for c in cases if c.path.name in QUICK]
    cases = [c for c in cases if options.only in c.path.name]
    if not cases:
        args.error("no case selected")
    ordered = sorted(cases, key=lambda c: c.uses_torch)
    groups = [
        [c for c in ordered if c.uses_torch == torch][i : i + options.batch]
        for torch in (False, True)
        for i in range(0, sum(c.uses_torch == torch for c in ordered), options.batch)
    ]
    folder = Path(tempfile.mkdtemp(prefix="torchhang-world-"))
    unfinished = 0
    kept: dict[str, dict[str, Any]] = {}
    first: dict[str, dict[str, Any]] = {}
    try:
        for run in range(options.repeat):
            for n, group in enumerate(groups):
                reports_dir = folder / f"run{run}-batch{n}"
                output, left, finished = run_batch(group, options.timeout, reports_dir)
                unfinished += not finished
                reports = reports_by_test(reports_dir) if reports_dir.exists() else {}
                if run == 0:
                    kept.update(reports)
                for case in group:
                    key = f"{case.path.name}::{case.test}"
                    score(case, output, reports.get(key), options.timeout, left)
                    if run == 0:
                        first[key] = case.row
                        first[key]["first_hint_runs"] = []
                    row = first[key]
                    row["first_hint_runs"].append(first_hint(case.row))
                    # a case is only as bounded, clean and tidy as its worst run
                    for flag in ("bounded", "sibling_passed"):
                        row[flag] = row[flag] and case.row[flag]
                    row["left_running"] = max(row["left_running"], case.row["left_running"])
        for case in cases:
            case.row = first[f"{case.path.name}::{case.test}"]
        print_results(cases)
        if options.repeat > 1:
            print_stability(cases)
        if options.record:
            record(options.record, cases, kept)
            print(f"recorded {len(cases)} cases into {options.record}")
        if options.json:
            options.json.write_text(json.dumps([c.row for c in cases], indent=1) + "\n")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    broken = [
        c
        for c in cases
        if not (c.row["bounded"] and c.row["sibling_passed"] and not c.row["left_running"])
    ]
    return 1 if broken or unfinished else 0


if __name__ == "__main__":
    sys.exit(main())
