"""Built-in workloads refuse absurd sizes up front, with the estimate (issue 12, item 8); the
estimate (``memplan.models.size``) is close to what capture finds."""

from __future__ import annotations

from typing import Any

import pytest

import memplan
from memplan.errors import ConfigError
from memplan.models.size import MAX_FORWARD_OPS, step_size


@pytest.mark.parametrize("name, params", [
    ("resnet", {"depth": 14, "batch": 2, "image": 32, "classes": 10}),
    ("resnet", {"depth": 152, "batch": 4, "image": 64, "classes": 100}),
    ("resnet", {"depth": 26, "batch": 1, "image": 224}),
    ("lstm", {"steps": 4, "batch": 2, "hidden": 32, "input": 8, "classes": 10}),
    ("lstm", {"steps": 16, "layers": 1, "batch": 2, "hidden": 32, "input": 8, "classes": 10}),
    ("lstm", {"steps": 8, "batch": 4, "hidden": 256, "input": 50, "classes": 500}),
    ("gpt", {"layers": 2, "d_model": 32, "heads": 2, "seq_len": 16, "vocab": 100, "batch": 2}),
    ("gpt", {"layers": 4, "d_model": 128, "heads": 4, "seq_len": 128, "vocab": 1000,
             "batch": 4}),
])
def test_estimate_is_close_to_the_capture(name: str, params: dict[str, Any]) -> None:
    w = memplan.models.get(name, **params)
    graph = memplan.capture(w)
    size = step_size(name, w.params)
    assert abs(size.forward_ops - len(graph.ops)) <= 2
    assert 0.8 <= size.step_bytes / (graph.saved_bytes + graph.param_bytes) <= 1.5


@pytest.mark.parametrize("name, params", [
    ("resnet", {"depth": 1000, "batch": 32, "image": 224}),  # the paper's (Sec. 5.2)
    ("lstm", {"steps": 2048}),  # Fig. 6's longest
    ("gpt", {}),
    ("gpt", {"layers": 96, "d_model": 12288, "heads": 96, "seq_len": 2048, "batch": 8}),
])
def test_paper_and_large_sizes_are_accepted(name: str, params: dict[str, Any]) -> None:
    assert step_size(name, memplan.models.get(name, **params).params).fits


@pytest.mark.parametrize("name, params, needle", [
    ("resnet", {"depth": 10**9}, "resnet.depth: expected an integer in [1, 187,497]"),
    ("resnet", {"batch": 10**24}, "resnet.batch: expected an integer in [1, "),
    ("resnet", {"image": 10**8}, "resnet.image: expected an integer in [1, "),
    ("resnet", {"classes": 10**15}, "resnet.classes"),
    ("lstm", {"steps": 10**7}, "lstm.steps"),
    ("lstm", {"layers": 10**5}, "lstm.layers"),
    ("gpt", {"layers": 10**6}, "gpt.layers"),
    ("gpt", {"vocab": 10**12}, "gpt.vocab"),
    ("resnet", {"depth": 10**6, "image": 8}, "resnet.depth"),  # the size that is too big
])
def test_absurd_sizes_are_refused_with_the_estimate(name: str, params: dict[str, Any],
                                                    needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        memplan.models.get(name, **params)
    text = str(info.value)
    assert needle in text and "its step would be about" in text
    assert f"{MAX_FORWARD_OPS:,} forward ops" in text and "Lower" in text


@pytest.mark.parametrize("name, params, needle", [
    ("resnet", {"batch": 1, "image": 32}, "resnet.image: expected at least 33 with batch=1"),
    ("resnet", {"batch": 1, "image": 1}, "BatchNorm"),
    ("gpt", {"d_model": 30, "heads": 4}, "gpt.d_model: expected a multiple of heads=4"),
    ("resnet", {"seed": 2**64}, "resnet.seed: expected an integer in [0, "),
    ("resnet", {"seed": -1}, "resnet.seed"),
    ("resnet", {"classes": 1.5}, "expected an int,"),
])
def test_model_constraints_are_checked_before_building(name: str, params: dict[str, Any],
                                                       needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        memplan.models.get(name, **params)
    assert needle in str(info.value)


def test_smallest_batchnorm_image_is_accepted_and_trains() -> None:
    w = memplan.models.get("resnet", depth=14, batch=1, image=33, classes=10)
    model, inputs = w.build_model(), w.build_inputs()
    w.loss(model(*inputs)).backward()
