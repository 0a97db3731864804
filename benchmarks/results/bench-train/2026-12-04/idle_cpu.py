# CPU an idle rank burns in 5 s: Horovod's background thread cycles vs torch.distributed (no background loop).
import json, os, sys, time
way = sys.argv[1]
if way == "ddp":
    import torch.distributed as dist
    dist.init_process_group("gloo")
    rank = dist.get_rank()
else:
    import horovod.torch as hvd
    hvd.init()
    rank = hvd.rank()
time.sleep(1)
c, w = time.process_time(), time.perf_counter()
time.sleep(5)
print(json.dumps({"way": way, "rank": rank, "cpu_s": round(time.process_time() - c, 3), "wall_s": round(time.perf_counter() - w, 3)}))
