"""layout.mesh.build_mesh with a timeout (public new_subgroups_by_enumeration + DeviceMesh.from_group): the same ranks
per dimension as init_device_mesh, and its groups time out after the given timeout. 4 gloo processes on the CPU."""

from __future__ import annotations

import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from procenv import free_port

from lightning_bfpp.layout.mesh import build_mesh
from lightning_bfpp.schedule import ScheduleSpec
from lightning_bfpp.schedule.dims import DP, PP, TP, ParallelDims

WORLD = 4
LAYOUTS = ((2, 1), (1, 2), (2, 2), (4, 1))  # (pipeline_parallel, tensor_parallel) built by every rank


def _dims(pp: int, tp: int = 1) -> ParallelDims:
    return ParallelDims(world=WORLD, spec=ScheduleSpec(pipeline_parallel=pp), tensor_parallel=tp).validate()


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _worker(rank: int, port: int, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=60))
    try:
        found = {}
        for pp, tp in LAYOUTS:
            names = (PP, DP, TP) if tp > 1 else (PP, DP)
            ours = build_mesh(_dims(pp, tp), "cpu", timeout=timedelta(seconds=60))
            torch_s = build_mesh(_dims(pp, tp), "cpu")  # init_device_mesh
            found[(pp, tp)] = [(dist.get_process_group_ranks(ours[n].get_group()),
                                dist.get_process_group_ranks(torch_s[n].get_group())) for n in names]
            assert ours.mesh.tolist() == torch_s.mesh.tolist()
            t = torch.ones(())
            dist.all_reduce(t, group=ours[names[-1]].get_group())  # the groups work
            found[(pp, tp, "sum")] = t.item()
        again = build_mesh(_dims(2), "cpu", timeout=timedelta(seconds=60))  # a later run's mesh: the same groups
        found["reused"] = again is build_mesh(_dims(2), "cpu", timeout=timedelta(seconds=60))
        threads = _threads()
        for _ in range(5):
            build_mesh(_dims(2), "cpu", timeout=timedelta(seconds=60))
        found["new_threads"] = _threads() - threads
        mesh = build_mesh(_dims(2), "cpu", timeout=timedelta(seconds=2))
        if rank == 0:  # rank 1 (its data-parallel peer) never joins: the all-reduce must fail after ~2 s, not 30 min
            start = time.monotonic()
            try:
                dist.all_reduce(torch.ones(()), group=mesh[DP].get_group())
                found["timeout"] = None
            except RuntimeError:
                found["timeout"] = time.monotonic() - start
        elif rank == 1:
            time.sleep(10)  # alive (a closed connection would fail the all-reduce at once), but not in the collective
        out[rank] = found
    finally:
        dist.destroy_process_group()


def test_mesh_with_timeout_matches_init_device_mesh_and_times_out():
    manager = mp.Manager()
    out = manager.dict()
    mp.start_processes(_worker, args=(free_port(), out), nprocs=WORLD, start_method="spawn")
    for rank in range(WORLD):
        layouts = {key: dims for key, dims in out[rank].items() if len(key) == 2}  # (pp, tp): each mesh dim's groups
        assert sorted(layouts) == sorted(LAYOUTS), (rank, sorted(layouts))
        for key, dims in layouts.items():
            assert all(ours == theirs for ours, theirs in dims), (rank, key, dims)
            assert rank in dims[0][0]
        assert out[rank][(2, 2, "sum")] == 2.0 and out[rank][(1, 2, "sum")] == 2.0
    assert out[0]["timeout"] is not None and 1.5 < out[0]["timeout"] < 8, out[0]["timeout"]
    # building the same layout again (every Trainer run does) creates no new groups, so no new gloo threads
    assert all(out[r]["reused"] and out[r]["new_threads"] == 0 for r in range(WORLD)), dict(out)


def test_parallel_dims_own_every_ranks_coordinates():
    """Global rank = (pipeline rank x dp + replica) x tp + tensor-parallel rank, the layout torch's init_device_mesh
    gives the shape (pp, dp[, tp]) (checked against it above); every group and leader follows from it."""
    for pp, tp, world in ((2, 1, 4), (1, 2, 4), (2, 2, 8), (4, 1, 4)):
        dims = ParallelDims(world=world, spec=ScheduleSpec(pipeline_parallel=pp), tensor_parallel=tp).validate()
        dp = dims.data_parallel
        assert dims.mesh_shape == ((pp, dp, tp) if tp > 1 else (pp, dp))
        grid = torch.arange(world).reshape(pp, dp, tp)
        for rank in range(world):
            p, d, t = dims.coordinates(rank)
            assert grid[p, d, t] == rank == dims.rank(p, d, t)
            assert dims.group(PP, rank) == grid[:, d, t].tolist()
            assert dims.group(DP, rank) == grid[p, :, t].tolist()
            assert dims.group(TP, rank) == grid[p, d, :].tolist()
            assert dims.replica_leader(rank) == grid[0, d, 0]
        assert dims.across_pipeline_ranks((0, pp - 1)) == [grid[[0, pp - 1], d, t].tolist()
                                                         for d in range(dp) for t in range(tp)]
