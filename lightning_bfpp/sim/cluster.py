"""What the simulator knows of a machine: a `conf/cluster/*.yaml` dict as numbers (`Cluster`), with the
per-layer times a calibration measured (`LayerTimes`)."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class LayerTimes:
    """Measured seconds per layer for one micro-batch (examples/calibrate.py, `layer_times` in a cluster yaml):
    (forward, backward) of the embedding, of one block and of the head including the loss, for models of one
    shape (`n_head, n_embd, block_size, vocab_size`) at `micro_batch_size` samples per micro-batch."""

    shape: tuple[int, int, int, int]
    micro_batch_size: int
    embedding: tuple[float, float]
    block: tuple[float, float]
    head: tuple[float, float]

    @classmethod
    def from_dict(cls, cfg: Mapping) -> LayerTimes:
        m = cfg["model"]
        pair = lambda v: (float(v[0]), float(v[1]))  # noqa: E731
        return cls((int(m["n_head"]), int(m["n_embd"]), int(m["block_size"]), int(m["vocab_size"])),
                   int(cfg["micro_batch_size"]), pair(cfg["embedding"]), pair(cfg["block"]), pair(cfg["head"]))


@dataclass(frozen=True)
class Cluster:
    """What the simulator needs from a `conf/cluster/*.yaml` dict (bytes/s, FLOP/s, seconds)."""

    devices: int  # per node
    num_nodes: int
    flops: float  # achieved FLOP/s per device
    device_memory: float
    intra_bw: float
    inter_bw: float
    latency: float
    overhead: float = 0.0  # seconds added to every forward and backward action (launch / Python cost)
    backward_factor: float = 2.0  # backward time / forward time (FLOP-based compute)
    collective_bw: float | None = None  # ring bandwidth of intra-node collectives, when unlike p2p (gloo)
    grad_scale: float = 0.0  # host seconds per parameter at REDUCE_GRAD (the runtime's 1/m gradient scaling)
    layer_times: LayerTimes | None = None  # measured per-layer times; win over FLOPs for a model of their shape
    p2p_latency: float | None = None  # per pipeline message as the runtime sees it (default: `latency`)
    step_overhead: float = 0.0  # host seconds per step and rank outside the actions (runtime start and end)
    memory_reserve: float = 0.0  # bytes never available to the step (CUDA context, comm buffers, fragmentation)
    intra_latency: float | None = None  # per in-node collective step (NVLink); default `latency`

    @property
    def usable_memory(self) -> float:
        return self.device_memory - self.memory_reserve

    @property
    def world_size(self) -> int:
        return self.devices * self.num_nodes

    @classmethod
    def from_dict(cls, cfg: Mapping) -> Cluster:
        """`achieved_flops` wins; else `peak_flops * compute_efficiency` (default efficiency 0.5).
        Optional (examples/calibrate.py writes them): `compute_overhead` (seconds added to every
        forward/backward action), `backward_factor`, `collective_bandwidth`, `grad_scale_time_per_param`,
        `layer_times`, `p2p_latency`, `step_overhead`; `memory_reserve` (bytes, default 3 GB on GPUs, 0 on CPUs)
        and `intra_node_latency`."""
        flops = cfg.get("achieved_flops")
        if flops is None:
            if cfg.get("peak_flops") is None:
                raise ValueError(
                    f"cluster={cfg.get('name')!r} has neither achieved_flops nor peak_flops; add "
                    "`achieved_flops: <FLOP/s per device>` to the cluster yaml (examples/calibrate.py measures it)."
                )
            flops = float(cfg["peak_flops"]) * float(cfg.get("compute_efficiency", 0.5))
        collective = cfg.get("collective_bandwidth")
        return cls(
            devices=int(cfg["devices"]), num_nodes=int(cfg.get("num_nodes", 1)), flops=float(flops),
            device_memory=float(cfg["device_memory"]), intra_bw=float(cfg["intra_node_bandwidth"]),
            inter_bw=float(cfg["inter_node_bandwidth"]), latency=float(cfg.get("latency", 0.0)),
            overhead=float(cfg.get("compute_overhead") or 0.0),
            backward_factor=float(cfg.get("backward_factor") or 2.0),
            collective_bw=float(collective) if collective else None,
            grad_scale=float(cfg.get("grad_scale_time_per_param") or 0.0),
            layer_times=LayerTimes.from_dict(cfg["layer_times"]) if cfg.get("layer_times") else None,
            p2p_latency=float(cfg["p2p_latency"]) if cfg.get("p2p_latency") is not None else None,
            step_overhead=float(cfg.get("step_overhead") or 0.0),
            memory_reserve=float(cfg.get("memory_reserve", 3e9 if cfg.get("accelerator") == "gpu" else 0.0)),
            intra_latency=float(cfg["intra_node_latency"]) if cfg.get("intra_node_latency") is not None else None,
        )

    def group_bandwidth(self, ranks: Sequence[int]) -> float:
        """Ring bandwidth of a group of global ranks: intra-node only if all share one node."""
        if len({r // self.devices for r in ranks}) <= 1:
            return self.collective_bw or self.intra_bw
        return self.inter_bw
