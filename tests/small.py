"""Tiny configs of the benchmark models: each captures in about a second."""

from __future__ import annotations

from typing import Any

import memplan

SMALL: dict[str, dict[str, Any]] = {
    "resnet": {"depth": 14, "batch": 2, "image": 32, "classes": 10},
    "lstm": {"steps": 4, "batch": 2, "hidden": 32, "input": 8, "classes": 10},
    "gpt": {"layers": 2, "d_model": 32, "heads": 2, "seq_len": 16, "vocab": 100, "batch": 2},
}


def small(name: str, **overrides: Any) -> memplan.models.Workload:
    return memplan.models.get(name, **{**SMALL[name], **overrides})
