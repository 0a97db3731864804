"""Optimizer construction for built-in tasks and the learning-rate rule for every run.

The rule is explicit: each parameter group's own lr is the base for one rank's batch; the target is
base x f, with f = ranks x accumulation (`linear`, Goyal et al. 2017), its square root (`sqrt`), or
1 (`none`). Warm-up ramps linearly from base to target; `cosine` then decays to zero by the last step,
`step` multiplies by gamma at each milestone.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from hvdtrain.config import OptimConfig, parse_milestones


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    params = model.parameters()
    if cfg.name == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    if cfg.name == "adam":
        return torch.optim.Adam(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)


def scale_factor(rule: str, ranks: int, accumulation: int) -> float:
    """How much larger the per-step lr is than the single-rank base lr."""
    f = ranks * accumulation
    return {"linear": float(f), "sqrt": math.sqrt(f), "none": 1.0}[rule]


def rescale_second_moment(optimizer: torch.optim.Optimizer, ratio: float) -> bool:
    """Multiply Adam/AdamW's running E[g²] (exp_avg_sq, and max_exp_avg_sq under amsgrad) by `ratio`:
    after a batch-size change it still averages ~1/(1-β2) steps of gradients at the old batch, whose
    noise part was B_new/B_old times larger (or smaller), so Adam's steps would stay too short (long)
    for hundreds of steps. False (nothing done) for other optimizers."""
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)) or ratio == 1.0:
        return False
    for state in optimizer.state.values():
        for key in ("exp_avg_sq", "max_exp_avg_sq"):
            if key in state:
                state[key].mul_(ratio)
    return True


def decays(milestones: tuple[int, ...], step: float) -> int:
    """How many step-schedule milestones lie at or before `step` (an adaptive run passes progress τ)."""
    return sum(step >= m for m in milestones)


class LRSchedule:
    """Sets every group's lr from its base lr for a given optimizer step; stateless apart from the
    base lrs, which live in the optimizer's own param groups (`initial_lr`) and so in its checkpoint."""

    def __init__(self, optimizer: torch.optim.Optimizer, cfg: OptimConfig, ranks: int, accumulation: int,
                 total_steps: int) -> None:
        self.optimizer = optimizer
        self.factor = scale_factor(cfg.lr_scaling, ranks, accumulation)
        self.warmup = cfg.warmup_steps
        self.cosine = cfg.schedule == "cosine"
        self.milestones, self.gamma = parse_milestones(cfg.milestones), cfg.gamma
        self.total = max(1, total_steps)
        for group in optimizer.param_groups:
            group.setdefault("initial_lr", group["lr"])

    def multiplier(self, step: float) -> float:
        """lr / base lr for optimizer step `step` (0-based; adaptive runs pass progress τ)."""
        if step < self.warmup:
            return 1.0 + (self.factor - 1.0) * (step + 1) / self.warmup
        if self.milestones:
            return self.factor * self.gamma ** decays(self.milestones, step)
        if not self.cosine:
            return self.factor
        progress = min(1.0, (step - self.warmup) / max(1, self.total - self.warmup))
        return self.factor * 0.5 * (1.0 + math.cos(math.pi * progress))

    def apply(self, step: int) -> float:
        """Set the lr of every group for `step`; returns the first group's lr."""
        m = self.multiplier(step)
        for group in self.optimizer.param_groups:
            group["lr"] = group["initial_lr"] * m
        return self.optimizer.param_groups[0]["lr"]
