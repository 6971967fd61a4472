"""``memplan demo`` (what ``make demo`` runs): the paper's headline, computed in the run
(``memplan.analysis.demo``), shown as tables.

1. The paper's 1000-layer ResNet (batch 32, 3x224x224, fp32), simulated on fake tensors:
   plain PyTorch vs torch's checkpoint_sequential with sqrt(n) segments vs memplan's sqrt and
   optimal plans (peak and extra compute), the optimal plan also measured after apply.
2. The paper's LSTM unrolled over 1024 steps: plain vs memplan's plans.
3. A small real CPU step, plain and under a plan: gradients and BatchNorm state compared.
4. A plot of ResNet memory vs depth, and where it went.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from memplan.cli.common import MAX_JOBS, check_folder, int_in, wide_console
from memplan.core.budget import GB, format_bytes
from memplan.errors import bad_arg


def add_parser(sub: Any) -> None:
    p = sub.add_parser("demo", help="the headline: ResNet-1000 and a long LSTM, plain vs "
                       "sqrt(n) vs memplan's best plan, and a real run")
    p.add_argument("--jobs", type=int_in(1, MAX_JOBS, "--jobs 2"), default=2,
                   help="worker processes (default 2)")
    p.add_argument("--quick", action="store_true", help="tiny models (a smoke test)")
    p.add_argument("--out", default="out/demo", help="folder for the plots (out/demo)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from memplan.analysis.demo import FULL, QUICK, plot, run_tasks

    out = Path(args.out)
    check_folder(out, "--out")
    start = time.perf_counter()
    quick = args.quick
    console = wide_console(markup=True)
    cfg = QUICK if quick else FULL
    rbase = cfg["resnet"][0]
    lbase, steps = cfg["lstm"]
    console.print("[bold]memplan demo[/bold]: the paper's models, one training step each "
                  "(simulated on fake tensors, fp32: nothing is allocated), then a real CPU "
                  f"step{' (--quick: tiny models)' if quick else ''}.\n")
    with console.status(f"capturing and planning in {args.jobs} worker process(es) ..."):
        res = run_tasks(args.jobs, quick)

    _resnet_table(console, res["resnet"], rbase)
    _lstm_table(console, res["lstm"], lbase, steps)
    real = res["real"]
    mark = {True: "[green]OK[/green]", False: "[red]FAILED[/red]", None: "skipped"}[real["ok"]]
    console.print(f"[bold]Real CPU step[/bold] ({mark}): {real['summary']}", markup=True)
    try:
        png = plot(res["resnet"]["sweep"], out)
    except OSError as err:
        raise bad_arg("--out", "a folder memplan can write", str(out),
                      f"Writing the plot failed ({err.strerror}); the tables above have the "
                      "results.") from None
    console.print(f"\nPlot of ResNet memory vs depth: {png}", markup=False)
    console.print("Full reproduction of the paper's Fig. 5-7 (ours beside the paper's "
                  "numbers): memplan reproduce -> out/reproduce/; sweeps with peers: "
                  "memplan bench resnet --peers -> out/bench/")
    console.print("worker seconds: " + ", ".join(f"{k} {v['seconds']:.0f} s"
                                                 for k, v in res.items()))
    console.print(f"\ndemo finished in {time.perf_counter() - start:.1f} s")
    return 0


def _resnet_table(console: Console, r: dict[str, Any], rbase: dict[str, Any]) -> None:
    top = r["sweep"][-1]
    table = _table(f"ResNet-{top['depth']} (batch {rbase.get('batch', 32)}, "
                   f"{rbase.get('image', 224)}x{rbase.get('image', 224)}): one training step")
    _row(table, "plain PyTorch", top["plain"], top["plain"], 0.0, "tracker")
    _row(table, f"torch checkpoint_sequential ({r['peer_detail']})", r["peer"], top["plain"],
         None, "tracker")
    _row(table, f"memplan sqrt ({top['sqrt']['params']['segments']} segments)",
         top["sqrt"]["peak"], top["plain"], top["sqrt"]["extra_pct"], "predicted")
    _row(table, "memplan optimal, at the sqrt plan's peak", top["optimal"]["peak"], top["plain"],
         top["optimal"]["extra_pct"], "predicted")
    if "applied" in r:
        _row(table, "  the same plan, measured after memplan.apply", r["applied"], top["plain"],
             top["optimal"]["extra_pct"], "tracker")
    elif "applied_error" in r:
        table.add_row("  the same plan after memplan.apply", "failed", "", "", "",
                      "(error below)")
    _row(table, "memplan optimal, least peak", r["least"]["peak"], top["plain"],
         r["least"]["extra_pct"], "predicted")
    console.print(table)
    if "applied_error" in r:
        console.print(f"  memplan.apply failed: {r['applied_error']}", markup=False)
    console.print("  paper (abstract, Sec. 5.2; MXNet on a Titan X): 48 GB -> 7 GB at 1000 "
                  "layers, ~30% more time per batch (Sec. 5.4)\n")


def _lstm_table(console: Console, lstm: dict[str, Any], lbase: dict[str, Any],
                steps: int) -> None:
    table = _table(f"LSTM unrolled over {steps} steps (4 x {lbase.get('hidden', 1024)}, batch "
                   f"{lbase.get('batch', 64)}): one training step")
    _row(table, "plain PyTorch", lstm["plain"], lstm["plain"], 0.0, "tracker")
    _row(table, f"memplan sqrt ({lstm['sqrt']['params']['segments']} segments)",
         lstm["sqrt"]["peak"], lstm["plain"], lstm["sqrt"]["extra_pct"], "predicted")
    _row(table, "memplan optimal, at the sqrt plan's peak", lstm["optimal"]["peak"],
         lstm["plain"], lstm["optimal"]["extra_pct"], "predicted")
    console.print(table)
    console.print("  paper (Sec. 5.3, Fig. 6): the sublinear plan needs more than 4x less "
                  "than the best plan without recomputation")
    console.print("  torch's checkpointing on the LSTM, measured: memplan bench lstm --peers\n")


def _table(title: str) -> Table:
    table = Table(title=title, title_justify="left")
    for col, just in (("method", "left"), ("peak", "right"), ("peak (GB)", "right"),
                      ("less than plain", "right"), ("extra compute", "right"), ("peak is", "left")):
        table.add_column(col, justify=just)  # type: ignore[arg-type]
    return table


def _row(table: Table, label: str, peak: int, plain: int, extra_pct: float | None,
         how: str) -> None:
    extra = "~1 forward (not counted)" if extra_pct is None else f"{extra_pct:.1f}% of step"
    table.add_row(label, format_bytes(peak), f"{peak / GB:.2f}", f"{plain / peak:.1f}x", extra,
                  how)
