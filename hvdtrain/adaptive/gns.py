"""Gradient noise scale (McCandlish et al. 2018) from two batch sizes that data parallelism gives for free.

Each rank's micro-batch gradient g_j (m samples) and the averaged gradient ḡ (all n·k micro-batches,
count = n·k) satisfy E|g_j|² = |G|² + tr(Σ)/m and E|ḡ|² = |G|² + tr(Σ)/(m·count), with G the true
gradient and Σ the per-sample gradient covariance. Solving the two gives unbiased estimators:

    |G|²  ≈ (count·|ḡ|² − mean_j |g_j|²) / (count − 1)
    tr(Σ) ≈ (mean_j |g_j|² − |ḡ|²) · m · count / (count − 1)

Their ratio is biased, so the two are smoothed separately (bias-corrected moving averages whose
horizon is counted in samples, not steps, so a larger batch does not shorten the memory) and the
noise scale φ = tr(Σ)/|G|² is taken from the averages.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn


def estimate(local_sq_mean: float, global_sq: float, count: int, micro_batch: int) -> tuple[float, float]:
    """Unbiased (|G|², tr(Σ)) from the mean local squared norm over `count` micro-batches of
    `micro_batch` samples and the squared norm of their average."""
    if count < 2:
        raise ValueError(f"the noise scale needs at least 2 micro-batches per step, got {count}")
    g2 = (count * global_sq - local_sq_mean) / (count - 1)
    trace = (local_sq_mean - global_sq) * micro_batch * count / (count - 1)
    return g2, trace


class SampleAverage:
    """Bias-corrected exponential average with decay β per `unit` samples (so the memory is a number
    of samples whatever the batch size)."""

    def __init__(self, beta: float, unit: int) -> None:
        self.beta, self.unit = beta, unit
        self.total, self.weight = 0.0, 0.0

    def update(self, value: float, samples: int) -> None:
        decay = self.beta ** (samples / self.unit)
        self.total = decay * self.total + (1 - decay) * value
        self.weight = decay * self.weight + (1 - decay)

    @property
    def value(self) -> float:
        return self.total / self.weight if self.weight > 0 else float("nan")

    def state_dict(self) -> dict[str, float]:
        return {"total": self.total, "weight": self.weight}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.total, self.weight = float(state["total"]), float(state["weight"])


SPIKE = 10.0  # a step whose mean micro-batch |g|² exceeds this x its running average counts as this much


class NoiseScale:
    """Smoothed |G|² and tr(Σ), and the noise scale φ = tr(Σ)/|G|².

    Both averages are linear in each step's estimates, so one step whose gradients are 100x the
    usual (an early loss spike) dominates them for hundreds of steps and freezes φ at that step's
    ratio (measured on pylm with Adam: φ held at 11.3 from step 13 to ~300 while the loss fell from
    2.9 to 2.1). Such a step is scaled down, |G|² and tr(Σ) alike, to SPIKE x the running average
    of the micro-batch |g|² (its own ratio is kept); ordinary steps are untouched, so the estimators
    stay unbiased where the gradient scale moves smoothly."""

    def __init__(self, beta: float, unit: int) -> None:
        self.g2, self.trace = SampleAverage(beta, unit), SampleAverage(beta, unit)
        self.local = SampleAverage(beta, unit)
        self.updates = 0

    def update(self, local_sq_mean: float, global_sq: float, count: int, micro_batch: int) -> None:
        g2, trace = estimate(local_sq_mean, global_sq, count, micro_batch)
        usual = self.local.value
        shrink = 1.0
        if self.updates >= 3 and usual > 0 and local_sq_mean > SPIKE * usual:
            shrink = SPIKE * usual / local_sq_mean
        samples = count * micro_batch
        self.g2.update(g2 * shrink, samples)
        self.trace.update(trace * shrink, samples)
        self.local.update(local_sq_mean * shrink, samples)
        self.updates += 1

    def rebase(self, unit: int) -> None:
        """Decay per `unit` samples from now on (an elastic world keeps the first world's B0)."""
        for avg in (self.g2, self.trace, self.local):
            avg.unit = unit

    @property
    def phi(self) -> float:
        """Noise scale in samples; inf while the gradient estimate is noise-dominated (|G|² ≤ 0)."""
        g2, trace = self.g2.value, self.trace.value
        if self.updates == 0 or math.isnan(g2):
            return float("nan")
        if g2 <= 0:
            return float("inf")
        return max(trace, 0.0) / g2

    def state_dict(self) -> dict[str, Any]:
        return {"g2": self.g2.state_dict(), "trace": self.trace.state_dict(), "local": self.local.state_dict(),
                "updates": self.updates}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.g2.load_state_dict(state["g2"])
        self.trace.load_state_dict(state["trace"])
        if "local" in state:  # absent in checkpoints from before 3 December: the guard restarts empty
            self.local.load_state_dict(state["local"])
        self.updates = int(state["updates"])


def _sum_sq(norms: list[torch.Tensor]) -> torch.Tensor:
    """Σ norm² in fp64 (the estimators subtract sums of squares of similar size)."""
    return torch.stack(norms).double().square().sum()


FLOOR_WEIGHT = 10.0  # no element's weight 1/sqrt(v̂) exceeds this / its tensor's mean sqrt(v̂)
REFRESH_MAX = 16  # steps between preconditioner rebuilds once Adam's v̂ moves slowly


class GradNormMeter:
    """Sums each micro-batch's local squared gradient norm with tensor hooks.

    `p.register_hook` fires once per backward with that backward's gradient, before it is added to
    `.grad` (the reducer's post-accumulate hooks see the running sum instead), so each micro-batch is
    measured on its own. Totals stay tensors (no host sync) until `local_sum`. With an Adam-family
    optimizer the gradients are divided by sqrt(v̂) + ε first, the geometry the optimizer steps in.
    """

    def __init__(self, params: Iterable[nn.Parameter], optimizer: torch.optim.Optimizer,
                 precondition: bool) -> None:
        seen: set[int] = set()
        self.params: list[nn.Parameter] = []
        for p in params:  # trainable, tied weights once
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                self.params.append(p)
        self.optimizer = optimizer
        self.precondition = precondition and isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW))
        self.scale: dict[int, torch.Tensor] = {}
        self.active = False
        self._parts: list[torch.Tensor] = []  # per-tensor norms of the running micro-batch
        self._segment: torch.Tensor | None = None  # the preconditioner's element -> tensor index
        self._micro: list[torch.Tensor] = []
        self._steps, self._refresh_at = 0, 0  # begin_step calls; when the preconditioner is rebuilt next
        self._hooks = [p.register_hook(self._hook(p)) for p in self.params]
        # The gradient reducer's buckets, when attached: with one micro-batch a step, a bucket's flat
        # buffer holds this rank's gradient just before its collective, so one fused norm per bucket
        # replaces a norm per tensor (hooks + |ḡ|²: 0.94 -> 0.40 ms of a ~16 ms pylm step at m = 8, CPU).
        self.buckets: list[list[nn.Parameter]] | None = None
        self.flat = False  # this step is measured on the buckets
        self._bucket_scale: list[torch.Tensor] = []

    def use_buckets(self, buckets: list[list[nn.Parameter]]) -> bool:
        """Measure single-micro-batch steps on these buckets (the reducer calls `bucket_ready`); False
        (and the hooks measure every step) unless they hold exactly the measured parameters."""
        if sorted(id(p) for b in buckets for p in b) != sorted(id(p) for p in self.params):
            return False
        self.buckets = buckets
        self._bucket_scale = self._per_bucket(self.scale)
        return True

    def _per_bucket(self, scale: dict[int, torch.Tensor]) -> list[torch.Tensor]:
        """The preconditioner laid out as the buckets' flat buffers ([] without buckets or scale)."""
        if not scale or self.buckets is None:
            return []
        return [torch.cat([scale[id(p)].reshape(-1) for p in b]) for b in self.buckets]

    def bucket_ready(self, b: int, flat: torch.Tensor) -> None:
        """Bucket b's flat local gradient, before its collective overwrites it with the average."""
        if self.active and self.flat:
            self._parts.append(self._flat_norm(b, flat))

    def _flat_norm(self, b: int, flat: torch.Tensor) -> torch.Tensor:
        scaled = flat * self._bucket_scale[b] if self._bucket_scale else flat
        return torch.linalg.vector_norm(scaled, dtype=torch.float32)

    def _hook(self, p: nn.Parameter):
        def hook(grad: torch.Tensor) -> None:
            if not self.active:
                return
            if self.flat:
                return  # measured on the reducer's bucket instead
            g = grad.detach()
            scale = self.scale.get(id(p))
            # One norm per tensor (fp32 accumulation, so fp16/bf16 gradients cannot overflow), squared
            # and summed in fp64 when the micro-batch closes: two full passes over the gradient
            # instead of the four a cast-square-sum in fp64 took.
            self._parts.append(torch.linalg.vector_norm(g if scale is None else g * scale, dtype=torch.float32))
        return hook

    @property
    def settled(self) -> bool:
        """False while Adam's state does not exist yet: the step is measured in the raw geometry,
        which a preconditioned average must not mix with (|g|² differs by orders of magnitude)."""
        return not self.precondition or bool(self.scale)

    def begin_step(self, micro_batches: int = 0) -> None:
        """Before a step's first micro-batch: freeze this step's preconditioner, clear the totals.

        Rebuilding the preconditioner cost ~1.4 ms a step on pylm (CPU), a tenth of a B=8 step. v̂ is
        an average over ~1/(1-β2) steps, so it is rebuilt every step at first and then every
        1 + steps/20 (at most REFRESH_MAX) steps, when v̂ has moved by a few percent at most. The
        estimators stay unbiased: each step measures every micro-batch and the average in one
        fixed geometry. The schedule counts calls, which every rank makes alike.

        `micro_batches` == 1 with buckets attached: the step is measured on the buckets."""
        if self.precondition and (not self.scale or self._steps >= self._refresh_at):
            self.scale = self.preconditioner()
            self._bucket_scale = self._per_bucket(self.scale)
            self._refresh_at = self._steps + min(REFRESH_MAX, 1 + self._steps // 20)
        self.flat = self.buckets is not None and micro_batches == 1
        self._steps += 1
        self._micro, self._parts, self.active = [], [], True

    def next_micro_batch(self) -> None:
        """Close the running micro-batch (if any) before the next backward."""
        if self._parts:
            self._micro.append(_sum_sq(self._parts))
        self._parts = []

    def local_sum(self, grad_scale: float) -> float:
        """Σ_j |g_j|² over this step's micro-batches; each hook saw g_j · grad_scale (the 1/k of
        accumulation), which is undone here."""
        self.next_micro_batch()
        self.active = False
        if not self._micro:
            return 0.0
        return float(torch.stack(self._micro).sum()) / grad_scale**2

    def global_sq(self, flats: list[torch.Tensor] | None = None) -> float:
        """|ḡ|² of the averaged gradient now in `.grad`, in the same (preconditioned) geometry; with
        buckets attached, on their flat buffers `flats` (after synchronize they hold that average
        whatever the number of micro-batches)."""
        if flats is not None and self.buckets is not None:
            return float(_sum_sq([self._flat_norm(b, f) for b, f in enumerate(flats)]).cpu())
        grads = [p.grad.detach() for p in self.params if p.grad is not None]
        if not grads:
            return 0.0
        if self.scale:
            grads = list(torch._foreach_mul(grads, [self.scale[id(p)] for p in self.params if p.grad is not None]))
        return float(_sum_sq(list(torch._foreach_norm(grads, 2, dtype=torch.float32))).cpu())

    def preconditioner(self) -> dict[int, torch.Tensor]:
        states = [self.optimizer.state.get(p, {}) for p in self.params]
        # All or nothing: a mix of raw and preconditioned parameters measures neither geometry.
        if not states or any("exp_avg_sq" not in st for st in states):
            return {}
        beta2 = self.optimizer.param_groups[0]["betas"][1]
        eps = self.optimizer.param_groups[0]["eps"]
        # One flat vector for all tensors: a loop of per-tensor ops (28 tensors on pylm, ~10 ops each)
        # cost ~2.4 ms a step on CPU in dispatch alone.
        sizes = [st["exp_avg_sq"].numel() for st in states]
        v = torch.cat([st["exp_avg_sq"].reshape(-1) for st in states])
        lengths = torch.tensor(sizes, device=v.device)
        if self._segment is None or self._segment.numel() != v.numel():  # element -> tensor index, once
            self._segment = torch.arange(len(sizes), device=v.device).repeat_interleave(lengths)
        debias = torch.tensor([1 - beta2 ** float(st["step"]) for st in states], dtype=v.dtype, device=v.device)
        root = v.div_(debias.index_select(0, self._segment)).sqrt_()
        # An element whose v̂ is still ~0 (an embedding row no batch has used yet) would be weighted
        # 1/eps ~ 1e8 and swamp both estimates for hundreds of steps (measured on pylm: the noise
        # scale stuck at its step-13 value until step ~300). Adam itself puts the current gradient
        # into v̂ before stepping, so it never divides by ~0; here the weight is capped at
        # FLOOR_WEIGHT x the tensor's typical one. The cap is fixed for the step, so every
        # micro-batch and the average are still measured in one linear geometry (no bias).
        # Tensor arithmetic only: an .item() per parameter would stall a GPU every step.
        means = torch.segment_reduce(root, "mean", lengths=lengths)
        typical = torch.where(means > 0, means, means.mean()) / FLOOR_WEIGHT  # unseen tensor: the overall
        weights = torch.maximum(root, typical.index_select(0, self._segment)).add_(eps)
        weights.reciprocal_()
        return {id(p): w.view_as(p) for p, w in zip(self.params, weights.split(sizes))}

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
