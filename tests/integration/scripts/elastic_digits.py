"""`hvdtrain train --elastic` on digits, with each micro-batch slowed by argv[1] seconds: however fast
the machine, the run then outlasts the few seconds Horovod needs to let a re-added host join.
Usage: elastic_digits.py DELAY_S --set key=value ..."""
import sys
import time

from hvdtrain import config, fit
from hvdtrain.tasks import build_task
from hvdtrain.world import World

delay = float(sys.argv[1])
cfg = config.build("configs/digits.yaml", [kv for kv in sys.argv[2:] if kv != "--set"])
world = World.init()
task = build_task(cfg)


def slow_loss(model, batch):
    time.sleep(delay)
    return task.loss_fn(model, batch)


result = fit(world, task.model, None, task.train_set, cfg, eval_set=task.eval_set, loss_fn=slow_loss)
world = World.init()  # the last world's ranks: the first world's rank 0 may be gone
world.print(f"done: step {result.step}, eval " + " ".join(f"{k} {v:.4f}" for k, v in result.eval.items()))
