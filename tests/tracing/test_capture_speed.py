"""The fast capture path (FakeTensorMode's cache entries found by a cheaper key, Workloads built
on the meta device, a user's parameters made fake directly) makes the same Graph as the
reference path (every op through the fake mode), field by field, on models with repeated
structure, closures, data-dependent ops, in-place views, parameter aliases and HF layers; and
it does skip the fake mode's dispatch. Timings live in benchmarks/capture.py, not here."""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import fields
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from memplan.core.graph import Graph
from memplan.tracing.capture import capture_target
from memplan.tracing.step import Target, as_target
from memplan.tracing.tracer import StepTracer, _OpRec, _ValueRec
from tests.builders import unet_inputs, unet_loss
from tests.small import small
from tests.tracing.test_user_models import (
    InplaceOnViews,
    LoopMoE,
    MaskedMLP,
    SparseRows,
    _dice_like,
    _hf_moe,
)


def _workload(name: str) -> Callable[[], Target]:
    return lambda: as_target(small(name, dropout=0.1), (), None)


def _closure() -> Target:
    torch.manual_seed(0)
    targets, weights = torch.tensor([0, 4, 1, 1, 3, 2]), torch.tensor([1.0, 2.0, 0.5, 1.0, 3.0])
    return as_target(MaskedMLP(), (torch.randn(6, 16),),
                     lambda out: F.cross_entropy(out, targets, weight=weights))


def _data_dependent() -> Target:
    torch.manual_seed(0)
    edges = torch.tensor([[0, 1, 2, 3, 3, 5, 7, 9, 4], [0, 2, 2, 1, 4, 5, 8, 9, 6]])
    return as_target(SparseRows(), (torch.randn(10, 8), edges), _dice_like)


def _moe_loop() -> Target:
    torch.manual_seed(1)
    return as_target(LoopMoE(), (torch.randn(12, 8),), lambda out: out.square().mean())


def _inplace_views() -> Target:
    torch.manual_seed(0)
    return as_target(InplaceOnViews(), (torch.randn(2, 4, 16),), lambda out: out.mean())


def _unet() -> Target:
    model, x = unet_inputs()
    return as_target(model, (x,), unet_loss)


def _hf_llama() -> Target:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=3, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=32)
    model = transformers.LlamaForCausalLM(cfg).train()
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, :3] = 0
    return as_target(model, (ids, mask), lambda out: out.logits.float().square().mean())


def _hf_mixtral() -> Target:
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(0))
    return as_target(_hf_moe("mixtral"), (ids,), lambda out: out.logits.float().mean())


class ParamAliases(torch.nn.Module):
    """Meets its parameters and buffers outside ``named_parameters`` too: a tied weight, one
    held in a list, a view of one kept as a plain attribute, a buffer in a list; two
    parameters over one storage; and asks whether a weight is a Parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(10, 8)
        self.lin = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 10, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 8))
        self.held = [self.lin.weight, self.scale]
        self.lin_t = self.lin.weight.t()
        shared = torch.randn(8, 8)
        self.left, self.right = torch.nn.Parameter(shared), torch.nn.Parameter(shared)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids) * self.held[1]
        if isinstance(self.lin.weight, torch.nn.Parameter):  # true of torch's fake copies too
            h = h * 2
        h = self.lin(h) + h @ self.lin_t + h @ self.held[0] + (h @ self.left) @ self.right
        out: torch.Tensor = self.head(h)
        return out


def _param_aliases() -> Target:
    torch.manual_seed(0)
    ids = torch.randint(0, 10, (3, 5), generator=torch.Generator().manual_seed(0))
    return as_target(ParamAliases(), (ids,), lambda out: out.square().mean())


CASES: dict[str, Callable[[], Target]] = {
    "resnet": _workload("resnet"), "lstm": _workload("lstm"), "gpt": _workload("gpt"),
    "closure": _closure, "data_dependent": _data_dependent, "moe_loop": _moe_loop,
    "inplace_views": _inplace_views, "unet": _unet, "hf_llama": _hf_llama,
    "hf_mixtral": _hf_mixtral, "param_aliases": _param_aliases,
}


@pytest.mark.parametrize("case", list(CASES))
def test_fast_capture_equals_the_reference_path(case: str) -> None:
    fast = capture_target(CASES[case](), fast=True)
    slow = capture_target(CASES[case](), fast=False)
    for f in fields(Graph):
        assert getattr(fast, f.name) == getattr(slow, f.name), f.name
    assert fast.fingerprint == slow.fingerprint
    assert fast.to_json() == slow.to_json()


def _fake_dispatches(target: Target, fast: bool) -> int:
    calls = 0
    dispatch = FakeTensorMode.dispatch

    def counted(self: FakeTensorMode, *args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        return dispatch(self, *args, **kwargs)

    FakeTensorMode.dispatch = counted  # type: ignore[method-assign]
    try:
        capture_target(target, fast=fast)
    finally:
        FakeTensorMode.dispatch = dispatch  # type: ignore[method-assign]
    return calls


def test_fast_path_skips_the_fake_mode_for_repeated_ops() -> None:
    make = _workload("lstm")
    slow, fast = _fake_dispatches(make(), fast=False), _fake_dispatches(make(), fast=True)
    assert fast * 3 < slow, (fast, slow)


class OwnSaveHooks(torch.nn.Module):
    """Packs what its middle layer saves with saved-tensor hooks of its own (as activation
    offloading does): those saves are not memplan's proxies, and read back unpacked."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = (torch.nn.Linear(16, 16) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        with torch.autograd.graph.saved_tensors_hooks(lambda t: ("boxed", t), lambda b: b[1]):
            h = torch.sigmoid(self.b(h)) * h
        return self.c(h / 2.0)


def _own_save_hooks() -> Target:
    torch.manual_seed(0)
    return as_target(OwnSaveHooks(), (torch.randn(4, 16),), lambda out: out.square().mean())


def _unpacked_saves(self: StepTracer, node: Any, name: str) -> list[torch.Tensor]:
    """What a node saved under ``name``, unpacked (through the hooks and a detach each)."""
    with self.paused():
        try:
            val = getattr(node, name)
        except RuntimeError:
            return []
    return [t for t in (val if isinstance(val, (tuple, list)) else (val,))
            if isinstance(t, torch.Tensor)]


@pytest.mark.parametrize("case", ["lstm", "gpt", "inplace_views", "hf_llama", "own_save_hooks"])
def test_saves_read_off_the_node_equal_unpacked_saves(case: str, monkeypatch: Any) -> None:
    make = {**CASES, "own_save_hooks": _own_save_hooks}[case]
    read = capture_target(make())
    monkeypatch.setattr(StepTracer, "_saved_tensors", _unpacked_saves)
    unpacked = capture_target(make())
    assert read.to_json() == unpacked.to_json()
    assert any(op.saved for op in read.ops)


def test_capture_leaves_its_records_to_reference_counting() -> None:
    """The tracer sits in a reference cycle; its op and value records must still be freed when
    capture ends, not left to the cyclic collector (a full pass over 1.3 M objects at LSTM
    T=1024: ``StepTracer.drop_records``)."""
    target = as_target(small("resnet"), (), None)
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)  # what the collector frees is kept in gc.garbage instead
    try:
        capture_target(target)
        gc.collect()
        left = sum(isinstance(o, (_OpRec, _ValueRec)) for o in gc.garbage)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    assert left == 0
