"""An IterableDataset streams the shards of dataset.epoch and waits for that epoch's shard directory to
be complete; the training loop sets dataset.epoch each epoch and removes the finished epoch's shards.
With persistent_workers=True the workers keep the copy of the dataset they forked with (epoch 0), so
in epoch 1 they wait for epoch 0's shards, which were removed."""

import os
import shutil
import time

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info


class EpochShards(IterableDataset):
    def __init__(self, root):
        self.root = root
        self.epoch = 0

    def __iter__(self):
        info = get_worker_info()
        shard_dir = os.path.join(self.root, f"epoch-{self.epoch}")
        while not os.path.exists(os.path.join(shard_dir, "_SUCCESS")):
            time.sleep(0.05)  # the preprocessing job has not finished this epoch yet
        with open(os.path.join(shard_dir, f"part-{info.id}")) as fh:
            for line in fh:
                yield torch.tensor([float(line)])


def write_epoch(root, epoch):
    d = os.path.join(root, f"epoch-{epoch}")
    os.makedirs(d)
    for part in range(2):
        with open(os.path.join(d, f"part-{part}"), "w") as fh:
            fh.write(f"{epoch}\n{epoch}\n")
    open(os.path.join(d, "_SUCCESS"), "w").close()


def train(root, persistent):
    dataset = EpochShards(root)
    loader = DataLoader(dataset, batch_size=2, num_workers=2, persistent_workers=persistent)
    seen = []
    for epoch in range(2):
        write_epoch(root, epoch)
        dataset.epoch = epoch
        seen.append(sum(float(b.sum()) for b in loader))
        shutil.rmtree(os.path.join(root, f"epoch-{epoch}"))  # free the disk
    return seen


def test_two_epochs_with_persistent_workers(tmp_path):
    assert train(str(tmp_path), persistent=True) == [0.0, 4.0]


def test_two_epochs_with_fresh_workers(tmp_path):
    assert train(str(tmp_path), persistent=False) == [0.0, 4.0]
