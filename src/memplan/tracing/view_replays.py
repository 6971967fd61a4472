"""Autograd's replays of a view written in place, which only fake tensors show.

When an op writes a view in place with autograd on (``keys[..., :4].copy_(k)``, HF
DeepSeek-V3's attention), autograd remakes the view's node before the op returns. A real
tensor's is remade by as_strided without a dispatch; a fake tensor's (a tensor subclass) by
replaying the view's ops from its base, through every dispatch mode. Those replays are no ops
of the step: the real forward never runs them, so counting them put the plan's op-level stage
boundaries (and its op count, which ``apply`` checks) off the real run's; and capture, treating
one as an op, read the nodes of earlier ops, the view's among them, under the lock autograd
holds while it remakes that node: a deadlock. Every mode that counts a fake forward's ops
skips them the same way (``ViewReplays``).
"""

from __future__ import annotations

from collections.abc import Iterable
from types import FrameType
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor


def _geometry(t: torch.Tensor) -> tuple[Any, ...]:
    return tuple(t.shape), t.stride(), t.storage_offset()


class ViewReplays:
    """Watches for the replays of a view a counted op just wrote in place. ``caller`` is the
    Python frame that called the op (the dispatch mode's caller: modes that count ops must not
    be wrapped by torch's dynamo-disable, which adds frames of its own)."""

    __slots__ = ("watch",)

    def __init__(self) -> None:
        # The watched view: the frame and instruction that called the op that wrote it, its
        # storage, and its size, stride and offset. Callers test it before ``is_replay``.
        self.watch: tuple[FrameType, int, int, tuple[Any, ...]] | None = None

    def written(self, written: Iterable[Any], tensor_args: Iterable[torch.Tensor],
                caller: FrameType) -> None:
        """After an op: watch the first fake view it wrote, if autograd tracks the write."""
        if not torch.is_grad_enabled():
            return
        for t in written:
            if type(t) is FakeTensor and t._is_view():
                if any(a.requires_grad for a in tensor_args):
                    self.watch = (caller, caller.f_lasti, t.untyped_storage()._cdata,
                                   _geometry(t))
                return

    def is_replay(self, func: Any, args: tuple[Any, ...], caller: FrameType) -> bool:
        """Before an op: whether it replays the watched view, i.e. a view op of its storage
        called by the same Python instruction as the op that wrote it. Any other op ends the
        watch."""
        if self.watch is None:
            return False
        frame, lasti, storage, _ = self.watch
        base = args[0] if args else None
        if (caller is frame and caller.f_lasti == lasti and func.is_view
                and isinstance(base, torch.Tensor) and base.untyped_storage()._cdata == storage):
            return True
        self.watch = None
        return False

    def replayed(self, out: Any) -> None:
        """After a replay: the watch ends with the view itself (its chain replayed)."""
        if (self.watch is not None and isinstance(out, torch.Tensor)
                and _geometry(out) == self.watch[3]):
            self.watch = None

    def clear(self) -> None:
        self.watch = None
