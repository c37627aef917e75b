"""A rank's own facts, read in the child at dump time: its process group (what makes it a rank,
whoever started it) and the store keys its threads wait for.

Standard-library only, like the rest of ``inject/``: it reads ``torch.distributed`` only when the
process has already imported it, and never imports torch. The flight-recorder listener thread
(``hook._serve_collectives``) calls :func:`rank_facts` when a capture asks; it never blocks and
runs no user code: the process group's getters and the stores' ``path``/``host``/``port`` are
torch's own C++ accessors.
"""

from __future__ import annotations

import functools
import sys
import time
from typing import Any

from .imports import sibling

#: A duration's clock, bound at import: out of reach of a test that patches ``time``.
_now = functools.partial(time.clock_gettime, time.CLOCK_MONOTONIC)

#: Store calls that wait for a key, by method name, and the argument that names the key(s).
_WAITING_CALLS = ("get", "wait")

#: The store wait each thread is in now: thread ident -> (method, keys, store, when it began).
#: Written by the wrapped ``Store.get``/``Store.wait`` around the call, read by the listener.
_WAITS: dict[int, tuple[str, list[str], Any, float]] = {}


def _keys(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[str]:
    """The key(s) of a ``get(key)`` or ``wait(keys[, timeout])`` call, as text."""
    first = args[0] if args else kwargs.get("key", kwargs.get("keys"))
    if isinstance(first, (list, tuple)):
        return [str(k) for k in first][:16]
    return [] if first is None else [str(first)]


def _recording(method: str, original: Any) -> Any:
    import threading

    get_ident = threading.get_ident

    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        ident = get_ident()
        _WAITS[ident] = (method, _keys(args, kwargs), self, _now())
        try:
            return original(self, *args, **kwargs)
        finally:
            _WAITS.pop(ident, None)

    call.__name__ = call.__qualname__ = method
    call.__doc__ = getattr(original, "__doc__", None)
    call._torch_hang_wrapped = original  # type: ignore[attr-defined]
    return call


def wrap_stores() -> bool:
    """Record the key of every ``Store.get``/``Store.wait`` in progress (FileStore, TCPStore,
    PrefixStore and HashStore inherit them from torch's ``Store``); idempotent. A call made from
    C++ (a process group's own rendezvous) is not seen. Returns False when there is no Store."""
    c10d = sys.modules.get("torch._C._distributed_c10d")
    store = getattr(c10d, "Store", None)
    if store is None:
        return False
    for method in _WAITING_CALLS:
        original = store.__dict__.get(method)
        if original is None or hasattr(original, "_torch_hang_wrapped"):
            continue
        setattr(store, method, _recording(method, original))
    return True


def _group_role() -> dict[str, Any] | None:
    """``{"kind": "rank", "rank": 1, "world": 2, "backend": "gloo"}`` from the default process
    group, when this process has one (a DataLoader worker forked from a rank has a copy of its
    parent's group, but no listener to ask, so it never says so)."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    role: dict[str, Any] = {"kind": "rank", "rank": int(dist.get_rank())}
    role["world"] = int(dist.get_world_size())
    backend = str(dist.get_backend())
    if backend:
        role["backend"] = backend
    return role


def _store_facts(store: Any) -> dict[str, Any]:
    """What a store is and where it lives: its class, a FileStore's path, a TCPStore's address;
    a PrefixStore is described by the store under it (its prefix is not exposed)."""
    out: dict[str, Any] = {"store": type(store).__name__}
    inner = store
    for _ in range(8):  # PrefixStore(PrefixStore(FileStore)): the innermost has the file
        under = getattr(inner, "underlying_store", None)
        if under is None:
            break
        inner = under
        out["prefixed"] = True
    if inner is not store:
        out["under"] = type(inner).__name__
    path = getattr(inner, "path", None)
    if isinstance(path, str):
        out["path"] = path
    host, port = getattr(inner, "host", None), getattr(inner, "port", None)
    if isinstance(host, str) and isinstance(port, int):
        out["address"] = f"{host}:{port}"
    return out


def _store_waits() -> list[dict[str, Any]]:
    out = []
    for ident, (method, keys, store, began) in list(_WAITS.items()):
        row: dict[str, Any] = {"thread": hex(ident), "method": method, "keys": keys}
        row["waited_s"] = round(max(_now() - began, 0.0), 3)
        try:
            row.update(_store_facts(store))
        except Exception as exc:  # the key is still worth saying
            row["store"] = f"? ({type(exc).__name__})"
        out.append(row)
    return out


def rank_facts() -> dict[str, Any]:
    """This process's role as a rank (``Role`` fields), its threads' store waits and the
    arguments of the ``torch.distributed`` calls they are in, as JSON-ready
    data; each part is left out (with why, under ``errors``) when it cannot be read."""
    out: dict[str, Any] = {}
    errors = []
    try:
        role = _group_role()
        if role is not None:
            out["role"] = role
    except Exception as exc:
        errors.append(f"process group: {type(exc).__name__}: {exc}")
    try:
        out["store_waits"] = _store_waits()
    except Exception as exc:
        errors.append(f"store waits: {type(exc).__name__}: {exc}")
    try:  # the arguments of the call each thread is stuck in, to compare with the peers'
        out["frame_args"] = sibling("peerargs").stuck_frames()
    except Exception as exc:
        errors.append(f"stuck calls' arguments: {type(exc).__name__}: {exc}")
    if errors:
        out["errors"] = errors
    return out
