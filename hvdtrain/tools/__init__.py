"""Command-line tools: `hvdtrain` (train, print-config, launch, plan, report, bench)."""
