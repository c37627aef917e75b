"""The suite's own leak check counts what the inner session left, and nothing another program did."""

from __future__ import annotations

import os
import threading
import uuid

from conftest import SHM_DIR, GuardedRunner
from outcomes import assert_outcomes

LEAKS_A_SEGMENT = """
import os
import time


def test_leaves_a_segment_behind():
    with open("/dev/shm/psm_left_by_the_inner_session", "w") as segment:
        segment.write("x")
    time.sleep(1.5)  # meanwhile another program creates a segment of its own
"""


def test_the_shm_check_counts_the_inner_sessions_segments_and_not_another_programs(
    guarded: GuardedRunner,
) -> None:
    guarded.pytester.makepyfile(test_leak=LEAKS_A_SEGMENT)
    other = SHM_DIR / f"psm_another_program_{uuid.uuid4().hex[:8]}"
    created = threading.Event()
    fds: list[int] = []

    def another_program() -> None:  # a live segment, open by its owner during the session
        threading.Event().wait(0.5)
        fds.append(os.open(other, os.O_CREAT | os.O_RDWR, 0o600))
        created.set()

    thread = threading.Thread(target=another_program)
    thread.start()
    try:
        session = guarded.run(timeout=30, grace_s=2)  # the leak stays: do not wait long
        thread.join()
        assert created.is_set()
        assert_outcomes(session.result, passed=1)
        assert session.new_shm == ["psm_left_by_the_inner_session"], session.new_shm
        assert not session.leftovers
    finally:
        thread.join()
        for fd in fds:
            os.close(fd)
        other.unlink(missing_ok=True)
        (SHM_DIR / "psm_left_by_the_inner_session").unlink(missing_ok=True)  # shared mode
