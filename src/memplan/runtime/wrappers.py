"""What wraps a model: FSDP units inside a model that would run under a plan.

A recompute scope around an FSDP unit would record its all-gathers on the tape and replay ops
on parameters FSDP freed after the forward: ``memplan.apply`` refuses such a model, and
``memplan.distributed`` applies plans per unit instead.
"""

from __future__ import annotations

import torch
from torch import nn

try:
    from torch.distributed import fsdp as _fsdp
except ImportError:  # a torch built without distributed support
    _fsdp = None  # type: ignore[assignment]

from memplan.errors import ConfigError


def _fsdp_classes() -> tuple[type, ...]:
    """FSDP2's ``FSDPModule`` (torch >= 2.6) and FSDP1's wrapper, where this torch has them."""
    classes: list[type] = []
    for name in ("FSDPModule", "FullyShardedDataParallel"):
        cls = getattr(_fsdp, name, None) if _fsdp is not None else None
        if isinstance(cls, type):
            classes.append(cls)
    return tuple(classes)


def sharded_units(model: nn.Module) -> list[str]:
    """Paths of the FSDP units (``fully_shard`` or FSDP1 wrappers) strictly inside ``model``."""
    if not torch.distributed.is_available():
        return []
    classes = _fsdp_classes()
    return [name for name, mod in model.named_modules() if name and isinstance(mod, classes)]


def check_wrappers(model: nn.Module) -> None:
    """Raise when ``model`` runs under a plan and contains FSDP units: their all-gathers would
    be recorded and their freed parameters replayed in backward (wrong gradients)."""
    inner = sharded_units(model)
    if inner:
        shown = ", ".join(inner[:3]) + (" ..." if len(inner) > 3 else "")
        raise ConfigError(
            f"memplan: this model runs under a plan and contains {len(inner)} FSDP unit(s) "
            f"({shown}); a recompute scope around an FSDP unit would replay its all-gathered "
            "parameters after FSDP freed them. Apply memplan per FSDP unit instead, before "
            "fully_shard: plans = memplan.distributed.plan_units(model, units, *inputs, "
            "loss_fn=..., budget=..., world_size=...); memplan.distributed.apply_units(model, "
            "plans); then fully_shard each unit and the root (docs/recipes.md)."
        )
