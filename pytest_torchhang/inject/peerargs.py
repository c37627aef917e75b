"""The values a stuck call was made with, read in the child without running any of its code.

The rank's listener thread (``hook._serve_collectives``) calls :func:`stuck_frames` while the
main thread waits in C: for each thread in a ``torch.distributed`` call, that call's frame (its
arguments) and the user's frame that made it (a few of its locals). Values are written as
bounded text by :func:`bounded_repr`, which calls nothing a user could have defined: builtins
by their own exact types, a torch tensor by its C getters, a process group by torch's rank table,
anything else by its type's name read from the type's slot (not ``__class__``, not a metaclass's
``__name__``). Standard-library only, like the rest of ``inject/``; it never imports torch.
"""

from __future__ import annotations

import itertools
import sys
import types
from typing import Any

#: Bounds of one value's text: characters of a str/bytes, items of a container, nesting depth.
MAX_CHARS = 48
MAX_ITEMS = 6
MAX_DEPTH = 2
#: Locals kept of the user's frame, and threads looked at.
MAX_LOCALS = 8
MAX_THREADS = 8

#: The type slots, read straight from ``type`` so that a metaclass's property is never called.
_TYPE_NAME = type.__dict__["__qualname__"]
_TYPE_MODULE = type.__dict__["__module__"]

#: Exact builtin types whose own repr runs no user code (a subclass is not one of them).
_SCALARS = (int, float, bool, type(None), complex)
#: Types whose own values are not worth saying in a frame's locals.
_SKIPPED = (types.ModuleType, types.FunctionType, types.BuiltinFunctionType, type)


def _one_of(kind: type, kinds: tuple[type | None, ...]) -> bool:
    """``kind in kinds`` by identity: ``in`` would call a metaclass's ``__eq__``."""
    return any(kind is k for k in kinds)


#: Frames of the wrapper that logs a collective's errors: the call is the frame it wraps.
_LOGGER = "torch/distributed/c10d_logger.py"
_DISTRIBUTED = "/torch/distributed/"
#: The module of torch's collectives: its outermost frame is the call the user made.
_C10D = "torch/distributed/distributed_c10d.py"

#: A code object's flags for ``*args`` and ``**kwargs`` (``inspect.CO_VARARGS``, ``CO_VARKEYWORDS``).
_CO_VARARGS = 0x04
_CO_VARKEYWORDS = 0x08


def type_name(value: object) -> str:
    """``module.QualName`` of the value's type (``QualName`` for builtins), read from the slots."""
    cls = type(value)
    name = _TYPE_NAME.__get__(cls, type)
    module = _TYPE_MODULE.__get__(cls, type)
    name = name if type(name) is str else "?"
    if type(module) is str and module != "builtins":
        return f"{module}.{name}"
    return name


def _text(value: str | bytes) -> str:
    cut = value[:MAX_CHARS]
    more = f"...+{len(value) - MAX_CHARS}" if len(value) > MAX_CHARS else ""
    return repr(cut) + more


def _tensor(value: Any) -> str | None:
    """``Tensor(shape=[8], dtype=float32)``: for torch's own tensor and parameter types only (a
    subclass may define ``__torch_function__``, which attribute access would run)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    kinds = (getattr(torch, "Tensor", None), getattr(getattr(torch, "nn", None), "Parameter", None))
    if not _one_of(type(value), kinds):
        return None
    shape = [int(n) for n in value.shape]
    dtype = str(value.dtype).removeprefix("torch.")
    device = str(value.device)
    where = "" if device == "cpu" else f", device={device}"
    return f"Tensor(shape={shape}, dtype={dtype}{where})"


def _group(value: Any) -> str | None:
    """``ProcessGroup(ranks=[0, 1], name='1')``: the global ranks torch's own table holds for
    the group and its name (a C++ getter); ``default`` for the default group."""
    c10d = sys.modules.get("torch.distributed.distributed_c10d")
    kind = getattr(c10d, "ProcessGroup", None)
    if kind is None or type(value) is not kind:
        return None
    words = []
    world = c10d.__dict__.get("_world")  # torch's _World: its default group is an attribute
    if value is getattr(world, "__dict__", {}).get("_default_pg"):
        words.append("default")
    table = c10d.__dict__.get("_pg_group_ranks")  # the module global behind _world.pg_group_ranks
    ranks = table.get(value) if type(table) is dict else None
    if type(ranks) is dict:
        words.append(f"ranks={sorted(r for r in ranks if type(r) is int)}")
    name = value.group_name
    if type(name) is str:
        words.append(f"name={_text(name)}")
    return f"ProcessGroup({', '.join(words)})"


def _reduce_op(value: Any) -> str | None:
    """``ReduceOp.SUM``: torch's reduce operations (a C++ enum, whose name is a C++ getter)."""
    if type_name(value) != "torch._C._distributed_c10d.ReduceOp.RedOpType":
        return None
    name = value.name
    return f"ReduceOp.{name}" if type(name) is str else "ReduceOp"


def bounded_repr(value: object, depth: int = 0) -> str:
    """The value as short text, running no code the user defined (see the module's docstring)."""
    kind = type(value)
    if _one_of(kind, _SCALARS):
        return repr(value)
    if kind is str or kind is bytes:
        return _text(value)  # type: ignore[arg-type]
    if _one_of(kind, (list, tuple, dict)):
        if depth >= MAX_DEPTH:
            return f"{kind.__name__}(len={len(value)})"  # type: ignore[arg-type]
        return _container(value, depth)
    for special in (_tensor, _group, _reduce_op):
        try:
            text = special(value)
        except Exception:  # torch's getters: a tensor without storage, a half-torn-down group
            text = None
        if text is not None:
            return text
    return type_name(value)


def _container(value: Any, depth: int) -> str:
    kind = type(value)
    if kind is dict:
        items = [
            f"{bounded_repr(k, depth + 1)}: {bounded_repr(v, depth + 1)}"
            for k, v in itertools.islice(value.items(), MAX_ITEMS)  # not a copy of a big one
        ]
        opening, closing = "{", "}"
    else:
        items = [bounded_repr(v, depth + 1) for v in list(value[:MAX_ITEMS])]
        opening, closing = ("[", "]") if kind is list else ("(", ",)" if len(value) == 1 else ")")
    if len(value) > MAX_ITEMS:
        items.append(f"...+{len(value) - MAX_ITEMS}")
    return opening + ", ".join(items) + closing


def _argument_names(code: types.CodeType) -> tuple[str, ...]:
    count = code.co_argcount + code.co_kwonlyargcount
    count += bool(code.co_flags & _CO_VARARGS) + bool(code.co_flags & _CO_VARKEYWORDS)
    return code.co_varnames[:count]


def _row(frame: types.FrameType, names: list[str], call: bool) -> dict[str, Any]:
    """One frame's place and the named values that it holds, as text."""
    values = frame.f_locals  # a snapshot dict (3.11-3.12) or a read-only view (3.13)
    args = {}
    for name in names:
        if name in values:
            args[name] = bounded_repr(values[name])
    code = frame.f_code
    return {
        "function": code.co_name,
        "file": code.co_filename,
        "line": frame.f_lineno,
        "args": args,
        "call": call,
    }


def _library(filename: str) -> bool:
    path = filename.replace("\\", "/")
    stdlib = sys.modules["os"].__file__ or ""
    home = stdlib.replace("\\", "/").rsplit("/", 1)[0] + "/"
    return (
        _DISTRIBUTED in path  # torch's own, wherever it is installed
        or "/site-packages/" in path
        or "/dist-packages/" in path
        or path.startswith(home)
        or path.startswith("<")
        or "/pytest_torchhang/" in path
    )


def _user_locals(frame: types.FrameType) -> list[str]:
    """The user's frame's arguments, then its other locals, keeping only values of a kind the
    report can say (builtins, tensors, groups): an object's bare type name says nothing."""
    code = frame.f_code
    values = frame.f_locals
    names = [n for n in (*code.co_varnames, *code.co_cellvars) if not n.startswith("__")]
    kept = []
    for name in dict.fromkeys(names):
        if name in ("self", "cls") or name not in values:
            continue
        value = values[name]
        if _one_of(type(value), _SKIPPED):
            continue
        if bounded_repr(value) == type_name(value):
            continue
        kept.append(name)
        if len(kept) == MAX_LOCALS:
            break
    return kept


def thread_frames(top: types.FrameType) -> list[dict[str, Any]]:
    """The ``torch.distributed`` call a thread is in (its outermost frame in torch's collectives
    module, else in ``torch/distributed``, past torch's logging wrapper) with its arguments, and
    the user's frame that made it with a few locals; empty when the thread is in no such call."""
    frames: list[types.FrameType] = []
    frame: types.FrameType | None = top
    while frame is not None and len(frames) < 256:
        frames.append(frame)
        frame = frame.f_back
    call = api = None
    for k, f in enumerate(frames):
        path = f.f_code.co_filename.replace("\\", "/")
        if _DISTRIBUTED in path and not path.endswith(_LOGGER):
            call = k
            if path.endswith(_C10D):
                api = k  # the collective itself, not a wrapper above it (FSDP's forward)
        elif call is not None and _DISTRIBUTED not in path:
            break
    call = api if api is not None else call
    if call is None:
        return []
    stuck = frames[call]
    rows = [_row(stuck, list(_argument_names(stuck.f_code)), True)]
    user = next((f for f in frames[call + 1 :] if not _library(f.f_code.co_filename)), None)
    if user is not None:
        rows.append(_row(user, _user_locals(user), False))
    return rows


def stuck_frames() -> list[dict[str, Any]]:
    """For every other thread in a ``torch.distributed`` call (the main thread first): rows of
    :func:`thread_frames`, each with its thread's ident as ``thread`` (hex, as faulthandler)."""
    import threading

    own = threading.get_ident()
    main = threading.main_thread().ident
    tops = sys._current_frames()
    order = sorted(tops, key=lambda ident: ident != main)
    out: list[dict[str, Any]] = []
    for ident in order[:MAX_THREADS]:
        if ident == own:
            continue
        for row in thread_frames(tops[ident]):
            out.append({"thread": hex(ident), **row})
    return out
