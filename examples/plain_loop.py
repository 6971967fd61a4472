"""Recipe: memplan in a plain PyTorch training loop.

    python examples/plain_loop.py                       # a small GPT, 5 steps, on the CPU
    python examples/plain_loop.py --layers 12 --d-model 768 --seq-len 1024 --budget 6GiB

Plan once for the shapes you train with, apply, and keep your loop as it is. The script also
trains a plain copy side by side and checks that every loss and the final weights are
bit-equal, that the measured peak fits the budget, and times both (interleaved medians).
"""

from __future__ import annotations

import copy

import torch
from _common import emit, interleaved_medians, parse_budget, parser

import memplan


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=16)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--budget", default="auto",
                   help="bytes, '6GiB', a fraction of the plain peak (0.5), or 'auto' (midway "
                        "between the least feasible peak and plain)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    w = memplan.models.get("gpt", layers=args.layers, d_model=args.d_model, heads=2,
                           seq_len=args.seq_len, vocab=100, batch=args.batch, dropout=0.1)
    model = w.build_model()
    x = w.build_inputs()  # (tokens, targets): the model returns per-token losses
    plain = copy.deepcopy(model)

    # --- the recipe --------------------------------------------------------------------------
    graph = memplan.capture(model, *x, loss_fn=w.loss)  # on fake tensors: no memory used
    budget = parse_budget(args.budget, memplan.plan(graph))
    plan = memplan.plan(graph, budget=budget)  # or memplan.plan(model, *x, loss_fn=..., budget=...)
    print(plan.explain())
    memplan.apply(model, plan)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # -----------------------------------------------------------------------------------------

    ref_opt = torch.optim.AdamW(plain.parameters(), lr=1e-3)
    losses_equal = True
    for step in range(args.steps):
        got = []
        for m, o in ((plain, ref_opt), (model, opt)):
            o.zero_grad()
            torch.manual_seed(step)  # the same dropout masks on both sides
            loss = w.loss(m(*x))
            loss.backward()
            o.step()
            got.append(loss.detach())
        losses_equal &= torch.equal(got[0], got[1])
    weights_equal = all(torch.equal(a, b) for a, b in zip(plain.parameters(), model.parameters()))

    peak = memplan.measure(model, *x, loss_fn=w.loss, simulate=False).peak_bytes
    plain_peak = memplan.measure(plain, *x, loss_fn=w.loss, simulate=False).peak_bytes

    def step_of(m: torch.nn.Module) -> object:
        return lambda: w.loss(m(*x)).backward()

    plain_s, planned_s = interleaved_medians([step_of(plain), step_of(model)])
    emit({"recipe": "plain_loop", "losses_equal": losses_equal, "weights_equal": weights_equal,
          "budget_bytes": plan.budget_bytes, "predicted_peak_bytes": plan.peak_bytes,
          "peak_bytes": peak, "plain_peak_bytes": plain_peak, "plain_step_s": plain_s,
          "planned_step_s": planned_s}, args.json)


if __name__ == "__main__":
    main()
