"""Tables, CSVs and plots of ``memplan reproduce``, with the paper's numbers beside ours.

The paper's numbers below are typed in from its text (the seed copy has the figures' axes but
not their curves, so no point is read off a curve): each is labelled with where it is stated.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

from memplan.analysis.bench_report import log_axes, write_csv
from memplan.core.budget import GB

Row = dict[str, Any]
GIB = 2**30
TITAN_X_BYTES = 12 * GIB  # the paper's GPU (Sec. 5.1); 12 GB is the card's memory

# (value, where the paper states it)
PAPER: dict[str, tuple[float, str]] = {
    "resnet1000_plain_gb": (48.0, "abstract: '1,000-layer ... from 48G to 7G' (Fig. 5b runtime)"),
    "resnet1000_sublinear_gb": (7.0, "abstract and Sec. 5.2: 'less than 7GB' (Fig. 5b)"),
    "sharing_gain_lo": (2.0, "Sec. 5.2 and Fig. 5 caption: 'factor of two to three'"),
    "sharing_gain_hi": (3.0, "Sec. 5.2 and Fig. 5 caption: 'factor of two to three'"),
    "deepest_sharing_layers": (200.0, "Sec. 5.2: 'only possible to train a 200 layer ResNet'"),
    "lstm_sublinear_gain": (4.0, "Sec. 5.3 and Fig. 6 caption: 'more than 4x reduction'"),
    "time_overhead_pct": (30.0, "Sec. 5.4 and Fig. 7 caption: 'roughly 30%'"),
}


def _gb(n: Any, div: float = GB) -> str:
    return "" if n is None else f"{n / div:.2f}"


def _unit(rows: Sequence[Row]) -> tuple[float, str]:
    """GB at paper scale, MB for tiny (--quick) models."""
    big = max((r.get("plain_peak_bytes") or 0 for r in rows), default=0)
    return (GB, "GB") if big >= 1e9 else (1e6, "MB")


def _pct(n: Any) -> str:
    return "" if n is None else f"{n:.1f}%"


def slope(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    """Least-squares slope of log y against log x (y ~ x^slope)."""
    pts = [(math.log(x), math.log(y)) for x, y in zip(xs, ys) if x and y]
    if len(pts) < 2:
        return None
    mx = sum(p[0] for p in pts) / len(pts)
    my = sum(p[1] for p in pts) / len(pts)
    den = sum((p[0] - mx) ** 2 for p in pts)
    return sum((p[0] - mx) * (p[1] - my) for p in pts) / den if den else None


def memory_table(rows: Sequence[Row], fig: str) -> list[str]:
    has_least = any("least_peak_bytes" in r for r in rows)
    has_meas = any("optimal_measured_bytes" in r for r in rows)
    div, unit = _unit(rows)
    head = [rows[0]["size_key"], f"{fig}a none {unit}", f"{fig}a sharing", f"{fig}a sublinear",
            f"{fig}b plain PyTorch {unit}", "memplan sqrt", "sqrt extra", "memplan optimal",
            "optimal extra"]
    head += ["optimal measured"] if has_meas else []
    head += ["least peak", "least extra"] if has_least else []
    head += ["capture s"]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for r in rows:
        cells = [str(r["size"]), _gb(r["static_none_bytes"], div),
                 _gb(r["static_sharing_bytes"], div), _gb(r["static_sublinear_bytes"], div),
                 _gb(r["plain_peak_bytes"], div), _gb(r["sqrt_peak_bytes"], div),
                 _pct(r["sqrt_extra_pct"]), _gb(r["optimal_peak_bytes"], div),
                 _pct(r["optimal_extra_pct"])]
        if has_meas:
            cells.append(_gb(r.get("optimal_measured_bytes"), div))
        if has_least:
            cells += [_gb(r.get("least_peak_bytes"), div), _pct(r.get("least_extra_pct"))]
        cells.append(str(r["capture_s"]))
        lines.append("| " + " | ".join(cells) + " |")
    sizes = [r["size"] for r in rows]
    fits = [f"{label} {s:.2f}" for label, col in (
        ("none", "static_none_bytes"), ("sharing", "static_sharing_bytes"),
        ("sublinear", "static_sublinear_bytes"), ("plain", "plain_peak_bytes"),
        ("sqrt", "sqrt_peak_bytes"), ("optimal", "optimal_peak_bytes"))
        if (s := slope(sizes, [r[col] for r in rows])) is not None]
    lines += ["", (f"{unit} = 10^{9 if unit == 'GB' else 6} bytes. a: static feature-map bytes (Sec. 5.1: parameters, "
              "gradients and workspace excluded); b: total peak of one step (everything). "
              "plain: measured by memplan's tracker on fake tensors; memplan sqrt/optimal: "
              "predicted by the chain model (optimal at the sqrt plan's peak); extra: "
              "recomputation FLOPs as a share of the plain step."),
              "", "log-log slope vs size: " + ", ".join(fits)]
    return lines


def time_table(rows: Sequence[Row]) -> list[str]:
    has_apply = any("optimal_time_s" in r for r in rows)
    head = ["model", "size", "plain s", "checkpoint_sequential s", "ratio"]
    head += ["memplan sqrt s", "ratio", "memplan optimal s", "ratio"] if has_apply else []
    head += ["sqrt extra FLOPs", "optimal extra FLOPs", "plain peak", "checkpoint_seq. peak"]
    head += ["memplan optimal peak"] if has_apply else []
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for r in rows:
        t0 = r["plain_time_s"]
        cells = [r["model"], f"{r['size_key']}={r['size']}", f"{t0:.3f}",
                 f"{r['checkpoint_sequential_time_s']:.3f}",
                 f"{r['checkpoint_sequential_time_s'] / t0:.2f}"]
        if has_apply:
            for k in ("sqrt", "optimal"):
                t = r.get(f"{k}_time_s")
                cells += ["", ""] if t is None else [f"{t:.3f}", f"{t / t0:.2f}"]
        cells += [_pct(r["sqrt_extra_pct"]), _pct(r["optimal_extra_pct"]),
                  f"{r['plain_peak_bytes'] / 2**20:.1f} MiB",
                  f"{r['checkpoint_sequential_peak_bytes'] / 2**20:.1f} MiB"]
        if has_apply:
            peak = r.get("optimal_peak_bytes")
            cells.append("" if peak is None else f"{peak / 2**20:.1f} MiB")
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", ("Median wall time of one training step on this CPU, one thread, real "
                   f"tensors, {rows[0].get('repeat', '?')} rounds timed round-robin over the "
                   "variants; ratio = time / plain time.")]
    if not has_apply:
        lines.append("memplan rows: n/a, memplan.apply is not available in this build.")
    return lines


def comparison(memory: Sequence[Row], timing: Sequence[Row], quick: bool) -> list[str]:
    """Ours beside the paper's stated numbers."""
    res = [r for r in memory if r["model"] == "resnet"]
    lstm = [r for r in memory if r["model"] == "lstm"]
    lines = ["| claim | paper | where the paper says it | ours |", "|---|---|---|---|"]

    def add(claim: str, key: str, paper: str, ours: str) -> None:
        lines.append(f"| {claim} | {paper} | {PAPER[key][1]} | {ours} |")

    at = next((r for r in res if r["size"] == 1000), res[-1] if res else None)
    if at is not None:
        d = at["size"]
        div, unit = _unit(res)

        def amount(n: Any) -> str:
            return "" if n is None else f"{n / div:.2f} {unit}"

        add(f"ResNet-{d} total memory, plain", "resnet1000_plain_gb", "48 GB (MXNet, no "
            "memory optimisation)", f"{amount(at['plain_peak_bytes'])} plain PyTorch "
            "(simulated; PyTorch frees dead tensors)")
        meas = at.get("optimal_measured_bytes")
        add(f"ResNet-{d} total memory, sublinear plan", "resnet1000_sublinear_gb", "< 7 GB",
            f"{amount(at['optimal_peak_bytes'])} memplan optimal, +"
            f"{at['optimal_extra_pct']:.1f}% FLOPs (predicted)"
            + (f"; {amount(meas)} measured after apply" if meas else "")
            + f"; sqrt {amount(at['sqrt_peak_bytes'])}"
            + (f"; least {amount(at['least_peak_bytes'])}" if "least_peak_bytes" in at else ""))
    if res:
        gains = [r["static_none_bytes"] / r["static_sharing_bytes"] for r in res]
        add("static sharing vs no optimisation (feature maps)", "sharing_gain_lo", "2x .. 3x",
            f"{min(gains):.2f}x .. {max(gains):.2f}x (depths {res[0]['size']}..{res[-1]['size']})")
        deep = deepest_under(res, "plain_peak_bytes", TITAN_X_BYTES)
        add("deepest ResNet in a 12 GB Titan X without recomputation", "deepest_sharing_layers",
            "~200 layers", deep)
    if lstm:
        gains = [r["static_sharing_bytes"] / r["static_sublinear_bytes"] for r in lstm]
        totals = [r["plain_peak_bytes"] / r["optimal_peak_bytes"] for r in lstm]
        add("LSTM: sublinear vs sharing", "lstm_sublinear_gain", "> 4x",
            f"feature maps {min(gains):.1f}x .. {max(gains):.1f}x; total plain PyTorch / memplan "
            f"optimal {min(totals):.1f}x .. {max(totals):.1f}x (T {lstm[0]['size']}.."
            f"{lstm[-1]['size']})")
    if timing:
        ck = [r["checkpoint_sequential_time_s"] / r["plain_time_s"] - 1 for r in timing]
        ours = (f"torch checkpoint_sequential +{100 * min(ck):.0f}% .. +{100 * max(ck):.0f}%")
        mp = [r["optimal_time_s"] / r["plain_time_s"] - 1 for r in timing if "optimal_time_s" in r]
        if mp:
            ours = f"memplan optimal +{100 * min(mp):.0f}% .. +{100 * max(mp):.0f}%; " + ours
        ex = [r["optimal_extra_pct"] for r in timing]
        add("extra time per batch, sublinear plan", "time_overhead_pct", "~30% (Titan X)",
            ours + f" (CPU, small models; predicted extra FLOPs {min(ex):.0f}% .. {max(ex):.0f}%)")
    if quick:
        lines.append("\n(--quick: tiny models, so 'ours' is not comparable to the paper.)")
    return lines


def deepest_under(rows: Sequence[Row], col: str, limit: int) -> str:
    """Depth where ``col`` crosses ``limit``, interpolated log-log between swept depths."""
    pts = sorted((r["size"], r[col]) for r in rows)
    for (d0, y0), (d1, y1) in itertools.pairwise(pts):
        if y0 <= limit < y1:
            f = (math.log(limit) - math.log(y0)) / (math.log(y1) - math.log(y0))
            depth = math.exp(math.log(d0) + f * (math.log(d1) - math.log(d0)))
            return (f"~{depth:.0f} layers plain PyTorch (peak crosses 12 GiB between {d0} and "
                    f"{d1}); memplan optimal fits all swept depths"
                    if all(r["optimal_peak_bytes"] <= limit for r in rows) else
                    f"~{depth:.0f} layers plain PyTorch")
    if pts and pts[0][1] > limit:
        return f"none of the swept depths (>= {pts[0][0]})"
    return f"all swept depths (<= {pts[-1][0]}) fit" if pts else ""


def markdown(memory: Sequence[Row], timing: Sequence[Row], quick: bool) -> str:
    out = ["# Reproduction of Chen et al. 2016, Fig. 5-7", ""]
    for model, fig, title in (("resnet", "5", ("Fig. 5: ResNet, batch 32, 3x224x224, memory vs "
                               "layers")), ("lstm", "6", ("Fig. 6: LSTM 4 x 1024, batch 64, "
                                           "memory vs unroll steps"))):
        rows = [r for r in memory if r["model"] == model]
        if rows:
            out += [f"## {title}" + (" (--quick: tiny configs)" if quick else ""), "",
                    *memory_table(rows, fig), ""]
    if timing:
        out += ["## Fig. 7: time per batch (real, small scale, this CPU)", "",
                *time_table(timing), ""]
    out += ["## Ours beside the paper", "", *comparison(memory, timing, quick), "",
            ("The paper's figures are not in our copy of it (only their axes survive), so its "
            "numbers here are the ones its text states.")]
    return "\n".join(out) + "\n"


def plot(memory: Sequence[Row], timing: Sequence[Row], path: Path) -> None:
    panels = [m for m in ("resnet", "lstm") if any(r["model"] == m for r in memory)]
    n = len(panels) + (1 if timing else 0)
    fig = Figure(figsize=(5.5 * max(n, 1), 4.3))
    axes = fig.subplots(1, max(n, 1), squeeze=False)
    curves = (("static_none_bytes", "a: no optimisation (static)", ":"),
              ("static_sharing_bytes", "a: sharing (static)", ":"),
              ("static_sublinear_bytes", "a: sublinear (static)", ":"),
              ("plain_peak_bytes", "b: plain PyTorch (total)", "-"),
              ("sqrt_peak_bytes", "b: memplan sqrt (total)", "-"),
              ("optimal_peak_bytes", "b: memplan optimal (total)", "-"),
              ("optimal_measured_bytes", "b: optimal, measured after apply", "--"))
    for ax, model in zip(axes[0], panels):
        rows = sorted((r for r in memory if r["model"] == model), key=lambda r: r["size"])
        for i, (col, label, style) in enumerate(curves):
            pts = [(r["size"], r[col] / GB) for r in rows if r.get(col)]
            if pts:
                ax.plot(*zip(*pts), style, marker="o", ms=3, label=label, color=f"C{i}")
        if model == "resnet":
            ax.plot([1000], [PAPER["resnet1000_plain_gb"][0]], "k^", label="paper: plain 48 GB")
            ax.plot([1000], [PAPER["resnet1000_sublinear_gb"][0]], "kv",
                    label="paper: sublinear < 7 GB")
        log_axes(ax, "layers" if model == "resnet" else "unroll steps", "memory (GB)",
                 "Fig. 5: ResNet" if model == "resnet" else "Fig. 6: LSTM", legend_size=6)
    if timing:
        ax = axes[0][n - 1]
        for i, model in enumerate(sorted({r["model"] for r in timing})):
            rows = sorted((r for r in timing if r["model"] == model), key=lambda r: r["size"])
            for j, (col, label) in enumerate((("plain_time_s", "plain"),
                                              ("checkpoint_sequential_time_s", "checkpoint_seq."),
                                              ("optimal_time_s", "memplan optimal"))):
                pts = [(r["size"], r[col]) for r in rows if r.get(col)]
                if pts:
                    ax.plot(*zip(*pts), "-" if i == 0 else "--", marker="o", ms=3,
                            label=f"{model} {label}", color=f"C{j}")
        log_axes(ax, "layers / unroll steps", "time per batch (s)", "Fig. 7: time (CPU, small)",
                 legend_size=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def write(memory: Sequence[Row], timing: Sequence[Row], out: Path, quick: bool) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, rows in (("fig5_6_memory", memory), ("fig7_time", timing)):
        if rows:
            paths.append(out / f"{name}.csv")
            write_csv(rows, paths[-1], columns=())
    paths.append(out / "reproduce.md")
    paths[-1].write_text(markdown(memory, timing, quick))
    paths.append(out / "reproduce.png")
    plot(memory, timing, paths[-1])
    return paths
