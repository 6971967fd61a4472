"""Captured graphs of small models, stored as JSON in ``tests/core/data/``, so that the core's
tests run without torch. ``tests/tracing/test_graph_fixtures.py`` checks that they equal fresh
captures; ``python -m tests.core.graphs`` (with torch) writes them again."""

from __future__ import annotations

import functools
import json
from pathlib import Path

from memplan.core.graph import Graph

DATA = Path(__file__).parent / "data"
TINY = {
    "resnet": {"depth": 14, "batch": 2, "image": 32},
    "lstm": {"steps": 4, "batch": 2, "hidden": 32, "input": 8, "classes": 10},
    "gpt": {"layers": 2, "d_model": 32, "heads": 2, "seq_len": 16, "vocab": 100, "batch": 2},
}
NAMES = (*TINY, "unet", "calibration", "rope", "flat", "functional")


@functools.cache
def tiny(name: str) -> Graph:
    """The stored graph ``name`` (one of NAMES)."""
    return Graph.from_dict(json.loads((DATA / f"{name}.json").read_text()))


def capture(name: str) -> Graph:
    """``name`` captured now (needs torch)."""
    import memplan
    from tests.builders import (
        FunctionalMLP,
        flat_mlp,
        mlp_input,
        rope_inputs,
        rope_loss,
        square_loss,
        unet_inputs,
        unet_loss,
    )
    from tests.runtime.test_plan_calibration import workload

    if name in TINY:
        return memplan.capture(memplan.models.get(name, **TINY[name]))
    if name == "unet":
        model, x = unet_inputs()
        return memplan.capture(model, x, loss_fn=unet_loss)
    if name == "rope":
        model, ids, mask = rope_inputs()
        return memplan.capture(model, ids, mask, loss_fn=rope_loss)
    if name == "flat":
        return memplan.capture(flat_mlp(), mlp_input(), loss_fn=square_loss)
    if name == "functional":
        return memplan.capture(FunctionalMLP(), mlp_input(), loss_fn=square_loss)
    return memplan.capture(workload())


if __name__ == "__main__":
    DATA.mkdir(exist_ok=True)
    for n in NAMES:
        (DATA / f"{n}.json").write_text(capture(n).to_json())
        print("wrote", DATA / f"{n}.json")
