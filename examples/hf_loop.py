"""Recipe: memplan with Hugging Face transformers, in a custom loop or under ``Trainer``.

    python examples/hf_loop.py --model llama --attn sdpa          # a custom training loop
    python examples/hf_loop.py --model gpt2 --trainer             # transformers.Trainer

No change to the model's code: plan for the batch shapes you train with (the batch goes in
as keyword inputs, ``kwargs=batch``, as ``model(**batch)`` takes it; the loss is the one the
model computes from ``labels``), apply, and train. memplan has one path for every model, the
op-tape runtime: the model's own forward runs, stage boundaries are module calls, and
recomputed scopes are replayed from their recorded aten ops in backward.

The budget needs no headroom: on these models the measured peak is the plan's prediction, to
the byte (GPT-2, Llama and BERT, both attention implementations).

The script trains a plain copy side by side (same seeds, same batches) and checks that every
loss and the final weights are bit-equal and that the measured peak fits the budget.
"""

from __future__ import annotations

import copy
import tempfile
import warnings
from typing import Any

import torch
from _common import compare, emit, grads, interleaved_medians, parse_budget, parser
from hf_models import batch, build, hf_loss

import memplan
from memplan.runtime.apply import applied_state


def custom_loop(model: Any, plain: Any, data: dict[str, torch.Tensor], steps: int
                ) -> dict[str, Any]:
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (plain, model)]
    losses_equal = True
    first: dict[str, Any] = {}
    for step in range(steps):
        losses = []
        for m, opt in zip((plain, model), opts):
            opt.zero_grad()
            torch.manual_seed(step)  # the same dropout masks on both sides
            loss = m(**data).loss  # exactly as the user's loop calls it
            loss.backward()
            if step == 0:
                first[str(id(m))] = grads(m)
            opt.step()
            losses.append(loss.detach())
        losses_equal &= torch.equal(losses[0], losses[1])
    return {"losses_equal": losses_equal,
            "first_grads": compare(first[str(id(plain))], first[str(id(model))])}


def trainer_loop(model: Any, plain: Any, data: dict[str, torch.Tensor], steps: int
                 ) -> dict[str, Any]:
    """The real transformers.Trainer, offline, on a tiny in-memory data set."""
    from transformers import Trainer, TrainingArguments

    rows = [{k: v[i] for k, v in data.items()} for i in range(len(data["input_ids"]))]
    out: dict[str, Any] = {}
    for name, m in (("plain", plain), ("memplan", model)):
        with tempfile.TemporaryDirectory() as tmp:
            args = TrainingArguments(
                output_dir=tmp, per_device_train_batch_size=len(rows), max_steps=steps,
                learning_rate=1e-3, report_to=[], save_strategy="no", logging_strategy="no",
                use_cpu=True, dataloader_num_workers=0, disable_tqdm=True, seed=7)
            Trainer(model=m, args=args, train_dataset=rows).train()
    out["weights_equal"] = all(torch.equal(a, b) for a, b in
                               zip(plain.parameters(), model.parameters()))
    return out


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--model", default="llama", choices=["gpt2", "llama", "bert"])
    p.add_argument("--attn", default="sdpa", choices=["eager", "sdpa"])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--budget", default="auto")
    p.add_argument("--trainer", action="store_true", help="train with transformers.Trainer")
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    model = build(args.model, args.attn, layers=args.layers)
    plain = copy.deepcopy(model)
    data = batch(args.model)

    # --- the recipe --------------------------------------------------------------------------
    graph = memplan.capture(model, kwargs=data, loss_fn=hf_loss)  # model(**data).loss
    plan = memplan.plan(graph, budget=parse_budget(args.budget, memplan.plan(graph)))
    memplan.apply(model, plan)
    # -----------------------------------------------------------------------------------------

    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # memplan warns if the stages do not match
        warnings.filterwarnings("ignore", module="transformers")
        warnings.filterwarnings("ignore", module="accelerate")
        result = (trainer_loop if args.trainer else custom_loop)(model, plain, data, args.steps)
    state = applied_state(model)
    assert state is not None and state.last is not None
    peak = memplan.measure(model, kwargs=data, loss_fn=hf_loss, simulate=False).peak_bytes
    plain_peak = memplan.measure(plain, kwargs=data, loss_fn=hf_loss, simulate=False).peak_bytes

    def step(m: Any) -> None:
        m.zero_grad()
        m(**data).loss.backward()

    plain_s, planned_s = interleaved_medians([lambda: step(plain), lambda: step(model)])
    emit({"recipe": "hf_trainer" if args.trainer else "hf_loop", "model": args.model,
          "attn": args.attn, "path": "op-tape runtime",
          "stages": len(plan.stages),
          "recomputed_stages": sum(s.mode != "keep" for s in plan.stages),
          "recorded_ops": state.last.recorded_ops, "all_stages_seen": state.last.finished,
          **result, "budget_bytes": plan.budget_bytes,
          "predicted_peak_bytes": plan.peak_bytes,
          "peak_bytes": peak, "plain_peak_bytes": plain_peak, "plain_step_s": plain_s,
          "planned_step_s": planned_s}, args.json)


if __name__ == "__main__":
    main()
