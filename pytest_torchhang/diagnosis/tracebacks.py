"""An exited process's last stderr lines read as a Python traceback: the uncaught exception, the
user's frame that raised it, and the library frame that called the user's code (issue 28, item 2:
what the other end of a wait did last).

Read from the text the process wrote, never from the process itself (it is gone).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from ..report.model import Frame
from .frames import is_library

#: ``  File "/x/y.py", line 13, in open_feature_store``
_FILE = re.compile(r'^\s*File "([^"]+)", line (\d+), in (\S+)')
#: The exception's line: ``FileNotFoundError: [Errno 2] ...``, ``KeyError: 'total'``.
_EXCEPTION = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt|Warning))\b(.*)$")
#: The callee of a library line that calls the user's code: ``initializer`` in
#: ``initializer(*initargs)``, ``_target`` in ``self._target(*self._args)``.
_CALLEE = re.compile(r"([A-Za-z_]\w*)\s*\(")
#: How much of an exception's message is said.
_MAX_MESSAGE = 120


@dataclass
class Raised:
    """The last traceback of a process's stderr: its frames (outermost first) and exception."""

    frames: list[Frame]
    exception: str  # ``FileNotFoundError: [Errno 2] No such file ...``

    def kind(self) -> str:
        """``FileNotFoundError``."""
        return self.exception.split(":", 1)[0].strip()

    def raised_in(self) -> str:
        """``open_feature_store at x.py:13``: the innermost frame of the user's code (else the
        innermost frame)."""
        frame = next((f for f in reversed(self.frames) if not is_library(f)), None)
        frame = frame or (self.frames[-1] if self.frames else None)
        return f"{frame.name} at {_place(frame)}" if frame else ""

    def called_by(self) -> str:
        """``worker at multiprocessing/pool.py:109, as initializer``: the library frame that
        called the user's code, and the name it called it by; empty when the user's code is
        the outermost (a script's own traceback) or absent."""
        first_user = next((k for k, f in enumerate(self.frames) if not is_library(f)), None)
        if not first_user:
            return ""
        caller = self.frames[first_user - 1]
        callee = _CALLEE.search(caller.line)
        return f"{caller.name} at {_place(caller)}" + (f", as {callee.group(1)}" if callee else "")


def _place(frame: Frame) -> str:
    """``pool.py:109`` for the library (its last two path parts), ``x.py:13`` for the user."""
    parts = frame.filename.replace(os.sep, "/").split("/")
    tail = "/".join(parts[-2:]) if is_library(frame) else parts[-1]
    return f"{tail}:{frame.lineno}"


def last_traceback(lines: list[str]) -> Raised | None:
    """The last traceback in ``lines`` (a stderr tail), or None when they hold none that ends
    in an exception's line."""
    start = max((k for k, line in enumerate(lines) if line.startswith("Traceback (")), default=-1)
    if start < 0:
        return None
    frames: list[Frame] = []
    exception = ""
    for k in range(start + 1, len(lines)):
        line = lines[k]
        found = _FILE.match(line)
        if found:
            code = lines[k + 1].strip() if k + 1 < len(lines) else ""
            code = "" if _FILE.match(code) else code
            frames.append(Frame(found.group(1), int(found.group(2)), found.group(3), code))
        elif not line.startswith(" ") and _EXCEPTION.match(line):
            exception = line.strip()
    if not exception:
        return None
    if len(exception) > _MAX_MESSAGE:
        exception = exception[: _MAX_MESSAGE - 3] + "..."
    return Raised(frames, exception)
