"""Mixed precision: autocast around forward and loss, and for fp16 a dynamic loss scale.

One fp16 step runs in Horovod's order: backward of the scaled loss -> `reducer.synchronize()` ->
unscale -> clip -> `optimizer.step()` -> update the scale. Gradients travel scaled, so an overflow on
any rank (or in an fp16 gradient codec) arrives as inf in the averaged gradient on every rank. The
reducer's finite verdict on that averaged gradient is the only overflow test: it is computed from
values identical on every rank, so all ranks skip, back off and grow together without another
collective, and a skipped step is one skip, counted once by the trainer. `torch.amp.GradScaler` is
not used because it makes its own, second inf check and skip decision inside `step()`.

Parameters, gradients and optimizer state stay fp32 (master weights); autocast only changes the
dtype of activations in the ops it covers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from hvdtrain.config import MemoryConfig
from hvdtrain.errors import ConfigError
from hvdtrain.profile.nvtx import nvtx_range

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class LossScaler:
    """Dynamic loss scale: halve on a non-finite step, double after `growth_interval` finite ones."""

    def __init__(self, init_scale: float = 65536.0, growth_interval: int = 2000,
                 growth_factor: float = 2.0, backoff_factor: float = 0.5) -> None:
        self.scale = float(init_scale)
        self.growth_interval = growth_interval
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.good_steps = 0

    def update(self, finite: bool) -> float:
        """Record one step's verdict (the same on every rank); returns the factor the scale changed by."""
        if not finite:
            self.good_steps = 0
            self.scale *= self.backoff_factor
            return self.backoff_factor
        self.good_steps += 1
        if self.good_steps < self.growth_interval:
            return 1.0
        self.good_steps = 0
        self.scale *= self.growth_factor
        return self.growth_factor

    def state_dict(self) -> dict[str, float]:
        return {"scale": self.scale, "good_steps": self.good_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale, self.good_steps = float(state["scale"]), int(state["good_steps"])


class Precision:
    """How one training step runs its phases: `forward()` (autocast), `backward(loss)` (scaled for
    fp16) and `step(...)` (unscale, clip, step, scale update). fp32 is the plain step."""

    def __init__(self, mode: str = "fp32", device: torch.device | str = "cpu",
                 scaler: LossScaler | None = None) -> None:
        if mode not in ("fp32", *DTYPES):
            raise ConfigError(f"memory.precision={mode!r} is not allowed; choose one of fp32, bf16, fp16")
        self.mode, self.device_type = mode, torch.device(device).type
        if mode == "bf16" and self.device_type == "cuda" and not torch.cuda.is_bf16_supported():
            raise ConfigError("memory.precision=bf16 needs a GPU with bfloat16 support (Ampere or newer); use fp16")
        self.scaler = scaler if mode == "fp16" else None
        if mode == "fp16" and self.scaler is None:
            self.scaler = LossScaler()

    @classmethod
    def from_config(cls, cfg: MemoryConfig, device: torch.device) -> Precision:
        return cls(cfg.precision, device, LossScaler(cfg.loss_scale, cfg.scale_growth_interval))

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        """Around the forward pass and the loss (autocast picks per op: matmuls low, reductions fp32)."""
        with nvtx_range("forward"):
            if self.mode == "fp32":
                yield
            else:
                with torch.autocast(self.device_type, dtype=DTYPES[self.mode]):
                    yield

    def backward(self, loss: torch.Tensor) -> None:
        with nvtx_range("backward"):
            if self.scaler is not None:
                # fp32 before scaling: an fp16 loss times 65536 would overflow on its own.
                loss = loss.float() * self.scaler.scale
            loss.backward()

    def step(self, optimizer: torch.optim.Optimizer, params: list[nn.Parameter], finite: bool, clip: float,
             reducer: Any = None) -> None:
        """After `reducer.synchronize()` returned `finite` (the same on every rank): unscale, clip,
        step, update the scale. A non-finite step leaves weights and optimizer state untouched."""
        with nvtx_range("optimizer step"):
            if finite:
                if self.scaler is not None:
                    inv = 1.0 / self.scaler.scale  # a power of two: unscaling is exact
                    if reducer is not None:
                        reducer.unscale_(inv, params)  # ZeRO's gradients are its slices
                    else:
                        for p in params:
                            if p.grad is not None:
                                p.grad.mul_(inv)
                if clip > 0:
                    torch.nn.utils.clip_grad_norm_(params, clip)  # on the true averaged gradient
                optimizer.step()
            if self.scaler is not None:
                factor = self.scaler.update(finite)
                if factor != 1.0 and reducer is not None:
                    # Error-feedback residuals are in scaled units; keep them in step with the scale.
                    for residual in reducer.residuals.values():
                        residual.mul_(factor)

    def report(self) -> dict[str, float]:
        """For the skip event: the loss scale after this step's update (fp16 only)."""
        return {"loss_scale": self.scaler.scale} if self.scaler else {}

    def state_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "scaler": self.scaler.state_dict() if self.scaler else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores the loss scale if both runs used fp16; another mode's state is ignored."""
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
