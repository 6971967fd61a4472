"""``memplan bench`` on the command line: arguments to a BenchConfig, a progress bar, files."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from memplan.cli.common import MAX_BATCH, MAX_REPEAT, check_folder, int_in, wide_console
from memplan.core.budget import budget_from_text, parse_budget
from memplan.core.planners import NAMES as PLANNER_NAMES
from memplan.errors import bad_arg

MAX_THREADS = 1024

if TYPE_CHECKING:
    from memplan.analysis.bench import BenchConfig


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "bench", help="sweep a model: plain PyTorch vs memplan plans (vs peers), files + plots",
        description="Sweep a built-in model over a size. Rows: plain PyTorch, memplan's plans "
        "(sqrt and optimal at the sqrt plan's peak, or at --budget), and with --peers torch's "
        "checkpoint_sequential (sqrt(n) segments) and per-block checkpointing, measured with the "
        "same tracker in the same run. Writes CSV, markdown and PNG to --out.")
    p.add_argument("model", metavar="MODEL",
                   help="resnet, lstm or gpt, optionally with fixed parameters: "
                   "'resnet:batch=8,image=112'")
    p.add_argument("--sweep", help="KEY=INT,INT,... e.g. depth=50,101,152 or steps=64,128 "
                   "(default: a sweep per model and mode)")
    how = p.add_mutually_exclusive_group()
    how.add_argument("--simulate", action="store_true",
                     help="fake tensors, any size, nothing allocated (the default)")
    how.add_argument("--real", action="store_true", help="real steps, with step times")
    p.add_argument("--device", default="cpu", help="cpu or cuda (with --real)")
    p.add_argument("--peers", action="store_true",
                   help="add torch checkpoint_sequential and per-block checkpointing")
    p.add_argument("--compile", metavar="BUDGETS",
                   help="slow, --real only: torch.compile at these activation_memory_budget "
                   "values, e.g. 1,0.5,0.2")
    p.add_argument("--budget", help="budget of the non-sqrt plans: 6GiB, 7GB or a fraction "
                   "like 0.25 (default: the sqrt plan's peak)")
    p.add_argument("--planners", default="sqrt,optimal", help="comma-separated memplan planners")
    p.add_argument("--batch", type=int_in(1, MAX_BATCH, "--batch 8"),
                   help="override the batch size")
    p.add_argument("--repeat", type=int_in(1, MAX_REPEAT, "--repeat 3"), default=3,
                   help="timed rounds per real row (median; rounds go over all rows of a size)")
    p.add_argument("--threads", type=int_in(1, MAX_THREADS, "--threads 1"),
                   help="CPU intra-op threads for real runs (torch's default otherwise; 1 is "
                   "steadier on a busy machine)")
    p.add_argument("--quick", action="store_true", help="tiny configs (a smoke test)")
    p.add_argument("--out", help="output folder (default out/bench/MODEL-MODE-DEVICE)")
    p.set_defaults(run=run)


def config(args: argparse.Namespace) -> BenchConfig:
    import torch

    from memplan import models
    from memplan.analysis import bench as B
    from memplan.cli.spec import split_spec

    name = args.model.partition(":")[0].strip()
    if name not in B.SIZE_KEYS:
        raise bad_arg("MODEL", f"one of {sorted(B.SIZE_KEYS)} (optionally ':key=value,...')",
                      args.model, "Write e.g. 'memplan bench resnet --sweep depth=50,101'.")
    base, sizes = B.defaults(name, args.real, args.quick)
    base.update(split_spec(args.model)[1])
    if args.batch is not None:
        base["batch"] = args.batch
    key, sizes = B.parse_sweep(name, args.sweep, sizes)
    if len(set(sizes)) != len(sizes):
        raise bad_arg("--sweep", "distinct sizes", args.sweep, "Name each size once.")
    base.pop(key, None)
    for size in sizes:  # every size's parameters and step size, before any work
        models.get(name, **{**base, key: size})
    B.check_bench_device(args.device, args.real)
    planners = tuple(p.strip() for p in args.planners.split(","))
    for p in planners:
        if p not in PLANNER_NAMES:
            what = f"{p!r} is not one" if p else "a name is empty"
            raise bad_arg("--planners", f"comma-separated names from {sorted(PLANNER_NAMES)}",
                          args.planners, f"{what}; use e.g. --planners sqrt,optimal.")
    if len(set(planners)) != len(planners):
        raise bad_arg("--planners", "distinct names", args.planners, "Name each planner once.")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    budgets: tuple[float, ...] = ()
    if args.compile:
        if not args.real:
            raise bad_arg("--compile", "a real run (--real)", args.compile,
                          "torch.compile cannot run on fake tensors: add --real.")
        try:
            budgets = tuple(float(b) for b in args.compile.split(",") if b.strip())
        except ValueError:
            raise bad_arg("--compile", "comma-separated floats in (0, 1]", args.compile,
                          "Write e.g. --compile 1,0.5,0.2.") from None
        if not budgets or not all(0.0 < b <= 1.0 for b in budgets):
            raise bad_arg("--compile", "comma-separated floats in (0, 1]", args.compile,
                          "Write e.g. --compile 1,0.5,0.2.")
    if args.budget is not None:  # syntax and range; fractions are resolved per size
        parse_budget(budget_from_text(args.budget), plain_peak_bytes=1, arg="--budget")
    return B.BenchConfig(name, base, key, sizes, real=args.real, device=args.device,
                         peers=args.peers, compile_budgets=budgets, budget=args.budget,
                         planners=planners, repeat=args.repeat)


def run(args: argparse.Namespace) -> int:
    from memplan.analysis import bench as B
    from memplan.analysis.bench_report import markdown, write_all

    cfg = config(args)
    out = Path(args.out) if args.out else B.default_out(cfg)
    check_folder(out, "--out")
    console = wide_console()
    total = len(cfg.sizes) * B.method_count(cfg)
    start = time.perf_counter()
    with Progress(TextColumn("{task.description}", markup=False), BarColumn(),
                  MofNCompleteColumn(), TimeElapsedColumn(), console=console,
                  transient=False) as bar:
        task = bar.add_task(f"bench {cfg.model} ({cfg.mode})", total=total)

        def tick(label: str) -> None:
            bar.update(task, advance=1, description=f"bench {cfg.model}: {label}")

        rows = B.run_bench(cfg, tick)

    title = (f"{cfg.model} {cfg.mode} on {cfg.device if cfg.real else 'fake tensors'}: "
             f"{cfg.key} sweep, fixed {cfg.base or 'defaults'}")
    print(markdown(rows, title))  # first: the results are shown even if a write fails
    try:
        paths = write_all(rows, out, "bench", title)
    except OSError as err:
        raise bad_arg("--out", "a folder memplan can write", str(out),
                      f"Writing the files failed ({err.strerror}); the table above has the "
                      "results.") from None
    console.print(f"bench finished in {time.perf_counter() - start:.1f} s; wrote "
                  + ", ".join(str(p) for p in paths))
    return 0
