"""Two looks at a hung tree: each process told blocked, spinning, polling or moving (issue 28)."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import GuardedRunner, assert_hang
from outcomes import assert_outcomes

# No torch: the motion of plain processes is the point. Each child says it reached its loop
# (an Event), so the deadline falls once all of them are where they stay.
FOUR_MOTIONS = """
import multiprocessing as mp
import os
import time

FORK = mp.get_context("fork")


def blocked(ready):
    reader, _writer = os.pipe()
    ready.set()
    os.read(reader, 1)  # nobody writes: blocked for good


def spinning(ready):
    ready.set()
    n = 0
    while True:
        n += 1


def moving(ready, path):
    ready.set()
    with open(path, "w") as out:
        while True:
            out.write("step\\n")  # slow, but it makes output
            out.flush()
            time.sleep(0.02)


def test_four_motions(tmp_path):
    counter = FORK.Value("i", 0)
    events = [FORK.Event() for _ in range(3)]
    children = [
        FORK.Process(target=blocked, args=(events[0],)),
        FORK.Process(target=spinning, args=(events[1],)),
        FORK.Process(target=moving, args=(events[2], str(tmp_path / "log"))),
    ]
    for child in children:
        child.start()
    for event in events:
        event.wait()
    while counter.value < 1:  # nobody increments it: the parent polls forever
        time.sleep(0.01)
"""


def test_each_process_is_told_blocked_spinning_polling_or_moving(
    guarded: GuardedRunner, tmp_path: Path
) -> None:
    guarded.pytester.makepyfile(test_motions=FOUR_MOTIONS)
    reports = tmp_path / "reports"
    session = guarded.run(f"--torch-hang-report-dir={reports}", timeout=4)
    assert_outcomes(session.result, hang=1)
    text = assert_hang(
        session,
        "test_four_motions",
        "*    motion: blocked: *",
        "*    motion: spinning: *",
        "*    motion: polling: *",
        "*    motion: moving: *",
    )
    (doc,) = [json.loads(p.read_text()) for p in reports.glob("*.json")]
    (parent,) = [p for p in doc["processes"] if p["role"] == "pytest"]
    assert parent["motion"]["kind"] == "polling", parent["motion"]
    assert parent["motion"]["voluntary_switches"] >= 2, parent["motion"]
    by_target = {
        p["role_facts"].get("target"): p["motion"]
        for p in doc["processes"]
        if p["role_facts"] and p["role_facts"].get("target")
    }
    assert by_target["blocked"]["kind"] == "blocked", by_target
    assert by_target["blocked"]["voluntary_switches"] == 0, by_target
    assert by_target["spinning"]["kind"] == "spinning", by_target
    assert by_target["spinning"]["cpu_delta_s"] > 0, by_target
    assert by_target["moving"]["kind"] == "moving", by_target
    assert by_target["moving"]["written_bytes"] > 0, by_target
    # the parent polls a condition that has not come: never "blocked", never "computing"
    polling = [h for h in doc["hints"] if parent["pid"] in h["pids"]]
    assert [h["rule"] for h in polling] == ["polling"], text[:4000]
    assert "polls for a condition that has not come" in polling[0]["text"]
    assert "while counter.value < 1:" in polling[0]["text"]
    assert "computing or spinning" not in " ".join(h["text"] for h in polling)
    session.assert_clean()
