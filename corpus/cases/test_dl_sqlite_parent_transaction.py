"""DataLoader workers read samples from an SQLite file and record each read in an access table; the
training process opened a write transaction on the same file (to log run metadata) and commits it only
after the epoch, so every worker waits in SQLite's busy handler for a lock the training process holds
while it waits for their batches."""

import sqlite3

import torch
from torch.utils.data import DataLoader, Dataset


class SqliteSamples(Dataset):
    def __init__(self, path):
        self.path = path

    def __len__(self):
        return 8

    def __getitem__(self, i):
        db = sqlite3.connect(self.path, timeout=3600)  # wait (up to an hour) for a busy database
        try:
            (value,) = db.execute("SELECT value FROM samples WHERE id = ?", (i,)).fetchone()
            with db:
                db.execute("INSERT INTO reads(id) VALUES (?)", (i,))
        finally:
            db.close()
        return torch.tensor([value])


def make_db(path):
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE samples(id INTEGER PRIMARY KEY, value REAL)")
    db.execute("CREATE TABLE reads(id INTEGER)")
    db.execute("CREATE TABLE runs(note TEXT)")
    db.executemany("INSERT INTO samples VALUES (?, ?)", [(i, float(i)) for i in range(8)])
    db.commit()
    db.close()


def run_epoch(path, commit_first):
    meta = sqlite3.connect(path, isolation_level=None)
    meta.execute("BEGIN IMMEDIATE")
    meta.execute("INSERT INTO runs VALUES ('epoch 0 started')")
    if commit_first:
        meta.execute("COMMIT")
    loader = DataLoader(SqliteSamples(path), batch_size=4, num_workers=2)
    total = sum(float(b.sum()) for b in loader)
    if not commit_first:
        meta.execute("COMMIT")
    meta.close()
    return total


def test_epoch_while_run_metadata_transaction_is_open(tmp_path):
    make_db(str(tmp_path / "samples.db"))
    assert run_epoch(str(tmp_path / "samples.db"), commit_first=False) == 28.0


def test_epoch_after_run_metadata_is_committed(tmp_path):
    make_db(str(tmp_path / "samples.db"))
    assert run_epoch(str(tmp_path / "samples.db"), commit_first=True) == 28.0
