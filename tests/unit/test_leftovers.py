"""The ownership rules of a hang's cleanup: given what the tree held and a listing, what goes."""

from __future__ import annotations

from pytest_torchhang.capture.leftovers import (
    Holding,
    ShmEntry,
    is_listener,
    parse_unix_sockets,
    shm_inodes_in_maps,
    shm_to_unlink,
    sockets_to_remove,
)

#: Read from a real process that made a shared_memory segment and a spawn-context Lock
#: (glibc's sem_open maps a temporary name, then renames it: the map says "(deleted)").
RECORDED_MAPS = """\
56194e72a000-56194e72b000 r--p 00000000 fe:00 26723                      /root/.pyenv/versions/3.11.7/bin/python3.11
7f694e31c000-7f694e31d000 rw-s 00000000 00:1b 2711                       /dev/shm/sem.Yrg44A (deleted)
7f694e31d000-7f694e31e000 rw-s 00000000 00:1b 2710                       /dev/shm/psm_recorded
7f694d485000-7f694d488000 rw-p 00000000 00:00 0
7ffcc01ef000-7ffcc0210000 rw-p 00000000 00:00 0                          [stack]
"""
#: /proc/net/unix: a listener on a multiprocessing-style address (recorded), an unbound socket
#: and an abstract one (the kernel's formats for those, as unix(7) describes them).
RECORDED_UNIX = """\
Num       RefCount Protocol Flags    Type St Inode Path
000000008667e093: 00000002 00000000 00010000 0001 01 176289 /tmp/pymp-21sbdcwo/listener-abc
0000000012345678: 00000003 00000000 00000000 0001 03 176301
00000000abcdef12: 00000002 00000000 00010000 0001 01 176302 @/tmp/.X11-unix/X0
"""

T0 = 1_000.0  # wall time the test began
WORKER = Holding(
    pid=41,
    started=T0 + 1,
    shm_inodes=frozenset({7001, 7002}),
    sockets=frozenset({("/tmp/x/pymp-ab/listener-cd", 9001)}),
)
ROOT = Holding(pid=40, started=T0 - 100, shm_inodes=frozenset({7003}), sockets=frozenset())


def entry(name: str, inode: int, ctime: float = T0 + 2) -> ShmEntry:
    return ShmEntry(name, inode, ctime)


def test_a_segment_a_killed_worker_mapped_is_unlinked() -> None:
    listing = [entry("psm_1234", 7001), entry("sem.mp-abcd", 7002)]
    assert shm_to_unlink([WORKER], {41}, listing, T0) == ["psm_1234", "sem.mp-abcd"]


def test_a_segment_nobody_of_the_tree_held_stays_even_when_open_by_nobody() -> None:
    # another program's hand-off by name: made during the test, closed, not unlinked
    listing = [entry("psm_other", 8001)]
    assert shm_to_unlink([WORKER], {41}, listing, T0) == []


def test_what_a_process_that_was_not_killed_held_stays() -> None:
    listing = [entry("psm_1234", 7001), entry("psm_root", 7003)]
    assert shm_to_unlink([WORKER, ROOT], {40}, listing, T0) == ["psm_root"]
    assert shm_to_unlink([WORKER, ROOT], set(), listing, T0) == []


def test_a_name_reused_by_another_file_is_not_the_one_held() -> None:
    # psm_1234 was unlinked and made again by someone else: a new inode
    assert shm_to_unlink([WORKER], {41}, [entry("psm_1234", 7999)], T0) == []


def test_a_segment_older_than_the_test_stays_though_a_killed_worker_mapped_it() -> None:
    # a session fixture's segment the worker attached to
    assert shm_to_unlink([WORKER], {41}, [entry("psm_1234", 7001, ctime=T0 - 5)], T0) == []


def test_a_segment_a_living_process_of_the_tree_still_maps_stays() -> None:
    listing = [entry("psm_1234", 7001)]
    assert shm_to_unlink([WORKER], {41}, listing, T0, kept_inodes={7001}) == []


def test_names_outside_the_multiprocess_stack_stay() -> None:
    held = Holding(41, T0 + 1, frozenset({7005}), frozenset())
    assert shm_to_unlink([held], {41}, [entry("my_app_buffer", 7005)], T0) == []


def test_torch_segments_of_a_killed_pid_go_though_no_map_was_read() -> None:
    # a worker's torch_<pid>_* segment, handed to its torch_shm_manager and unmapped
    listing = [entry("torch_41_1785_0", 7100), entry("torch_42_99_0", 7101)]
    assert shm_to_unlink([WORKER], {41}, listing, T0) == ["torch_41_1785_0"]


def test_a_torch_segment_older_than_its_pid_is_an_earlier_process_s() -> None:
    # pid 41 was used before: that process's segment is older than the killed worker
    listing = [entry("torch_41_1785_0", 7100, ctime=T0 + 0.5)]
    assert shm_to_unlink([WORKER], {41}, listing, T0) == []


#: when the test began (wall time), for the listeners' ages
BEGAN = 1_000.0


def test_a_killed_listener_that_is_still_its_file_is_removed() -> None:
    present = {
        "/tmp/x/pymp-ab/listener-cd": (9001, BEGAN + 1),
        "/tmp/y/pymp-zz/listener-zz": (9002, BEGAN + 1),
    }
    assert sockets_to_remove([WORKER], {41}, present, BEGAN) == ["/tmp/x/pymp-ab/listener-cd"]


def test_a_listener_replaced_or_gone_or_of_a_living_process_stays() -> None:
    path = "/tmp/x/pymp-ab/listener-cd"
    assert sockets_to_remove([WORKER], {41}, {path: (9555, BEGAN + 1)}, BEGAN) == []
    assert sockets_to_remove([WORKER], {41}, {}, BEGAN) == []
    assert sockets_to_remove([WORKER], {99}, {path: (9001, BEGAN + 1)}, BEGAN) == []


def test_a_listener_bound_before_the_test_stays_though_a_killed_fork_held_it() -> None:
    # a forkserver of an earlier test: the worker it forked for this one still held its socket
    path = "/tmp/x/pymp-ab/listener-cd"
    assert sockets_to_remove([WORKER], {41}, {path: (9001, BEGAN - 30)}, BEGAN) == []


def test_the_shm_files_a_process_maps_are_read_by_inode_whatever_their_name() -> None:
    assert shm_inodes_in_maps(RECORDED_MAPS) == {2710, 2711}


def test_bound_unix_sockets_are_read_by_inode_and_abstract_or_unbound_ones_left_out() -> None:
    assert parse_unix_sockets(RECORDED_UNIX) == {176289: "/tmp/pymp-21sbdcwo/listener-abc"}


def test_only_a_listener_in_a_pymp_dir_is_multiprocessings() -> None:
    assert is_listener("/tmp/pymp-21sbdcwo/listener-abc")
    assert not is_listener("/tmp/app/listener-abc")
    assert not is_listener("/tmp/pymp-21sbdcwo/server.sock")
