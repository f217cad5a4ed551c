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

from lightning_bfpp.layout.mesh import build_expert_mesh, build_mesh, parameter_mesh
from lightning_bfpp.schedule import ScheduleSpec
from lightning_bfpp.schedule.dims import CP, DP, DP_CP, EDP, EP, PP, TP, ParallelDims

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
        # context parallel (pp1 x cp2 x tp2): the mesh has a CP dimension, and the parameters' mesh one of dp x cp
        cp_dims = ParallelDims(world=WORLD, spec=ScheduleSpec(pipeline_parallel=1), tensor_parallel=2,
                               context_parallel=2).validate()
        for timeout in (timedelta(seconds=60), None):
            mesh = build_mesh(cp_dims, "cpu", timeout=timeout)
            params = parameter_mesh(cp_dims, mesh)
            found[f"cp-{timeout is None}"] = [dist.get_process_group_ranks(g.get_group()) for g in (
                mesh[CP], params[DP_CP], params[TP], mesh[TP])] + [params.mesh.tolist(), params.mesh_dim_names]
        # a (pp, dp, cp) mesh and a (pp, dp, tp) one of the same shape (1, 2, 2): two meshes, each with its names; the
        # experts' mesh of ep=2 x tp=2, (PP, EDP, EP, TP): an ep group is the replicas at one tp coordinate
        only_cp = ParallelDims(world=WORLD, spec=ScheduleSpec(pipeline_parallel=1), context_parallel=2).validate()
        ep_tp = ParallelDims(world=WORLD, spec=ScheduleSpec(pipeline_parallel=1), tensor_parallel=2,
                             expert_parallel=2).validate()
        found["same shape"] = [build_mesh(d, "cpu", timeout=timedelta(seconds=60)).mesh_dim_names
                               for d in (only_cp, ep_tp)]
        experts = build_expert_mesh(ep_tp, build_mesh(ep_tp, "cpu", timeout=timedelta(seconds=60)), "cpu",
                                    timedelta(seconds=60))
        found["ep x tp"] = [experts.mesh_dim_names, experts.mesh.tolist()] + [
            dist.get_process_group_ranks(experts[n].get_group()) for n in (EDP, EP, TP)]
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
    for rank in range(WORLD):  # cp groups: ranks tp apart; gradients over dp x cp (dp 1: the cp group)
        for key in ("cp-False", "cp-True"):
            cp_group, grads, tp_params, tp_mesh, grid, names = out[rank][key]
            assert cp_group == grads == [rank % 2, rank % 2 + 2] and tp_params == tp_mesh == [rank // 2 * 2,
                                                                                              rank // 2 * 2 + 1]
            assert grid == [[[0, 1], [2, 3]]] and names == (PP, DP_CP, TP)
    for rank in range(WORLD):
        assert out[rank]["same shape"] == [(PP, DP, CP), (PP, DP, TP)]
        names, grid, edp, ep, tp = out[rank]["ep x tp"]
        assert names == (PP, EDP, EP, TP) and grid == [[[[0, 1], [2, 3]]]]
        assert edp == [rank] and ep == [rank % 2, rank % 2 + 2] and tp == [rank // 2 * 2, rank // 2 * 2 + 1]
    assert out[0]["timeout"] is not None and 1.5 < out[0]["timeout"] < 8, out[0]["timeout"]
    # building the same layout again (every Trainer run does) creates no new groups, so no new gloo threads
    assert all(out[r]["reused"] and out[r]["new_threads"] == 0 for r in range(WORLD)), dict(out)


def test_parallel_dims_own_every_ranks_coordinates():
    """Global rank = ((pipeline rank x dp + replica) x cp + context-parallel rank) x tp + tensor-parallel rank, the
    layout torch's init_device_mesh gives the shape (pp, dp[, cp][, tp]) (checked against it above); every group and
    leader follows from it, and the gradient groups (dp x cp) partition the world."""
    for pp, cp, tp, world in ((2, 1, 1, 4), (1, 1, 2, 4), (2, 1, 2, 8), (4, 1, 1, 4), (2, 2, 1, 8), (1, 2, 2, 8),
                              (2, 2, 2, 8)):
        dims = ParallelDims(world=world, spec=ScheduleSpec(pipeline_parallel=pp), tensor_parallel=tp,
                            context_parallel=cp).validate()
        dp = dims.data_parallel
        assert dims.mesh_shape == tuple(n for n, keep in ((pp, True), (dp, True), (cp, cp > 1), (tp, tp > 1)) if keep)
        assert dims.mesh_dim_names == tuple(n for n, size in ((PP, 0), (DP, 0), (CP, cp), (TP, tp)) if size != 1)
        grid = torch.arange(world).reshape(pp, dp, cp, tp)
        for rank in range(world):
            p, d, t, c = dims.coordinates(rank)
            assert grid[p, d, c, t] == rank == dims.rank(p, d, t, c)
            assert dims.group(PP, rank) == grid[:, d, c, t].tolist()
            assert dims.group(DP, rank) == grid[p, :, c, t].tolist()
            assert dims.group(CP, rank) == grid[p, d, :, t].tolist()
            assert dims.group(TP, rank) == grid[p, d, c, :].tolist()
            assert dims.gradient_group(rank) == grid[p, :, :, t].flatten().tolist()
            assert dims.replica_leader(rank) == grid[0, d, 0, 0]
        assert dims.across_pipeline_ranks((0, pp - 1)) == [grid[[0, pp - 1], d, c, t].tolist()
                                                         for d in range(dp) for c in range(cp) for t in range(tp)]
        assert sorted(r for g in dims.gradient_groups() for r in g) == list(range(world))
        assert dims.parameter_mesh_shape == ((pp, dp * cp) + ((tp,) if tp > 1 else ()) if cp > 1 else dims.mesh_shape)
