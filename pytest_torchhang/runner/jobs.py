"""Jobs that run inside runner children: iterate a DataLoader, live one rank's life.

Imported by the parent too (to unpickle ``LoaderStats``), so torch is only imported inside them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from .. import clock
from ..inject import hook


@dataclass
class LoaderStats:
    """What ``torch_hang.dataloader`` saw."""

    batches: int = 0
    first_batch_s: float | None = None
    batch_times: list[float] = field(default_factory=list)
    worker_pids: list[int] = field(default_factory=list)
    start_method: str = ""


def _loader(
    dataset_or_factory: Any, multiprocessing_context: str | None, loader_kwargs: dict[str, Any]
) -> Any:
    from torch.utils.data import DataLoader, Dataset, IterableDataset

    made = dataset_or_factory
    if (
        callable(made)
        and not isinstance(made, (Dataset, IterableDataset))
        and not hasattr(made, "__getitem__")
    ):
        made = made()
    if isinstance(made, DataLoader):
        return made
    kwargs = dict(loader_kwargs)
    if multiprocessing_context is not None and kwargs.get("num_workers", 0) > 0:
        kwargs["multiprocessing_context"] = multiprocessing_context
    return DataLoader(made, **kwargs)


def iterate_loader(
    dataset_or_factory: Any,
    batches: int | None,
    multiprocessing_context: str | None,
    loader_kwargs: dict[str, Any],
) -> LoaderStats:
    """Build the loader here, in the child, and time ``batches`` batches (all when None)."""
    loader = _loader(dataset_or_factory, multiprocessing_context, loader_kwargs)
    stats = LoaderStats()
    start = last = clock.perf_counter()
    iterator = iter(loader)
    workers = getattr(iterator, "_workers", [])
    stats.worker_pids = [w.pid for w in workers]
    context = loader.multiprocessing_context
    if workers:
        stats.start_method = (
            context.get_start_method() if context is not None else workers[0]._start_method or ""
        )
        if not stats.start_method:
            import multiprocessing

            stats.start_method = multiprocessing.get_start_method()
    for _ in iterator:
        now = clock.perf_counter()
        stats.batch_times.append(now - last)
        if stats.first_batch_s is None:
            stats.first_batch_s = now - start
        last = now
        stats.batches += 1
        if batches is not None and stats.batches >= batches:
            break
    del iterator  # shut the workers down here, not at interpreter exit
    return stats


def rank_main(
    fn: Any,
    rank: int,
    world_size: int,
    backend: str,
    store_path: str,
    pg_timeout_s: float,
    init_timeout_s: float,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    """One rank: join the group through a FileStore, run ``fn(rank, world_size, ...)``, leave."""
    import torch.distributed as dist

    if backend == "nccl":
        import torch

        torch.cuda.set_device(0)  # CUDA_VISIBLE_DEVICES holds this rank's own GPU
    since_ns = clock.wall_ns()  # flight-recorder entries older than this are not this group's
    store = dist.FileStore(store_path, world_size)  # type: ignore[attr-defined]
    store.set_timeout(timedelta(seconds=init_timeout_s))
    dist.init_process_group(
        backend,
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=pg_timeout_s),
    )
    # Every rank's init must have returned before any runs ``fn``: a rank whose ``fn`` is quick
    # would otherwise leave the group while a slower peer is still connecting its side of the
    # mesh (gloo: "connectFullMesh failed ... Connection closed by peer"), seen on a busy machine.
    store.set(f"torchhang/joined/{rank}", "1")
    store.wait(
        [f"torchhang/joined/{r}" for r in range(world_size)], timedelta(seconds=init_timeout_s)
    )
    hook.start_collectives_listener(since_ns)  # no-op where the import hook started it
    result = fn(rank, world_size, *args, **kwargs)
    dist.destroy_process_group()
    return result


def call_test(function: Any, funcargs: dict[str, Any]) -> None:
    """The body of an ``isolate=True`` test."""
    function(**funcargs)
