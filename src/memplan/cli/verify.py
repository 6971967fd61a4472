"""``memplan verify MODEL --plan plan.json``: one real step plain and one under the plan.
Exit 0 only when gradients and BatchNorm state are bit-equal, the RNG state matches and the
measured peak is within 2% of the prediction (and the budget); 1 when any fails; 2 on errors."""

from __future__ import annotations

import argparse
from typing import Any

from memplan.cli.common import MAX_BATCH, MAX_REPEAT, MODEL_HELP, int_in, wide_console
from memplan.cli.progress import working
from memplan.core.plan import Plan
from memplan.core.plan_schema import printable
from memplan.errors import PlanMismatch


def add_parser(sub: Any) -> None:
    p = sub.add_parser("verify", help="one real step plain and one under a plan, compared")
    p.add_argument("model", metavar="MODEL", help=MODEL_HELP)
    p.add_argument("--plan", required=True, help="a plan file from memplan plan -o")
    p.add_argument("--batch", type=int_in(1, MAX_BATCH, "--batch 32"), default=None,
                   help="override the workload's batch")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--repeat", type=int_in(1, MAX_REPEAT, "--repeat 5"), default=5,
                   help="timed steps of each (default 5)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from memplan.analysis.verify import verify
    from memplan.cli.spec import resolve
    from memplan.core.plan import load_plan
    from memplan.tracing.device import check_device
    from memplan.tracing.step import input_specs, kwarg_specs

    check_device(args.device, "--device")
    plan = load_plan(args.plan, "PLAN")
    target = resolve(args.model, args.batch)
    obj, inputs, kwargs, loss_fn = target.call_args()
    given = inputs if target.workload is None else target.workload.build_inputs()
    check_inputs(plan, input_specs(tuple(given)), kwarg_specs(kwargs or {}), args.plan)
    with working(wide_console(), f"verifying {args.plan} on {target.label}: a plain and a "
                 "planned real step", count_calls=False):
        report = verify(obj, plan, *inputs, kwargs=kwargs, loss_fn=loss_fn, device=args.device,
                        repeat=args.repeat)
    print(report.summary())
    return 0 if report.ok else 1


def check_inputs(plan: Plan, specs: list[dict[str, Any]], kwarg_specs: dict[str, dict[str, Any]],
                 path: str) -> None:
    """The model's example inputs must be those the plan was made for (shapes and dtypes,
    keyword inputs by name): a plan for another model or batch is refused before anything
    runs."""
    if plan.forward is None:
        return  # memplan.apply refuses it with its own message

    def shown(specs: list[dict[str, Any]], kwargs: dict[str, dict[str, Any]]) -> list[str]:
        return [_shown(s) for s in specs] + [f"{k}={_shown(kwargs[k])}" for k in sorted(kwargs)]

    want = shown(list(plan.forward.inputs), plan.forward.kwargs)
    got = shown(specs, kwarg_specs)
    if want != got:
        recorded, given = ", ".join(want), ", ".join(got)
        raise PlanMismatch(
            f"PLAN {printable(path)} was made for other inputs ({recorded}) than MODEL gives "
            f"({given}): a plan for another model or batch. Make one for this model: "
            "memplan plan MODEL -o plan.json")


def _shown(spec: dict[str, Any]) -> str:
    if "shape" in spec:
        return f"{spec['dtype']}{list(spec['shape'])}"
    if "value" in spec:
        return repr(spec["value"])
    return str(spec.get("type"))
