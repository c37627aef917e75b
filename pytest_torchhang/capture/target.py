"""What one capture is of: a test's tree (or a fixture call's children), and what to spare.

Light on purpose (no psutil, no /proc): every guarded test makes one, and the capture modules
that act on it load only when a deadline first fires. Frozen: a test's is made when it is armed,
and the capture's is made from it once, at the fire (``hang.path.at_fire``); a change is a new
value (``dataclasses.replace``), never a field changed under another thread's feet.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from .. import clock

#: (pid, start time in clock ticks) of processes alive at some moment: identities, not pids.
Births = frozenset[tuple[int, int]]


@dataclass(frozen=True)
class CaptureTarget:
    """What one capture watches: the tree under ``root_pid``, minus the plugin's own processes."""

    test_id: str
    timeout_s: float
    root_pid: int
    dump_dir: str | None
    started: float = field(default_factory=clock.monotonic)
    exclude: frozenset[int] = frozenset()
    shm_since: float = 0.0  # wall time the test began: /dev/shm segments younger are its own
    root_in_process: bool = True  # the root is this very process: read its stacks directly
    kill_root: bool = False
    root_role: str = "pytest"
    phase: str = "call"
    capture_budget_s: float = 2.0
    #: When set, the tree is these processes and their descendants (runner children), not the
    #: root's descendants; the root is then only the process the report is written for.
    roots: Sequence[int] | None = None
    #: Trees captured and killed with the root's (fixture calls' children in flight: the zygote
    #: that forked them is the plugin's, so they are not the root's descendants).
    extra_roots: Sequence[int] = ()
    native: bool = False  # add native stacks (pystack / py-spy) where installed and permitted
    #: The root's descendants when the test began: they, and what they start, are reported for
    #: context and never signalled (a session fixture's server is not the hung test's).
    before: Births | None = None
    #: Processes of the tree that are captured (stacks and all) but never signalled to die: the
    #: workers of a pool that a wider-scoped fixture's value owns (a DataLoader's
    #: ``persistent_workers``), which the next test uses. Added at the fire (``fixtures.py``).
    spare: Births = frozenset()
    #: What ``spare`` is, said in the report's notes when they are spared.
    spare_note: str = ""
