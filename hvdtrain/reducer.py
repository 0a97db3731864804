"""Bucketed gradient averaging over Horovod, overlapped with backward.

Parameters are grouped into buckets in reverse registration order (roughly the order backward
produces their gradients). A post-accumulate-grad hook counts each bucket's gradients during the
last micro-batch's backward and launches the bucket's collective as soon as it is complete, so
communication overlaps the rest of backward, as in Horovod's DistributedOptimizer. Buckets whose
parameters got no gradient are launched in `synchronize()`. Every bucket has a fixed name, so
Horovod matches them across ranks whatever order the hooks fire in.

Owning this step (instead of hvd.DistributedOptimizer) is what allows codecs Horovod lacks (bf16),
error feedback per bucket, and one agreed skip decision when the reduced gradient is not finite.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from hvdtrain.compression import Codec, Pending, make_codec
from hvdtrain.world import World


class GradReducer:
    """Averages `.grad` of the given parameters across ranks. `synchronize` must be called on all
    ranks after the last micro-batch's backward of every optimizer step."""

    def __init__(self, world: World, named_parameters: Iterable[tuple[str, nn.Parameter]], codec: str = "none",
                 bucket_mb: float = 25.0, error_feedback: bool = False) -> None:
        self.world = world
        self.codec: Codec = make_codec(codec, world.size)
        self.error_feedback = error_feedback
        seen: set[int] = set()
        params = []
        for _, p in named_parameters:
            if p.requires_grad and id(p) not in seen:  # tied weights appear once
                seen.add(id(p))
                params.append(p)
        self.buckets = _bucketize(params[::-1], int(bucket_mb * 2**20))
        self._bucket_of = {id(p): i for i, b in enumerate(self.buckets) for p in b}
        self._ready = [0] * len(self.buckets)
        self._pending: dict[int, Pending] = {}
        self.residuals: dict[int, torch.Tensor] = {}
        self._armed = True
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in params]

    def set_codec(self, name: str) -> None:
        """Switch codec between steps (all ranks together); residuals of the old codec are dropped."""
        self.codec = make_codec(name, self.world.size)
        self.residuals.clear()

    def arm(self, last_micro_batch: bool) -> None:
        """Before each backward: only the last micro-batch of a step launches collectives."""
        self._armed = last_micro_batch

    def _on_grad(self, p: torch.Tensor) -> None:
        if not self._armed:
            return
        b = self._bucket_of[id(p)]
        self._ready[b] += 1
        if self._ready[b] == len(self.buckets[b]):
            self._launch(b)

    def _launch(self, b: int) -> None:
        flat = torch.cat([_grad_or_zeros(p).reshape(-1) for p in self.buckets[b]])
        if self.error_feedback and b in self.residuals:
            flat += self.residuals[b]
        compensated = flat.clone() if self.error_feedback else None
        pending = self.codec.launch(flat, name=f"hvdtrain.grad.{b}", want_sent=self.error_feedback)
        if compensated is not None and pending.sent is not None:
            # What this rank meant to send minus what the wire carried: added back next step.
            self.residuals[b] = compensated - pending.sent
        self._pending[b] = pending

    def synchronize(self) -> bool:
        """Wait for every bucket, write the averaged gradients back; True if all are finite.

        All ranks receive the same reduced values, so they reach the same verdict without another
        collective and skip (or take) the step together.
        """
        for b in range(len(self.buckets)):
            if b not in self._pending:
                self._launch(b)
        for b in sorted(self._pending):
            self.codec.advance(self._pending[b])
        finite = []
        for b in sorted(self._pending):
            out = self.codec.finish(self._pending[b])
            finite.append(torch.isfinite(out).all())
            _write_back(self.buckets[b], out)
        self._pending.clear()
        self._ready = [0] * len(self.buckets)
        self._armed = True
        ok = bool(torch.stack(finite).all()) if finite else True
        if not ok:
            self.residuals.clear()  # an inf in the residual would poison every later step
        return ok

    def state_dict(self) -> dict[str, object]:
        """Per-rank state (residuals differ between ranks)."""
        return {"codec": self.codec.name, "residuals": {str(k): v for k, v in self.residuals.items()}}

    def load_state_dict(self, state: dict[str, object]) -> None:
        self.set_codec(str(state["codec"]))
        self.residuals = {int(k): v for k, v in dict(state["residuals"]).items()}  # type: ignore[arg-type]

    def adopt_hooks(self, handles: list) -> None:
        """Hooks other gradient features registered (the noise-scale meter): detached with ours, on
        every exit path of `fit`."""
        self._hooks.extend(handles)

    def remove(self) -> None:
        """Detach the hooks (so a model can be trained again with a new reducer)."""
        for h in self._hooks:
            h.remove()


def _bucketize(params: list[torch.Tensor], cap_bytes: int) -> list[list[torch.Tensor]]:
    buckets: list[list[torch.Tensor]] = [[]]
    size = 0
    for p in params:
        nbytes = p.numel() * 4
        if buckets[-1] and size + nbytes > cap_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(p)
        size += nbytes
    return [b for b in buckets if b]


def _grad_or_zeros(p: torch.Tensor) -> torch.Tensor:
    # A parameter unused in this step still takes part, as zeros, so every rank sends equal shapes.
    return p.grad.float() if p.grad is not None else torch.zeros_like(p, dtype=torch.float32)


def _write_back(params: list[torch.Tensor], flat: torch.Tensor) -> None:
    offset = 0
    for p in params:
        n = p.numel()
        view = flat[offset:offset + n].view_as(p).to(p.dtype)
        if p.grad is None:
            p.grad = view.clone()
        else:
            p.grad.copy_(view)
        offset += n
