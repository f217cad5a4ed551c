"""The one rule every exactness test compares by: a layout's run and its one-process reference, both in float64.

Float32 cannot decide exactness: after a few SGD steps two correct float32 runs that only add in another order end
a few ulps apart (1e-6 on values near 1-4), and which side of a 1e-6 bound they land on depends on the machine's
vector units and BLAS kernels. In float64 the same rounding is ~1e-15, so a bound of `EXACT_TOL` = 1e-10 sits five
orders of magnitude above it and five below a real error of 1e-5 (a count off by one token, a scale applied twice).
Runs train with ``Trainer(precision="64-true")``; references build the model as the run does (float32
initialization, then ``.double()``) and feed float64 inputs (``exact_model.as_float64``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

EXACT_TOL = 1e-10
PRECISION = "64-true"  # the Trainer precision of every exactness run
ELEMENT_BYTES = 8  # bytes of one float64 element: what an exactness run's activations, messages and weights count


def _pairs(actual: Any, expected: Any, what: str) -> list[tuple[str, Any, Any]]:
    """(name, actual, expected) for every value compared; the names of two mappings must agree."""
    if isinstance(expected, Mapping):
        assert set(actual) == set(expected), (
            f"{what}: names differ: only in the run {sorted(set(actual) - set(expected))}, only in the reference "
            f"{sorted(set(expected) - set(actual))}")
        return [(f"{what}[{k!r}]", actual[k], expected[k]) for k in expected]
    if isinstance(expected, Sequence) and not isinstance(expected, str):
        assert len(actual) == len(expected), f"{what}: {len(actual)} values in the run, {len(expected)} in reference"
        return [(f"{what}[{i}]", a, e) for i, (a, e) in enumerate(zip(actual, expected))]
    return [(what, actual, expected)]


def _as_float64(value: Any, name: str) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        if value.is_floating_point():
            assert value.dtype == torch.float64, (
                f"{name} is {value.dtype}: exactness is compared in float64 (precision={PRECISION!r} and a float64 "
                "reference), where rounding cannot decide it")
        return value.detach().to(torch.float64)
    return torch.tensor(value, dtype=torch.float64)


def max_difference(actual: Any, expected: Any, what: str = "value") -> tuple[float, str]:
    """The largest |actual - expected| over tensors, mappings of tensors (same names) or sequences of numbers, and
    the name of the value where it is."""
    worst, where = 0.0, what
    for name, a, e in _pairs(actual, expected, what):
        a64, e64 = _as_float64(a, name), _as_float64(e, name)
        assert a64.shape == e64.shape, f"{name}: shape {tuple(a64.shape)} in the run, {tuple(e64.shape)} in reference"
        diff = (a64 - e64).abs().max().item() if a64.numel() else 0.0
        if math.isnan(diff):  # NaN is the worst
            return diff, name
        if diff > worst:
            worst, where = diff, name
    return worst, where


def assert_exact(actual: Any, expected: Any, what: str, tol: float = EXACT_TOL) -> float:
    """Assert that a run's values equal its reference's to `tol` (float64 both); returns the largest difference."""
    diff, where = max_difference(actual, expected, what)
    assert diff <= tol, f"{where}: max |run - reference| = {diff:.3g} > {tol:g} (float64)"
    return diff
