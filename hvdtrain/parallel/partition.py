"""A model cut into pipeline stages: its layers in forward order, split into S contiguous slices.

A model is cut where its author says it may be: an nn.Sequential at its children, any other model
at the list its `pipeline_layers()` returns (composing them in order must equal its forward, and
only one tensor may pass from one layer to the next). The built-in GPT returns its embedding, its
blocks and its head.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from torch import nn

from hvdtrain.errors import ConfigError

BALANCES = ("params", "time")


def pipeline_layers(model: nn.Module) -> list[nn.Module]:
    """`model`'s layers in forward order (see the module docstring)."""
    cut = getattr(model, "pipeline_layers", None)
    if callable(cut):
        layers = list(cut())
    elif isinstance(model, nn.Sequential):
        layers = list(model)
    else:
        raise ConfigError(f"parallel.pipeline_stages > 1 cannot cut a {type(model).__name__}: pass an nn.Sequential, "
                          "or give the model a pipeline_layers() method that returns its layers in forward order")
    if not all(isinstance(layer, nn.Module) for layer in layers):
        raise ConfigError(f"{type(model).__name__}.pipeline_layers() must return nn.Module objects")
    covered = {id(p) for layer in layers for p in layer.parameters()}
    missing = [name for name, p in model.named_parameters() if id(p) not in covered]
    if missing:
        raise ConfigError(f"parameter {missing[0]} of {type(model).__name__} is in none of its pipeline layers, so "
                          "no stage would train it: include its module in pipeline_layers()")
    return layers


def parse_balance(text: str, stages: int) -> tuple[int, ...] | None:
    """`"3,5"` -> layers per stage; "params"/"time" -> None. ConfigError names parallel.balance."""
    if text in BALANCES:
        return None
    try:
        counts = tuple(int(t) for t in text.split(","))
    except ValueError:
        counts = ()
    if len(counts) != stages or min(counts, default=0) < 1:
        raise ConfigError(f"parallel.balance={text!r} must be params, time, or {stages} positive layer counts "
                          f"(one per stage), e.g. \"{','.join(['2'] * stages)}\"")
    return counts


def split(weights: Sequence[float], stages: int) -> list[int]:
    """Boundaries b (len S + 1) of the contiguous split of `weights` into `stages` non-empty slices
    whose largest sum is smallest (stage s holds layers b[s]:b[s+1]). Exact, O(S x L^2)."""
    n = len(weights)
    if n < stages:
        raise ConfigError(f"parallel.pipeline_stages={stages} exceeds the model's {n} layers")
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + float(w))
    inf = float("inf")
    # best[s][i]: the smallest largest-slice sum of layers [0, i) in s slices; cut[s][i]: its last cut.
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for s in range(1, stages + 1):
        for i in range(s, n - (stages - s) + 1):
            for j in range(s - 1, i):
                cost = max(best[s - 1][j], prefix[i] - prefix[j])
                if cost < best[s][i]:
                    best[s][i], cut[s][i] = cost, j
    bounds = [n]
    for s in range(stages, 0, -1):
        bounds.append(cut[s][bounds[-1]])
    return bounds[::-1]


def layer_times(layers: Sequence[nn.Module], x: torch.Tensor, repeats: int = 3) -> list[float]:
    """Seconds of forward plus backward of each layer on input `x` (one micro-batch), the median of
    `repeats`, each layer fed the previous one's output. Leaves no gradients behind."""
    times = []
    for layer in layers:
        runs = []
        for _ in range(repeats):
            xin = x.detach().requires_grad_(x.is_floating_point())
            started = time.perf_counter()
            out = layer(xin)
            out.backward(torch.ones_like(out))
            if out.device.type == "cuda":
                torch.cuda.synchronize()
            runs.append(time.perf_counter() - started)
        times.append(sorted(runs)[len(runs) // 2])
        x = out.detach()
        for p in layer.parameters():
            p.grad = None
    return times


def boundaries(layers: Sequence[nn.Module], stages: int, balance: str,
               times: Sequence[float] | None = None) -> list[int]:
    """Stage boundaries by `balance`: parameter counts, measured `times` per layer
    (`layer_times`, the same on every rank), or a list of layers per stage."""
    counts = parse_balance(balance, stages)
    if counts is not None:
        if sum(counts) != len(layers):
            raise ConfigError(f"parallel.balance={balance!r} sums to {sum(counts)} layers; the model has "
                              f"{len(layers)}")
        out = [0]
        for c in counts:
            out.append(out[-1] + c)
        return out
    if balance == "time":
        if times is None or len(times) != len(layers):
            raise ValueError("parallel.balance=time needs one measured time per layer")
        return split(times, stages)
    return split([sum(p.numel() for p in layer.parameters()) for layer in layers], stages)


class Stage(nn.Module):
    """Layers [first, last) of a cut model, run in order. Their parameters are named by the layer's
    index in the whole model ("5.attn.qkv.weight"), so one stage's state reads the same at any S."""

    def __init__(self, layers: Sequence[nn.Module], first: int) -> None:
        super().__init__()
        self.first = first
        self.layers = nn.ModuleDict({str(first + i): layer for i, layer in enumerate(layers)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers.values():
            x = layer(x)
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"a pipeline layer must return one tensor (it goes to the next stage), got "
                                f"{type(x).__name__} from {type(layer).__name__}")
        return x


def shared_parameters(layers: Sequence[nn.Module], bounds: Sequence[int]) -> dict[int, set[int]]:
    """id(parameter) -> the stages that hold it, for parameters held by more than one stage."""
    where: dict[int, set[int]] = {}
    for s in range(len(bounds) - 1):
        for layer in layers[bounds[s]:bounds[s + 1]]:
            for p in layer.parameters():
                where.setdefault(id(p), set()).add(s)
    return {k: v for k, v in where.items() if len(v) > 1}
