"""Recipe: memplan with torch.compile.

    python examples/compile.py --backend inductor      # or --backend eager

Apply first, compile the applied model: ``torch.compile(memplan.apply(model, plan))``. The
compiler keeps the plan: the planned training forward is excluded from Dynamo
(``torch.compiler.disable``) and runs eagerly with its recomputation; the code around it (loss,
optimizer step, your own compiled functions) is compiled as usual, and inference (``eval()``
or ``no_grad``) compiles the model normally. So gradients are bit-equal to the eager applied
model and to plain eager PyTorch, and the peak is the eager plan's. (Compiling the model first
and applying afterwards is refused with a MemplanError.)

The script checks all of that: gradients against plain eager and eager applied, the number of
forward ops recorded for recomputation, the measured peak against the plan, and the step time
against the plain model compiled with the same backend (whose gradients differ in the last
bits under inductor, as fused kernels round differently).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from _common import compare, emit, grads, interleaved_medians, parse_budget, parser

import memplan
from memplan.runtime.apply import applied_state


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--backend", default="inductor", choices=["eager", "aot_eager", "inductor"])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=32)
    p.add_argument("--budget", default="auto")
    p.add_argument("--no-plain-compiled", action="store_true",
                   help="skip compiling the plain model for comparison (the slow part)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    w = memplan.models.get("gpt", layers=args.layers, d_model=args.d_model, heads=2,
                           seq_len=16, vocab=100, batch=2, dropout=0.1)
    model = w.build_model()
    x = w.build_inputs()
    plain = copy.deepcopy(model)
    eager_applied = copy.deepcopy(model)

    # --- the recipe --------------------------------------------------------------------------
    graph = memplan.capture(model, *x, loss_fn=w.loss)
    plan = memplan.plan(graph, budget=parse_budget(args.budget, memplan.plan(graph)))
    compiled = torch.compile(memplan.apply(model, plan), backend=args.backend)
    opt = torch.optim.SGD(compiled.parameters(), lr=1e-2)
    # -----------------------------------------------------------------------------------------

    memplan.apply(eager_applied, plan)
    plain_compiled = None if args.no_plain_compiled else torch.compile(
        copy.deepcopy(plain), backend=args.backend)

    def step(m: Any, seed: int = 1) -> list[torch.Tensor | None]:
        for q in m.parameters():
            q.grad = None
        torch.manual_seed(seed)
        w.loss(m(*x)).backward()
        return grads(m)

    ref = step(plain)
    got = step(compiled)
    recorded = applied_state(model).last.recorded_ops  # type: ignore[union-attr]
    eager = step(eager_applied)
    eager_recorded = applied_state(eager_applied).last.recorded_ops  # type: ignore[union-attr]
    opt.step()  # the optimizer sees the compiled module's parameters (the model's own)
    peak = memplan.measure(compiled, *x, loss_fn=w.loss, simulate=False).peak_bytes
    eager_peak = memplan.measure(eager_applied, *x, loss_fn=w.loss, simulate=False).peak_bytes
    # Inductor draws dropout masks with its own RNG: the plain compiled model's gradients
    # differ from eager ones by more than rounding whenever dropout is on.
    vs_plain_compiled = None if plain_compiled is None else compare(step(plain_compiled), ref)
    models = [plain, compiled] + ([plain_compiled] if plain_compiled is not None else [])
    times = interleaved_medians([lambda m=m: step(m) for m in models])
    plain_s, planned_s = times[:2]
    compiled_plain_s = times[2] if len(times) > 2 else None
    emit({"recipe": "compile", "backend": args.backend,
          "vs_plain": compare(got, ref), "vs_eager_applied": compare(got, eager),
          "plain_compiled_vs_plain": vs_plain_compiled,
          "recorded_ops": recorded, "eager_recorded_ops": eager_recorded,
          "budget_bytes": plan.budget_bytes, "predicted_peak_bytes": plan.peak_bytes,
          "peak_bytes": peak, "eager_applied_peak_bytes": eager_peak,
          "plain_step_s": plain_s, "plain_compiled_step_s": compiled_plain_s,
          "planned_step_s": planned_s}, args.json)


if __name__ == "__main__":
    main()
