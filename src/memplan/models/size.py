"""How big a built-in workload's training step is, from its config alone (nothing built):
the forward's aten ops and the step's bytes (parameters + what the forward saves), so that
absurd sizes (``resnet:depth=1000000000``) are refused up front with the estimate instead of
capturing for days. The estimates are within 2x of captured graphs
(``tests/tracing/test_model_size.py``); the limits leave the paper's largest runs (ResNet-1000,
LSTM over 2048 steps) far inside.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from memplan.core.budget import format_bytes
from memplan.errors import ConfigError
from memplan.models.resnet import _BASE_WIDTH, _STAGE_WIDTHS, units_for_depth

MAX_FORWARD_OPS = 1_000_000  # ~30 min of capture on one CPU core (the LSTM over 2048 steps: 121k)
MAX_STEP_BYTES = 2**50  # 1 PiB, fp32: a thousand times the largest accelerator's memory
_FP32 = 4


@dataclass(frozen=True)
class StepSize:
    forward_ops: int
    step_bytes: int  # parameters (fp32) + activations the forward saves for backward

    @property
    def fits(self) -> bool:
        return self.forward_ops <= MAX_FORWARD_OPS and self.step_bytes <= MAX_STEP_BYTES

    def describe(self) -> str:
        return f"about {_count(self.forward_ops)} forward ops and {_bytes(self.step_bytes)}"


def _count(n: int) -> str:
    return f"{n:,}" if n < 10**12 else f"{n:.3g}"


def _bytes(n: int) -> str:
    return format_bytes(n) if n < 2**50 else f"{n / 2**50:.3g} PiB"


def _out(size: int) -> int:
    """Spatial size after a stride-2 conv or pool with 'same' padding (k=3 p=1, k=7 p=3)."""
    return (size - 1) // 2 + 1


def resnet_final_size(image: int) -> int:
    """The last stage's feature map side: the stem (conv, pool) and three strided stages."""
    for _ in range(5):
        image = _out(image)
    return image


def _resnet(p: dict[str, Any]) -> StepSize:
    batch, classes = p["batch"], p["classes"]
    units = units_for_depth(p["depth"])
    side = _out(p["image"])
    acts = 2 * _BASE_WIDTH * side**2  # saved: the stem conv's and relu's outputs
    side = _out(side)
    acts += 3 * _BASE_WIDTH * side**2  # the pool's output and its indices (int64)
    params = 3 * _BASE_WIDTH * 49
    in_ch = _BASE_WIDTH
    for i, (n, width) in enumerate(zip(units, _STAGE_WIDTHS)):
        mid = width // 4
        # The first unit of a stage strides (after stage 1) and projects its shortcut; the
        # n - 1 others are alike: counted in closed form (a billion units cost nothing here).
        out_side = _out(side) if i > 0 else side
        # saved per unit: conv and relu outputs of its two mid convs, its last conv's output,
        # the shortcut conv's (first unit), the unit's relu output
        acts += 2 * mid * side**2 + 2 * mid * out_side**2 + 3 * width * out_side**2
        params += in_ch * mid + 9 * mid * mid + mid * width + in_ch * width
        acts += (n - 1) * (4 * mid + 2 * width) * out_side**2
        params += (n - 1) * (width * mid + 9 * mid * mid + mid * width)
        in_ch, side = width, out_side
    params += in_ch * classes
    acts += 2 * classes
    ops = 16 * sum(units) + 30
    return StepSize(ops, _FP32 * (params + batch * acts))


def _lstm(p: dict[str, Any]) -> StepSize:
    steps, batch, inp, hidden = p["steps"], p["batch"], p["input"], p["hidden"]
    layers, classes = p["layers"], p["classes"]
    params = (inp + hidden) * 4 * hidden + (layers - 1) * 8 * hidden * hidden + hidden * classes
    per_step = batch * (inp + 14 * hidden + (layers - 1) * 15 * hidden + 2 * classes)
    ops = steps * (20 + 13 * (layers - 1)) + 3
    return StepSize(ops, _FP32 * (params + steps * per_step))


def _gpt(p: dict[str, Any]) -> StepSize:
    layers, d, seq, vocab, batch = p["layers"], p["d_model"], p["seq_len"], p["vocab"], p["batch"]
    params = (vocab + seq) * d + layers * 12 * d * d
    acts = batch * seq * (layers * 16 * d + 3 * vocab + 2 * d)
    ops = 31 * layers + 14
    return StepSize(ops, _FP32 * (params + acts))


ESTIMATES: dict[str, Callable[[dict[str, Any]], StepSize]] = {
    "resnet": _resnet, "lstm": _lstm, "gpt": _gpt}


def step_size(name: str, params: dict[str, Any]) -> StepSize:
    """The estimated size of the step of built-in workload ``name`` at ``params`` (all set)."""
    return ESTIMATES[name](params)


def check_size(name: str, params: dict[str, Any], given: dict[str, Any]) -> None:
    """Refuse a config whose step is past the limits, naming the given parameter to lower
    (the one furthest past its own largest accepted value), its accepted range and the
    estimate."""
    size = step_size(name, params)
    if size.fits:
        return
    sizes = [k for k, v in given.items() if isinstance(v, int) and not isinstance(v, bool)
             and k != "seed" and v > 1]
    limits = {k: _largest(name, params, k) for k in sizes}
    lowerable = [k for k in sizes if 1 <= limits[k] < params[k]]
    why = (f"its step would be {size.describe()}, past what memplan captures "
           f"({MAX_FORWARD_OPS:,} forward ops, ~30 min; {_bytes(MAX_STEP_BYTES)})")
    if not lowerable:
        spec = ",".join(f"{k}={v}" for k, v in sorted(given.items()))
        raise ConfigError(f"{name}:{spec}: {why}. Use smaller sizes.")
    key = max(lowerable, key=lambda k: params[k] / limits[k])
    fixed = ", ".join(f"{k}={v}" for k, v in sorted(params.items())
                      if k not in (key, "seed", "dropout"))
    raise ConfigError(f"{name}.{key}: expected an integer in [1, {limits[key]:,}] at {fixed}, "
                      f"got {_count(params[key])}: {why}. Lower {key}.")


def _largest(name: str, params: dict[str, Any], key: str) -> int:
    """The largest value of ``key`` (others fixed) whose step fits; 0 when none does.
    Every estimate grows with every size parameter, so bisection finds it."""
    def fits(v: int) -> bool:
        return step_size(name, {**params, key: v}).fits

    if not fits(1):
        return 0
    lo, hi = 1, int(params[key])
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo
