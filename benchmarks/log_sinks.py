"""What one logging step costs rank 0 per sink: metrics.jsonl alone, with TensorBoard, with MLflow
(async logging into a local SQLite store). Each sink gets the same train records, in interleaved
blocks; one JSON line per sink with the median microseconds per record written.

    python benchmarks/log_sinks.py [--records 200] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

from hvdtrain.metrics import RunLog
from hvdtrain.world import World


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--records", type=int, default=200, help="records per block")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    world = World.init()
    folder = tempfile.mkdtemp(prefix="hvdtrain-logbench-")
    os.environ.setdefault("MLFLOW_TRACKING_URI", f"sqlite:///{folder}/mlflow.db")
    sinks = {"jsonl": RunLog(world, f"{folder}/a", tensorboard=False),
             "jsonl+tensorboard": RunLog(world, f"{folder}/b", tensorboard=True),
             "jsonl+mlflow": RunLog(world, f"{folder}/c", tensorboard=False, mlflow="log-bench")}
    record = {"loss": 0.5, "accuracy": 0.9, "lr": 0.05, "epoch": 1, "samples_per_s": 1e4, "comm_wait_ms": 0.1}
    per: dict[str, list[float]] = {name: [] for name in sinks}
    step = 0
    for r in range(args.rounds + 1):  # round 0 warms up (imports, the first writes)
        for name in list(sinks) if r % 2 else list(sinks)[::-1]:
            started = time.perf_counter()
            for _ in range(args.records):
                step += 1
                sinks[name].write(step, "train", record)
            if r:
                per[name].append((time.perf_counter() - started) / args.records)
    closing = {}
    for name, sink in sinks.items():
        started = time.perf_counter()
        sink.close()
        closing[name] = time.perf_counter() - started
    for name, times in per.items():
        print(json.dumps({"bench": "log_sinks", "sink": name, "us_per_record": round(1e6 * statistics.median(times), 1),
                          "spread_us": [round(1e6 * min(times), 1), round(1e6 * max(times), 1)],
                          "records": args.records * args.rounds, "close_s": round(closing[name], 3)}), flush=True)


if __name__ == "__main__":
    main()
