"""The stdlib byte corpus — determinism, the split, windows and the global-batch arithmetic."""
from types import SimpleNamespace

import pytest
import torch
from data import (
    ByteWindows,
    CorpusDataModule,
    load_corpus,
    replica_batch_size,
    split_corpus,
    stdlib_files,
)


def test_file_list_is_sorted_stdlib_only():
    files = stdlib_files()
    assert len(files) > 100
    assert all(f.suffix == ".py" for f in files)
    assert not any("site-packages" in f.parts for f in files)
    assert files == sorted(files, key=lambda p: p.as_posix())


def test_corpus_is_deterministic_and_capped():
    a, b = load_corpus(200_000), load_corpus(200_000)
    assert a == b and len(a) == 200_000
    assert load_corpus(300_000)[:200_000] == a  # a bigger cap only appends


def test_split_is_a_deterministic_tail():
    data = load_corpus(100_000)
    train, val = split_corpus(data, 0.1)
    assert train + val == data and len(val) == 10_000
    with pytest.raises(ValueError, match="val_fraction"):
        split_corpus(data, 1.5)


def test_windows_shift_by_one():
    ds = ByteWindows(bytes(range(100)), block_size=8)
    assert len(ds) == (100 - 9) // 8 + 1
    x, y = ds[2]
    assert x.dtype == torch.int64 and x.shape == (8,)
    assert x.tolist() == list(range(16, 24)) and y.tolist() == list(range(17, 25))
    x, y = ds[len(ds) - 1]  # the last window still has its target byte
    assert y.shape == (8,)
    assert len(ByteWindows(bytes(100), block_size=8, stride=4)) == (100 - 9) // 4 + 1


def test_global_batch_splits_over_data_parallel_and_micro_batches():
    assert replica_batch_size(32, data_parallel=2, micro_batches=4) == 16
    with pytest.raises(ValueError, match=r"data.batch_size=30 .* data_parallel x schedule.micro_batches = 2 x 4 = 8"
                                         r".*use data.batch_size=24 or 32"):
        replica_batch_size(30, data_parallel=2, micro_batches=4)


def test_datamodule_reads_layout_from_the_strategy():
    dm = CorpusDataModule(block_size=16, batch_size=8, max_bytes=50_000, val_fraction=0.1)
    dm.trainer = SimpleNamespace(strategy=SimpleNamespace(data_parallel=2, micro_batches=2, world_size=4))
    dm.setup("fit")
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == (4, 16) and y.shape == (4, 16)  # 8 global / dp 2
    val = dm.val_dataloader()
    assert val.drop_last and len(val) == len(dm.val_set) // 4
    first = [b[0] for b, _ in zip(dm.train_dataloader(), range(3))]
    again = [b[0] for b, _ in zip(dm.train_dataloader(), range(3))]
    assert all(torch.equal(a, b) for a, b in zip(first, again))  # seeded shuffle


def test_datamodule_rejects_indivisible_batch():
    dm = CorpusDataModule(block_size=16, batch_size=6, max_bytes=50_000, data_parallel=2, micro_batches=2)
    with pytest.raises(ValueError, match="data.batch_size=6"):
        dm.setup("fit")
