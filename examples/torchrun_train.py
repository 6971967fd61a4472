"""Recipe: memplan under torchrun, with DDP or FSDP2 (``fully_shard``), each rank planning
for its own memory.

    torchrun --nproc_per_node 2 examples/torchrun_train.py --wrap ddp      # CPU, gloo
    torchrun --nproc_per_node 2 examples/torchrun_train.py --wrap fsdp
    torchrun --nproc_per_node 2 examples/torchrun_train.py --wrap fsdp --model llama  # HF
    torchrun --nproc_per_node 8 examples/torchrun_train.py --wrap fsdp --device cuda  # NCCL

* DDP: plan on the local batch with ``memplan.distributed.plan_ddp`` (the rank's budget less
  DDP's gradient buckets), ``memplan.apply``, then wrap with DistributedDataParallel.
* FSDP2: plan per FSDP unit with ``memplan.distributed.plan_units`` (parameters and gradients
  counted as sharded, plus FSDP's transient unsharded copies), ``apply_units``, then
  ``fully_shard`` each unit and the root. A plan applied around FSDP units is refused.
  ``--model llama``: a Hugging Face Llama, its batch passed by keyword (``kwargs=``), its
  decoder layers the units (called with the mask and rotary tables by keyword), no KV cache.

Every rank plans by itself; planning is deterministic, so all ranks choose the same plan: the
script all-gathers the plans' fingerprints and stops if they differ. It then trains a few
steps and checks each rank against a single-process reference computed on the rank (the plain
model run on every rank's shard with that rank's seed, gradients averaged), the per-rank peak
(``memplan.distributed.RankTracker``) against the budget, and times plain vs planned steps of
the same wrapper (interleaved medians). Rank 0 prints (and writes with --json) the results.
"""

from __future__ import annotations

import copy
import datetime
import os
import sys
from typing import Any

import torch
import torch.distributed as dist
from _common import compare, emit, grads, interleaved_medians, parser

import memplan
from memplan import distributed as md
from memplan.runtime.apply import applied_state

SEED = 100


def wrap(model: torch.nn.Module, how: str, units: list[str], device: torch.device
         ) -> torch.nn.Module:
    if how == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        ids = [device.index] if device.type == "cuda" else None
        return DDP(model, device_ids=ids)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for path in units:
        fully_shard(model.get_submodule(path), mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


class Batch:
    """The example inputs, positional or by keyword, of memplan's GPT or a HF Llama."""

    def __init__(self, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
                 ) -> None:
        self.args, self.kwargs = args, kwargs or {}

    def shard(self, part: slice) -> Batch:
        def cut(t: Any) -> Any:
            return t[part] if isinstance(t, torch.Tensor) else t
        return Batch(tuple(cut(t) for t in self.args),
                     {k: cut(v) for k, v in self.kwargs.items()})

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (*self.args, *self.kwargs.values()) if isinstance(t, torch.Tensor)]

    def __call__(self, model: torch.nn.Module) -> Any:
        return model(*self.args, **self.kwargs)


def build(kind: str, layers: int, d_model: int, batch: int, dropout: float
          ) -> tuple[torch.nn.Module, Batch, Any, str]:
    """(model, the global batch, loss, the class name of its FSDP units)."""
    if kind == "gpt":
        w = memplan.models.get("gpt", layers=layers, d_model=d_model, heads=2, seq_len=16,
                               vocab=100, batch=batch, dropout=dropout)
        return w.build_model(), Batch(tuple(w.build_inputs())), w.loss, "Block"
    from hf_models import batch as hf_batch
    from hf_models import build as hf_build
    from hf_models import hf_loss

    model = hf_build("llama", "sdpa", layers=layers, hidden=d_model)
    data = {**hf_batch("llama", size=batch, seq=16), "use_cache": False}
    data["attention_mask"] = torch.ones_like(data["input_ids"])
    # Padding in every other row, so in every rank's shard: an all-ones mask takes another
    # path (HF skips building the mask), and the ranks would plan apart.
    data["attention_mask"][::2, 12:] = 0
    return model, Batch(kwargs=data), hf_loss, "LlamaDecoderLayer"


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--wrap", choices=["ddp", "fsdp"], default="ddp")
    p.add_argument("--model", choices=["gpt", "llama"], default="gpt")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=32)
    p.add_argument("--batch", type=int, default=2, help="per rank")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--budget", default="auto",
                   help="per-rank bytes or '6GiB'; 'auto': midway between the least "
                        "feasible and the plain per-rank peak")
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")

    with device:  # seeded: the same weights on every rank; the global batch
        model, full, loss_fn, unit_class = build(args.model, args.layers, args.d_model,
                                                 args.batch * world, args.dropout)
    shard = [slice(r * args.batch, (r + 1) * args.batch) for r in range(world)]
    local = full.shard(shard[rank])  # each rank trains on its shard
    reference = copy.deepcopy(model)
    plain = copy.deepcopy(model)
    units = [n for n, m in model.named_modules() if type(m).__name__ == unit_class]

    # --- the recipe --------------------------------------------------------------------------
    if args.wrap == "ddp":
        budget: object = args.budget
        if budget == "auto":
            least = memplan.plan(model, *local.args, kwargs=local.kwargs, loss_fn=loss_fn)
            budget = md.bucket_bytes(model) + (least.peak_bytes + least.plain_peak_bytes) // 2
        plan = md.plan_ddp(model, *local.args, kwargs=local.kwargs, loss_fn=loss_fn,
                           budget=budget)
        predicted = plan.peak_bytes + md.bucket_bytes(model)
        memplan.apply(model, plan)
        budget_bytes = int(plan.budget_bytes or 0) + md.bucket_bytes(model)
        print_plan = plan.explain()
        fp = md.fingerprint(plan)
    else:
        budget = args.budget
        if budget == "auto":
            lo = md.plan_units(model, units, *local.args, kwargs=local.kwargs,
                               loss_fn=loss_fn, world_size=world)
            hi = md.plan_units(model, units, *local.args, kwargs=local.kwargs,
                               loss_fn=loss_fn, world_size=world, budget=1 << 40)
            budget = (3 * lo.peak_bytes + hi.peak_bytes) // 4
            print("rank prediction: least", lo.peak_bytes, "plain", hi.peak_bytes)
        uplans = md.plan_units(model, units, *local.args, kwargs=local.kwargs,
                               loss_fn=loss_fn, budget=budget, world_size=world)
        md.apply_units(model, uplans)
        predicted, budget_bytes = uplans.peak_bytes, int(uplans.budget_bytes or 0)
        print_plan = f"unit budget fraction {uplans.fraction}, predicted rank peak {predicted}"
        fp = md.fingerprint(uplans)
    fps: list[Any] = [None] * world
    dist.all_gather_object(fps, fp)
    if len(set(fps)) != 1:
        raise SystemExit(f"ranks chose different plans: {fps}")
    model = wrap(model, args.wrap, units, device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    # -----------------------------------------------------------------------------------------

    plain = wrap(plain, args.wrap, units, device)
    plain_opt = torch.optim.SGD(plain.parameters(), lr=1e-2)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=1e-2)

    def step(m: torch.nn.Module, o: torch.optim.Optimizer | None, seed: int) -> None:
        m.zero_grad(set_to_none=True)
        torch.manual_seed(seed)
        loss_fn(local(m)).backward()
        if o is not None:
            o.step()

    def reference_step(n: int) -> list[torch.Tensor | None]:
        """Plain model, one process: every rank's shard with its seed, gradients averaged."""
        acc: list[torch.Tensor | None] = [None] * len(list(reference.parameters()))
        for r in range(world):
            reference.zero_grad(set_to_none=True)
            torch.manual_seed(SEED + 1000 * n + r)
            loss_fn(full.shard(shard[r])(reference)).backward()
            for i, g in enumerate(grads(reference)):
                if g is not None:
                    acc[i] = g / world if acc[i] is None else acc[i] + g / world  # type: ignore[operator]
        for prm, g in zip(reference.parameters(), acc):
            prm.grad = g
        return acc

    exact, worst, fullbatch = True, 0.0, None
    for n in range(args.steps):
        step(model, None, SEED + 1000 * n + rank)
        got = grads(model)
        want = reference_step(n)
        c = compare(got, want)
        exact &= c["equal"]
        worst = max(worst, c["max_abs_diff"])
        if n == 0 and args.dropout == 0:  # no dropout: the full batch in one process too
            single = copy.deepcopy(reference)
            single.zero_grad(set_to_none=True)
            loss_fn(full(single)).backward()
            fullbatch = compare(got, grads(single))
        opt.step()
        ref_opt.step()
        step(plain, plain_opt, SEED + 1000 * n + rank)
    weights = [q.full_tensor() if hasattr(q, "full_tensor") else q for q in model.parameters()]
    weights_equal = all(torch.equal(a.detach(), b.detach())
                        for a, b in zip(weights, reference.parameters()))

    def rank_peak(m: torch.nn.Module, o: torch.optim.Optimizer) -> tuple[int, int | None]:
        """The per-rank peak of one more step, what lives across steps counted up front."""
        m.zero_grad(set_to_none=True)
        tracker = md.RankTracker()
        tracker.track(list(m.parameters()), list(m.buffers()), local.tensors(),
                      [s for st in o.state.values() for s in st.values()])
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        tracker.reset_peak()
        with tracker:
            torch.manual_seed(SEED + rank)
            loss_fn(local(m)).backward()
        if cuda:
            torch.cuda.synchronize()
            return tracker.peak_bytes, torch.cuda.max_memory_allocated() - base
        return tracker.peak_bytes, None

    peak, allocator_peak = rank_peak(model, opt)
    plain_peak, plain_allocator_peak = rank_peak(plain, plain_opt)
    inner = model.module if args.wrap == "ddp" else model
    recorded = sum(st.last.recorded_ops for mod in inner.modules()
                   if (st := applied_state(mod)) is not None and st.last is not None)
    plain_s, planned_s = interleaved_medians(
        [lambda: step(plain, None, SEED), lambda: step(model, None, SEED)])

    row = {"rank": rank, "fingerprint": fp, "grads_equal": exact, "max_abs_diff": worst,
           "full_batch": fullbatch, "weights_equal": weights_equal,
           "budget_bytes": budget_bytes, "predicted_peak_bytes": predicted,
           "peak_bytes": peak, "allocator_peak_bytes": allocator_peak,
           "plain_peak_bytes": plain_peak, "plain_allocator_peak_bytes": plain_allocator_peak,
           "recorded_ops": recorded,
           "plain_step_s": plain_s, "planned_step_s": planned_s}
    rows: list[Any] = [None] * world
    dist.all_gather_object(rows, row)
    if rank == 0:
        print(print_plan)
        emit({"recipe": "torchrun", "wrap": args.wrap, "model": args.model, "world_size": world,
              "device": args.device, "ranks": rows}, args.json)
    dist.barrier()  # every rank done with its collectives before the group goes
    dist.destroy_process_group()
    # With gloo on CPU, some runs hung or aborted after all work was done and written: about
    # 1 in 3 hung while main's locals (the DDP reducer, gloo's work objects) were freed, about
    # 1 in 8 aborted in C++ static destructors ("terminate called without an active
    # exception"). Leave before either runs.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
