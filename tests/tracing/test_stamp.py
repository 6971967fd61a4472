"""Trace-once-and-stamp capture (issue 14, item 3) makes the same Graph as the reference path:
repeated units (ResNet bottlenecks, GPT blocks) stamped from their first call, field by field;
units that only look repeated (a stride change, shared weights) are traced, not stamped."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import fields
from typing import Any

import pytest
import torch
from torch import nn

from memplan.core.graph import Graph
from memplan.models.lstm import LSTM
from memplan.tracing import capture, chain_links, stamp
from memplan.tracing.capture import capture_target
from memplan.tracing.step import Target, as_target
from tests.small import small
from tests.zoo import ZOO, installed, split


class ConvUnit(nn.Module):
    """conv3x3-bn-relu plus a second conv: same parameters whatever the stride."""

    def __init__(self, ch: int, stride: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(ch, ch, 3, stride=stride, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(ch)
        self.out = nn.Conv2d(ch, ch, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.out(torch.relu(self.bn(self.conv(x))))
        return y


class StrideChange(nn.Module):
    """Units 0-1 and 3-4 repeat; unit 2 has their parameters and input but stride 2."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(4, 4, 1)  # the units' input requires grad
        self.units = nn.Sequential(*(ConvUnit(4, 2 if i == 2 else 1) for i in range(5)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.units(self.stem(x))
        return y


class Shared(nn.Module):
    """Two calls of one unit (shared weights: their grads add up): the second is not stamped,
    and the first's backward (with those adds) is not its side run's, so the template is not
    trusted for the unit of the same structure between them: the capture falls back."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(4, 4, 1)
        self.unit = ConvUnit(4, 1)
        self.other = ConvUnit(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.unit(self.other(self.unit(self.stem(x))))
        return y


class Parallel(nn.Module):
    """Two units of one structure side by side, summed: add's backward hands both the same
    gradient tensor, which outlives the second (stamped) unit's backward."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(4, 4, 1)
        self.a = ConvUnit(4, 1)
        self.b = ConvUnit(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        y: torch.Tensor = self.a(h) + self.b(h)
        return y


class WeightReused(nn.Module):
    """A stamped unit's weight read again outside it (its grads add up after the unit's
    backward, which its template does not foresee): the capture falls back."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(4, 4, 1)
        self.units = nn.Sequential(ConvUnit(4, 1), ConvUnit(4, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.units(self.stem(x))
        out: torch.Tensor = torch.nn.functional.conv2d(y, self.units[1].out.weight)
        return out


class Layer(nn.Module):
    """An HF-style decoder layer: two arguments (so not stamped itself), a residual add
    around an MLP of one argument on 3-d input, whose output is a view of a matmul's: the
    MLP is stamped, and add's backward hands its gradient to the residual too."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.mlp = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))

    def forward(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        y: torch.Tensor = x + self.mlp(self.norm(x)) * scale
        return y


class ResidualMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.layers = nn.ModuleList(Layer() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x.flatten(2).transpose(1, 2))
        for layer in self.layers:
            h = layer(h, 0.5)
        return h


class MLPStack(nn.Module):
    """MLPs on 3-d input, one after another (the HF MLP without its residual): stamped."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.mlps = nn.Sequential(*(nn.Sequential(nn.Linear(8, 8), nn.GELU()) for _ in range(3)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.mlps(self.embed(x.flatten(2).transpose(1, 2)))
        return y


class TiedLSTM(nn.Module):
    """The paper's LSTM (steps: one module called again on its own outputs, shared weights)
    whose classifier weight is read again after the steps: its gradient gets an add the
    chain's stamp does not foresee: the capture falls back."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = LSTM(8, 16, 2, 10)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        loss: torch.Tensor = self.lstm(x, target)
        return loss + self.lstm.classifier.weight.square().sum()


class Repeated(nn.Module):
    """One block called five times in a row on its own output (ALBERT-style sharing)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.block = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x.flatten(2).transpose(1, 2))
        for _ in range(5):
            h = self.block(h)
        return h


class Shifted(nn.Module):
    """A unit whose input is shifted by a constant tensor made from its ``shift``."""

    def __init__(self, shift: Any) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.shift = shift

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x + torch.full((), self.shift)))


class Shifts(nn.Module):
    """Units alike but for a shift of 1, 1.0 or True: equal in Python, not to torch (an
    int64, a float32 and a bool constant). ``shifts``: two of each in turn, so a stamped
    call's gradient comes from the next structure's first call, traced: its linear layer on
    3-d input hands a view (its matmul's gradient reshaped back), which nothing else holds."""

    def __init__(self, shifts: tuple[Any, ...] = (1, 1.0, True)) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.units = nn.Sequential(*(Shifted(v) for v in shifts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.units(self.embed(x.flatten(2).transpose(1, 2)))
        return y


class _ViewAndBase(torch.autograd.Function):
    """x.flatten() + z, whose backward hands x a view of the gradient it hands z as it is."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        ctx.shape = x.shape
        return x.flatten() + z

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return grad.view(ctx.shape), grad


class ViewHeldElsewhere(Shifts):
    """A stamped call's gradient is a view whose base autograd also holds for another node,
    which runs after the call's (made before it): the base outlives the call, not as the
    template has it, so the stamp falls back."""

    def __init__(self) -> None:
        super().__init__((1, 1))
        self.z = nn.Parameter(torch.zeros(2 * 64 * 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.z * 2.0
        y: torch.Tensor = _ViewAndBase.apply(super().forward(x), z)  # type: ignore[no-untyped-call]
        return y


class ConcatenatedAfter(Shifts):
    """A stamped call's output joined to another tensor: its gradient is a slice of the
    join's, laid out with the join's strides, which no template foresaw: the stamp falls
    back."""

    def __init__(self) -> None:
        super().__init__((1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        return torch.cat([y, y.detach()], dim=-1)


class Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.b(torch.relu(self.a(x)))
        return y


class Doubled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pair = Pair()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pair(x) * 2


class OtherDepths(nn.Module):
    """One unit's calls at other module depths: the first reads the step's input (no grad:
    traced), the second, inside two modules, is the template, and the third, two levels up,
    is stamped: its module calls (and so the cut points) are at its own depths."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.inner, self.last = Pair(), nn.Sequential(Doubled()), Pair()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.last(self.inner(self.first(x)))
        return y


class PartialGELU(nn.Module):
    """Hugging Face's ``GELUTanh``: an activation holding a partial of its own."""

    def __init__(self, approximate: str) -> None:
        super().__init__()
        self.act = functools.partial(nn.functional.gelu, approximate=approximate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.act(x)
        return y


class PartialMLP(nn.Module):
    def __init__(self, approximate: str) -> None:
        super().__init__()
        self.up, self.act, self.down = nn.Linear(8, 16), PartialGELU(approximate), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.down(self.act(self.up(x)))
        return y


class PartialMLPs(nn.Module):
    """MLPs whose activations are partials made per module, alike but for the last one's
    argument: the first three are one structure, the last another. The first reads the
    embedding's output, the next two a view (a linear layer's on 3-d input): the third call
    is stamped from the second."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.units = nn.Sequential(*(PartialMLP(a) for a in ("tanh", "tanh", "tanh", "none")))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.units(self.embed(x.flatten(2).transpose(1, 2)))
        return y


class HeadedMLPs(nn.Module):
    """A user's MLP stack with a linear head right after its last block (no final norm), on
    3-d input: the last block's gradient is the head's, reshaped back, a view. Before views
    were foreseen, the capture fell back, unstamped. (The first block reads the embedding's
    output, not a view: the second is the template, the last four are stamped.)"""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.blocks = nn.Sequential(*(Pair() for _ in range(6)))
        self.head = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.head(self.blocks(self.embed(x.flatten(2).transpose(1, 2))))
        return y


def _zoo(name: str) -> Callable[[], Target]:
    """A zoo entry (skipped where its library is not installed)."""
    def make() -> Target:
        entry = ZOO[name]
        if not installed(entry.library):
            pytest.skip(f"{entry.library} is not installed")
        model, example, loss = entry.build(0)
        inputs, kwargs = split(example)
        return as_target(model, inputs, loss, kwargs)
    return make


def _other_depths() -> Target:
    torch.manual_seed(0)
    return as_target(OtherDepths(), (torch.randn(4, 8),), lambda out: out.square().mean())


class CountingBlock(nn.Module):
    """Counts its calls and takes another path at the fourth."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        y = torch.tanh(self.a(x))
        y_: torch.Tensor = self.b(y * 2.0 if self.calls == 4 else y)
        return y_


class Counted(Repeated):
    """A block whose fourth call runs an op more than its template (its Python state
    differs, which no key sees): the capture falls back."""

    def __init__(self) -> None:
        super().__init__()
        self.block = CountingBlock()  # type: ignore[assignment]


class Collected(Repeated):
    """Each call's output read after the loop too (stacked): a second gradient for each
    stamped call, which its template does not foresee: the capture falls back."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x.flatten(2).transpose(1, 2))
        outs = []
        for _ in range(5):
            h = self.block(h)
            outs.append(h)
        return torch.stack(outs)


class CellLoop(nn.Module):
    """A user's loop over one of torch's RNN cells (a leaf module), the state passed back in
    by keyword, the loss on the last step's output (stamped); ``per_step``: a head and a loss
    on every step's output too, read outside the chain before the next step (stamped: autograd
    adds the head's gradient after the next step's, outside the chain); ``embed``: each step's
    input an embedding's output, requiring grad and from outside the chain (stamped: a fresh
    input per call); ``shared``: every step reads the first step's input, the same tensor (its
    gradient a sum over the calls, which the chain's stamp does not foresee: not stamped)."""

    def __init__(self, kind: str, per_step: bool = False, embed: bool = False,
                 shared: bool = False) -> None:
        super().__init__()
        self.kind, self.per_step, self.shared = kind, per_step, shared
        self.embed = nn.Linear(8, 8) if embed else None
        self.cell = {"lstm": nn.LSTMCell, "gru": nn.GRUCell, "rnn": nn.RNNCell}[kind](8, 16)
        self.head = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        h = torch.zeros(x.shape[1], 16)
        state: Any = (h, torch.zeros_like(h)) if self.kind == "lstm" else h
        inputs = self.embed(x) if self.embed is not None else x
        first = inputs[0]
        loss = torch.zeros(())
        for t in range(x.shape[0]):
            state = self.cell(first if self.shared else inputs[t], hx=state)
            h = state[0] if self.kind == "lstm" else state
            if self.per_step:
                loss = loss + nn.functional.cross_entropy(self.head(h), target[t])
        return loss + nn.functional.cross_entropy(self.head(h), target[-1])


class StackedCells(nn.Module):
    """The paper's LSTM as users write it: a loop over stacked RNN cells, a loss per step.
    Layer i's ``h[t]`` is read by layer i's step t+1 and by layer i+1's step t, both chains:
    layer i+1's call finds layer i's next step's gradient waiting for its input, and adds onto
    it in the middle of its backward (stamped: the template holds the add). ``residual``: the
    input added to each upper layer's output too, a traced add whose gradient waits for the
    call: the upper layers' chains are left traced, the bottom one's stamped. ``gathered``:
    the losses taken after the loop, from outputs gathered on the way (read after the next
    step: not stamped)."""

    def __init__(self, kind: str, residual: bool = False, gathered: bool = False) -> None:
        super().__init__()
        self.kind, self.residual, self.gathered = kind, residual, gathered
        make = {"lstm": nn.LSTMCell, "gru": nn.GRUCell}[kind]
        self.cells = nn.ModuleList(make(8, 8) for _ in range(3))
        self.out = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        zeros = x.new_zeros(x.shape[1], 8)
        state: list[Any] = [(zeros, zeros) if self.kind == "lstm" else zeros
                            for _ in self.cells]
        loss, tops = x.new_zeros(()), []
        for t in range(x.shape[0]):
            h = x[t]
            for i, cell in enumerate(self.cells):
                state[i] = cell(h, state[i])
                top = state[i][0] if self.kind == "lstm" else state[i]
                h = top + h if self.residual and i else top
            if self.gathered:
                tops.append(h)
            else:
                loss = loss + nn.functional.cross_entropy(self.out(h), y[t])
        for t, h in enumerate(tops):
            loss = loss + nn.functional.cross_entropy(self.out(h), y[t])
        return loss


class SwitchedCell(nn.Module):
    """An ``nn.RNNCell`` whose nonlinearity the loop switches to relu for steps 3 and 4: a
    stamped call of torch's own cell makes its outputs without running it, unless its
    attributes changed since its first call; then it runs, takes another path, and the
    capture falls back (the side run after the loop meets tanh again: only that check sees
    it)."""

    def __init__(self) -> None:
        super().__init__()
        self.cell = nn.RNNCell(8, 16)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        h = torch.zeros(x.shape[1], 16)
        for t in range(x.shape[0]):
            self.cell.nonlinearity = "relu" if t in (3, 4) else "tanh"
            h = self.cell(x[t], h)
        return h.square().mean()


def _stacked(kind: str, **kw: bool) -> Callable[[], Target]:
    def make() -> Target:
        torch.manual_seed(0)
        x, target = torch.randn(6, 2, 8), torch.randint(0, 5, (6, 2))
        return as_target(StackedCells(kind, **kw), (x, target), lambda out: out)
    return make


class UniversalTransformer(nn.Module):
    """One ``nn.TransformerEncoderLayer`` called four times on its own output, with dropout
    and a causal mask by keyword: its input is read by the attention and the residual add
    (two nodes), its gradient their sum, which its chain's side run sees as autograd hands it
    on: stamped. ``head``: a linear head on the last output, whose gradient is then a view
    (the head's matmul reshaped back): stamped too."""

    def __init__(self, head: bool = False) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.1, batch_first=True)
        self.head = nn.Linear(16, 3) if head else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1])
        for _ in range(4):
            h = self.layer(h, src_mask=mask)
        return h if self.head is None else self.head(h)


def _cells(kind: str, **kw: bool) -> Callable[[], Target]:
    def make() -> Target:
        torch.manual_seed(0)
        x, target = torch.randn(6, 2, 8), torch.randint(0, 10, (6, 2))
        return as_target(CellLoop(kind, **kw), (x, target), lambda out: out)
    return make


def _universal(head: bool = False) -> Target:
    torch.manual_seed(0)
    return as_target(UniversalTransformer(head), (torch.randn(2, 5, 8),),
                     lambda out: out.square().mean())


def _albert() -> Target:
    """HF ALBERT (its one layer group called four times on its own output, by keyword
    arguments): the group's input is read by three projections and a residual add, and the
    group sits inside the encoder, a chain module of its own called once: not stamped."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.AlbertConfig(
        vocab_size=50, embedding_size=8, hidden_size=16, num_hidden_layers=4,
        num_attention_heads=2, intermediate_size=32, max_position_embeddings=16)
    ids = torch.randint(0, 50, (2, 6))
    return as_target(transformers.AlbertForMaskedLM(cfg).train(), (ids,),
                     lambda out: out.logits.float().mean())


def _transposed_grad(model: Callable[[], nn.Module]) -> Callable[[], Target]:
    """``model`` under a loss that hands its output a transposed gradient (a product with a
    transposed tensor lays it out so, not a view). ``ResidualMLP``: each layer's add hands it
    on to the stamped MLP as is; its first call and its stamped calls meet that layout, which
    the template's side run then takes: stamped, not a fallback. ``MLPStack``: only the last
    MLP meets it, the others a contiguous one (the next linear's): the stamped calls emit two
    backwards, and the first call's traced backward vouches for one at most: the capture
    falls back."""
    def make() -> Target:
        torch.manual_seed(0)
        mix = torch.randn(2, 8, 64).transpose(1, 2)
        return as_target(model(), (torch.randn(2, 4, 8, 8),), lambda out: (out * mix).sum())
    return make


def _tied() -> Target:
    torch.manual_seed(0)
    x, target = torch.randn(6, 2, 8), torch.randint(0, 10, (6, 2))
    return as_target(TiedLSTM(), (x, target), lambda out: out)


def _user(model: Callable[[], nn.Module]) -> Callable[[], Target]:
    def make() -> Target:
        torch.manual_seed(0)
        return as_target(model(), (torch.randn(2, 4, 8, 8),), lambda out: out.square().mean())
    return make


CASES: dict[str, tuple[Callable[[], Target], int | None]] = {
    # (target, how many unit calls are stamped; None: the stamp falls back, unstamped)
    "resnet50": (lambda: as_target(small("resnet", depth=50), (), None), 8),
    "resnet50_dropout": (lambda: as_target(small("resnet", depth=50, dropout=0.1), (), None), 8),
    "gpt3": (lambda: as_target(small("gpt", layers=3), (), None), 2),
    "gpt3_dropout": (lambda: as_target(small("gpt", layers=3, dropout=0.1), (), None), 2),
    "stride_change": (_user(StrideChange), 2),
    "shared": (_user(Shared), None),
    "parallel": (_user(Parallel), 1),
    "weight_reused": (_user(WeightReused), None),
    "residual_mlp": (_user(ResidualMLP), 2),
    "transposed_grad": (_transposed_grad(ResidualMLP), 2),
    "transposed_grad_last": (_transposed_grad(MLPStack), None),
    "mlp_stack": (_user(MLPStack), 2),
    # An LSTM's steps: the first traced (no state requiring grad), the second the template.
    "lstm": (lambda: as_target(small("lstm", steps=6), (), None), 4),
    "lstm_dropout": (lambda: as_target(small("lstm", steps=5, dropout=0.1), (), None), 3),
    "lstm_tied": (_tied, None),
    "repeated": (_user(Repeated), 3),
    "shifts": (_user(Shifts), 0),  # three structures, none stamped from another
    "shifts_view_grads": (_user(lambda: Shifts((1, 1, 1.0, 1.0, True, True))), 3),
    "view_grad_held_elsewhere": (_user(ViewHeldElsewhere), None),
    "view_grad_of_a_concatenation": (_user(ConcatenatedAfter), None),
    "other_depths": (_other_depths, 1),
    "headed_mlps": (_user(HeadedMLPs), 4),
    "partial_activations": (_user(PartialMLPs), 1),
    # Zoo models whose units' outputs are reshaped (their gradients views), or whose
    # parameters' gradients autograd reshapes as it accumulates them (MONAI's UNETR).
    "zoo_monai_unetr": (_zoo("monai-unetr"), 13),
    "zoo_xt_decoder": (_zoo("xt-decoder"), 11),
    "zoo_hf_bert": (_zoo("hf-bert"), 3),
    "counted": (_user(Counted), None),
    "collected": (_user(Collected), None),
    # Models others wrote: torch's RNN cells in a user's loop (the first step traced: its
    # state needs no grad; the second the template), a Universal Transformer, HF ALBERT.
    "lstm_cell": (_cells("lstm"), 4),
    "rnn_cell": (_cells("rnn"), 4),
    "gru_cell": (_cells("gru"), 4),  # h read twice (the gates, the blend): their sum
    "lstm_cell_per_step": (_cells("lstm", per_step=True), 4),
    # The paper's LSTM as a loop over stacked cells (issue 14's build): three chains of 4.
    "stacked_lstm_cells": (_stacked("lstm"), 12),
    "stacked_gru_cells": (_stacked("gru"), 12),
    "stacked_lstm_residual": (_stacked("lstm", residual=True), 4),
    "stacked_lstm_gathered": (_stacked("lstm", gathered=True), None),
    "lstm_cell_embedded": (_cells("lstm", embed=True), 4),
    "lstm_cell_shared_input": (_cells("lstm", embed=True, shared=True), 0),
    "rnn_cell_embedded": (_cells("rnn", embed=True), 4),
    "rnn_cell_switched": (lambda: as_target(SwitchedCell(), (torch.randn(6, 2, 8),
                                                              torch.zeros(2)), lambda out: out),
                          None),
    "universal_transformer": (_universal, 2),
    "universal_transformer_head": (lambda: _universal(head=True), 2),
    "albert": (_albert, 0),
}


def _stamped_capture(make: Callable[[], Target], monkeypatch: Any) -> tuple[Graph, int | None]:
    """The fast capture, and how many calls it stamped (None: it fell back to no stamp)."""
    made: list[stamp.Stamper] = []
    init = stamp.Stamper.__init__

    def keep(self: stamp.Stamper, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        made.append(self)

    steps = []
    run_step = capture.run_step

    def counted(*args: Any, **kwargs: Any) -> Any:
        steps.append(kwargs.get("stamp"))
        return run_step(*args, **kwargs)

    monkeypatch.setattr(stamp.Stamper, "__init__", keep)
    monkeypatch.setattr(capture, "run_step", counted)
    graph = capture.capture_target(make(), fast=True)
    # One stamper per attempt at the step (a step with data-dependent ops runs twice: the
    # second, with what the first learned, makes the Graph).
    assert made and steps[0] is True
    return graph, made[-1].stamped + made[-1].chains.stamped if len(steps) == 1 else None


@pytest.mark.parametrize("case", list(CASES))
def test_stamped_capture_equals_the_reference_path(case: str, monkeypatch: Any) -> None:
    make, expect_stamped = CASES[case]
    fast, stamped = _stamped_capture(make, monkeypatch)
    slow = capture_target(make(), fast=False)
    for f in fields(Graph):
        assert getattr(fast, f.name) == getattr(slow, f.name), f.name
    assert fast.to_json() == slow.to_json()
    assert stamped == expect_stamped


def test_the_op_check_sets_aside_only_clones_before_an_in_place_op() -> None:
    """A chained call stamped runs without grad mode, so autograd's clone before an in-place
    op whose backward needs the overwritten tensor (a GRU cell's ``mul_``) is missing from
    it; any other clone still counts."""
    ops = ["aten.addmm.default", "aten.clone.default", "aten.mul_.Tensor",
           "aten.clone.default", "aten.add.Tensor", "aten.clone.default"]
    assert chain_links.no_clones(ops) == [
        "aten.addmm.default", "aten.mul_.Tensor", "aten.clone.default", "aten.add.Tensor",
        "aten.clone.default"]


@pytest.mark.parametrize("value", [
    3, 2.5, True, "zeros", None, (1, 1), (3, 3, "same"), (1, (2, 3)), [1, 2], (1, [2, 3]),
    torch.Size([2, 3]), (1, torch.float32), torch.float32, nn.ReLU(), (), [], (None, False),
])
def test_a_structure_attribute_keys_as_the_general_rule(value: Any) -> None:
    """``_attr_key``'s shortcut for scalars and flat tuples of them gives what the general
    rule gives (a plain value frozen, anything else by identity)."""
    general = (stamp.frozen_value(value) if stamp.is_plain(value) else ("id", id(value)))
    got = stamp._attr_key(value)
    assert got == general and type(got) is type(general) and hash(got) == hash(general)


def test_equal_values_of_other_types_key_apart() -> None:
    """1, 1.0 and True are equal in Python but make different tensors (``Shifts``); a list is
    not a tuple. Structure attributes and call arguments key them apart."""
    values: list[Any] = [1, 1.0, True, (1, 2), (1.0, 2), [1, 2]]
    attrs = [stamp._attr_key(v) for v in values]
    frozen = [stamp.frozen_value(v) for v in values]
    assert len(set(attrs)) == len(values) and len(set(frozen)) == len(values)


def test_partials_key_by_function_and_arguments() -> None:
    """A partial of plain arguments is a plain value: two made alike key alike; another
    argument or another function keys apart; one of a tensor is no plain value."""
    def gelu(approximate: str) -> Any:
        return functools.partial(nn.functional.gelu, approximate=approximate)

    assert stamp.is_plain(gelu("tanh"))
    assert stamp.frozen_value(gelu("tanh")) == stamp.frozen_value(gelu("tanh"))
    assert stamp.frozen_value(gelu("tanh")) != stamp.frozen_value(gelu("none"))
    other = functools.partial(nn.functional.silu, approximate="tanh")
    assert stamp.frozen_value(other) != stamp.frozen_value(gelu("tanh"))
    assert not stamp.is_plain(functools.partial(torch.add, torch.ones(1)))
