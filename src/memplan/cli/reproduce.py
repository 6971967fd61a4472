"""``memplan reproduce``: the paper's Fig. 5 (ResNet memory vs depth), Fig. 6 (LSTM memory vs
unroll) and Fig. 7 (time per batch), ours computed in the run, the paper's numbers beside them
(``memplan.analysis.reproduce`` computes the rows)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from memplan.cli.common import MAX_JOBS, MAX_REPEAT, check_folder, int_in, wide_console
from memplan.errors import bad_arg


def add_parser(sub: Any) -> None:
    p = sub.add_parser("reproduce", help="the paper's Fig. 5, 6 and 7, ours beside the paper's",
                       description=__doc__)
    p.add_argument("--figs", default="5,6,7", help="which figures (default 5,6,7)")
    p.add_argument("--quick", action="store_true", help="tiny models: seconds, not paper scale")
    p.add_argument("--least", action="store_true",
                   help="also the optimal planner's least-peak plan per size (~7 s each)")
    p.add_argument("--jobs", type=int_in(1, MAX_JOBS, "--jobs 2"), default=2,
                   help="worker processes for Fig. 5/6 (2)")
    p.add_argument("--repeat", type=int_in(1, MAX_REPEAT, "--repeat 7"), default=7,
                   help="timed rounds per Fig. 7 row (median; the paper ran 20 batches)")
    p.add_argument("--out", default="out/reproduce", help="output folder (out/reproduce)")
    p.set_defaults(run=run)


def parse_figs(text: str) -> list[int]:
    try:
        figs = sorted({int(f) for f in text.split(",") if f.strip()})
    except ValueError:
        figs = []
    if not figs or not set(figs) <= {5, 6, 7}:
        raise bad_arg("--figs", "a comma-separated subset of 5,6,7", text, "Use e.g. --figs 5,6.")
    return figs


def run(args: argparse.Namespace) -> int:
    from memplan.analysis import reproduce as A
    from memplan.analysis import reproduce_report as R

    figs = parse_figs(args.figs)
    out = Path(args.out)
    check_folder(out, "--out")
    console = wide_console()
    start = time.perf_counter()
    sweeps = [s for f, s in ((5, A.QUICK5 if args.quick else A.FIG5),
                             (6, A.QUICK6 if args.quick else A.FIG6)) if f in figs]
    fig7 = (A.QUICK7 if args.quick else A.FIG7) if 7 in figs else []
    with Progress(TextColumn("{task.description}", markup=False), BarColumn(),
                  MofNCompleteColumn(), TimeElapsedColumn(), console=console) as bar:
        task = bar.add_task("Fig. 5/6 (simulated, paper scale)",
                            total=sum(len(s[3]) for s in sweeps + fig7))

        def tick(label: str) -> None:
            bar.update(task, advance=1, description=label)

        memory = A.memory_rows(sweeps, args.jobs, args.least, tick)
        timing = A.time_rows(fig7, args.repeat, tick)
    print(R.markdown(memory, timing, quick=args.quick))  # first: shown even if a write fails
    try:
        paths = R.write(memory, timing, out, quick=args.quick)
    except OSError as err:
        raise bad_arg("--out", "a folder memplan can write", str(out),
                      f"Writing the files failed ({err.strerror}); the tables above have the "
                      "results.") from None
    console.print(f"reproduce finished in {time.perf_counter() - start:.1f} s; wrote "
                  + ", ".join(str(p) for p in paths))
    return 0


