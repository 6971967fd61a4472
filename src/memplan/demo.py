"""``memplan demo``: the main job on built-in workloads (grows with the planners)."""

from __future__ import annotations

import multiprocessing
from concurrent.futures import ProcessPoolExecutor

from rich.console import Console
from rich.table import Table

from memplan.report import format_bytes

RESNET_DEPTHS = (128, 256, 512, 1024)
LSTM_STEPS = (64, 128, 256, 512, 1024, 2048)
GB = 1e9


def _simulated_peak(spec: tuple[str, dict[str, int]]) -> tuple[int, int, int, float]:
    import time

    import memplan

    start = time.perf_counter()
    report = memplan.measure(memplan.models.get(spec[0], **spec[1]), simulate=True)
    activations = report.breakdown_at_peak["activation"] + report.breakdown_at_peak["backward"]
    return report.peak_bytes, report.param_bytes, activations, time.perf_counter() - start


def run_demo(jobs: int = 2) -> None:
    console = Console()
    console.print(
        "[bold]memplan demo[/bold]: simulated peak memory of one plain PyTorch training step "
        "(fake tensors, fp32, nothing allocated)\n"
    )
    specs = [("resnet", {"depth": d, "batch": 32}) for d in RESNET_DEPTHS]
    specs += [("lstm", {"steps": t}) for t in LSTM_STEPS]
    # Longest first so two workers finish together.
    order = sorted(range(len(specs)), key=lambda i: -_cost(specs[i]))
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=max(1, jobs), mp_context=ctx) as pool:
        futures = {i: pool.submit(_simulated_peak, specs[i]) for i in order}
        results = {i: f.result() for i, f in futures.items()}

    table = Table(title="Paper's ResNet (batch 32, 3x224x224): plain PyTorch")
    for col in ("layers", "peak", "peak (GB)", "parameters", "activations at peak", "simulated in"):
        table.add_column(col, justify="right")
    for i, (name, p) in enumerate(specs):
        if name != "resnet":
            continue
        peak, params, acts, secs = results[i]
        table.add_row(str(p["depth"]), format_bytes(peak), f"{peak / GB:.1f}",
                      format_bytes(params), format_bytes(acts), f"{secs:.1f} s")
    console.print(table)
    console.print("  paper (MXNet, no optimisation, Fig. 5): 48 GB at 1000 layers\n")

    table = Table(title="Paper's LSTM (4 x 1024, batch 64, 5000 classes): plain PyTorch")
    for col in ("unroll T", "peak", "peak (GB)", "parameters", "activations at peak", "simulated in"):
        table.add_column(col, justify="right")
    for i, (name, p) in enumerate(specs):
        if name != "lstm":
            continue
        peak, params, acts, secs = results[i]
        table.add_row(str(p["steps"]), format_bytes(peak), f"{peak / GB:.1f}",
                      format_bytes(params), format_bytes(acts), f"{secs:.1f} s")
    console.print(table)


def _cost(spec: tuple[str, dict[str, int]]) -> int:
    name, p = spec
    return p["steps"] * 10 if name == "lstm" else p["depth"] * 5
