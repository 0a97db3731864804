import sys, time, torch
from torch.profiler import profile, ProfilerActivity
from hvdtrain import config as config_mod
from hvdtrain.bench_loops import _batches, _horovod_step, _hvdtrain_step
from hvdtrain.tasks import build_task
from hvdtrain.world import World
world = World.init(threads=1)
cfg = config_mod.build(None, [], task=sys.argv[1])
steps = {}
for way, make in (("hvdtrain", _hvdtrain_step), ("horovod", _horovod_step)):
    task = build_task(cfg); steps[way] = make(world, task, cfg)
batches = _batches(world, task, cfg, 40)
for w, s in steps.items():
    for b in batches[:10]: s(b)
for w, s in steps.items():
    with profile(activities=[ProfilerActivity.CPU]) as p:
        for b in batches[10:40]: s(b)
    print("=====", w)
    print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=14))
