"""The paper's benchmark models as lazy workloads.

``get(name, **params)`` builds nothing: it returns a :class:`Workload` whose ``build_model()``,
``build_inputs()`` and ``loss()`` are called by capture/measure, possibly under a fake-tensor
mode, so paper-scale configurations cost no real memory.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from memplan.errors import bad_arg
from memplan.models.gpt import GPT
from memplan.models.lstm import LSTM
from memplan.models.resnet import ResNet
from memplan.models.size import check_size, resnet_final_size

__all__ = ["Workload", "defaults", "get", "names"]


@dataclass(frozen=True)
class Workload:
    """A model config plus example inputs and loss, built on demand."""

    name: str
    params: dict[str, Any]
    _build_model: Callable[[], nn.Module] = field(repr=False)
    _build_inputs: Callable[[torch.Generator | None], tuple[torch.Tensor, ...]] = field(repr=False)
    _loss: Callable[[Any], torch.Tensor] = field(repr=False)

    def build_model(self) -> nn.Module:
        """A freshly initialised model in train mode (seeded: the same weights every call)."""
        torch.manual_seed(int(self.params.get("seed", 0)))
        return self._build_model().train()

    def build_inputs(self) -> tuple[torch.Tensor, ...]:
        """Example inputs, deterministic for a given seed."""
        gen = torch.Generator().manual_seed(int(self.params.get("seed", 0)) + 1)
        device = torch.empty(0).device  # the default device (``with torch.device(...)``)
        with torch.device("cpu"):  # drawn on the CPU: the same values on every device
            inputs = self._build_inputs(gen)
        return tuple(t.to(device) for t in inputs)

    def loss(self, output: Any) -> torch.Tensor:
        """The scalar training loss from the model's output."""
        return self._loss(output)

    @property
    def spec(self) -> str:
        """``name:key=value,...``, the form the command line accepts."""
        args = ",".join(f"{k}={v}" for k, v in sorted(self.params.items()))
        return f"{self.name}:{args}"


def _resnet(p: dict[str, Any]) -> Workload:
    batch, size, classes = p["batch"], p["image"], p["classes"]

    def inputs(gen: torch.Generator | None) -> tuple[torch.Tensor, ...]:
        x = torch.randn(batch, 3, size, size, generator=gen)
        y = torch.randint(0, classes, (batch,), generator=gen)
        return x, y


    def model() -> nn.Module:
        return _WithTarget(ResNet(p["depth"], classes, p["dropout"]))

    return Workload("resnet", p, model, inputs, _mean)


def _lstm(p: dict[str, Any]) -> Workload:
    steps, batch, inp, classes = p["steps"], p["batch"], p["input"], p["classes"]

    def inputs(gen: torch.Generator | None) -> tuple[torch.Tensor, ...]:
        x = torch.randn(steps, batch, inp, generator=gen)
        y = torch.randint(0, classes, (steps, batch), generator=gen)
        return x, y

    def model() -> nn.Module:
        return LSTM(inp, p["hidden"], p["layers"], classes, p["dropout"])

    def loss(out: torch.Tensor) -> torch.Tensor:
        mean: torch.Tensor = out / (steps * batch)
        return mean

    return Workload("lstm", p, model, inputs, loss)


def _gpt(p: dict[str, Any]) -> Workload:
    batch, seq, vocab = p["batch"], p["seq_len"], p["vocab"]

    def inputs(gen: torch.Generator | None) -> tuple[torch.Tensor, ...]:
        idx = torch.randint(0, vocab, (batch, seq + 1), generator=gen)
        return idx[:, :-1].contiguous(), idx[:, 1:].contiguous()

    def model() -> nn.Module:
        gpt = GPT(p["layers"], p["d_model"], p["heads"], seq, vocab, p["dropout"])
        return _WithTarget(gpt, flatten=True)

    return Workload("gpt", p, model, inputs, _mean)


class _WithTarget(nn.Module):
    """Wraps a classifier so that forward(x, target) returns the per-sample losses.

    Putting the loss inside the module keeps the whole step in one forward call, which is what
    capture and the runtime see; ``Workload.loss`` then only reduces it.
    """

    def __init__(self, net: nn.Module, flatten: bool = False) -> None:
        super().__init__()
        self.net = net
        self.flatten = flatten

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        logits = self.net(x)
        if self.flatten:
            logits, target = logits.flatten(0, -2), target.flatten()
        losses: torch.Tensor = F.cross_entropy(logits, target, reduction="none")
        return losses


def _mean(out: torch.Tensor) -> torch.Tensor:
    return out.mean()


_DEFAULTS: dict[str, dict[str, Any]] = {
    "resnet": {"depth": 50, "batch": 32, "image": 224, "classes": 1000, "dropout": 0.0, "seed": 0},
    "lstm": {
        "steps": 64, "batch": 64, "input": 50, "hidden": 1024, "layers": 4,
        "classes": 5000, "dropout": 0.0, "seed": 0,
    },
    "gpt": {
        "layers": 12, "d_model": 768, "heads": 12, "seq_len": 1024, "vocab": 50257,
        "batch": 8, "dropout": 0.0, "seed": 0,
    },
}
_BUILDERS: dict[str, Callable[[dict[str, Any]], Workload]] = {
    "resnet": _resnet, "lstm": _lstm, "gpt": _gpt,
}


MAX_SEED = 2**63 - 2  # torch seeds are 64-bit; the inputs' generator takes seed + 1


def names() -> list[str]:
    """Built-in workload names."""
    return sorted(_BUILDERS)


def defaults(name: str) -> dict[str, Any]:
    """The default parameters of a built-in workload."""
    _check_name(name)
    return dict(_DEFAULTS[name])


def _check_name(name: str) -> None:
    if name not in _BUILDERS:
        raise bad_arg("model", f"one of {names()}", name, "Pick a built-in workload name.")


def get(name: str, **params: Any) -> Workload:
    """A lazy workload: ``get("resnet", depth=1000, batch=32)``. Nothing is built yet, but the
    parameters are checked now: types, ranges, the model's constraints, and the step's size
    (``memplan.models.size``: absurd sizes are refused with the estimate)."""
    _check_name(name)
    merged = dict(_DEFAULTS[name])
    for key, value in params.items():
        if key not in merged:
            raise bad_arg(
                f"{name} parameter", f"one of {sorted(merged)}", key,
                f"Drop '{key}' or use one of the listed parameters.",
            )
        want = type(merged[key])
        if want is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, want) or isinstance(value, bool):
            kind = "an int" if want is int else f"a {want.__name__}"
            raise bad_arg(f"{name}.{key}", kind, value, f"Pass {key} as {kind}.")
        if key == "seed" and not 0 <= value <= MAX_SEED:
            raise bad_arg(f"{name}.seed", f"an integer in [0, {MAX_SEED}]", value,
                          "Use e.g. seed=0.")
        if want is int and value < 1 and key != "seed":
            raise bad_arg(f"{name}.{key}", "an integer >= 1", value, f"Use a positive {key}.")
        if key == "dropout" and not 0.0 <= value < 1.0:
            raise bad_arg(f"{name}.dropout", "a float in [0, 1)", value, "Use e.g. dropout=0.1.")
        merged[key] = value
    _check_constraints(name, merged)
    check_size(name, merged, params)
    return _BUILDERS[name](merged)


def _check_constraints(name: str, p: dict[str, Any]) -> None:
    """What each model needs of its parameters beyond their ranges, checked before building."""
    if name == "gpt" and p["d_model"] % p["heads"]:
        raise bad_arg("gpt.d_model", f"a multiple of heads={p['heads']}", p["d_model"],
                      "Pick d_model and heads with d_model % heads == 0, e.g. 256 and 4.")
    if name == "resnet" and p["batch"] * resnet_final_size(p["image"]) ** 2 < 2:
        # BatchNorm in training needs two values per channel; the last stage's map is
        # image/32 on a side.
        raise bad_arg("resnet.image", "at least 33 with batch=1 (BatchNorm needs more than one "
                      "value per channel in the last stage, whose side is image/32)", p["image"],
                      "Use e.g. image=224, or batch >= 2.")
