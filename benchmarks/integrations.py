"""The integrations table: memplan in a plain loop, under torch.compile (eager and inductor
backends), DDP and FSDP2 with 2 ranks under torchrun (CPU, gloo), and Hugging Face GPT-2,
Llama and BERT (tiny configs): exactness, measured peak vs budget, step time vs plain.

    .venv/bin/python benchmarks/integrations.py            # ~3 min on 2 CPU cores
    .venv/bin/python benchmarks/integrations.py --only hf  # rows whose name contains 'hf'

Each row runs a recipe script of examples/ (the ones docs/recipes.md shows) and reads the JSON
it writes. Step times are medians of 5 interleaved plain/planned steps of tiny models, where
memplan's per-op Python overhead dominates: read them as an upper bound of the overhead, not
as what a large model sees. Writes out/integrations/integrations.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
TORCHRUN = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]

ROWS: list[tuple[str, list[str]]] = [
    ("eager (plain loop)", [PY, "examples/plain_loop.py"]),
    ("compile, eager backend", [PY, "examples/compile.py", "--backend", "eager"]),
    ("compile, inductor", [PY, "examples/compile.py", "--backend", "inductor"]),
    ("DDP 2 ranks (gloo)", [*TORCHRUN, "examples/torchrun_train.py", "--wrap", "ddp",
                            "--dropout", "0"]),
    ("DDP 2 ranks, dropout 0.1", [*TORCHRUN, "examples/torchrun_train.py", "--wrap", "ddp"]),
    ("FSDP2 2 ranks (gloo)", [*TORCHRUN, "examples/torchrun_train.py", "--wrap", "fsdp",
                              "--dropout", "0"]),
    ("FSDP2 2 ranks, dropout 0.1", [*TORCHRUN, "examples/torchrun_train.py", "--wrap",
                                    "fsdp"]),
] + [
    (f"hf {kind} ({attn})", [PY, "examples/hf_loop.py", "--model", kind, "--attn", attn])
    for kind in ("gpt2", "llama", "bert") for attn in ("eager", "sdpa")
] + [("hf gpt2 Trainer", [PY, "examples/hf_loop.py", "--model", "gpt2", "--trainer"])]


def run(cmd: list[str]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "r.json"
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
        proc = subprocess.run([*cmd, "--json", str(out)], check=False, cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=900)
        if proc.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}\n"
                             f"{proc.stderr[-4000:]}")
        result: dict[str, Any] = json.loads(out.read_text())
        return result


def exactness(r: dict[str, Any]) -> str:
    if r["recipe"] == "torchrun":
        rows = r["ranks"]
        text = ("equal" if all(x["grads_equal"] and x["weights_equal"] for x in rows)
                else f"DIFFER (max {max(x['max_abs_diff'] for x in rows):.2g})")
        text += " vs 1-process per-shard ref"
        fb = [x["full_batch"] for x in rows if x["full_batch"]]
        if fb:
            ok = all(f["allclose"] for f in fb)
            text += (f"; full batch {'allclose' if ok else 'NOT close'} (rtol {fb[0]['rtol']:g},"
                     f" atol {fb[0]['atol']:g}; max diff {max(f['max_abs_diff'] for f in fb):.2g})")
        return text
    if r["recipe"] == "compile":
        text = "equal" if r["vs_plain"]["equal"] and r["vs_eager_applied"]["equal"] else "DIFFER"
        text += " (vs plain eager and eager applied)"
        pc = r.get("plain_compiled_vs_plain")
        if pc and not pc["equal"]:
            text += f"; plain compiled vs plain eager: max diff {pc['max_abs_diff']:.2g}"
        return text
    keys = [k for k in ("losses_equal", "weights_equal") if k in r]
    return "equal" if all(r[k] for k in keys) else "DIFFER"


def peaks(r: dict[str, Any]) -> tuple[int, int, int, str]:
    """(measured, predicted, budget, plain measured); the worst rank for torchrun."""
    if r["recipe"] == "torchrun":
        worst = max(r["ranks"], key=lambda x: x["peak_bytes"])
        return (worst["peak_bytes"], worst["predicted_peak_bytes"], worst["budget_bytes"],
                f"{max(x['plain_peak_bytes'] for x in r['ranks']):,}")
    if "plain_peak_bytes" in r:
        return r["peak_bytes"], r["predicted_peak_bytes"], r["budget_bytes"], \
            f"{r['plain_peak_bytes']:,}"
    return r["peak_bytes"], r["predicted_peak_bytes"], r["budget_bytes"], \
        f"(eager applied: {r['eager_applied_peak_bytes']:,})"



def times(r: dict[str, Any]) -> str:
    if r["recipe"] == "torchrun":
        rows = r["ranks"]
        plain = max(x["plain_step_s"] for x in rows)
        planned = max(x["planned_step_s"] for x in rows)
    else:
        plain, planned = r["plain_step_s"], r["planned_step_s"]
    text = f"{planned * 1e3:.1f} / {plain * 1e3:.1f} ms ({planned / plain:.1f}x)"
    if r.get("plain_compiled_step_s"):
        text += f"; plain compiled {r['plain_compiled_step_s'] * 1e3:.1f} ms"
    return text


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", default="", help="run the rows whose name contains this")
    p.add_argument("--out", default=str(ROOT / "out" / "integrations"))
    args = p.parse_args()
    results: dict[str, Any] = {}
    header = ("| integration | exactness | peak measured / predicted / budget (bytes) | "
              "plain peak (bytes) | step planned / plain (median of 5 interleaved) |")
    lines = [header, "|---|---|---|---|---|"]
    for name, cmd in ROWS:
        if args.only not in name:
            continue
        r = results[name] = run(cmd)
        got, pred, budget, plain = peaks(r)
        ok = "within" if got <= budget else "OVER"
        lines.append(f"| {name} | {exactness(r)} | {got:,} / {pred:,} / {budget:,} ({ok}) | "
                     f"{plain} | {times(r)} |")
        print(lines[-1], flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "integrations.md").write_text("\n".join(lines) + "\n")
    (out / "integrations.json").write_text(json.dumps(results, indent=1, sort_keys=True))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
