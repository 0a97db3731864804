# Torch profiler over 30 steps of hvdtrain's step and of the hand-written Horovod loop, one process.
#   horovodrun -np 1 --gloo python profile_np1.py pylm           top operators by self CPU
#   horovodrun -np 1 --gloo python profile_np1.py pylm shapes    fill_/zero_ calls grouped by shape
import sys

from torch.profiler import ProfilerActivity, profile

from hvdtrain import config as config_mod
from hvdtrain.bench_loops import _batches, _horovod_step, _hvdtrain_step
from hvdtrain.tasks import build_task
from hvdtrain.world import World

world = World.init(threads=1)
cfg = config_mod.build(None, [], task=sys.argv[1])
by_shape = len(sys.argv) > 2 and sys.argv[2] == "shapes"
steps = {}
for way, make in (("hvdtrain", _hvdtrain_step), ("horovod", _horovod_step)):
    task = build_task(cfg)
    steps[way] = make(world, task, cfg)
batches = _batches(world, task, cfg, 40)
for s in steps.values():
    for b in batches[:10]:
        s(b)
for w, s in steps.items():
    with profile(activities=[ProfilerActivity.CPU], record_shapes=by_shape) as p:
        for b in batches[10:40]:
            s(b)
    print("=====", w)
    if not by_shape:
        print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=14))
        continue
    for e in sorted(p.key_averages(group_by_input_shape=True), key=lambda e: -e.self_cpu_time_total):
        if e.key in ("aten::fill_", "aten::zero_", "aten::zeros"):
            print(e.key, e.input_shapes, e.count, round(e.self_cpu_time_total / 1e3, 2), "ms")
