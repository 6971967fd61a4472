"""Reproduce the paper's Fig. 5 (ResNet memory vs depth), Fig. 6 (LSTM memory vs unroll) and
Fig. 7 (time per batch), ours beside the paper's stated numbers: the same as
``memplan reproduce``.

    .venv/bin/python benchmarks/reproduce.py [--quick] [--figs 5,6,7] [--out out/reproduce]
"""

from __future__ import annotations

import sys

from memplan.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["reproduce", *sys.argv[1:]]))
