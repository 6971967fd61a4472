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
