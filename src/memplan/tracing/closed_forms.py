"""Batch norm's output layouts, worked out directly where they are certain (``opcache``).

The fake mode runs ``native_batch_norm`` and its backward as Python decompositions, twenty-odd
reference ops each: 6 ms a call at a new shape even on the meta kernel, 0.2 s of a ResNet-1000
capture (32 first calls). Their outputs' layouts follow from the decompositions
(``torch/_decomp/decompositions.py``) for the inputs training meets: float32, dense, with no
dimension of size 1 or 0 (elementwise ops lay their output out as such an input, whatever
the order of its dimensions; a reduction to the channels, or a vector op on them, gives a
dense vector). Elsewhere (other dtypes, eval mode, a size-1 dimension whose stride any
layout allows, a non-dense input) the caller runs the meta kernel as before.
``tests/tracing/test_opcache.py`` checks both against the fake mode over layouts and dtypes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

# An output: its sizes and strides (float32, fresh storage, offset 0), or None (not made).
Layout = tuple[tuple[int, ...], tuple[int, ...]] | None
_ATEN = torch.ops.aten


def _dense_float(t: Any) -> bool:
    """A float32 tensor of two dimensions or more, none of size 0 or 1, filling its storage
    once in some order of its dimensions (from offset 0)."""
    if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.dim() < 2 \
            or t.storage_offset() != 0 or any(n < 2 for n in t.shape):
        return False
    expected = 1
    for size, step in sorted(zip(t.shape, t.stride()), key=lambda d: d[1]):
        if step != expected:
            return False
        expected *= size
    return True


def _channels(t: Any, c: int, optional: bool = True) -> bool:
    """A float32 vector of ``c`` elements (or None, where ``optional``)."""
    if t is None:
        return optional
    return isinstance(t, torch.Tensor) and t.dtype == torch.float32 and tuple(t.shape) == (c,)


def batch_norm(args: tuple[Any, ...]) -> list[Layout] | None:
    """``native_batch_norm(input, weight, bias, running_mean, running_var, training, momentum,
    eps)`` in training: the output laid out as the input (elementwise ops on it and channel
    vectors), save_mean and save_invstd (the channel reduction, squeezed): dense vectors."""
    if len(args) != 8 or args[5] is not True or not _dense_float(args[0]):
        return None
    x = args[0]
    c = x.shape[1]
    if not all(_channels(t, c) for t in args[1:5]):
        return None
    return [(tuple(x.shape), tuple(x.stride())), ((c,), (1,)), ((c,), (1,))]


def batch_norm_backward(args: tuple[Any, ...]) -> list[Layout] | None:
    """``native_batch_norm_backward(grad_out, input, weight, running_mean, running_var,
    save_mean, save_invstd, train, eps, output_mask)`` in training, grad_out laid out as the
    input: grad_input laid out as both (always made), grad_weight and grad_bias (a channel
    reduction; its product with save_invstd) dense vectors where the mask asks for them."""
    if len(args) != 10 or args[7] is not True or not _dense_float(args[1]):
        return None
    grad, x, mask = args[0], args[1], args[9]
    c = x.shape[1]
    if not isinstance(grad, torch.Tensor) or grad.dtype != torch.float32 \
            or grad.shape != x.shape or grad.stride() != x.stride() \
            or not all(_channels(t, c) for t in args[2:5]) \
            or not all(_channels(t, c, optional=False) for t in args[5:7]) \
            or not isinstance(mask, (list, tuple)) or len(mask) != 3 \
            or not all(type(m) is bool for m in mask):
        return None
    vector = ((c,), (1,))
    return [(tuple(x.shape), tuple(x.stride())), vector if mask[1] else None,
            vector if mask[2] else None]


CLOSED_FORMS: dict[Any, Callable[[tuple[Any, ...]], list[Layout] | None]] = {
    _ATEN.native_batch_norm.default: batch_norm,
    _ATEN.native_batch_norm_backward.default: batch_norm_backward,
}
