"""`hvdtrain train` (the CLI, exit codes and all) with each training micro-batch slowed by argv[1]
seconds, so a test can send a signal mid-run; each rank first prints its rank and pid.
Usage: slow_train.py DELAY_S train ARGS..."""
import os
import sys
import time

import hvdtrain.tasks
from hvdtrain.tools.cli import main

delay = float(sys.argv[1])
build = hvdtrain.tasks.build_task


def slow_task(cfg):
    task = build(cfg)
    loss_fn = task.loss_fn

    def slow(model, batch):
        if model.training:
            time.sleep(delay)
        return loss_fn(model, batch)

    task.loss_fn = slow
    return task


hvdtrain.tasks.build_task = slow_task  # the CLI looks it up when it trains
rank = os.environ.get("HOROVOD_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
print(f"whoami rank={rank} pid={os.getpid()}", flush=True)
sys.exit(main(sys.argv[2:]))
