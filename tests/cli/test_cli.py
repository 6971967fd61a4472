from __future__ import annotations

import csv
from pathlib import Path

import pytest

import memplan
from memplan.cli import main
from tests.small import SMALL


def _spec(name: str) -> str:
    return name + ":" + ",".join(f"{k}={v}" for k, v in SMALL[name].items())


def test_measure_prints_the_peak(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["measure", _spec("gpt")]) == 0
    out = capsys.readouterr().out
    assert "simulated" in out and "peak" in out and "parameter" in out


def test_measure_real(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["measure", _spec("lstm"), "--real"]) == 0
    assert "measured" in capsys.readouterr().out


@pytest.mark.parametrize(
    "spec, needle",
    [("vgg:depth=3", "MODEL"), ("resnet:depth", "key=value"), ("resnet:width=3", "width"),
     ("lstm:steps=0", "steps")],
)
def test_bad_specs_exit_2_with_one_line(
    spec: str, needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["measure", spec]) == 2
    err = capsys.readouterr().err
    assert err.startswith("memplan: error:") and needle in err and err.count("\n") == 1
    assert "Traceback" not in err


# --- helpers ---------------------------------------------------------------------------------

def _err_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    assert err.startswith("memplan: error:") and err.count("\n") == 1, err
    assert "Traceback" not in err
    return err


# --- plan / explain --------------------------------------------------------------------------

def test_plan_table_summary_and_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plan.json"
    assert main(["plan", "resnet:depth=14,batch=16,image=32,classes=10", "--budget", "0.97",
                 "--planner", "optimal", "-o", str(out)]) == 0
    text = " ".join(capsys.readouterr().out.split())  # rich wraps long lines
    assert "plan 'optimal'" in text and "predicted peak" in text and "extra compute" in text
    assert "runs of the same mode" in text and str(out) in text
    plan = memplan.Plan.from_json(out.read_text())
    assert plan.planner == "optimal" and plan.budget_bytes is not None
    assert plan.peak_bytes <= plan.budget_bytes
    assert f"{plan.extra_fraction:.1%}" in text


def test_plan_all_stages_and_sqrt(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", _spec("lstm"), "--planner", "sqrt", "--all-stages"]) == 0
    text = capsys.readouterr().out
    assert "plan 'sqrt'" in text and "recomputed" in text and "kept" in text
    assert "runs of the same mode" not in text


def test_plan_batch_override_changes_the_model(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", _spec("gpt"), "--planner", "sqrt", "--batch", "3"]) == 0
    assert "batch=3" in capsys.readouterr().out


def test_plan_objective_time_predicts_a_step_time(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", _spec("lstm"), "--objective", "time", "--budget", "0.98"]) == 0
    assert "predicted step time" in capsys.readouterr().out


def test_plan_groups_long_chains() -> None:
    from memplan.cli.plan import groups
    from memplan.core.plan import Stage

    stages = tuple(Stage(i, i, i, f"m{i}", 1 if 3 <= i < 7 else 0,
                         "recompute" if 3 <= i < 7 else "keep", 10, 100) for i in range(10))
    assert [len(g) for g in groups(stages, all_stages=False)] == [3, 4, 3]
    assert len(groups(stages, all_stages=True)) == 10


def test_plan_budget_too_small_prints_least_peak(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", _spec("resnet"), "--budget", "1KiB"]) == 2
    err = _err_line(capsys)
    assert "least feasible peak" in err and "Raise the budget" in err


@pytest.mark.parametrize(
    "argv, needle",
    [(["--budget", "6 parsecs"], "budget"), (["--budget", "1.5"], "fraction"),
     (["--planner", "magic"], "planner"), (["--objective", "time", "--planner", "sqrt"], "time"),
     (["--objective", "time", "--device", "tpu"], "device"),
     (["-o", "/nonexistent-dir/plan.json"], "-o")],
)
def test_plan_bad_flags_exit_2(argv: list[str], needle: str,
                               capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", _spec("gpt"), *argv]) == 2
    assert needle in _err_line(capsys)


def test_argparse_errors_exit_2_with_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", _spec("gpt"), "--objective", "speed"]) == 2
    assert "--objective" in _err_line(capsys)
    assert main(["bench", "resnet", "--simulate", "--real"]) == 2
    assert "not allowed with" in _err_line(capsys)


def test_debug_shows_the_traceback() -> None:
    with pytest.raises(memplan.MemplanError):
        main(["--debug", "plan", "vgg:depth=3"])


def test_explain_reads_a_plan_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "p.json"
    assert main(["plan", _spec("lstm"), "--planner", "sqrt", "-o", str(out)]) == 0
    capsys.readouterr()
    assert main(["explain", str(out)]) == 0
    text = capsys.readouterr().out
    assert text.startswith("Plan by 'sqrt'") and "recompute" in text and "keep" in text


@pytest.mark.parametrize("content, needle", [
    (None, "No such file"), ("{not json", "not JSON"), ("[1, 2]", "JSON object"),
    ('{"kind": "other"}', "schema_version"),
    ('{"kind": "memplan.Plan", "schema_version": 1}', "not a valid memplan plan"),
])
def test_explain_bad_files_exit_2(content: str | None, needle: str, tmp_path: Path,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "plan.json"
    if content is not None:
        path.write_text(content)
    assert main(["explain", str(path)]) == 2
    assert needle in _err_line(capsys)


# --- user factories --------------------------------------------------------------------------

@pytest.mark.parametrize("spec", ["tests.factories:make", "tests.factories:make_with_loss"])
def test_plan_user_factory(spec: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", spec, "--planner", "sqrt"]) == 0
    assert f"{spec}: plan 'sqrt'" in capsys.readouterr().out


FACTORY_FILE = """
from dataclasses import dataclass
import torch
from torch import nn
from neighbour import WIDTH  # beside this file, as `python models.py` would import it

@dataclass  # needs its module in sys.modules
class Cfg:
    depth: int = 4

def make(batch: int = 8):
    layers = [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU()) for _ in range(Cfg().depth)]
    return nn.Sequential(*layers), torch.randn(batch, WIDTH)
"""


def test_plan_factory_from_a_file(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "models.py").write_text(FACTORY_FILE)
    (tmp_path / "src" / "neighbour.py").write_text("WIDTH = 16\n")
    monkeypatch.chdir(tmp_path)
    assert main(["plan", "src/models.py:make", "--planner", "sqrt", "--batch", "4"]) == 0
    assert "src/models.py:make: plan 'sqrt'" in capsys.readouterr().out
    assert main(["plan", "src/models.py:nope"]) == 2
    assert "src/models.py has no 'nope'" in _err_line(capsys)
    assert main(["plan", "src/none.py:make"]) == 2
    assert "an existing Python file" in _err_line(capsys)


def test_factory_batch_and_measure(capsys: pytest.CaptureFixture[str]) -> None:
    from memplan.cli.spec import resolve

    assert resolve("tests.factories:make_batch", batch=5).inputs[0].shape[0] == 5
    assert main(["measure", "tests.factories:make_batch", "--batch", "4"]) == 0
    assert "peak" in capsys.readouterr().out


@pytest.mark.parametrize("argv, needle", [
    (["nonexistent_memplan_mod:make"], "No module named"),
    (["tests.factories:nope"], "has no 'nope'"),
    (["tests.factories:NOT_CALLABLE"], "a callable"),
    (["tests.factories:wrong_return"], "(model, example_inputs)"),
    (["tests.factories:not_a_model"], "torch.nn.Module"),
    (["tests.factories:raises"], "no weights here"),
    (["tests.factories:make", "--batch", "4"], "batch"),
    (["resnet:depth=14", "--batch", "0"], "--batch"),
])
def test_bad_factories_exit_2(argv: list[str], needle: str,
                              capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", *argv]) == 2
    assert needle in _err_line(capsys)


# --- bench / reproduce / demo ----------------------------------------------------------------

def test_bench_simulated_with_peers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "lstm", "--quick", "--peers", "--out", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    for name in ("bench.csv", "bench.md", "bench.png"):
        assert (tmp_path / name).stat().st_size > 0
    rows = list(csv.DictReader((tmp_path / "bench.csv").read_text().splitlines()))
    methods = {r["method"] for r in rows}
    assert {"plain PyTorch", "memplan sqrt", "memplan optimal", "torch checkpoint_sequential",
            "torch per-block checkpoint"} <= methods
    assert {int(r["size"]) for r in rows} == {4, 8}
    plain = {r["size"]: int(r["measured_peak_bytes"]) for r in rows
             if r["method"] == "plain PyTorch"}
    assert all(abs(plain[r["size"]] / int(r["measured_peak_bytes"])
                   - float(r["plain_over_peak"])) < 0.01 for r in rows if r["measured_peak_bytes"])
    assert "| steps=4 | plain PyTorch |" in text


def test_bench_real_records_step_times(tmp_path: Path) -> None:
    assert main(["bench", "gpt", "--quick", "--real", "--sweep", "layers=2", "--repeat", "1",
                 "--planners", "sqrt", "--out", str(tmp_path)]) == 0
    rows = list(csv.DictReader((tmp_path / "bench.csv").read_text().splitlines()))
    assert rows and all(float(r["step_time_s"]) > 0 for r in rows if r["step_time_s"])
    assert rows[0]["mode"] == "real" and float(rows[0]["step_time_s"]) > 0


@pytest.mark.parametrize("argv, needle", [
    (["vgg"], "MODEL"), (["resnet", "--sweep", "width=1,2"], "--sweep"),
    (["resnet", "--sweep", "depth=a,b"], "integers"), (["resnet", "--sweep", "depth"], "KEY="),
    (["resnet", "--compile", "0.5"], "--real"), (["resnet", "--real", "--compile", "2"], "(0, 1]"),
    (["resnet", "--device", "cuda"], "--device"), (["resnet", "--device", "tpu", "--real"], "cpu"),
    (["resnet", "--planners", "sqrt,magic"], "--planners"), (["resnet", "--budget", "lots"], "budget"),
    (["resnet:width=3"], "width"), (["resnet", "--batch", "0"], "--batch"),
    (["resnet", "--threads", "0"], "--threads"), (["resnet", "--repeat", "0"], "--repeat"),
])
def test_bench_bad_args_exit_2(argv: list[str], needle: str,
                               capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", *argv, "--quick"]) == 2
    assert needle in _err_line(capsys)


def test_reproduce_quick(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["reproduce", "--quick", "--figs", "6,7", "--jobs", "1", "--repeat", "1",
                 "--out", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "Fig. 6" in text and "Fig. 7" in text and "Ours beside the paper" in text
    assert "more than 4x" in text and "roughly 30%" in text
    for name in ("fig5_6_memory.csv", "fig7_time.csv", "reproduce.md", "reproduce.png"):
        assert (tmp_path / name).stat().st_size > 0


@pytest.mark.parametrize("argv, needle", [(["--figs", "4"], "--figs"),
                                          (["--jobs", "0"], "--jobs")])
def test_reproduce_bad_args_exit_2(argv: list[str], needle: str,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["reproduce", "--quick", *argv]) == 2
    assert needle in _err_line(capsys)


def test_demo_quick(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--quick", "--jobs", "1", "--out", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "plain PyTorch" in text and "memplan optimal" in text and "checkpoint_sequential" in text
    assert "Real CPU step" in text and "demo finished in" in text
    assert (tmp_path / "resnet_memory_vs_depth.png").stat().st_size > 0
