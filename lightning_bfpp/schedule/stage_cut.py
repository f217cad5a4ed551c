"""How a model's ordered layers are cut into contiguous pipeline stages (pure arithmetic, shared by
the runtime's cut (layout.cut) and the simulator's cost model)."""
from __future__ import annotations

from collections.abc import Sequence


def balanced_stage_layers(weights: Sequence[int], num_stages: int) -> list[int]:
    """Layers per stage: contiguous, at least one layer each, minimising the heaviest stage."""
    n = len(weights)
    if num_stages > n:
        raise ValueError(
            f"{num_stages} stages (pipeline_parallel x loops) need at least as many layers, "
            f"but pipeline_layers() returns {n}; lower pipeline_parallel or loops so that pipeline_parallel x loops "
            f"<= {n}."
        )
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + max(w, 1))  # parameter-free layers still cost something
    # best[k][i]: minimal max-stage weight splitting the first i layers into k stages.
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0
    for k in range(1, num_stages + 1):
        for i in range(k, n - (num_stages - k) + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    layout, i = [], n
    for k in range(num_stages, 0, -1):
        layout.append(i - cut[k][i])
        i = cut[k][i]
    return layout[::-1]
