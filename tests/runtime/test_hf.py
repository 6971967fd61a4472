"""Hugging Face transformers models (tiny configs built in code, nothing downloaded) under
memplan with no change to their code: bit-equal gradients with dropout on, the measured peak
within the budget, one runtime path (the op tape) for all; and transformers installed beside
the pinned torch without replacing it."""

from __future__ import annotations

import copy
import importlib.metadata as md
import json
import re
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import memplan
from memplan.runtime.apply import applied_state

pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))

from hf_models import batch, build, hf_loss

from tests.runtime.test_integrations import run_example


def _step(model: Any, data: dict[str, torch.Tensor], seed: int) -> list[Any]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = model(**data).loss
    loss.backward()
    return [loss.detach()] + [p.grad for p in model.parameters()] + [torch.get_rng_state()]


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("kind", ["gpt2", "llama", "bert"])
def test_hf_model_exact_and_within_budget(kind: str, attn: str) -> None:
    model = build(kind, attn)
    plain = copy.deepcopy(model)
    data = batch(kind)
    graph = memplan.capture(model, kwargs=data, loss_fn=hf_loss)  # as model(**data) takes them
    least = memplan.plan(graph)
    budget = (least.peak_bytes + least.plain_peak_bytes) // 2
    plan = memplan.plan(graph, budget=budget)
    assert any(s.mode != "keep" for s in plan.stages)
    memplan.apply(model, plan)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # a stage mismatch would warn
        warnings.filterwarnings("ignore", module="transformers")
        for seed in (0, 1):
            ref, got = _step(plain, data, seed), _step(model, data, seed)
            assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(ref, got))
    state = applied_state(model)
    assert state is not None and state.last is not None
    assert state.last.finished and state.last.recorded_ops > 0  # the op-tape runtime ran
    peak = memplan.measure(model, kwargs=data, loss_fn=hf_loss, simulate=False).peak_bytes
    plain_peak = memplan.measure(plain, kwargs=data, loss_fn=hf_loss, simulate=False).peak_bytes
    assert peak == plan.peak_bytes <= budget < plain_peak  # the prediction, to the byte


def test_recipe_hf_trainer(tmp_path: Path) -> None:
    pytest.importorskip("accelerate")
    r = run_example([sys.executable, "examples/hf_loop.py", "--model", "gpt2", "--trainer",
                     "--steps", "2"], tmp_path)
    assert r["weights_equal"] and r["all_stages_seen"] and r["recorded_ops"] > 0
    assert r["peak_bytes"] <= r["budget_bytes"] < r["plain_peak_bytes"]


def test_recipe_hf_custom_loop(tmp_path: Path) -> None:
    r = run_example([sys.executable, "examples/hf_loop.py", "--model", "llama", "--steps",
                     "2"], tmp_path)
    assert r["losses_equal"] and r["first_grads"]["equal"]
    assert r["peak_bytes"] <= r["budget_bytes"] < r["plain_peak_bytes"]


def test_transformers_did_not_bring_another_torch() -> None:
    """One torch distribution, the one imported, the one the Makefile pins (the dev extra
    installs transformers and accelerate after it), and pip finds no broken requirement."""
    torches = [d for d in md.distributions() if (d.metadata["Name"] or "").lower() == "torch"]
    assert len(torches) == 1
    assert torch.__version__ == md.version("torch")
    pin = re.search(r"^TORCH \?= torch==(\S+)", (ROOT / "Makefile").read_text(), re.MULTILINE)
    if pin is not None:
        assert torch.__version__.split("+")[0] == pin.group(1)
    check = subprocess.run([sys.executable, "-m", "pip", "check"], check=False,
                           capture_output=True, text=True, timeout=120)
    assert check.returncode == 0, check.stdout + check.stderr


def _masked(kind: str) -> tuple[Any, dict[str, torch.Tensor]]:
    """A tiny model (4 layers) and its keyword inputs with a padding attention mask."""
    model = build(kind, "sdpa", layers=4)
    data = batch(kind, size=2, seq=16)
    mask = torch.ones_like(data["input_ids"])
    mask[1, 12:] = 0
    return model, {**data, "attention_mask": mask}


@pytest.mark.parametrize("kind", ["gpt2", "llama", "bert"])
def test_hf_masked_plans_keep_their_peak(kind: str) -> None:
    """With an attention mask (and Llama's rotary tables) read by every layer: the default
    planner's least peak equals ilp's (the mask and tables used to make every layer boundary
    unclean), and the planned step's real peak is the plan's, to the byte."""
    model, data = _masked(kind)
    graph = memplan.capture(model, kwargs=data, loss_fn=hf_loss)
    least = memplan.plan(graph)
    assert least.peak_bytes <= memplan.plan(graph, planner="ilp", node_limit=500).peak_bytes
    plan = memplan.plan(graph, budget=(least.peak_bytes + graph.peak_bytes) // 2)
    memplan.apply(model, plan)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        real = memplan.measure(model, kwargs=data, loss_fn=hf_loss, simulate=False,
                               repeat=1).peak_bytes
    assert real == plan.peak_bytes <= plan.budget_bytes < graph.peak_bytes


def test_hf_decoder_layers_called_with_keywords_are_planned_as_units() -> None:
    """``plan_units`` (FSDP2) over a Llama's decoder layers, which the model calls with the
    mask, rotary tables and position ids by keyword: each unit captured on those, planned,
    applied; the step stays bit-equal. With the KV cache on (a state object passed along the
    layers), the refusal says what to do."""
    import memplan.distributed as md

    model = build("llama", "sdpa", layers=4, hidden=64)
    data = {**batch("llama", size=4, seq=32), "use_cache": False}
    data["attention_mask"] = torch.ones_like(data["input_ids"])
    data["attention_mask"][1, 20:] = 0
    units = [f"model.layers.{i}" for i in range(4)]
    plain = copy.deepcopy(model)
    plans = md.plan_units(model, units, kwargs=data, loss_fn=hf_loss)
    for path in units:
        plan = plans.plans[path]
        assert plan.forward is not None and "position_embeddings" in plan.forward.kwargs
        assert any(s.mode != "keep" for s in plan.stages)
    md.apply_units(model, plans)
    for seed in (0, 1):
        assert all(torch.equal(a, b) for a, b in zip(_step(plain, data, seed),
                                                     _step(model, data, seed)))
    with pytest.raises(memplan.ConfigError, match=r"unit 'model.layers.0' is called with "
                       r"cache holding a DynamicCache.* use_cache=False"):
        md.plan_units(plain, units, kwargs={**data, "use_cache": True}, loss_fn=hf_loss)


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_hf_all_ones_mask_is_captured_as_the_eager_step_runs_it(kind: str) -> None:
    """An attention mask without padding (what a tokenizer gives for fixed-length chunks):
    transformers skips building the 4D mask in eager mode, but took fake tensors for a trace
    and built it at capture, so the plan's peak ran 512 B over the real one here. The capture
    now runs the eager path (``tracing.shims``), and apply without inputs checks the plan
    along it (the plan records what ``mask.all()`` returned): the real peak is the plan's,
    to the byte, and the step is bit-equal."""
    model = build(kind, "sdpa", layers=4)
    data = {**batch(kind, size=2, seq=16)}
    data["attention_mask"] = torch.ones_like(data["input_ids"])
    plain = copy.deepcopy(model)
    graph = memplan.capture(model, kwargs=data, loss_fn=hf_loss)
    assert graph.forward is not None and graph.forward.answers  # mask.all(): True
    assert graph.peak_bytes == memplan.measure(model, kwargs=data, loss_fn=hf_loss,
                                               simulate=False, repeat=1).peak_bytes
    plan = memplan.plan(graph, budget=(memplan.plan(graph).peak_bytes + graph.peak_bytes) // 2)
    memplan.apply(model, json.loads(plan.to_json()))  # checked on the plan's shapes alone
    for seed in (0, 1):
        assert all(torch.equal(a, b) for a, b in zip(_step(plain, data, seed),
                                                     _step(model, data, seed)))
    real = memplan.measure(model, kwargs=data, loss_fn=hf_loss, simulate=False, repeat=1)
    assert real.peak_bytes == plan.peak_bytes == memplan.measure(
        model, kwargs=data, loss_fn=hf_loss).peak_bytes


def test_hf_on_the_meta_device_is_captured_on_its_trace_path() -> None:
    """A model built on the meta device (to plan one larger than the machine) has no data for
    the eager path's reads (``mask.all()``): it is captured on transformers' trace path, which
    builds the masks, and the plan says so (an upper bound). Its empty cache constants, made
    on the meta device, are lifted as on the CPU (``meta_constants``): the plan applies to
    the real model, which trains bit-equal within it along that path."""
    data = {**batch("llama", size=2, seq=16)}
    data["attention_mask"] = torch.ones_like(data["input_ids"])
    with torch.device("meta"):
        meta = build("llama", "sdpa", layers=4)
        meta_data = {k: v.to("meta") for k, v in data.items()}
    graph = memplan.capture(meta, kwargs=meta_data, loss_fn=hf_loss)
    assert graph.forward is not None and graph.forward.trace_path
    assert any("trace path" in note for note in memplan.plan(graph).notes)
    model = build("llama", "sdpa", layers=4)
    eager = memplan.capture(model, kwargs=data, loss_fn=hf_loss)
    assert eager.forward is not None and not eager.forward.trace_path
    assert len(graph.ops) > len(eager.ops) and graph.peak_bytes >= eager.peak_bytes  # masks
    plan = memplan.plan(graph, budget=(memplan.plan(graph).peak_bytes + graph.peak_bytes) // 2)
    plain = copy.deepcopy(model)
    memplan.apply(model, json.loads(plan.to_json()))  # on the trace path, as captured
    assert all(torch.equal(a, b) for a, b in zip(_step(plain, data, 0), _step(model, data, 0)))
    real = memplan.measure(model, kwargs=data, loss_fn=hf_loss, simulate=False, repeat=1)
    assert real.peak_bytes <= plan.peak_bytes
