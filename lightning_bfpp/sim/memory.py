"""Peak memory of one pipeline rank from the allocation events the simulator records
(activations between a micro-batch's forward and backward, gathered weights, unsharded gradients,
a backward's transient working set, what zero bubble's input-gradient pass keeps for its weight pass)
on top of the static parameter/optimizer state."""
from __future__ import annotations

from dataclasses import dataclass, field

CATEGORIES = ("activations", "weights", "gradients", "workspace", "weight_pass")


@dataclass
class MemoryReport:
    """Bytes of one rank: `static` (state), the peak of the total, its split at that moment, and the
    peak of each category on its own."""

    static: float
    peak: float
    at_peak: dict[str, float] = field(default_factory=dict)
    category_peak: dict[str, float] = field(default_factory=dict)

    @property
    def activations(self) -> float:
        return self.category_peak.get("activations", 0.0)


def memory_report(events: list[tuple[float, float, str]], static: float) -> MemoryReport:
    """Sweep (time, delta, category) events; at equal times frees come before allocations."""
    live = dict.fromkeys(CATEGORIES, 0.0)
    best = dict.fromkeys(CATEGORIES, 0.0)
    peak, at_peak = static, dict(live)
    for _, delta, cat in sorted(events, key=lambda e: (e[0], e[1])):
        live[cat] += delta
        best[cat] = max(best[cat], live[cat])
        total = static + sum(live.values())
        if total > peak:
            peak, at_peak = total, dict(live)
    return MemoryReport(static, peak, at_peak, best)
