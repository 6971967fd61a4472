"""The command line's promise (issue 12, item 7): every bad input, to every subcommand, ends
with exactly one line on stderr starting "memplan: error:", exit code 2, no traceback, and
nothing on stdout; results that took work are never lost when the last write fails."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import memplan
from memplan.cli import common as cli_common
from memplan.cli import main
from memplan.core.plan_schema import MAX_FILE_BYTES
from tests.factories import ODD_NAMES

RESNET = "resnet:depth=14,batch=2,image=32,classes=10"
LSTM = "lstm:steps=4,batch=2,hidden=32,input=8,classes=10"
BIG = "1" * 40
HUGE = str(10**24)
NO_CUDA = "cuda" if not __import__("torch").cuda.is_available() else "cuda:99"


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Plan files, good and bad, and paths that cannot be written."""
    folder = tmp_path_factory.mktemp("cli-errors")
    out = {"dir": str(folder), "missing": str(folder / "none.json")}
    good = folder / "lstm.json"
    assert main(["plan", LSTM, "--planner", "sqrt", "-o", str(good)]) == 0
    out["lstm_plan"] = str(good)
    data = json.loads(good.read_text())
    bad = {
        "not_json": "{not json",
        "list": "[1, 2]",
        "deep": "[" * 100_000 + "]" * 100_000,
        "negative_stage": json.dumps({**data, "schedule": [*data["schedule"][:-1], {
            "kind": "keep", "stage": -1}]}),
        "nan_peak": json.dumps({**data, "peak_bytes": float("nan")}),
        "bad_dtype": json.dumps({**data, "forward": {**data["forward"], "inputs": [
            {"shape": [2], "dtype": "__import__('os')", "requires_grad": False}]}}),
        "escape": json.dumps({**data, "planner": "\x1b[2J", "notes": ["\x1b]0;title\x07"]}),
    }
    for name, text in bad.items():
        (folder / f"{name}.json").write_text(text)
        out[name] = str(folder / f"{name}.json")
    with (folder / "huge.json").open("wb") as f:
        f.truncate(2 * MAX_FILE_BYTES)  # sparse
    out["huge"] = str(folder / "huge.json")
    (folder / "latin1.json").write_bytes(b"\xff\xfe{}")
    out["latin1"] = str(folder / "latin1.json")
    return out


# (argv, a phrase the one line must hold). {name} is filled from the files fixture.
CASES: list[tuple[list[str], str]] = [
    # the command line itself
    ([], "a command is required"),
    (["nosuchcmd"], "invalid choice: 'nosuchcmd'"),
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["plan"], "required: MODEL"),
    (["plan", RESNET, "--bogus"], "unrecognized arguments"),
    # plan: flags
    (["plan", RESNET, "--budget", "1e400"], "--budget: expected a size from 1 B"),
    (["plan", RESNET, "--budget", BIG], "--budget"),
    (["plan", RESNET, "--budget", "6 parsecs"], "--budget 6GiB"),
    (["plan", RESNET, "--budget", "1.5"], "fraction of the plain peak"),
    (["plan", RESNET, "--budget", "-5"], "--budget"),
    (["plan", RESNET, "--budget", "nan"], "--budget"),
    (["plan", RESNET, "--planner", "magic"], "argument --planner: invalid choice"),
    (["plan", RESNET, "--objective", "speed"], "argument --objective: invalid choice"),
    (["plan", RESNET, "--objective", "time", "--planner", "sqrt"], "--planner optimal"),
    (["plan", RESNET, "--device", "tpu"], "--device"),
    (["plan", RESNET, "--objective", "time", "--device", NO_CUDA], "--device"),
    (["plan", RESNET, "--batch", "0"], "argument --batch: expected an integer in [1, "),
    (["plan", RESNET, "--batch", HUGE], "argument --batch"),
    (["plan", RESNET, "--batch", "x"], "argument --batch"),
    (["plan", RESNET, "-o", "/nonexistent-dir/plan.json"], "-o: expected a file in an"),
    (["plan", RESNET, "-o", "/dev/full"], "-o: expected a regular file"),
    (["plan", RESNET, "-o", "{dir}"], "-o: expected a file path, not a directory"),
    (["plan", RESNET, "-o", "/proc/memplan-plan.json"], "-o: expected a path memplan can write"),
    # plan: model specs
    (["plan", "vgg:depth=3"], "MODEL"),
    (["plan", "resnet:depth"], "key=value"),
    (["plan", "resnet:width=3"], "width"),
    (["plan", "resnet:depth=50,depth=101"], "'depth' is given twice"),
    (["plan", f"resnet:batch={HUGE}"], "resnet.batch: expected an integer in [1, "),
    (["plan", "resnet:image=100000000"], "resnet.image: expected an integer in [1, "),
    (["plan", f"resnet:seed={10**30}"], "resnet.seed"),
    (["plan", "resnet:depth=1000000000"], "forward ops"),
    (["plan", "gpt:d_model=30,heads=4"], "gpt.d_model: expected a multiple of heads=4"),
    (["plan", "resnet:batch=1,image=1"], "BatchNorm"),
    (["plan", "resnet:dropout=nan"], "resnet.dropout"),
    (["plan", "lstm:steps=1e400"], "lstm.steps: expected an int"),
    (["plan", "lstm:steps=0"], "lstm.steps"),
    # plan: user factories
    (["plan", "tests.factories:exits"], "sys.exit(3)"),
    (["plan", "tests.factories:broken_forward"], "this forward is broken"),
    (["plan", "nonexistent_memplan_mod:make"], "No module named"),
    (["plan", "tests.factories:nope"], "has no 'nope'"),
    (["plan", "tests.factories:NOT_CALLABLE"], "a callable"),
    (["plan", "tests.factories:wrong_return"], "(model, example_inputs)"),
    (["plan", "tests.factories:raises"], "no weights here"),
    (["plan", "tests.factories:make", "--batch", "4"], "--batch"),
    # measure
    (["measure", RESNET, "--device", "tpu", "--real"], "--device"),
    (["measure", RESNET, "--device", NO_CUDA, "--real"], "--device"),
    (["measure", RESNET, "--batch", "0"], "argument --batch"),
    (["measure", "resnet:depth=14,batch=2,image=32,depth=17"], "twice"),
    (["measure", "tests.factories:exits"], "sys.exit(3)"),
    # explain
    (["explain"], "required: PLAN_JSON"),
    (["explain", "{missing}"], "No such file"),
    (["explain", "/dev/zero"], "regular plan file"),
    (["explain", "{dir}"], "not a directory"),
    (["explain", "{not_json}"], "not JSON"),
    (["explain", "{list}"], "JSON object"),
    (["explain", "{deep}"], "not valid plan JSON"),
    (["explain", "{negative_stage}"], "].stage: expected an integer in [0, "),
    (["explain", "{nan_peak}"], "peak_bytes"),
    (["explain", "{bad_dtype}"], "dtype"),
    (["explain", "{huge}"], "larger than"),
    (["explain", "{latin1}"], "UTF-8"),
    # verify
    (["verify", RESNET], "required: --plan"),
    (["verify", RESNET, "--plan", "{missing}"], "PLAN"),
    (["verify", RESNET, "--plan", "{lstm_plan}", "--device", NO_CUDA], "--device"),
    (["verify", RESNET, "--plan", "{lstm_plan}", "--repeat", "0"], "argument --repeat"),
    (["verify", RESNET, "--plan", "{lstm_plan}", "--repeat", HUGE], "argument --repeat"),
    (["verify", RESNET, "--plan", "{lstm_plan}"], "was made for other inputs"),
    (["verify", RESNET, "--plan", "{negative_stage}"], "stage"),
    # bench
    (["bench", "vgg"], "MODEL"),
    (["bench", "resnet", "--planners", ","], "--planners"),
    (["bench", "resnet", "--planners", "sqrt,sqrt"], "distinct names"),
    (["bench", "resnet", "--sweep", "depth=14,14"], "distinct sizes"),
    (["bench", "resnet", "--sweep", f"depth={HUGE}"], "resnet.depth"),
    (["bench", "resnet", "--sweep", "depth=a,b"], "integers"),
    (["bench", "resnet", "--threads", "100000000000"], "argument --threads"),
    (["bench", "resnet", "--repeat", "0"], "argument --repeat"),
    (["bench", "resnet", "--batch", HUGE], "argument --batch"),
    (["bench", "resnet", "--out", "/dev/full/x"], "--out"),
    (["bench", "resnet", "--budget", "1e400"], "--budget"),
    (["bench", "resnet", "--simulate", "--real"], "not allowed with"),
    (["bench", "resnet:depth=50,depth=101"], "twice"),
    (["bench", "resnet", "--compile", "nan", "--real"], "--compile"),
    # reproduce
    (["reproduce", "--figs", "4"], "--figs"),
    (["reproduce", "--jobs", "0"], "argument --jobs"),
    (["reproduce", "--jobs", HUGE], "argument --jobs"),
    (["reproduce", "--repeat", "x"], "argument --repeat"),
    (["reproduce", "--out", "/dev/full/x"], "--out"),
    # demo
    (["demo", "--jobs", "0"], "argument --jobs"),
    (["demo", "--jobs", HUGE], "argument --jobs"),
    (["demo", "--out", "/dev/full/x"], "--out"),
    (["demo", "--bogus"], "unrecognized arguments"),
]
QUICK = ("bench", "reproduce", "demo")  # their sizes stay small if a check let one through


def _ids() -> list[str]:
    return [" ".join(argv)[:60] or "(none)" for argv, _ in CASES]


@pytest.mark.parametrize("argv, needle", CASES, ids=_ids())
def test_bad_input_ends_in_one_line_exit_2(argv: list[str], needle: str, files: dict[str, str],
                                           capsys: pytest.CaptureFixture[str]) -> None:
    argv = [a.format(**files) if a.startswith("{") else a for a in argv]
    if "/dev/full" in " ".join(argv) and not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full here")
    if argv and argv[0] in QUICK:
        argv.append("--quick")
    capsys.readouterr()
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert err.startswith("memplan: error: ") and err.count("\n") == 1 and err.endswith("\n"), err
    assert needle in err, err
    assert "Traceback" not in err and "\x1b" not in err
    assert out == ""


def test_the_walk_covers_every_subcommand() -> None:
    from memplan.cli import COMMANDS

    walked = {argv[0] for argv, _ in CASES if argv}
    assert {c.__name__.rpartition(".")[2] for c in COMMANDS} <= walked
    assert len(CASES) >= 80


def test_the_console_script_prints_one_line(tmp_path: Path) -> None:
    """End to end, in a fresh process: the installed entry point keeps the promise too."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    script = "from memplan.cli import main; raise SystemExit(main())"
    for argv in (["explain", "/dev/zero"], ["plan", "tests.factories:exits"]):
        done = subprocess.run([sys.executable, "-c", script, *argv], capture_output=True,
                              text=True, env=env, cwd=Path(memplan.__file__).parents[2],
                              check=False)
        assert done.returncode == 2 and done.stdout == "", (argv, done)
        assert done.stderr.startswith("memplan: error:") and done.stderr.count("\n") == 1


def test_debug_works_after_the_command_too() -> None:
    for argv in (["--debug", "plan", "vgg:depth=3"], ["plan", "vgg:depth=3", "--debug"]):
        with pytest.raises(memplan.MemplanError):
            main(argv)
    with pytest.raises(memplan.ConfigError) as info:  # the traceback leads to the factory
        main(["plan", "tests.factories:exits", "--debug"])
    assert isinstance(info.value.__cause__, SystemExit)


def test_help_exits_0_and_stays_fast() -> None:
    code = ("import sys, time; t = time.perf_counter(); from memplan.cli import main; "
            "rc = main(['--help']); assert rc == 0, rc; assert 'torch' not in sys.modules")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=False)
    assert done.returncode == 0, done.stderr
    assert "usage: memplan" in done.stdout


def test_a_failed_write_after_the_work_keeps_the_plan(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    def disk_full(src: Any, dst: Any) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(cli_common.os, "replace", disk_full)
    target = tmp_path / "plan.json"
    assert main(["plan", LSTM, "--planner", "sqrt", "-o", str(target)]) == 2
    out, err = capsys.readouterr()
    assert "plan 'sqrt'" in out  # the table came before the failed write
    assert err.count("\n") == 1 and "No space left on device" in err
    saved = err.split("saved to ")[1].split(" instead")[0]
    plan = memplan.Plan.from_json(Path(saved).read_text())
    assert plan.planner == "sqrt" and not target.exists()
    assert not list(tmp_path.glob(".memplan-*"))  # no half-written file left behind
    Path(saved).unlink()


def test_odd_module_names_print_as_they_are(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    """Rich markup in module names ended in a MarkupError; an ESC cleared the screen; an
    emoji code (':llama:', also in a factory 'userfac:llama' before ': plan') printed 🦙."""
    out_file = tmp_path / "odd.json"
    assert main(["plan", "tests.factories:llama", "--planner", "sqrt", "--all-stages",
                 "-o", str(out_file)]) == 0
    out = capsys.readouterr().out
    assert "tests.factories:llama: plan" in out
    assert "blocks.[/red]" in out and "blocks.[bold]b" in out and "blocks.\\x1b[2Jc" in out
    assert "blocks.:llama:" in out and "\N{LLAMA}" not in out
    assert "\x1b" not in out
    assert main(["explain", str(out_file)]) == 0
    text = capsys.readouterr().out
    assert "\x1b" not in text and "[/red]" in text and "\\x1b[2Jc" in text
    assert ":llama:" in text and "\N{LLAMA}" not in text
    modules = {s.module for s in memplan.Plan.from_json(out_file.read_text()).stages}
    assert {f"blocks.{name}" for name in ODD_NAMES} <= modules  # stored as they are


def test_escaped_plan_strings_in_explain(files: dict[str, str],
                                         capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["explain", files["escape"]]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\\x1b" in out


@pytest.mark.parametrize("planner, other", [("optimal", False), ("sqrt", True)])
def test_budget_refusal_names_flags(planner: str, other: bool,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", LSTM, "--budget", "1KiB", "--planner", planner]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "least feasible peak" in err and "--budget " in err
    assert ("--planner optimal" in err) == other and "planner='" not in err


def test_plan_file_is_written_whole_with_the_usual_mode(tmp_path: Path) -> None:
    target = tmp_path / "plan.json"
    assert main(["plan", LSTM, "--planner", "sqrt", "-o", str(target)]) == 0
    mask = os.umask(0)
    os.umask(mask)
    assert target.stat().st_mode & 0o777 == 0o666 & ~mask
    assert memplan.Plan.from_json(target.read_text()).planner == "sqrt"
    assert [p.name for p in tmp_path.iterdir()] == ["plan.json"]
