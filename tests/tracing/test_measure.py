from __future__ import annotations

import pytest
import torch
from torch import nn

import memplan
from tests.small import small


@pytest.mark.parametrize("name", ["resnet", "lstm", "gpt"])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_simulated_peak_equals_real_peak_to_the_byte(name: str, dropout: float) -> None:
    w = small(name, dropout=dropout)
    sim = memplan.measure(w, simulate=True)
    real = memplan.measure(w, simulate=False, repeat=1)
    assert sim.peak_bytes == real.peak_bytes
    assert sim.forward_peak_bytes == real.forward_peak_bytes
    assert sim.breakdown_at_peak == real.breakdown_at_peak
    assert sum(real.breakdown_at_peak.values()) == real.peak_bytes
    assert real.step_time_s is not None and real.step_time_s > 0 and sim.step_time_s is None


def test_capture_peak_matches_measure() -> None:
    w = small("resnet")
    graph = memplan.capture(w)
    assert max(graph.live_bytes_timeline()) == memplan.measure(w).peak_bytes


class TanhGelu(nn.Module):
    """GPT-2's gelu_new: products with Python floats, whose backward saves the float as a
    0-dim tensor autograd made (a wrapped number), not memory of the step."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return 0.5 * h * (1.0 + torch.tanh(0.7978845608 * (h + 0.044715 * torch.pow(h, 3.0))))


def test_scalars_autograd_wraps_are_not_counted_by_capture_either() -> None:
    model, x = TanhGelu(), torch.randn(32, 64)
    graph = memplan.capture(model, x)
    scalars = [v for v in graph.values if v.kind == "external" and v.shape == ()]
    assert len(scalars) >= 3 and all(v.nbytes == 0 for v in scalars)  # tracked, saved
    assert any(v.id in op.saved for op in graph.ops for v in scalars)
    real = memplan.measure(model, x, simulate=False, repeat=1).peak_bytes
    assert graph.peak_bytes == memplan.measure(model, x).peak_bytes == real


def test_peak_counts_parameters_gradients_and_activations_by_hand() -> None:
    # y = relu(x @ W^T): every byte is predictable.
    model = nn.Linear(256, 256, bias=False)
    x = torch.randn(64, 256)
    report = memplan.measure(model, x, loss_fn=lambda out: out.relu().sum(), simulate=False)
    w_bytes, act = 256 * 256 * 4, 64 * 256 * 4
    assert report.param_bytes == w_bytes
    assert report.breakdown_at_peak["parameter"] == w_bytes
    assert report.breakdown_at_peak["input"] == act
    assert report.peak_bytes >= w_bytes + act + act  # + linear output, relu output...
    sim = memplan.measure(model, x, loss_fn=lambda out: out.relu().sum(), simulate=True)
    assert sim.peak_bytes == report.peak_bytes


def test_views_of_weights_are_not_new_memory() -> None:
    # nn.Linear's backward transposes the weight: a view, never counted again.
    model = nn.Linear(512, 512, bias=False)
    x = torch.randn(1, 512)
    report = memplan.measure(model, x, simulate=True)
    assert report.peak_bytes < 2 * 512 * 512 * 4 + 64 * 1024  # weight + its grad + small stuff


def test_measure_rejects_bad_arguments() -> None:
    w = small("gpt")
    with pytest.raises(memplan.ConfigError, match="device"):
        memplan.measure(w, simulate=False, device="tpu")
    with pytest.raises(memplan.ConfigError, match="repeat"):
        memplan.measure(w, repeat=0)
    if not torch.cuda.is_available():
        with pytest.raises(memplan.ConfigError, match="device"):
            memplan.measure(w, simulate=False, device="cuda")
