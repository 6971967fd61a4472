"""What the tracer reads of an op call, worked out once per overload where it can be: whether
it is counted, its name, the arguments it writes, its FLOPs (torch's ``FlopCounterMode``
formulas for matmul/conv/attention), and the tensors among its arguments."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

_DETACH = torch.ops.aten.detach.default


def is_counted(func: Any) -> bool:
    """Whether an op gets an index in the captured forward (the runtime counts the same way)."""
    return func.namespace != "prim" and func is not _DETACH


def _mutated_arg_positions(func: Any) -> tuple[int, ...]:
    return tuple(
        i
        for i, arg in enumerate(func._schema.arguments)
        if arg.alias_info is not None and arg.alias_info.is_write
    )


@dataclass(frozen=True, slots=True)
class OpInfo:
    """What the tracer needs of an op overload, worked out once per overload."""

    counted: bool
    target: str
    mutated: tuple[int, ...]  # positions of the arguments it writes
    formula: Any  # torch's FLOP formula, or None


def op_info(func: Any) -> OpInfo:
    return OpInfo(is_counted(func), str(func), _mutated_arg_positions(func),
                   flop_registry.get(func.overloadpacket))


def tensors_of(args: Any, kwargs: dict[str, Any] | None = None) -> list[torch.Tensor]:
    """The tensors among an op's arguments (or outputs), in ``tree_flatten`` order: aten
    arguments nest lists one level deep at most, so a hand walk does what pytree's general one
    does, at a fraction of the cost."""
    if isinstance(args, torch.Tensor):
        return [args]
    out: list[torch.Tensor] = []
    items = args if isinstance(args, (list, tuple)) else (args,)
    for a in (*items, *kwargs.values()) if kwargs else items:
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out.extend(tensors_of(a))
        elif isinstance(a, dict):
            flat, _ = tree_flatten(a)
            out.extend(t for t in flat if isinstance(t, torch.Tensor))
    return out


def shape_key(target: str, args: tuple[Any, ...], out: Any) -> tuple[Any, ...] | None:
    """What a FLOP formula reads of a call: shapes of tensors, other arguments as they are
    (None when one of them is not hashable)."""
    key: list[Any] = [target]
    for a in (*args, out):
        if isinstance(a, torch.Tensor):
            key.append(a.shape)
        elif isinstance(a, (list, tuple)):
            key.append(tuple(b.shape if isinstance(b, torch.Tensor) else b for b in a))
        else:
            key.append(a)
    frozen = tuple(key)
    try:
        hash(frozen)
    except TypeError:
        return None
    return frozen
