"""``memplan explain PLAN_JSON``: what a plan keeps and recomputes, and why."""

from __future__ import annotations

import argparse
from typing import Any

from memplan.core.plan import load_plan


def add_parser(sub: Any) -> None:
    p = sub.add_parser("explain", help="what a plan file keeps and recomputes, and why")
    p.add_argument("plan", metavar="PLAN_JSON", help="a file from memplan plan -o")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    print(load_plan(args.plan, "PLAN").explain())
    return 0
