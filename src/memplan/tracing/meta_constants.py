"""Constants a forward makes on the meta device, lifted as on every other device.

``torch.tensor(data, device=d)`` (and ``as_tensor``, ``asarray``, ``Tensor.new_tensor``) from
Python data dispatches ``aten.lift_fresh`` on the CPU and CUDA, and nothing on the meta device.
A model built on the meta device (to plan one larger than the machine) would then be captured
with fewer ops than the real model runs, and its plan would not apply to it: a Hugging Face
Llama makes two empty constants per layer so. Within ``lifted_meta_constants``, such a
constant made on the meta device is lifted as it would be elsewhere: one op sequence for
every device the model may sit on. Only for a model on the meta device (``on_meta``): a
function mode sees every torch call, 7-14 % of a capture's time.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_LIFT = torch.ops.aten.lift_fresh.default
META_NOTE = (
    "captured on the meta device: where the forward sets items from Python numbers "
    "(`y[i] = 2`) or moves CPU tensors to its device (`t.to(x.device)`), the CPU runs other "
    "ops, and the plan does not apply there (apply says so); "
    "backward kernels may lay out gradients otherwise than on the device you train on "
    "(ConvNeXt's peak came out 0.4% below its CPU capture's): measure the applied model "
    "there, memplan.measure(model, ..., simulate=False)")
# The factories that end in lift_fresh where they build from Python data, and where that data
# is among their arguments: (position, keyword); new_tensor's after self.
_DATA_AT: dict[Any, tuple[int, str]] = {
    torch.tensor: (0, "data"), torch.as_tensor: (0, "data"), torch.asarray: (0, "obj"),
    torch.Tensor.new_tensor: (1, "data")}


class _LiftMetaConstants(TorchFunctionMode):
    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        at = _DATA_AT.get(func)
        if at is None or type(out) is not torch.Tensor or not out.is_meta:
            return out
        data = args[at[0]] if len(args) > at[0] else kwargs.get(at[1])
        return out if data is None or _not_python_data(data) else _LIFT(out)


def _not_python_data(data: Any) -> bool:
    """Data these factories copy or convert rather than build (no lift_fresh of theirs on the
    meta device either, or one for a CPU copy first): tensors and arrays."""
    return isinstance(data, torch.Tensor) or hasattr(data, "__array__")


def on_meta(model: torch.nn.Module) -> bool:
    """Whether any of the model's parameters or buffers is on the meta device."""
    return any(t.is_meta for t in itertools.chain(model.parameters(), model.buffers()))


@contextlib.contextmanager
def lifted_meta_constants(on: bool = True) -> Iterator[None]:
    """Within (``on``): Python-data constants made on the meta device are lifted (see above)."""
    with _LiftMetaConstants() if on else contextlib.nullcontext():
        yield
