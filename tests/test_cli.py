from __future__ import annotations

import pytest

from memplan.cli import main
from small import SMALL


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
