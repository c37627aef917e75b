"""A stressed run's report shows the user's stacks without ``--torch-hang-hunt-stress``'s wrappers,
cut as pytest's own frames are (issue 29); the JSON keeps every frame.

``recorded_views/stress_lost_wakeup.json.gz`` is the report of a real stressed hang, written by
the plugin and not edited: ``tests/corpus/corpus_rare.py``'s
``rare_lost_wakeup_of_a_flag_checked_outside_its_lock`` run with ``-o python_functions=rare_*
--torch-hang-timeout=2 --torch-hang-hunt=1 --torch-hang-hunt-seed=862851342
--torch-hang-report-dir=DIR`` (the seed replays the hang).
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from pytest_torchhang.report import groups
from pytest_torchhang.report.model import Frame, HangReport, ThreadStack
from pytest_torchhang.report.text import to_text

STRESS = "/venv/lib/python3.11/site-packages/pytest_torchhang/inject/stress.py"


def recorded() -> HangReport:
    path = Path(__file__).parent / "recorded_views" / "stress_lost_wakeup.json.gz"
    return HangReport.from_json(json.loads(gzip.decompress(path.read_bytes())))


def test_the_text_shows_the_users_stacks_with_one_cut_line_where_stress_wrapped_a_call() -> None:
    report = recorded()
    text = to_text(report)
    assert "inject/stress.py" not in text
    assert text.count("... --torch-hang-hunt-stress frames cut") == 2  # the waiter, the joiner
    waiter = text[text.index('"Thread-2 (wait_until_done)"') :]
    order = [
        waiter.index('threading.py", line 327, in wait'),
        waiter.index("... --torch-hang-hunt-stress frames cut"),
        waiter.index("in wait_until_done"),
        waiter.index("... threading's start-up frames cut"),
    ]
    assert order == sorted(order), waiter[:1500]
    # the data stays whole: the JSON still holds the wrappers' frames
    frames = [f.filename for p in report.processes for t in p.threads for f in t.frames]
    assert sum(name.endswith("pytest_torchhang/inject/stress.py") for name in frames) == 4


def _frame(filename: str, name: str, lineno: int = 1) -> Frame:
    return Frame(filename, lineno, name)


def test_each_run_of_stress_frames_becomes_one_line_in_its_place() -> None:
    frames = [
        _frame("/usr/lib/python3.11/threading.py", "wait"),
        _frame(STRESS, "call"),
        _frame(STRESS, "stressed"),
        _frame("/work/test_x.py", "helper"),
        _frame(STRESS, "stressed"),
        _frame("/work/test_x.py", "test_x"),
    ]
    assert [f.name for f in groups.cut_stress(frames)] == [
        "wait",
        groups.STRESS_CUT.name,
        "helper",
        groups.STRESS_CUT.name,
        "test_x",
    ]
    plain = [f for f in frames if f.filename != STRESS]
    assert groups.cut_stress(plain) == plain  # a plain run's stacks are left as they are
    # the plugin's other files are not stress's wrappers
    runner = [_frame("/site-packages/pytest_torchhang/runner/child.py", "main")]
    assert groups.cut_stress(runner) == runner


def test_two_stacks_that_differ_only_in_the_wrappers_lines_are_one_group() -> None:
    def stack(line: int) -> ThreadStack:
        return ThreadStack(
            ident="0x1",
            frames=[
                _frame("/usr/lib/python3.11/threading.py", "wait", 327),
                _frame(STRESS, "call", line),
                _frame("/work/test_x.py", "test_x", 9),
            ],
        )

    assert groups.thread_key(stack(220)) == groups.thread_key(stack(224))
