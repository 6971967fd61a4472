"""Example inputs passed by keyword (``kwargs=``, as ``model(**batch)`` takes a Hugging Face
batch) through capture, plan, plan files, apply, measure, verify and the command line: the
same exactness and the same peaks as positional inputs, and clear errors where keyword inputs
go astray."""

from __future__ import annotations

import copy
import json
import warnings
from typing import Any

import pytest
import torch
from torch import nn

import memplan
from memplan.analysis.verify import verify
from memplan.cli import main
from memplan.core.graph import INPUT
from memplan.errors import CaptureError, ConfigError, PlanMismatch
from memplan.runtime.apply import applied_state
from tests.factories import KeywordInputs, keyword_batch, make_keywords


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.square().mean()


def _model() -> tuple[nn.Module, dict[str, Any]]:
    torch.set_num_threads(1)  # gradients differ between thread counts
    torch.manual_seed(0)
    return KeywordInputs(), keyword_batch()


def _grads(model: nn.Module, batch: dict[str, Any], seed: int) -> list[Any]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = _loss(model(**batch))
    loss.backward()
    return [loss.detach()] + [p.grad for p in model.parameters()] + [torch.get_rng_state()]


def _equal(a: list[Any], b: list[Any]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def test_keyword_inputs_are_captured_as_the_forward_sees_them() -> None:
    model, batch = _model()
    graph = memplan.capture(model, kwargs=batch, loss_fn=_loss)
    assert graph.forward is not None and graph.forward.inputs == ()
    assert graph.forward.kwargs == {
        "x": {"shape": [256, 16], "dtype": "float32", "requires_grad": False},
        "mask": {"shape": [256], "dtype": "float32", "requires_grad": False},
        "scale": {"value": 0.5}}
    assert sum(v.kind == INPUT for v in graph.values) == 2  # x and mask
    # The mask takes part: one multiply per block that a forward without it does not run.
    unmasked = memplan.capture(model, kwargs={"x": batch["x"]}, loss_fn=_loss)
    assert len(graph.ops) > len(unmasked.ops)
    # The same step as a positional x with the rest by keyword, to the byte.
    mixed = memplan.capture(model, batch["x"], kwargs={"mask": batch["mask"], "scale": 0.5},
                            loss_fn=_loss)
    assert (mixed.peak_bytes, len(mixed.ops)) == (graph.peak_bytes, len(graph.ops))


@pytest.mark.parametrize("planner", ["optimal", "sqrt", "drop-cheap"])
def test_a_plan_from_keyword_inputs_is_exact_and_measures_its_prediction(planner: str) -> None:
    model, batch = _model()
    plain = copy.deepcopy(model)
    plan = memplan.plan(model, kwargs=batch, loss_fn=_loss, budget=0.8 if planner == "optimal"
                        else None, planner=planner)
    assert any(s.mode != "keep" for s in plan.stages)
    # From its file, checked on zeros of the recorded shapes, the keyword ones included.
    from_file = json.loads(plan.to_json())
    assert from_file["forward"]["kwargs"]["scale"] == {"value": 0.5}
    memplan.apply(model, from_file)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a stage or input mismatch would warn
        for seed in (0, 1):
            assert _equal(_grads(plain, batch, seed), _grads(model, batch, seed))
    real = memplan.measure(model, kwargs=batch, loss_fn=_loss, simulate=False, repeat=1)
    simulated = memplan.measure(model, kwargs=batch, loss_fn=_loss)
    assert real.peak_bytes == simulated.peak_bytes == plan.peak_bytes


def test_apply_plans_and_checks_on_keyword_inputs() -> None:
    model, batch = _model()
    plain = copy.deepcopy(model)
    memplan.apply(model, budget=0.8, kwargs=batch, loss_fn=_loss)  # plan and apply at once
    assert _equal(_grads(plain, batch, 3), _grads(model, batch, 3))
    plan = memplan.unapply(model) and memplan.plan(model, kwargs=batch, loss_fn=_loss,
                                                   budget=0.8)
    memplan.apply(model, plan, kwargs=batch)  # checked on the real inputs
    assert _equal(_grads(plain, batch, 4), _grads(model, batch, 4))


def test_a_keyword_input_of_another_shape_warns_with_the_scaled_peak() -> None:
    model, batch = _model()
    memplan.apply(model, memplan.plan(model, kwargs=batch, loss_fn=_loss, budget=0.8))
    with pytest.warns(UserWarning, match=r"x=\[256, 16\] float32, mask=\[256\] float32; this "
                      r"forward's are x=\[512, 16\] float32, mask=\[512\] float32"):
        model(**keyword_batch(512))


def test_verify_and_time_objective_take_keyword_inputs() -> None:
    model, batch = _model()
    plan = memplan.plan(model, kwargs=batch, loss_fn=_loss, budget=0.8, objective="time")
    assert plan.predicted_time_s is not None
    report = verify(model, plan, kwargs=batch, loss_fn=_loss, repeat=1)
    assert report.ok and report.grads_equal and report.measured_peak_bytes == plan.peak_bytes


def test_cli_factory_with_keyword_inputs(capsys: pytest.CaptureFixture[str],
                                         tmp_path: Any) -> None:
    out = tmp_path / "plan.json"
    assert main(["plan", "tests.factories:make_keywords", "--budget", "0.8", "-o",
                 str(out)]) == 0
    assert json.loads(out.read_text())["forward"]["kwargs"]["scale"] == {"value": 0.5}
    assert main(["measure", "tests.factories:make_keywords"]) == 0
    assert main(["verify", "tests.factories:make_keywords", "--plan", str(out), "--repeat",
                 "1"]) == 0
    assert "all hold" in capsys.readouterr().out


@pytest.mark.parametrize("kwargs, needle", [
    ([1, 2], "kwargs: expected a dict of the model's keyword inputs, got 'list'"),
    ({1: torch.ones(2)}, "kwargs: expected a dict with string keys"),
])
def test_bad_kwargs_are_refused_by_name(kwargs: Any, needle: str) -> None:
    model, _ = _model()
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        memplan.capture(model, kwargs=kwargs)


def test_a_model_input_passed_to_plan_as_a_setting_names_kwargs() -> None:
    model, batch = _model()
    with pytest.raises(ConfigError, match=r"mask: expected a setting of planner 'optimal' .*"
                       r"kwargs=\{'mask': \.\.\.\}.* takes max_stages, slots, drop_cheap"):
        memplan.plan(model, batch["x"], mask=batch["mask"], budget=0.8)
    with pytest.raises(ConfigError, match=r"max_stage: expected a setting of planner "
                       r"'optimal', got 3\. Planner 'optimal' takes max_stages"):
        memplan.plan(model, batch["x"], max_stage=3)
    with pytest.raises(ConfigError, match=r"slots: .* Planner 'sqrt' takes segments"):
        memplan.plan(model, batch["x"], planner="sqrt", slots=64)


def test_a_batch_spread_as_keywords_names_kwargs() -> None:
    """``capture(model, **batch)``, as the model itself is called: each entry point names the
    keyword and points to ``kwargs=`` (it was Python's TypeError); a misspelt setting is
    named with what the entry point takes."""
    model, batch = _model()
    plan = memplan.plan(model, kwargs=batch, loss_fn=_loss, planner="sqrt")
    calls = {"capture": lambda: memplan.capture(model, **batch),
             "measure": lambda: memplan.measure(model, **batch),
             "apply": lambda: memplan.apply(copy.deepcopy(model), plan, **batch),
             "verify": lambda: verify(model, plan, **batch)}
    for name, call in calls.items():
        with pytest.raises(ConfigError, match=rf"x: expected an argument of memplan\.{name} "
                           r"\(the model's keyword inputs go in kwargs=\).*"
                           rf"memplan\.{name}\(model, kwargs=\{{'x': \.\.\., \.\.\.\}}\)"):
            call()
    with pytest.raises(ConfigError, match=r"los_fn: expected an argument of memplan\.capture, "
                       r"got None\. memplan\.capture takes kwargs=, loss_fn= and device="):
        memplan.capture(model, kwargs=batch, los_fn=None)


def test_workloads_and_graphs_take_no_keyword_inputs() -> None:
    _, batch = _model()
    w = memplan.models.get("gpt", layers=2)
    with pytest.raises(ConfigError, match="nothing beside a Workload"):
        memplan.capture(w, kwargs=batch)
    graph = memplan.capture(w)
    with pytest.raises(ConfigError, match="nothing beside a captured Graph"):
        memplan.plan(graph, kwargs=batch)


def test_a_batch_dict_passed_positionally_hints_at_kwargs() -> None:
    model, batch = _model()
    with pytest.raises(CaptureError, match=r"dict of 3: .* pass kwargs=batch instead"):
        memplan.capture(model, batch, loss_fn=_loss)


def test_factory_dict_inputs_resolve_to_keyword_inputs() -> None:
    from memplan.cli.spec import resolve

    spec = resolve("tests.factories:make_keywords")
    model, inputs, kwargs, _ = spec.call_args()
    assert isinstance(model, KeywordInputs) and inputs == ()
    assert kwargs is not None and sorted(kwargs) == ["mask", "scale", "x"]
    assert make_keywords()[1].keys() == kwargs.keys()


def test_apply_names_the_plans_keyword_inputs_left_out() -> None:
    model, batch = _model()
    plan = memplan.plan(model, kwargs=batch, loss_fn=_loss, budget=0.8)
    with pytest.raises(PlanMismatch, match=r"keyword inputs \['mask'\] that were not "
                       r"given: pass them with kwargs="):
        memplan.apply(model, plan, kwargs={"x": batch["x"], "scale": 0.5})  # the mask left out
    assert applied_state(model) is None  # untouched
