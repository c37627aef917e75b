"""Stall detection's cost on the path users take: per DataLoader batch, per optimizer step, per loop.

A generated pytest session times, inside its test, (1) ``next()`` on a single-process
DataLoader over ready-made tensors, where a batch costs a few microseconds, so the beat's own
cost shows; (2) ``optimizer.step()`` of a one-parameter model; (3) a 4-worker FakeData
training loop (CIFAR-sized images, a small model), the loop the goal is stated for. The same file
runs in sessions with ``--torch-hang-stall=600`` (beats on) and without (``--torch-hang-timeout``
only), taking turns. Goals (issue 12): under 1 us per batch and per step, under 1% of the loop.
Run: ``python bench/bench_stall.py [--rounds N]``.
"""

from __future__ import annotations

import tempfile
import textwrap
from pathlib import Path

from _common import OUT_ENV, machine, median, parser, run_session, spread, table

TEST = textwrap.dedent(
    """
    import json
    import os
    import time

    import torch
    from torch.utils.data import DataLoader
    from torchvision import transforms
    from torchvision.datasets import FakeData

    CALLS = int(os.environ["BENCH_CALLS"])
    BATCHES = int(os.environ["BENCH_BATCHES"])


    def per_call(fn, calls):
        best = float("inf")
        for _ in range(5):  # the best of five blocks: the least disturbed by the machine
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            best = min(best, (time.perf_counter() - start) / calls)
        return best


    def test_costs():
        data = [torch.zeros(1)] * (CALLS * 6)
        batches = iter(DataLoader(data, batch_size=1))
        next_batch = per_call(lambda: next(batches), CALLS)

        weight = torch.nn.Parameter(torch.zeros(1))
        weight.grad = torch.zeros(1)
        optimizer = torch.optim.SGD([weight], lr=0.0)
        step = per_call(optimizer.step, CALLS)

        images = FakeData(size=BATCHES * 32, image_size=(3, 32, 32), transform=transforms.ToTensor())
        model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 32 * 32, 10))
        sgd = torch.optim.SGD(model.parameters(), lr=0.01)
        loader = DataLoader(images, batch_size=32, num_workers=4, persistent_workers=True)
        for _ in loader:  # workers started, first epoch out of the way
            pass
        start = time.perf_counter()
        for _epoch in range(3):
            for x, y in loader:
                torch.nn.functional.cross_entropy(model(x), y).backward()
                sgd.step()
                sgd.zero_grad()
        loop = (time.perf_counter() - start) / (3 * BATCHES)
        with open(os.environ[OUT], "w") as out:
            json.dump({"next_batch_s": next_batch, "step_s": step, "loop_batch_s": loop}, out)
    """
).replace("OUT]", f"{OUT_ENV!r}]")


def main() -> None:
    args_parser = parser(__doc__)
    args_parser.add_argument("--rounds", type=int, default=5, help="Sessions of each kind")
    args = args_parser.parse_args()
    rounds, calls, batches = (1, 2_000, 8) if args.quick else (args.rounds, 20_000, 40)
    env = {"BENCH_CALLS": str(calls), "BENCH_BATCHES": str(batches)}
    kinds = {
        "stall detection on": ["--torch-hang-timeout=600", "--torch-hang-stall=600"],
        "off (timeout only)": ["--torch-hang-timeout=600"],
    }
    figures: dict[str, list[dict[str, float]]] = {kind: [] for kind in kinds}
    with tempfile.TemporaryDirectory(prefix="bench-stall-") as tmp:
        root = Path(tmp)
        (root / "test_costs.py").write_text(TEST)
        for _ in range(rounds):
            for kind, options in kinds.items():  # taking turns: the machine's drift hits both
                session = run_session(root, [*options, "-p", "no:randomly"], env=env)
                figures[kind].append(session.figures)  # type: ignore[arg-type]
    print(f"stall detection: cost per DataLoader batch, optimizer step and loop ({machine()})")
    print(
        f"{rounds} session(s) of each kind, medians; a 4-worker FakeData loop of {batches} batches"
    )
    rows = []
    for key, label, unit in (
        ("next_batch_s", "next() of a single-process DataLoader", 1e6),
        ("step_s", "optimizer.step(), one parameter", 1e6),
        ("loop_batch_s", "4-worker FakeData training loop, per batch", 1e3),
    ):
        on = [f[key] * unit for f in figures["stall detection on"]]
        off = [f[key] * unit for f in figures["off (timeout only)"]]
        rows.append((label, median(off), median(on), median(on) - median(off), spread(on)))
    table(["", "off", "on", "on - off", "on, min-max"], rows, first=46)
    print("(first two rows in microseconds per call, the loop in milliseconds per batch)")
    loop_off, loop_on = rows[2][1], rows[2][2]
    print(f"loop overhead: {100 * (loop_on - loop_off) / loop_off:+.2f}% (goal: under 1%)")
    print(f"per batch: {rows[0][3]:+.2f} us, per step: {rows[1][3]:+.2f} us (goal: under 1 us)")
    share = (max(rows[0][3], 0) + max(rows[1][3], 0)) / (1000 * loop_off)
    print(
        f"the beats' share of a loop batch (one batch and one step): {100 * share:.4f}% "
        "(the loop row above is the machine's noise at this size)"
    )


if __name__ == "__main__":
    main()
