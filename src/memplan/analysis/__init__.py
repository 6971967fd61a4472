"""Experiments as data rows: verify, peers, bench, reproduce, demo and their reports (files and
plots). No argparse and no console here: ``memplan.cli`` prints."""
