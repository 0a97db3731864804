"""Adaptive batch sizing: the controller (a batch policy), its memory probe, per-step statistics,
the gradient noise scale, the goodput model and the decision broadcast."""
