"""What people use today instead of memplan, built on the same workloads so that ``memplan
bench --peers`` measures them with the same tracker in the same run:

* ``checkpoint_sequential``: sqrt(n) segments of the model's units with torch's own
  ``torch.utils.checkpoint.checkpoint_sequential`` (ResNet, GPT; the LSTM's steps take several
  inputs, so its segments are cut with the same arithmetic and run through ``checkpoint``);
  every segment but the last is recomputed in backward, as torch does;
* ``per-block``: every unit (residual unit, LSTM step, transformer block) in its own
  non-reentrant ``torch.utils.checkpoint.checkpoint``;
* ``torch.compile``: the min-cut partitioner under
  ``torch._functorch.config.activation_memory_budget`` (real runs only, slow).

A peer is a Workload whose model shares nothing with memplan: only the units' forward is
re-wired, weights and inputs are those of the plain workload (same seeds).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch._dynamo
import torch._functorch.config as fconfig
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint, checkpoint_sequential

from memplan.errors import bad_arg
from memplan.models import Workload
from memplan.models.gpt import GPT
from memplan.models.lstm import LSTM
from memplan.models.resnet import ResNet, units_for_depth

PEERS = ("checkpoint_sequential", "per-block")
State = tuple[torch.Tensor, ...]


def peer_workload(w: Workload, peer: str) -> Workload:
    """``w`` with its model re-wired by ``peer`` (one of PEERS)."""
    if peer not in PEERS:
        raise bad_arg("peer", f"one of {list(PEERS)}", peer, "Pick a listed peer.")
    if w.name not in ("resnet", "lstm", "gpt"):
        raise bad_arg("peer model", "a built-in workload (resnet, lstm, gpt)", w.name,
                      "Peers re-wire the built-in models' units.")

    def build() -> nn.Module:
        return Rewired(w._build_model(), peer)

    return Workload(w.name, w.params, build, w._build_inputs, w._loss)


class compile_budget:
    """Context manager: ``torch._functorch.config.activation_memory_budget`` set, and the
    dynamo cache reset so that the next compile sees it."""

    def __init__(self, budget: float) -> None:
        self.budget = budget
        self.old = 1.0

    def __enter__(self) -> None:
        torch._dynamo.reset()
        self.old = float(fconfig.activation_memory_budget)
        fconfig.activation_memory_budget = self.budget

    def __exit__(self, *exc: object) -> None:
        fconfig.activation_memory_budget = self.old
        torch._dynamo.reset()


def checkpoint_sequential_segments(n_units: int) -> int:
    """How many segments people give ``checkpoint_sequential``: about sqrt(n)."""
    return max(1, math.isqrt(max(n_units - 1, 0)) + 1) if n_units > 1 else 1


def units_of(model: nn.Module) -> int:
    """How many units a built-in model is checkpointed by."""
    return len(_Units(model).units)


class Rewired(nn.Module):
    """Runs a built-in model's units under a peer's checkpointing; same outputs as the model."""

    def __init__(self, model: nn.Module, peer: str) -> None:
        super().__init__()
        self.model = model
        self.peer = peer

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        u = _Units(self.model)
        state = u.start(inputs)
        n = len(u.units)
        if self.peer == "per-block":
            for fn in u.units:
                state = _ckpt(fn, state)
        elif u.sequential is not None:
            seq = u.sequential
            out = checkpoint_sequential(  # type: ignore[no-untyped-call]
                seq, checkpoint_sequential_segments(n), state[0], use_reentrant=False)
            state = (out,)
        else:
            for a, b in _torch_segments(n, checkpoint_sequential_segments(n)):
                seg = _chain(u.units[a:b])
                state = _ckpt(seg, state) if b < n else seg(*state)
        return u.finish(state, inputs)


def _torch_segments(n: int, segments: int) -> list[tuple[int, int]]:
    """checkpoint_sequential's split: equal segments of n // segments, the rest in the last."""
    size = max(n // segments, 1)
    bounds = [(a, a + size) for a in range(0, size * (segments - 1), size)]
    bounds.append((bounds[-1][1] if bounds else 0, n))
    return [(a, b) for a, b in bounds if a < b]


def _ckpt(fn: Callable[..., State], state: State) -> State:
    out: State = checkpoint(fn, *state, use_reentrant=False)
    return out


def _chain(fns: Sequence[Callable[..., State]]) -> Callable[..., State]:
    def run(*state: torch.Tensor) -> State:
        for fn in fns:
            state = fn(*state)
        return state

    return run


class _Units:
    """A built-in model as: start(inputs) -> state, units (state -> state), finish."""

    def __init__(self, model: nn.Module) -> None:
        self.sequential: nn.Sequential | None = None
        net = getattr(model, "net", model)
        self.flatten = bool(getattr(model, "flatten", False))
        if isinstance(net, ResNet):
            units = [u for stage in net.stages.children() for u in stage.children()]
            mods: list[nn.Module] = [net.stem, *units, net.head]
            self.units = [_one(m) for m in mods]
            self.sequential = nn.Sequential(*mods)
            self.kind = "resnet"
        elif isinstance(net, GPT):
            self.units = [_embed(net), *(_one(b) for b in net.blocks), _one_seq(net.ln_f, net.head)]
            self.kind = "gpt"
        elif isinstance(net, LSTM):
            self.units = []
            self.kind = "lstm"
        else:
            raise bad_arg("model", "a built-in resnet, lstm or gpt model", type(net).__name__,
                          "Peers re-wire the built-in models' units.")
        self.net = net

    def start(self, inputs: tuple[torch.Tensor, ...]) -> State:
        if self.kind != "lstm":
            return (inputs[0],)
        net = self.net
        assert isinstance(net, LSTM)
        x, target = inputs
        self.units = [_lstm_step(net, x, target, t) for t in range(x.shape[0])]
        zeros = x.new_zeros(x.shape[1], net.hidden)
        return tuple(zeros for _ in range(2 * net.layers)) + (x.new_zeros(()),)

    def finish(self, state: State, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        if self.kind == "lstm":
            return state[-1]
        logits, target = state[0], inputs[1]
        if self.flatten:
            logits, target = logits.flatten(0, -2), target.flatten()
        losses: torch.Tensor = F.cross_entropy(logits, target, reduction="none")
        return losses


def _one(m: nn.Module) -> Callable[..., State]:
    def run(x: torch.Tensor) -> State:
        return (m(x),)

    return run


def _one_seq(*mods: nn.Module) -> Callable[..., State]:
    def run(x: torch.Tensor) -> State:
        for m in mods:
            x = m(x)
        return (x,)

    return run


def _embed(net: GPT) -> Callable[..., State]:
    def run(idx: torch.Tensor) -> State:
        pos = torch.arange(idx.shape[1], device=idx.device)
        return (net.drop(net.tok(idx) + net.pos(pos)),)

    return run


def _lstm_step(net: LSTM, x: torch.Tensor, target: torch.Tensor, t: int) -> Callable[..., State]:
    def run(*state: torch.Tensor) -> State:
        hc = [(state[2 * i], state[2 * i + 1]) for i in range(net.layers)]
        new, loss = net.step(x[t], target[t], hc, state[-1])
        return tuple(v for pair in new for v in pair) + (loss,)

    return run


def describe(w: Workload, peer: str) -> str:
    """How a peer cuts this workload, for tables."""
    n = _unit_count(w)
    if peer == "per-block":
        return f"{n} units, each checkpointed"
    return f"{checkpoint_sequential_segments(n)} segments of {n} units"


def _unit_count(w: Workload) -> int:
    p: dict[str, Any] = w.params
    if w.name == "lstm":
        return int(p["steps"])
    if w.name == "gpt":
        return int(p["layers"]) + 2
    return sum(units_for_depth(int(p["depth"]))) + 2
