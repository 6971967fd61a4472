"""Capture of models written the way users write them (issue 11): losses and forwards that
close over real tensors, data-dependent ops (boolean masks, nonzero, .item(), .tolist(), MoE
routing), HF MoE with grouped_mm experts, in-place ops on views of non-leaf tensors. Each is
captured, planned, applied and trained one step: loss, gradients, buffers and RNG equal to
plain PyTorch (``torch.equal``)."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

import memplan
from memplan.core.graph import EXTERNAL, Graph
from memplan.errors import CaptureError, PlanMismatch
from memplan.runtime.apply import applied_state

ROOT = Path(__file__).resolve().parents[2]
LossFn = Callable[[Any], torch.Tensor]


def _blocks(n: int, width: int) -> list[nn.Module]:
    return [nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Dropout(0.1)) for _ in range(n)]


def _step(model: nn.Module, inputs: tuple[Any, ...], loss_fn: LossFn, seed: int = 3
          ) -> dict[str, Any]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = loss_fn(model(*inputs))
    loss.backward()  # type: ignore[no-untyped-call]
    return {"loss": loss.detach(), "grads": [p.grad for p in model.parameters()],
            "buffers": [b.clone() for b in model.buffers()], "rng": torch.get_rng_state()}


def _assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert torch.equal(a["loss"], b["loss"])
    assert len(a["grads"]) == len(b["grads"]) > 0
    for x, y in zip(a["grads"], b["grads"]):
        assert (x is None and y is None) or torch.equal(x, y)
    assert all(torch.equal(x, y) for x, y in zip(a["buffers"], b["buffers"]))
    assert torch.equal(a["rng"], b["rng"])


def _recompute_plan(graph: Graph) -> memplan.Plan:
    """A plan halfway between the least peak and the plain peak: some stages recomputed."""
    least = memplan.plan(graph)
    plan = memplan.plan(graph, budget=(least.peak_bytes + least.plain_peak_bytes) // 2)
    assert any(s.mode != "keep" for s in plan.stages)
    return plan


def _planned_step_is_exact(model: nn.Module, inputs: tuple[Any, ...], loss_fn: LossFn,
                           apply_inputs: bool = True) -> memplan.Plan:
    """Capture, plan, apply (with or without example inputs for the plan check) and one
    step: equal to plain PyTorch. Returns the plan."""
    plain = copy.deepcopy(model)
    plan = _recompute_plan(memplan.capture(model, *inputs, loss_fn=loss_fn))
    memplan.apply(model, plan, inputs=inputs if apply_inputs else None)
    for seed in (3, 4):
        _assert_same(_step(plain, inputs, loss_fn, seed), _step(model, inputs, loss_fn, seed))
    state = applied_state(model)
    assert state is not None and state.last is not None and state.last.finished
    assert state.last.recorded_ops > 0
    return plan


# --- 1. real tensors the loss or the forward closes over --------------------------------------


class MaskedMLP(nn.Module):
    """A forward that reads a plain tensor attribute (not a buffer): a feature mask."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*_blocks(4, 16))
        self.head = nn.Linear(16, 5)
        self.feature_mask = (torch.arange(16) % 3 != 0).float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x * self.feature_mask))


def test_loss_closing_over_targets_and_class_weights() -> None:
    torch.manual_seed(0)
    model, x = MaskedMLP(), torch.randn(6, 16)
    targets = torch.tensor([0, 4, 1, 1, 3, 2])
    class_weights = torch.tensor([1.0, 2.0, 0.5, 1.0, 3.0])

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out, targets, weight=class_weights, label_smoothing=0.1)

    graph = memplan.capture(model, x, loss_fn=loss_fn)
    # Each closed-over tensor is one constant of the step, counted once, alive throughout.
    external = sorted(v.nbytes for v in graph.values if v.kind == EXTERNAL and v.shape)
    assert external == sorted([targets.nbytes, class_weights.nbytes, 16 * 4])
    assert all(v.birth == -1 and v.death is None
               for v in graph.values if v.kind == EXTERNAL and v.shape)
    _planned_step_is_exact(model, (x,), loss_fn)


# --- 2. data-dependent ops ---------------------------------------------------------------------


class SparseRows(nn.Module):
    """Boolean-mask indexing and nonzero in the forward (torch-geometric's self loops)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*_blocks(4, 8))
        self.out = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, edges: torch.Tensor) -> torch.Tensor:
        h = self.blocks(x)
        keep = edges[:, edges[0] != edges[1]]  # drop self loops: a data-dependent count
        msg = h[keep[0]] * h[keep[1]]
        rows = torch.nonzero(h[:, 0] > 0).squeeze(1)
        return self.out(msg).sum(0) + self.out(h[rows]).mean(0)


def _dice_like(out: torch.Tensor) -> torch.Tensor:
    """A loss that reads values in Python (MONAI's Dice loss: .item(), .tolist())."""
    scale = max(out.detach().abs().max().item(), 1.0)
    weights = [w / 2 for w in out.detach().sign().tolist()]
    return (out / scale * torch.tensor(weights)).sum()


def test_data_dependent_ops_are_sized_from_the_example_batch() -> None:
    torch.manual_seed(0)
    model = SparseRows()
    x = torch.randn(10, 8)
    edges = torch.tensor([[0, 1, 2, 3, 3, 5, 7, 9, 4], [0, 2, 2, 1, 4, 5, 8, 9, 6]])
    graph = memplan.capture(model, x, edges, loss_fn=_dice_like)
    n_edges = int((edges[0] != edges[1]).sum())  # 5 of 9
    index_outputs = [graph.values[o].shape for op in graph.ops
                     if op.target == "aten.index.Tensor" for o in op.outputs]
    assert (2, n_edges) in index_outputs  # the kept edges: the real count
    assert (n_edges, 8) in index_outputs  # h[keep[0]] and h[keep[1]]
    assert graph.forward is not None and graph.forward.assumptions
    plain = copy.deepcopy(model)
    plan = _planned_step_is_exact(model, (x, edges), _dice_like)
    assert any("data-dependent sizes of the example batch" in n for n in plan.notes)
    assert "data-dependent sizes of the example batch" in plan.explain()
    # The check of a plan without the example inputs (zeros of their shapes) works too, on
    # the plan as its file holds it (the capture's assumptions with it).
    from_file = json.loads(plan.to_json())
    assert from_file["forward"]["assumptions"] == list(graph.forward.assumptions)
    again = memplan.apply(memplan.unapply(model), from_file)
    _assert_same(_step(plain, (x, edges), _dice_like), _step(again, (x, edges), _dice_like))


class LoopMoE(nn.Module):
    """MoE routing as eager HF code writes it: top-k, then a loop over the experts that got
    tokens, with torch.where(mask) picking their tokens."""

    def __init__(self, width: int = 8, experts: int = 4, layers: int = 3) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.ModuleDict({"gate": nn.Linear(width, experts, bias=False),
                           "experts": nn.ModuleList(_blocks(experts, width))})
            for _ in range(layers))
        self.out = nn.Linear(width, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            probs = layer["gate"](x).softmax(-1)
            weight, chosen = probs.topk(2, dim=-1)
            hit = torch.zeros(probs.shape[-1], dtype=torch.bool).index_fill(0, chosen.flatten(), True)
            y = torch.zeros_like(x)
            for e in hit.nonzero().flatten().tolist():
                token, slot = torch.where(chosen == e)
                out = layer["experts"][e](x[token]) * weight[token, slot, None]
                y = y.index_add(0, token, out)
            x = x + y
        return self.out(x)


def test_moe_routing_loop_is_exact() -> None:
    torch.manual_seed(1)
    model, x = LoopMoE(), torch.randn(12, 8)
    plan = _planned_step_is_exact(model, (x,), lambda out: out.square().mean())
    assert any("aten.nonzero.default" in n for n in plan.notes)


class SplitMoE(nn.Module):
    """HF JetMoe's routing: expert sizes by ``tolist()``, tokens by ``split``; before it, a
    check HF runs on real tensors only (``mask.all()``, skipped on fake ones): its bools
    took the place of the sizes."""

    def __init__(self, width: int = 8, experts: int = 4) -> None:
        super().__init__()
        self.gate = nn.Linear(width, experts, bias=False)
        self.experts = nn.ModuleList(_blocks(experts, width))
        self.out = nn.Linear(width, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, FakeTensor) and bool((x.abs() >= 0).all()):
            x = x * 1.0
        chosen = self.gate(x).argmax(-1)
        order = chosen.argsort()
        sizes = torch.bincount(chosen, minlength=len(self.experts)).tolist()
        parts = x[order].split(sizes, dim=0)
        y = torch.cat([e(p) for e, p in zip(self.experts, parts)])
        return self.out(torch.zeros_like(x).index_add(0, order, y))


def test_items_a_real_forward_takes_alone_do_not_shift_the_others() -> None:
    torch.manual_seed(1)
    plan = _planned_step_is_exact(SplitMoE(), (torch.randn(12, 8),),
                                  lambda out: out.square().mean())
    assert any("aten._local_scalar_dense.default" in n for n in plan.notes)


def test_error_in_the_model_is_a_capture_error() -> None:
    model = nn.Sequential(nn.Linear(4, 5), nn.Linear(4, 2))  # the user's own shape bug
    with pytest.raises(CaptureError, match="training step of Sequential raised RuntimeError"):
        memplan.capture(model, torch.randn(3, 4))


def test_inputs_passed_as_one_tuple_are_named_in_the_error() -> None:
    """capture(model, (x, mask)) hands forward one tuple: the error says to unpack it."""
    class TwoInputs(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 2)

        def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            return self.lin(x) * mask

    x, mask = torch.randn(3, 4), torch.ones(3, 2)
    with pytest.raises(CaptureError, match=r"a tuple of 2: pass the model's inputs as separate "
                                           r"arguments, memplan.capture\(model, \*inputs"):
        memplan.capture(TwoInputs(), (x, mask))
    with pytest.raises(CaptureError) as plain_err:  # an error of the model itself: no hint
        memplan.capture(nn.Sequential(nn.Linear(4, 5), nn.Linear(4, 2)), x)
    assert "separate arguments" not in str(plain_err.value)
    assert memplan.capture(TwoInputs(), x, mask).ops  # unpacked: captured


def test_error_in_apply_check_is_a_plan_mismatch() -> None:
    """A model that fails on the plan's inputs is not the plan's model (issue 12.4)."""
    x = torch.randn(3, 4)
    plan = memplan.plan(memplan.capture(nn.Sequential(*_blocks(3, 4)), x))
    broken = nn.Sequential(nn.Linear(4, 5), nn.Linear(4, 2))
    with pytest.raises(PlanMismatch, match="this model's forward fails on inputs"):
        memplan.apply(broken, plan)
    assert applied_state(broken) is None


# --- 3. HF MoE with grouped_mm experts ---------------------------------------------------------


@pytest.mark.parametrize("shapes", [((10, 8), (3, 5, 8), True), ((10, 8), (3, 8, 16), False),
                                    ((3, 4, 8), (3, 5, 8), True), ((3, 4, 8), (3, 8, 16), False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_grouped_mm_fake_kernel_allocates_as_the_cpu_kernel(shapes: Any, dtype: torch.dtype
                                                            ) -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    import memplan.tracing.fake  # noqa: F401  (registers the kernel)

    a_shape, b_shape, transposed = shapes
    a = torch.randn(a_shape, dtype=dtype)
    b = torch.randn(b_shape, dtype=dtype)
    b = b.transpose(-2, -1) if transposed else b
    offs = torch.tensor([3, 7, 10], dtype=torch.int32) if a.dim() == 2 else None
    real = torch._grouped_mm(a, b, offs=offs)
    with FakeTensorMode(allow_non_fake_inputs=True):
        fake = torch._grouped_mm(a, b, offs=offs)
    assert (fake.shape, fake.stride(), fake.dtype) == (real.shape, real.stride(), real.dtype)
    assert fake.untyped_storage().nbytes() == real.untyped_storage().nbytes()


def _hf_moe(kind: str) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    common = {"vocab_size": 96, "hidden_size": 32, "num_hidden_layers": 3,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
              "attention_dropout": 0.1}
    torch.manual_seed(0)
    if kind == "mixtral":
        cfg = transformers.MixtralConfig(intermediate_size=64, num_local_experts=4,
                                         num_experts_per_tok=2, **common)
        model = transformers.MixtralForCausalLM(cfg)
    else:
        cfg = transformers.Qwen3MoeConfig(intermediate_size=64, moe_intermediate_size=32,
                                          num_experts=4, num_experts_per_tok=2, **common)
        model = transformers.Qwen3MoeForCausalLM(cfg)
    assert model.config._experts_implementation == "grouped_mm"
    return model.train()


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_hf_moe_with_grouped_mm_plans_and_applies_exactly(kind: str) -> None:
    model = _hf_moe(kind)
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(0))

    def loss_fn(out: Any) -> torch.Tensor:
        return F.cross_entropy(out.logits.flatten(0, 1), ids.flatten())

    graph = memplan.capture(model, ids, loss_fn=loss_fn)
    assert any(op.target == "aten._grouped_mm.default" for op in graph.ops)
    # The fake step counts the bytes the real one allocates.
    real = memplan.measure(model, ids, loss_fn=loss_fn, simulate=False)
    assert graph.peak_bytes == real.peak_bytes
    _planned_step_is_exact(model, (ids,), loss_fn)


class LSTMBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.LSTM(16, 16, batch_first=True)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.drop(self.rnn(x)[0])
        return out


class StackedLSTM(nn.Module):
    """nn.LSTM layers (CPU: oneDNN's mkldnn_rnn_layer, with a workspace for backward), one
    block each so that a plan can cut between them."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(LSTMBlock() for _ in range(4)))
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.blocks(x))
        return out


def test_nn_lstm_fake_step_counts_the_real_workspace() -> None:
    torch.manual_seed(0)
    model, x = StackedLSTM(), torch.randn(4, 12, 16)

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        return out.square().mean()

    real = memplan.measure(model, x, loss_fn=loss_fn, simulate=False).peak_bytes
    assert memplan.measure(model, x, loss_fn=loss_fn).peak_bytes == real
    graph = memplan.capture(model, x, loss_fn=loss_fn)
    assert graph.peak_bytes == real
    workspaces = [graph.values[op.outputs[-1]].nbytes for op in graph.ops
                  if op.target == "aten.mkldnn_rnn_layer.default"]
    assert len(workspaces) == 4 and min(workspaces) > 0


@pytest.mark.xfail(strict=True, raises=KeyError, reason=(
    "runtime: a recomputed mkldnn_rnn_layer is replayed in backward, where grad mode is off "
    "and oneDNN's kernel returns no workspace (replay.materialise: KeyError on the handle)"))
def test_nn_lstm_planned_step_is_exact() -> None:
    torch.manual_seed(0)
    _planned_step_is_exact(StackedLSTM(), (torch.randn(4, 12, 16),),
                           lambda out: out.square().mean())


# --- 4. in-place ops on views of non-leaf tensors ----------------------------------------------


class InplaceOnViews(nn.Module):
    """F.relu(y.view(...), inplace=True) and InstanceNorm + LeakyReLU(inplace=True) (MONAI's
    conv blocks): both write a view of a tensor autograd made."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.convs = nn.Sequential(*(
            nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.InstanceNorm2d(4, affine=True),
                          nn.LeakyReLU(0.1, inplace=True)) for _ in range(4)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        y = F.relu(y.view(2, 4, 4, 4), inplace=True)
        return self.convs(y)


class CopyIntoSlices(nn.Module):
    """HF DeepSeek-V3's attention (``expand_kv``): keys built by copy_ into slices of a
    new_empty tensor. The slices' nodes were read after the copy_ wrote them, while autograd
    made them again under its lock: a deadlock."""

    def __init__(self) -> None:
        super().__init__()
        self.kv = nn.Linear(16, 16)
        self.rot = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kv = self.kv(x).view(2, 4, 2, 8).transpose(1, 2)
        k, v = torch.split(kv, [4, 4], dim=-1)
        rot = self.rot(x).view(2, 1, 4, 4).expand(-1, 2, -1, -1)
        keys = kv.new_empty(*kv.shape[:-1], 8)
        keys[..., :4].copy_(k)
        keys[..., 4:].copy_(rot)
        return torch.cat([keys.softmax(-1), v], -1).relu()


def inplace_on_views_case() -> None:
    """Run in a subprocess by the test below: a deadlock must fail the test, not hang it."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    _planned_step_is_exact(InplaceOnViews(), (torch.randn(2, 4, 16),),
                           lambda out: out.square().mean())
    _planned_step_is_exact(CopyIntoSlices(), (torch.randn(2, 4, 16),),
                           lambda out: out.square().mean())
    print("inplace-ok")


def test_inplace_on_view_of_non_leaf_captures_and_is_exact() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    code = textwrap.dedent("""
        from tests.tracing.test_user_models import inplace_on_views_case
        inplace_on_views_case()
    """)
    try:
        done = subprocess.run([sys.executable, "-c", code], check=False, cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        pytest.fail("capture of an in-place op on a view did not return (deadlock)")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "inplace-ok" in done.stdout
