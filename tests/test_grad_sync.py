"""Buckets of the sharding="none" gradient all-reduce (no processes; the reduction itself is checked against
the single-process reference by the sharding="none" configs of test_exactness.py)."""

from __future__ import annotations

import torch

from lightning_bfpp.runtime.grad_sync import buckets


def test_buckets_keep_order_and_split_by_size_and_dtype():
    f32 = [torch.zeros(n) for n in (10, 10, 30, 5)]  # 40, 40, 120, 20 bytes
    bf16 = torch.zeros(8, dtype=torch.bfloat16)
    grads = [*f32[:2], bf16, *f32[2:]]
    cut = buckets(grads, bucket_bytes=100)
    assert [[id(g) for g in b] for b in cut] == [[id(f32[0]), id(f32[1])], [id(bf16)], [id(f32[2])], [id(f32[3])]]
    assert [t for b in cut for t in b] == grads  # every gradient once, in order
    assert len(buckets(grads, bucket_bytes=2**30)) == 3  # only the dtype changes cut
    assert buckets([], 100) == []
