"""Calibration: a small chain model run stage by stage with real non-reentrant
``torch.utils.checkpoint`` regions (selective policies for drop-cheap) under the live-storage
tracker; the measured peak must equal the chain model's prediction within 2%."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

import memplan
from memplan.core import chain as C
from memplan.core import schedule as S
from memplan.core.ops import is_expensive
from memplan.core.planners import PLANNERS
from memplan.models import Workload
from memplan.tracing.step import as_target, run_step

torch.set_num_threads(1)


def _block(c_in: int, c_out: int) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU(),
        nn.Conv2d(c_out, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU(),
    )


def chain_model(n: int = 8, width: int = 8) -> nn.Sequential:
    torch.manual_seed(0)
    widths = [3] + [width * (1 + i % 3) for i in range(n)]
    return nn.Sequential(*[_block(widths[i], widths[i + 1]) for i in range(n)])


def _policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    if is_expensive(str(op)):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


class Scheduled(nn.Module):
    """Runs the blocks of a Sequential as a chain schedule prescribes (what memplan.apply runs)."""

    def __init__(self, blocks: nn.Sequential, schedule: tuple[S.Item, ...]) -> None:
        super().__init__()
        self.blocks = blocks
        self.schedule = schedule

    def _run(self, items: tuple[S.Item, ...], x: torch.Tensor) -> torch.Tensor:
        for it in items:
            if isinstance(it, S.Keep):
                if it.stage < len(self.blocks):
                    x = self.blocks[it.stage](x)
            elif isinstance(it, S.DropCheap) and it.stage < len(self.blocks):
                ctx = functools.partial(create_selective_checkpoint_contexts, _policy)
                x = checkpoint(self.blocks[it.stage], x, use_reentrant=False, context_fn=ctx)
            else:
                body = it.body
                x = checkpoint(lambda y, b=body: self._run(b, y), x, use_reentrant=False)
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._run(self.schedule, x)


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.float().square().mean()


def _inputs(gen: torch.Generator | None) -> tuple[torch.Tensor, ...]:
    return (torch.randn(4, 3, 16, 16, generator=gen),)


def workload(schedule: tuple[S.Item, ...] | None = None) -> Workload:
    """A Workload (built lazily, so capture can build it on fake tensors)."""
    def build() -> nn.Module:
        model = chain_model()
        return model if schedule is None else Scheduled(model, schedule)

    return Workload("calib", {"seed": 0}, build, _inputs, _loss)


def measured_peak(schedule: tuple[S.Item, ...]) -> int:
    target = as_target(workload(schedule), (), None)
    return run_step(target, simulate=False, record=False).tracer.peak_bytes


@functools.lru_cache(maxsize=1)
def _setup() -> C.Chain:
    return C.build_chain(memplan.capture(workload()))


K, R, D = S.Keep, S.Region, S.DropCheap
SCHEDULES = {
    "plain": tuple(K(s) for s in range(9)),
    "segments": (R(0, 2, (K(0), K(1), K(2))), R(3, 5, (K(3), K(4), K(5))), K(6), K(7), K(8)),
    "nested": (R(0, 5, (K(0), R(1, 2, (K(1), K(2))), K(3), R(4, 4, (K(4),)), K(5))),
               K(6), R(7, 7, (K(7),)), K(8)),
    "drop-cheap": (D(0), D(1), R(2, 4, (K(2), K(3), K(4))), D(5), K(6), D(7), K(8)),
}


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_predicted_peak_matches_measured(name: str) -> None:
    chain = _setup()
    assert chain.n == 9, "one stage per block plus the loss"
    predicted, _ = S.simulate(chain, SCHEDULES[name])
    measured = measured_peak(SCHEDULES[name])
    print(f"{name}: predicted {predicted} measured {measured} ({predicted / measured - 1:+.3%})")
    assert abs(predicted - measured) <= 0.02 * measured


@pytest.mark.parametrize("planner", ["sqrt", "chen", "recursive", "drop-cheap", "optimal"])
def test_planner_plans_match_measured(planner: str) -> None:
    chain = _setup()
    least = PLANNERS["optimal"](chain, None).peak_bytes
    plain = S.simulate(chain, S.plain_schedule(chain))[0]
    budget = None if planner != "optimal" else (least + plain) // 2
    plan = PLANNERS[planner](chain, budget)
    measured = measured_peak(plan.schedule)
    print(f"{planner}: predicted {plan.peak_bytes} measured {measured}")
    assert abs(plan.peak_bytes - measured) <= 0.02 * measured
