"""``memplan measure MODEL``: the peak memory of one training step, simulated or real."""

from __future__ import annotations

import argparse
from typing import Any

from memplan.cli.common import MAX_BATCH, MODEL_HELP, int_in, wide_console
from memplan.cli.progress import working


def add_parser(sub: Any) -> None:
    p = sub.add_parser("measure", help="peak memory of one training step")
    p.add_argument("model", metavar="MODEL", help=MODEL_HELP)
    p.add_argument("--batch", type=int_in(1, MAX_BATCH, "--batch 32"),
                   help="override a built-in model's batch size")
    p.add_argument("--real", action="store_true", help="run for real instead of simulating")
    p.add_argument("--device", default="cpu", help="cpu or cuda (with --real)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from memplan.cli.spec import estimate, resolve
    from memplan.tracing.device import check_device
    from memplan.tracing.measure import measure

    check_device(args.device, "--device")
    target = resolve(args.model, args.batch)
    obj, inputs, kwargs, loss_fn = target.call_args()
    how = "running" if args.real else "simulating"
    # Real steps are timed: no module-call counting hook there.
    with working(wide_console(), f"{how} one step of {estimate(target)}",
                 count_calls=not args.real):
        report = measure(obj, *inputs, kwargs=kwargs, loss_fn=loss_fn, simulate=not args.real,
                         device=args.device)
    print(report.summary())
    return 0
