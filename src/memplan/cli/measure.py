"""``memplan measure MODEL``: the peak memory of one training step, simulated or real."""

from __future__ import annotations

import argparse
from typing import Any

from memplan.cli.common import MODEL_HELP


def add_parser(sub: Any) -> None:
    p = sub.add_parser("measure", help="peak memory of one training step")
    p.add_argument("model", metavar="MODEL", help=MODEL_HELP)
    p.add_argument("--batch", type=int, help="override a built-in model's batch size")
    p.add_argument("--real", action="store_true", help="run for real instead of simulating")
    p.add_argument("--device", default="cpu", help="cpu or cuda (with --real)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from memplan.cli.spec import resolve
    from memplan.tracing.measure import measure

    obj, inputs, loss_fn = resolve(args.model, args.batch).call_args()
    report = measure(obj, *inputs, loss_fn=loss_fn, simulate=not args.real, device=args.device)
    print(report.summary())
    return 0
