"""Benchmarks (`hvdtrain bench ...`): one JSON line per result, compared side by side in one run."""
