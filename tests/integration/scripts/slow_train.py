"""`hvdtrain train` (the CLI, exit codes and all) with each training micro-batch slowed by argv[1]
seconds, so a test can send a signal mid-run; each rank first prints its rank and pid. With
EXIT_AT=N in the environment, rank 1 dies (exit code 3) at its N-th training micro-batch.
Usage: slow_train.py DELAY_S train ARGS..."""
import os
import sys
import time

import hvdtrain.tasks
from hvdtrain.tools.cli import main

delay = float(sys.argv[1])
exit_at = int(os.environ.get("EXIT_AT", "0"))
build = hvdtrain.tasks.build_task


def slow_task(cfg):
    task = build(cfg)
    loss_fn = task.loss_fn

    calls = [0]

    def slow(model, batch):
        if model.training:
            time.sleep(delay)
            calls[0] += 1
            if rank == "1" and calls[0] == exit_at:
                os._exit(3)
        return loss_fn(model, batch)

    task.loss_fn = slow
    return task


hvdtrain.tasks.build_task = slow_task  # the CLI looks it up when it trains
rank = os.environ.get("HOROVOD_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
print(f"whoami rank={rank} pid={os.getpid()}", flush=True)
sys.exit(main(sys.argv[2:]))
