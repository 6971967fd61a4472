"""The ``memplan`` command line. Errors end with one line and exit code 2 (``--debug`` shows
the traceback)."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

from memplan.errors import MemplanError

MODEL_HELP = ("a built-in workload 'resnet:depth=1000,batch=32', 'lstm:steps=1024', "
              "'gpt:layers=12', or a factory 'package.module:callable' returning "
              "(model, example_inputs[, loss_fn])")


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        result: int = args.run(args)
        return result
    except MemplanError as err:
        if args.debug:
            raise
        print(f"memplan: error: {_one_line(err)}", file=sys.stderr)
        return 2


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split())


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="memplan", description=__doc__)
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    sub = parser.add_subparsers(dest="command")

    demo = sub.add_parser("demo", help="the headline: ResNet-1000 and a long LSTM, plain vs "
                          "sqrt(n) vs memplan's best plan, and a real run")
    demo.add_argument("--jobs", type=int, default=2, help="worker processes (default 2)")
    demo.add_argument("--quick", action="store_true", help="tiny models (a smoke test)")
    demo.add_argument("--out", default="out/demo", help="folder for the plots (out/demo)")
    demo.set_defaults(run=_demo)

    meas = sub.add_parser("measure", help="peak memory of one training step")
    meas.add_argument("model", metavar="MODEL", help=MODEL_HELP)
    meas.add_argument("--batch", type=int, help="override a built-in model's batch size")
    meas.add_argument("--real", action="store_true", help="run for real instead of simulating")
    meas.add_argument("--device", default="cpu", help="cpu or cuda (with --real)")
    meas.set_defaults(run=_measure)

    plan = sub.add_parser("plan", help="plan what to keep and what to recompute under a budget")
    plan.add_argument("model", metavar="MODEL", help=MODEL_HELP)
    plan.add_argument("--batch", type=int, help="override a built-in model's batch size")
    plan.add_argument("--budget", help="peak budget: 6GiB, 7GB, bytes, or a fraction of the "
                      "plain peak like 0.25 (default: none; optimal then finds the least peak)")
    from memplan.planners import PLANNERS

    plan.add_argument("--planner", default="optimal",
                      help=f"one of {', '.join(sorted(PLANNERS))} (default optimal)")
    plan.add_argument("--objective", default="flops", choices=("flops", "time"),
                      help="what the planner minimises: recomputed FLOPs (default) or predicted "
                      "step time (times each stage's forward for real on --device)")
    plan.add_argument("--device", default="cpu",
                      help="cpu or cuda: where --objective time measures stage times")
    plan.add_argument("-o", "--output", metavar="PLAN_JSON", help="write the plan file here")
    plan.add_argument("--all-stages", action="store_true",
                      help="one table row per stage (default: runs of the same mode grouped)")
    plan.set_defaults(run=_plan)

    explain = sub.add_parser("explain", help="what a plan file keeps and recomputes, and why")
    explain.add_argument("plan", metavar="PLAN_JSON", help="a file from memplan plan -o")
    explain.set_defaults(run=_explain)

    from memplan import bench_cli, reproduce

    bench_cli.add_parser(sub)
    reproduce.add_parser(sub)
    _external_commands(sub)
    return parser


def _external_commands(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Subcommands other modules own (``memplan verify``): each module's ``add_parser(sub)``."""
    import importlib

    for name in ("memplan.verify_cli",):
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as err:
            if err.name != name:
                raise
            continue
        module.add_parser(sub)


def _measure(args: argparse.Namespace) -> int:
    from memplan.measure import measure
    from memplan.spec import resolve

    obj, inputs, loss_fn = resolve(args.model, args.batch).call_args()
    report = measure(obj, *inputs, loss_fn=loss_fn, simulate=not args.real, device=args.device)
    print(report.summary())
    return 0


def _plan(args: argparse.Namespace) -> int:
    from memplan.commands import run_plan

    return run_plan(args.model, args.batch, args.budget, args.planner, args.objective,
                    args.output, args.all_stages, args.device)


def _explain(args: argparse.Namespace) -> int:
    from memplan.commands import run_explain

    return run_explain(args.plan)


def _demo(args: argparse.Namespace) -> int:
    from memplan.demo import run_demo

    start = time.perf_counter()
    run_demo(jobs=args.jobs, quick=args.quick, out=args.out)
    print(f"\ndemo finished in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
