import sys, torch
from torch.profiler import profile, ProfilerActivity
from hvdtrain import config as config_mod
from hvdtrain.bench_loops import _batches, _horovod_step, _hvdtrain_step
from hvdtrain.tasks import build_task
from hvdtrain.world import World
world = World.init(threads=1)
cfg = config_mod.build(None, [], task="pylm")
steps = {}
for way, make in (("hvdtrain", _hvdtrain_step), ("horovod", _horovod_step)):
    task = build_task(cfg); steps[way] = make(world, task, cfg)
batches = _batches(world, task, cfg, 40)
for w, s in steps.items():
    for b in batches[:10]: s(b)
for w, s in steps.items():
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as p:
        for b in batches[10:40]: s(b)
    print("=====", w)
    for e in sorted(p.key_averages(group_by_input_shape=True), key=lambda e: -e.self_cpu_time_total):
        if e.key in ("aten::fill_", "aten::zero_", "aten::zeros"):
            print(e.key, e.input_shapes, e.count, round(e.self_cpu_time_total/1e3, 2), "ms")
