"""The zoo (issue 11): every entry of tests/zoo, one plain and one planned real step at half
the activation memory (tests/zoo/check.py defines it), each in its own process with a time
limit. Writes zoo-PLANNER.md and zoo-PLANNER.csv under --out and prints passes / total and the
median over-prediction (predicted / measured - 1) over the passing entries.

    python benchmarks/zoo.py [--only hf-llama,pyg-gcn] [--planner optimal|ilp] [--jobs 2]
    python benchmarks/zoo.py --llama      # issue 11's 8-layer Llama: least peaks, plan time
    python benchmarks/zoo.py --readme     # README.md's zoo table from the runs under --out
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.zoo import ZOO
from tests.zoo.check import Row
from tests.zoo.runner import COLUMNS, run_many


def mib(n: int) -> str:
    return f"{n / 2**20:.2f}" if n else ""


def markdown(rows: list[Row], planner: str) -> str:
    passed = sum(r.status == "pass" for r in rows)
    lines = [f"# memplan zoo, planner `{planner}`, budget = half the activation memory", "",
             (f"{passed} / {len(rows)} pass. Peaks in MiB, measured by memplan's real CPU "
              "tracker; predicted = the plan's peak."), "",
             ("| model | library | plain peak | planned peak | predicted peak | budget | "
              "extra FLOPs | status | detail |"),
             "|---|---|---:|---:|---:|---:|---:|---|---|"]
    for r in rows:
        status = "pass" if r.status == "pass" else r.failure
        extra = f"{r.extra_flops_fraction:.1%}" if r.predicted_peak_bytes else ""
        detail = r.detail.replace("|", "/")
        lines.append(f"| {r.model} | {r.library} | {mib(r.plain_peak_bytes)} | "
                     f"{mib(r.planned_peak_bytes)} | {mib(r.predicted_peak_bytes)} | "
                     f"{mib(r.budget_bytes)} | {extra} | {status} | {detail} |")
    classes: dict[str, list[str]] = defaultdict(list)
    for r in rows:
        if r.status != "pass":
            classes[r.failure].append(r.model)
    lines += ["", "## Failures by class", ""]
    lines += [f"- **{c}** ({len(names)}): {', '.join(names)}"
              for c, names in sorted(classes.items(), key=lambda kv: -len(kv[1]))]
    return "\n".join(lines) + "\n"


README = ROOT / "README.md"
README_START, README_END = "<!-- zoo table: start -->", "<!-- zoo table: end -->"


def readme_table(rows: list[Row], ilp_rows: list[Row]) -> str:
    """The README's zoo table (the default planner's run) and the pass counts of both."""
    def passes(rs: list[Row]) -> str:
        return f"{sum(r.status == 'pass' for r in rs)} / {len(rs)}"

    over = over_prediction(rows)
    lines = [f"Default planner: **{passes(rows)} pass**"
             + (f"; `ilp`: {passes(ilp_rows)}" if ilp_rows else "")
             + (f". Predicted / measured peak - 1 over the passing entries: median "
                f"{statistics.median(over):+.1%}, max {max(over):+.2%}." if over else "."),
             "", "| model | library | plain peak | planned peak | extra FLOPs | status |",
             "|---|---|---:|---:|---:|---|"]
    for r in rows:
        status = "pass" if r.status == "pass" else r.failure
        extra = f"{r.extra_flops_fraction:.0%}" if r.predicted_peak_bytes else ""
        planned = (f"{mib(r.planned_peak_bytes)} MiB" if r.planned_peak_bytes else
                   f"(least {mib(r.least_peak_bytes)} MiB)" if r.least_peak_bytes else "")
        lines.append(f"| {r.model} | {r.library} | {mib(r.plain_peak_bytes)} MiB | {planned} |"
                     f" {extra} | {status} |")
    return "\n".join(lines) + "\n"


def read_rows(path: Path) -> list[Row]:
    if not path.exists():
        return []
    with path.open(newline="") as f:
        types = {k: type(v) for k, v in vars(Row("", "", "")).items()}
        return [Row(**{k: types[k](v) for k, v in d.items()}) for d in csv.DictReader(f)]


def write_readme(out: Path) -> None:
    """Put the table of ``out``'s runs between the README's zoo markers."""
    rows = read_rows(out / "zoo-optimal.csv")
    if not rows:
        raise SystemExit(f"no {out / 'zoo-optimal.csv'}: run the zoo first")
    text = README.read_text()
    head, rest = text.split(README_START, 1)
    _, tail = rest.split(README_END, 1)
    table = readme_table(rows, read_rows(out / "zoo-ilp.csv"))
    README.write_text(f"{head}{README_START}\n{table}{README_END}{tail}")
    print(f"wrote the zoo table of {out} into {README}")


def over_prediction(rows: list[Row]) -> list[float]:
    return [r.predicted_peak_bytes / r.planned_peak_bytes - 1 for r in rows
            if r.status == "pass" and r.planned_peak_bytes]


def llama_figures() -> None:
    """Issue 11's must-show: an 8-layer HF Llama (hidden 512, seq 512, batch 2)."""
    import torch
    from tests.zoo.transformers_zoo import GQA, _build, model_loss

    import memplan

    torch.set_num_threads(1)
    config = {**GQA, "hidden_size": 512, "intermediate_size": 1376, "num_hidden_layers": 8,
              "num_attention_heads": 8, "num_key_value_heads": 8, "vocab_size": 32000,
              "max_position_embeddings": 1024}
    model = _build("LlamaForCausalLM", "LlamaConfig", 0, **config)
    ids = torch.randint(3, 32000, (2, 512), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 512, dtype=torch.long)
    mask[1, 384:] = 0  # the second sequence padded
    for masked in (False, True):
        batch = {"input_ids": ids, "labels": ids, **({"attention_mask": mask} if masked else {})}
        t = time.perf_counter()
        graph = memplan.capture(model, kwargs=batch, loss_fn=model_loss)
        print(f"8-layer Llama, hidden 512, seq 512, batch 2, attention_mask "
              f"{'with padding' if masked else 'none'}: capture {time.perf_counter() - t:.1f} s,"
              f" {len(graph.ops)} ops, {len(graph.cut_points)} cut points")
        for planner in ("optimal", "ilp"):
            wall, cpu = time.perf_counter(), time.process_time()
            plan = memplan.plan(graph, planner=planner)
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            print(f"  {planner:8s} least peak {plan.peak_bytes / 2**20:7.1f} MiB = "
                  f"{plan.peak_bytes / plan.plain_peak_bytes:.2f}x plain "
                  f"({plan.plain_peak_bytes / 2**20:.1f} MiB, predicted); planning "
                  f"{wall:.2f} s wall, {cpu:.2f} s CPU")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="", help="comma-separated entry names (default: all)")
    parser.add_argument("--planner", default="optimal", choices=["optimal", "ilp"])
    parser.add_argument("--jobs", type=int, default=1, help="entries run at once")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per entry")
    parser.add_argument("--out", type=Path, default=ROOT / "out" / "zoo")
    parser.add_argument("--llama", action="store_true", help="the 8-layer Llama figures only")
    parser.add_argument("--readme", action="store_true",
                        help="write the table of the runs under --out into README.md")
    args = parser.parse_args()
    if args.llama:
        llama_figures()
        return
    if args.readme:
        write_readme(args.out)
        return
    names = [n for n in args.only.split(",") if n] or list(ZOO)
    unknown = [n for n in names if n not in ZOO]
    if unknown:
        parser.error(f"unknown entries {unknown}; known: {', '.join(ZOO)}")
    started = time.perf_counter()
    rows = run_many(names, args.planner, args.timeout, args.jobs)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"zoo-{args.planner}"
    stem.with_suffix(".md").write_text(markdown(rows, args.planner))
    with stem.with_suffix(".csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(vars(r) for r in rows)
    for r in rows:
        print(f"{r.model:26s} {r.status:7s} {r.failure} {r.detail[:120]}")
    over = over_prediction(rows)
    median = f"{statistics.median(over):+.1%}" if over else "n/a (no passing entry)"
    print(f"planner {args.planner}: {sum(r.status == 'pass' for r in rows)} / {len(rows)} pass; "
          f"median over-prediction {median}; {time.perf_counter() - started:.0f} s; "
          f"wrote {stem}.md and .csv")


if __name__ == "__main__":
    main()
