"""Helpers the recipe scripts share: checking and reporting, not needed to use memplan."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn


def parser(doc: str | None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=(doc or "").split("\n\n")[0])
    p.add_argument("--json", help="write the results here (the tests read them)")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads (exactness needs "
                   "the same count for both sides)")
    return p


def parse_budget(text: str, least: Any) -> object:
    """A --budget argument: 'auto' (midway between the least-memory plan ``least`` and the
    plain peak), an int of bytes, a float fraction of the plain peak, or a size string."""
    if text == "auto":
        return (least.peak_bytes + least.plain_peak_bytes) // 2
    if text.replace(".", "", 1).isdigit():
        return float(text) if "." in text else int(text)
    return text


def grads(model: nn.Module) -> list[torch.Tensor | None]:
    """Parameter gradients in order; DTensor (FSDP2) gradients gathered to full tensors."""
    out: list[torch.Tensor | None] = []
    for p in model.parameters():
        g = p.grad
        if g is not None and hasattr(g, "full_tensor"):
            g = g.full_tensor()
        out.append(None if g is None else g.detach().clone())
    return out


RTOL, ATOL = 1e-5, 1e-6  # float32 tolerance where summation order differs (all-reduce)


def compare(a: Sequence[torch.Tensor | None], b: Sequence[torch.Tensor | None]
            ) -> dict[str, Any]:
    """Bit-equality, allclose(rtol=RTOL, atol=ATOL) and the largest absolute difference of
    two gradient lists."""
    assert len(a) == len(b), (len(a), len(b))
    equal, close, worst = True, True, 0.0
    for x, y in zip(a, b):
        if x is None or y is None:
            equal &= x is None and y is None
            close &= x is None and y is None
            continue
        equal &= torch.equal(x, y)
        close &= torch.allclose(x, y, rtol=RTOL, atol=ATOL)
        worst = max(worst, (x.float() - y.float()).abs().max().item())
    return {"equal": bool(equal), "allclose": bool(close), "max_abs_diff": worst,
            "rtol": RTOL, "atol": ATOL}


def interleaved_medians(steps: Sequence[Callable[[], Any]], repeat: int = 5) -> list[float]:
    """Median wall time of each step function, run in turns (noise hits all alike)."""
    times: list[list[float]] = [[] for _ in steps]
    for i in range(repeat + 1):  # the first round warms up
        for k, step in enumerate(steps):
            t0 = time.perf_counter()
            step()
            if i:
                times[k].append(time.perf_counter() - t0)
    return [statistics.median(t) for t in times]


def emit(result: dict[str, Any], path: str | None) -> None:
    print(json.dumps(result, indent=1, sort_keys=True))
    if path:
        with open(path, "w") as fh:
            json.dump(result, fh, indent=1, sort_keys=True)
