"""Bench results as files: CSV (every field), a markdown table and log-log PNG plots."""

from __future__ import annotations

import csv
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

from memplan.core.budget import GB, format_bytes

Row = dict[str, Any]
COLUMNS = ("model", "size_key", "size", "method", "detail", "mode", "device", "device_name",
           "predicted_peak_bytes", "measured_peak_bytes", "allocator_peak_bytes",
           "plain_over_peak", "extra_flops", "extra_pct", "step_time_s", "time_vs_plain",
           "seconds", "spec", "note")


def write_csv(rows: Sequence[Row], path: Path, columns: Sequence[str] = COLUMNS) -> None:
    """Every field of every row: ``columns`` first, then the others as first seen."""
    keys = list(dict.fromkeys([*columns, *(k for r in rows for k in r)]))
    with open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=keys)
        writer.writeheader()
        for r in rows:
            writer.writerow({k: r.get(k) for k in keys})


def _b(n: Any) -> str:
    return "" if n is None else format_bytes(int(n))


def markdown(rows: Sequence[Row], title: str) -> str:
    real = any(r.get("mode") == "real" for r in rows)
    cuda = any(r.get("allocator_peak_bytes") is not None for r in rows)
    head = ["size", "method", "detail", "predicted peak", "measured peak"]
    head += ["allocator peak"] if cuda else []
    head += ["plain / peak", "extra FLOPs"]
    head += ["step time", "time / plain"] if real else []
    head += ["note"]
    lines = [f"## {title}", "", "| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for r in rows:
        cells = [f"{r['size_key']}={r['size']}", r["method"], str(r.get("detail", "")),
                 _b(r.get("predicted_peak_bytes")), _b(r.get("measured_peak_bytes"))]
        if cuda:
            cells.append(_b(r.get("allocator_peak_bytes")))
        ratio = r.get("plain_over_peak")
        cells.append("" if ratio is None else f"{ratio:.2f}x")
        pct = r.get("extra_pct")
        cells.append("" if pct is None else f"{pct:.1f}%")
        if real:
            t = r.get("step_time_s")
            cells.append("" if t is None else f"{t * 1e3:.1f} ms")
            tr = r.get("time_vs_plain")
            cells.append("" if tr is None else f"{tr:.2f}")
        cells.append(str(r.get("note") or ""))
        lines.append("| " + " | ".join(cells) + " |")
    names = sorted({str(r["device_name"]) for r in rows if r.get("device_name")})
    lines += ["", "Peaks: every live storage of one training step (parameters, gradients, "
              "buffers, inputs, activations, backward temporaries), measured by memplan's "
              "tracker" + (" on fake tensors (simulated)" if not real else "")
              + "; predicted: memplan's chain model; extra FLOPs: recomputation as a share of "
              "the plain step's FLOPs."]
    if cuda:
        lines.append("Allocator peak: torch.cuda.max_memory_allocated() above what was "
                     "allocated before the step (parameters and inputs); device "
                     + ", ".join(str(n) for n in names) + ".")
    return "\n".join(lines) + "\n"


def plot(rows: Sequence[Row], path: Path, title: str) -> None:
    """Peak vs size per method (log-log); a second panel with step times for real runs."""
    real = any(r.get("step_time_s") for r in rows)
    fig = Figure(figsize=(11 if real else 6.5, 4.2))
    axes = fig.subplots(1, 2 if real else 1, squeeze=False)
    methods = list(dict.fromkeys(r["method"] for r in rows))
    key = rows[0]["size_key"] if rows else "size"
    ax = axes[0][0]
    for i, m in enumerate(methods):
        pts = sorted((r["size"], peak_of(r) / GB) for r in rows
                     if r["method"] == m and peak_of(r))
        if pts:
            style = "--" if all(r.get("measured_peak_bytes") is None for r in rows
                                if r["method"] == m) else "-"
            ax.plot(*zip(*pts), style, marker="o", label=m, color=f"C{i % 10}")
    log_axes(ax, key, "peak memory (GB)", title)
    if real:
        ax = axes[0][1]
        for i, m in enumerate(methods):
            pts = sorted((r["size"], r["step_time_s"]) for r in rows
                         if r["method"] == m and r.get("step_time_s"))
            if pts:
                ax.plot(*zip(*pts), marker="o", label=m, color=f"C{i % 10}")
        log_axes(ax, key, "time per step (s)", "step time")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def peak_of(r: Row) -> float:
    """The measured peak where there is one (allocator's on CUDA), else the prediction."""
    for k in ("allocator_peak_bytes", "measured_peak_bytes", "predicted_peak_bytes"):
        if r.get(k):
            return float(r[k])
    return 0.0


def log_axes(ax: Any, xlabel: str, ylabel: str, title: str, legend_size: int = 7) -> None:
    """Log-log (base 2) axes with labels, grid and legend: the papers' figure style."""
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=legend_size)


def write_all(rows: Sequence[Row], out: Path, name: str, title: str) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{name}.csv", out / f"{name}.md", out / f"{name}.png"]
    write_csv(rows, paths[0])
    paths[1].write_text(markdown(rows, title))
    plot(rows, paths[2], title)
    return paths
