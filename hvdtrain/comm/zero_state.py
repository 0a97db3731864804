"""Re-sharding ZeRO optimizer state between partitions (another world size or bucket size).

Pure functions, no collectives: every rank rebuilds the whole optimizer state by parameter name
from all saved shards and cuts out its own slice of the new layout. Only restores at a changed
world size pay for a full-size copy; a restore at the same partition loads the rank's own shard.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from hvdtrain.errors import CheckpointError

Full = dict[str, dict[str, Any]]


def consolidate(saved: list[dict[str, Any]]) -> tuple[Full, set[str]]:
    """Per parameter name, its whole optimizer state (tensors shaped like the parameter), from every
    rank's saved ZeRO state in rank order; also the names of the elementwise (sharded) keys."""
    part = saved[0]["zero"]
    if len(saved) != part["world_size"]:
        raise CheckpointError(f"the checkpoint holds {len(saved)} optimizer shards but was saved by "
                              f"{part['world_size']} ranks; it is incomplete")
    full: Full = {}
    sharded: set[str] = set()
    for b, bucket in enumerate(part["buckets"]):
        states = [s["optimizer"].get("state", {}).get(b, {}) for s in saved]
        for key, first in states[0].items():
            if isinstance(first, torch.Tensor) and first.dim() == 1 and \
                    first.numel() * part["world_size"] == bucket["numel"]:
                sharded.add(key)
                flat = torch.cat([st[key] for st in states])
                for name, shape, off in zip(bucket["names"], bucket["shapes"], bucket["offsets"]):
                    full.setdefault(name, {})[key] = flat[off:off + math.prod(shape)].reshape(shape).clone()
            else:  # per-bucket scalars (Adam's step count): identical on every rank and bucket
                for name in bucket["names"]:
                    full.setdefault(name, {})[key] = first
    return full, sharded


def shard(full: Full, sharded: set[str], partition: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """Optimizer state for the shards `partition` (a ZeroReducer.partition()) describes."""
    n, r = partition["world_size"], partition["rank"]
    out: dict[int, dict[str, Any]] = {}
    for b, bucket in enumerate(partition["buckets"]):
        first = full.get(bucket["names"][0])
        if first is None:
            continue  # the checkpoint was taken before any step: no state yet
        entry: dict[str, Any] = {}
        for key, value in first.items():
            if key not in sharded:
                entry[key] = value.clone() if isinstance(value, torch.Tensor) else value
                continue
            flat = torch.zeros(bucket["numel"], dtype=value.dtype)
            for name, shape, off in zip(bucket["names"], bucket["shapes"], bucket["offsets"]):
                flat[off:off + math.prod(shape)] = full[name][key].reshape(-1)
            size = bucket["numel"] // n
            entry[key] = flat[r * size:(r + 1) * size].clone()
        out[b] = entry
    return out


def reshard(saved: list[dict[str, Any]], partition: dict[str, Any]) -> dict[str, Any]:
    """A torch optimizer state_dict for this rank's shards in `partition`, from every saved rank's
    ZeRO state (saved at any world size or bucket size over the same parameters)."""
    full, sharded = consolidate(saved)
    shapes_old = {n: s for b in saved[0]["zero"]["buckets"] for n, s in zip(b["names"], b["shapes"])}
    shapes_new = {n: s for b in partition["buckets"] for n, s in zip(b["names"], b["shapes"])}
    if set(shapes_old) != set(shapes_new):
        diff = sorted(set(shapes_old) ^ set(shapes_new))
        raise CheckpointError(f"the checkpoint's optimizer shards cover other parameters (first difference: "
                              f"{diff[0]}); resume with the model it was saved with")
    for name, shape in shapes_old.items():
        if list(shapes_new[name]) != list(shape):
            raise CheckpointError(f"parameter {name} has shape {list(shape)} in the checkpoint and "
                                  f"{list(shapes_new[name])} now")
    groups = [dict(g) for g in saved[0]["optimizer"].get("param_groups", [])]
    for g in groups:
        g["params"] = list(range(len(partition["buckets"])))
    return {"state": shard(full, sharded, partition), "param_groups": groups}
