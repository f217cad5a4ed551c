"""A failing rank takes the whole job down, loudly and quickly: nobody waits for a collective forever."""

from __future__ import annotations

import time

import pytest

from launch import run_lightning, run_torchrun


@pytest.mark.parametrize("fail_rank", [0, 3])
def test_failing_rank_stops_every_process(tmp_path, fail_rank):
    start = time.monotonic()
    with pytest.raises(AssertionError, match=f"injected failure on rank {fail_rank}"):
        run_lightning(tmp_path, 4, [{"pp": 2, "loops": 2, "m": 2, "fail_rank": fail_rank}], timeout=100)
    assert time.monotonic() - start < 100


def test_failing_rank_under_torchrun(tmp_path):
    with pytest.raises(AssertionError, match="injected failure on rank 1"):
        run_torchrun(tmp_path, 2, [{"pp": 2, "loops": 1, "m": 2, "fail_rank": 1}], timeout=100)
