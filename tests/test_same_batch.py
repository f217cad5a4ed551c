"""The batch fingerprint the ranks of a replica compare (lightning_bfpp.adapter.same_batch): equal for the same batch,
different for another draw, the same samples in another order, or a NaN on one side only."""

import math

import torch

from lightning_bfpp.adapter.same_batch import _same, fingerprint


def test_fingerprint_tells_batches_apart():
    x, y = torch.arange(12.0).reshape(4, 3), torch.tensor([0, 1, 2, 1])
    same = fingerprint((x.clone(), {"target": y.clone(), "ids": ["a", "b", "c", "d"]}))
    assert same == fingerprint((x, {"target": y, "ids": ["e"]}))  # non-tensor items are not compared
    assert all(_same(a, b) for a, b in zip(same, fingerprint([x, [y]])))
    reordered = fingerprint((x[[1, 0, 2, 3]], {"target": y[[1, 0, 2, 3]]}))
    assert reordered[:2] == same[:2] and not _same(reordered[2], same[2])  # same samples, another order
    other = fingerprint((x + 1e-3, {"target": y}))
    assert not all(_same(a, b) for a, b in zip(other, same))


def test_nan_is_the_same_only_on_both_sides():
    assert _same(math.nan, math.nan) and not _same(math.nan, 1.0) and not _same(1.0, math.nan)
    assert _same(1e12, 1e12 * (1 + 1e-12)) and not _same(1.0, 1.0 + 1e-6)


def test_ragged_tail_of_a_loader():
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_bfpp.adapter.loader import ragged_tail as _ragged_tail

    ds = TensorDataset(torch.zeros(21, 2))
    assert _ragged_tail(DataLoader(ds, batch_size=8)) == 5
    assert _ragged_tail(DataLoader(ds, batch_size=8, drop_last=True)) == 0
    assert _ragged_tail(DataLoader(ds, batch_size=7)) == 0
    assert _ragged_tail(DataLoader(ds, batch_size=None)) == 0  # no batching: unknown, nothing said
