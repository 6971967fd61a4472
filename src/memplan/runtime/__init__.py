"""The one interpreter of a Plan (torch): stage layout, tape recording and replay, and
``memplan.apply`` which patches a model to train under a plan."""
