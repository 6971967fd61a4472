"""``memplan verify MODEL --plan plan.json``: one real step plain and one under the plan.
Exit 0 only when gradients and BatchNorm state are bit-equal, the RNG state matches and the
measured peak is within 2% of the prediction (and the budget); 1 when any fails; 2 on errors."""

from __future__ import annotations

import argparse
from typing import Any

from memplan.cli.common import MODEL_HELP


def add_parser(sub: Any) -> None:
    p = sub.add_parser("verify", help="one real step plain and one under a plan, compared")
    p.add_argument("model", metavar="MODEL", help=MODEL_HELP)
    p.add_argument("--plan", required=True, help="a plan file from memplan plan -o")
    p.add_argument("--batch", type=int, default=None, help="override the workload's batch")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--repeat", type=int, default=5, help="timed steps of each (default 5)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from memplan.analysis.verify import verify
    from memplan.cli.spec import resolve
    from memplan.core.plan import load_plan

    plan = load_plan(args.plan, "PLAN")
    obj, inputs, loss_fn = resolve(args.model, args.batch).call_args()
    report = verify(obj, plan, *inputs, loss_fn=loss_fn, device=args.device, repeat=args.repeat)
    print(report.summary())
    return 0 if report.ok else 1
