"""``memplan verify``: exit 0 when everything holds, 1 when a check fails, 2 on bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from memplan.cli import main

SPEC = "resnet:depth=14,batch=2,image=32,classes=10,dropout=0.1"


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("verify") / "plan.json"
    assert main(["plan", SPEC, "--planner", "recursive", "-o", str(path)]) == 0
    return path


def test_verify_passes(plan_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", SPEC, "--plan", str(plan_file), "--repeat", "1"]) == 0
    out = capsys.readouterr().out
    assert "bit-equal" in out and "all hold" in out


def test_verify_fails_on_a_wrong_prediction(plan_file: Path, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    data = json.loads(plan_file.read_text())
    data["peak_bytes"] //= 2  # a prediction the run cannot match
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    assert main(["verify", SPEC, "--plan", str(bad), "--repeat", "1"]) == 1
    assert "FAILED" in capsys.readouterr().out


def test_verify_errors(plan_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", SPEC, "--plan", str(tmp_path / "none.json")]) == 2
    assert "memplan: error: PLAN" in capsys.readouterr().err
    other = "resnet:depth=17,batch=2,image=32,classes=10,dropout=0.1"
    assert main(["verify", other, "--plan", str(plan_file)]) == 2
    assert "another model" in capsys.readouterr().err
    assert main(["verify", SPEC]) == 2  # --plan is required
    assert "--plan" in capsys.readouterr().err
