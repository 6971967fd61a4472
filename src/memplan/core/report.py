"""Measurement results: plain data, no torch."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from memplan.core.budget import format_bytes


@dataclass(frozen=True)
class MemoryReport:
    """Peak memory of one training step.

    ``peak_bytes`` counts every live storage (parameters, gradients, buffers, inputs,
    activations, backward temporaries), each storage once. ``breakdown_at_peak`` splits the
    peak by kind. ``allocator_peak_bytes`` is the CUDA caching allocator's own peak (CUDA only).
    """

    name: str
    device: str
    simulated: bool
    peak_bytes: int
    forward_peak_bytes: int
    breakdown_at_peak: dict[str, int]
    param_bytes: int
    step_time_s: float | None = None
    allocator_peak_bytes: int | None = None
    device_name: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> str:
        how = "simulated" if self.simulated else "measured"
        parts = ", ".join(f"{k} {format_bytes(v)}" for k, v in self.breakdown_at_peak.items() if v)
        line = f"{self.name} [{how}, {self.device}]: peak {format_bytes(self.peak_bytes)} ({parts})"
        if self.step_time_s is not None:
            line += f", step {self.step_time_s * 1e3:.1f} ms"
        return line
