"""What ``/proc/PID/task/TID/syscall`` says of a blocked thread: the call's name by its number
(x86-64 and aarch64), the kinds of calls the wait-for graph follows, and whether the call was
given a timeout. Pure: ``waitgraph.py`` reads the file and resolves the call's object.
"""

from __future__ import annotations

import platform

_X86_64 = {
    0: "read", 1: "write", 7: "poll", 17: "pread64", 19: "readv", 20: "writev", 23: "select",
    24: "sched_yield", 34: "pause", 62: "kill", 200: "tkill", 234: "tgkill", 35: "nanosleep", 42: "connect", 43: "accept", 44: "sendto",
    45: "recvfrom", 46: "sendmsg", 47: "recvmsg", 61: "wait4", 65: "semop", 72: "fcntl",
    73: "flock", 128: "rt_sigtimedwait", 130: "rt_sigsuspend", 202: "futex", 219: "restart_syscall",
    220: "semtimedop", 230: "clock_nanosleep", 232: "epoll_wait", 247: "waitid", 257: "openat",
    2: "open", 270: "pselect6", 271: "ppoll", 281: "epoll_pwait", 288: "accept4",
    441: "epoll_pwait2", 449: "futex_waitv",
}  # fmt: skip
_AARCH64 = {
    63: "read", 64: "write", 73: "ppoll", 67: "pread64", 65: "readv", 66: "writev",
    72: "pselect6", 124: "sched_yield", 101: "nanosleep", 203: "connect", 202: "accept",
    206: "sendto", 207: "recvfrom", 211: "sendmsg", 212: "recvmsg", 260: "wait4", 25: "fcntl",
    32: "flock", 137: "rt_sigtimedwait", 133: "rt_sigsuspend", 98: "futex", 128: "restart_syscall",
    192: "semtimedop", 115: "clock_nanosleep", 22: "epoll_pwait", 95: "waitid", 56: "openat",
    242: "accept4", 441: "epoll_pwait2", 449: "futex_waitv",
}  # fmt: skip
SYSCALLS = _AARCH64 if platform.machine() in ("aarch64", "arm64") else _X86_64

#: Calls that wait on one descriptor, to read from it or to write to it.
FD_READS = ("read", "pread64", "readv", "recvfrom", "recvmsg", "accept", "accept4")
FD_WRITES = ("write", "writev", "sendto", "sendmsg", "connect")
#: Calls that wait on several descriptors, and calls that only sleep.
POLLS = ("poll", "ppoll", "select", "pselect6", "epoll_wait", "epoll_pwait", "epoll_pwait2")
SLEEPS = ("nanosleep", "clock_nanosleep", "pause", "rt_sigsuspend", "rt_sigtimedwait")
#: ``fcntl`` commands that wait for a file lock, and the futex flag of a private one.
F_SETLKW = (7, 38)  # F_SETLKW (F_SETLKW64 on 64-bit), F_OFD_SETLKW
FUTEX_PRIVATE = 128


_NO_TIMEOUT = {(1 << 64) - 1, (1 << 32) - 1}  # -1 as the kernel shows it


def timed(call: str, args: list[int]) -> bool:
    """Whether a blocking call was given a timeout (it returns by itself when that runs out)."""
    if len(args) < 5:
        return False
    if call == "poll":
        return args[2] not in _NO_TIMEOUT
    if call.startswith("epoll"):
        return args[3] not in _NO_TIMEOUT
    if call in ("ppoll", "futex"):
        # futex: FUTEX_WAIT / FUTEX_WAIT_BITSET with a timespec
        return bool(args[2 if call == "ppoll" else 3]) and (
            call == "ppoll" or args[1] & 0x7F in (0, 9)
        )
    if call in ("select", "pselect6"):
        return bool(args[4])
    return False
