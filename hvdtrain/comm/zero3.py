"""ZeRO stage 3: the parameters are sharded too, and gathered only while a module uses them.

The model is cut into sharding units (each top-level child by default, or the modules that
`memory.zero3_units` names). Each unit's parameters live in one flat fp32 bucket padded to a
multiple of the world size, laid out as ZeRO-1/2 lay theirs (so checkpoints re-shard between all
stages by parameter name). A rank keeps only its slice of each bucket; that slice is what the
optimizer steps. Per micro-batch, identical on every rank:
- forward: a unit's pre-forward hook allgathers its bucket into the flat buffer (whose storage is
  otherwise freed: size 0), and its post-forward hook frees it again;
- backward: a hook on the unit's outputs fires when their gradient arrives, before the unit's own
  backward, and gathers the bucket again; when every parameter of the unit has its gradient, the
  gradient bucket is reduce-scattered (averaged, through the gradient codec) into this rank's
  slice and the gathered bucket is freed;
- prefetch: the order units run in is recorded on the first micro-batch (forward and backward
  separately, as FSDP does), and from then on the next `prefetch` units' allgathers are launched
  while the current unit computes.
The parameters stay views into the flat buffers; freeing resizes the buffer's storage to 0 and a
gather re-allocates it, so the views autograd saved in forward see the re-gathered values in
backward (an activation-checkpointed unit's recompute gathers nothing more: the backward hook has).

Parameters claimed by two units (tied weights) or by none form the root unit: gathered at the
model's forward and kept until their gradients are reduced.

Every micro-batch reduce-scatters every unit once (zeros where a parameter got no gradient), so
gradient memory stays 1/n under accumulation; the price is k reduce-scatters per step instead of
one. Every rank must run the same units in the same order (no data-dependent branches between
units): a unit gathered on one rank only leaves the others waiting.
"""

from __future__ import annotations

import collections
import contextlib
import fnmatch
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from hvdtrain.comm.compression import reducescatter_finish, reducescatter_launch
from hvdtrain.comm.zero import ZeroReducer
from hvdtrain.errors import ConfigError
from hvdtrain.world import World

_WINDOW = 2  # gradient reduce-scatters in flight at once (each holds a full-size unit bucket)
_CONTAINERS = (nn.ModuleList, nn.ModuleDict)  # no forward of their own: their children are the units


def sharding_units(model: nn.Module, spec: str = "") -> list[tuple[str, nn.Module]]:
    """The modules ZeRO-3 gathers one at a time: `spec` "" takes each top-level child (a ModuleList's
    or ModuleDict's entries instead of the container); otherwise a comma list of class names or
    fnmatch patterns over qualified module names, of which the outermost matches are taken."""
    chosen: list[tuple[str, nn.Module]] = []
    if not spec:
        def expand(prefix: str, module: nn.Module) -> None:
            for name, child in module.named_children():
                if isinstance(child, _CONTAINERS):
                    expand(f"{prefix}{name}.", child)
                else:
                    chosen.append((f"{prefix}{name}", child))

        expand("", model)
        return chosen
    patterns = [p.strip() for p in spec.split(",") if p.strip()]

    def walk(prefix: str, module: nn.Module) -> None:
        for name, child in module.named_children():
            full = f"{prefix}{name}"
            if any(type(child).__name__ == p or fnmatch.fnmatchcase(full, p) for p in patterns):
                chosen.append((full, child))
            else:
                walk(full + ".", child)

    walk("", model)
    if not chosen:
        raise ConfigError(f"memory.zero3_units={spec!r}: no submodule matches (give class names, e.g. Block, "
                          "or qualified-name patterns, e.g. blocks.*)")
    return chosen


class Zero3Reducer(ZeroReducer):
    """Reducer, sharded optimizer step and parameter gathering for `memory.zero_stage=3`. The
    interface of ZeroReducer, plus `full_parameters` (every bucket gathered, for evaluation and
    whole-model state) and `unshard` (the end of training: the model keeps its full weights)."""

    def __init__(self, world: World, model: nn.Module, units: str = "", codec: str = "none", clip: float = 0.0,
                 prefetch: int = 1) -> None:
        # Error feedback is refused by the config: each micro-batch reduce-scatters on its own, so no
        # one residual per step exists; `residuals` stays empty (the interface's codec state).
        self.world, self.stage, self.clip, self.error_feedback = world, 3, clip, False
        self.prefetch = max(0, prefetch)
        self.set_codec(codec)
        self.buckets, modules = unit_buckets(model, sharding_units(model, units), world.size)
        self._root = len(self.buckets) - 1 if modules[-1] is model else -1
        self.flat: list[torch.Tensor] = []
        self.shards: list[torch.Tensor] = []
        for u, bucket in enumerate(self.buckets):
            flat = self._flatten(bucket)
            # Rank 0's weights everywhere before anything is cut (the model may differ per rank).
            if world.size > 1:
                flat.copy_(world.broadcast(flat, name=f"hvdtrain.zero3.init.{u}"))
            self.shards.append(self._mine(flat).clone())
            _free(flat)
            self.flat.append(flat)
        self.optimizer: torch.optim.Optimizer | None = None
        self.residuals: dict[int, torch.Tensor] = {}
        self.grad_norm = torch.zeros(())
        self._bucket_of = {id(p): u for u, b in enumerate(self.buckets) for _, p in b["params"]}
        self._bucket_len = [len(b["params"]) for b in self.buckets]
        self._ready = [0] * len(self.buckets)
        self._pending: dict[int, Any] = {}  # gradient reduce-scatters in flight
        self._gathers: dict[int, Any] = {}  # parameter allgathers in flight
        self._gathered: set[int] = set()
        self._reduced: set[int] = set()  # units reduce-scattered in this micro-batch
        # Collectives issued in this micro-batch by (kind, unit), and those of the first micro-batch:
        # what a rank that ran out of memory mid-step still owes its peers (`_replay`).
        self._issued: collections.Counter = collections.Counter()
        self._per_micro_batch: dict[tuple[str, int], int] = {}
        self._left = 0  # micro-batches after this one in the step
        self._backward = False  # a backward is running (recomputation's forwards must not free)
        self._pinned = 0  # inside full_parameters(): nothing is freed
        self._order: dict[str, list[int]] = {"forward": [], "backward": []}
        self._recorded = False  # both orders known (after the first micro-batch)
        self._cursor = {"forward": 0, "backward": 0}
        self.gather_wait_s = 0.0  # seconds spent waiting for allgathers (the part prefetch did not hide)
        self.gather_count = 0
        self.gathered_peak = 0  # most bytes of gathered buckets (or allgathers in flight) held at once
        self._hooks: list[Any] = [model.register_forward_pre_hook(self._root_forward)]
        for u, module in enumerate(modules):
            if u != self._root:
                self._hooks.append(module.register_forward_pre_hook(self._forward_hook(u, before=True)))
                self._hooks.append(module.register_forward_hook(self._forward_hook(u, before=False)))
        self._hooks += [p.register_post_accumulate_grad_hook(self._on_grad)
                        for b in self.buckets for _, p in b["params"]]

    # ---- gathering ----

    def _launch_gather(self, u: int) -> None:
        if u in self._gathered or u in self._gathers:
            return
        self._gathers[u] = self.world.allgather_async(self.shards[u].detach(), name=f"hvdtrain.zero3.params.{u}")
        self._issued[("params", u)] += 1
        self._note_peak()

    def _ensure(self, u: int) -> None:
        """Unit u's parameters gathered (waiting for a prefetched allgather, or gathering now)."""
        if u in self._gathered:
            return
        self._launch_gather(u)
        started = time.perf_counter()
        out = self.world.wait(self._gathers.pop(u))
        self.gather_wait_s += time.perf_counter() - started
        self.gather_count += 1
        flat = self.flat[u]
        flat.untyped_storage().resize_(flat.numel() * flat.element_size())
        # Through .data: a copy into the buffer must not bump the version counter that autograd
        # checks on the views it saved in forward (they are meant to see these values).
        flat.data.copy_(out)
        self._gathered.add(u)
        self._note_peak()

    def _note_peak(self) -> None:
        # An allgather in flight counts whole: Horovod allocates its full-size output.
        held = sum(self.flat[v].numel() * 4 for v in self._gathered | set(self._gathers))
        self.gathered_peak = max(self.gathered_peak, held)

    def _release(self, u: int) -> None:
        if u in self._gathered and not self._pinned:
            _free(self.flat[u])
            self._gathered.discard(u)

    def _advance(self, phase: str, u: int) -> None:
        """Record the execution order on the first micro-batch; later, follow it and prefetch."""
        order = self._order[phase]
        if not self._recorded:
            order.append(u)
            return
        at = self._cursor[phase]
        if at < len(order) and order[at] == u:
            at += 1
        else:  # off the recorded order (a unit run twice, say): no prefetch until it is found again
            at = order.index(u, at) + 1 if u in order[at:] else len(order)
        self._cursor[phase] = at
        for v in order[at:at + self.prefetch]:
            if phase == "forward" or v not in self._reduced:
                self._launch_gather(v)

    def _root_forward(self, module: nn.Module, args: Any) -> None:
        if self._root >= 0:
            self._ensure(self._root)
        if self._backward:  # the whole model recomputed in backward: nothing to prefetch
            return
        self._cursor = {"forward": 0, "backward": 0}
        if self.prefetch and self._recorded and not self._pinned and self._order["forward"]:
            for v in self._order["forward"][:self.prefetch]:
                self._launch_gather(v)

    def _forward_hook(self, u: int, before: bool) -> Any:
        def pre(module: nn.Module, args: Any) -> None:
            self._ensure(u)
            if not (self._backward or self._pinned):
                self._advance("forward", u)

        def post(module: nn.Module, args: Any, output: Any) -> None:
            if self._backward or self._pinned:
                return  # a recomputation during backward, or evaluation with everything gathered
            tensors = [t for t in _tensors(output) if t.requires_grad]
            if tensors:
                torch.autograd.graph.register_multi_grad_hook(tensors, lambda grads: self._before_backward(u),
                                                              mode="any")
            self._release(u)

        return pre if before else post

    def _before_backward(self, u: int) -> None:
        self._backward = True
        self._ensure(u)
        self._advance("backward", u)

    # ---- gradients ----

    def arm(self, last_micro_batch: bool, left: int = 0) -> None:
        """Before each micro-batch: the previous one's units still owed a reduce-scatter get it now."""
        if self._backward or self._reduced:
            self._end_micro_batch()
        self._left = left

    def _on_grad(self, p: torch.Tensor) -> None:
        u = self._bucket_of[id(p)]
        self._ready[u] += 1
        if self._ready[u] == self._bucket_len[u]:
            self._reduce(u)

    def _reduce(self, u: int, fill: float | None = None) -> None:
        if u in self._reduced:
            return
        bucket = self.buckets[u]
        flat = torch.zeros(bucket["numel"], dtype=torch.float32, device=self.shards[u].device)
        for (_, p), off in zip(bucket["params"], bucket["offsets"]):
            if p.grad is not None:
                flat[off:off + p.numel()].copy_(p.grad.reshape(-1))
                p.grad = None
        if fill is not None:
            flat.fill_(fill)
        if u in self._pending:  # the previous micro-batch's, under the same name
            self._finish(u)
        while len(self._pending) >= _WINDOW:
            self._finish(min(self._pending))
        self._pending[u], _ = reducescatter_launch(self.world, self.codec.name, flat, f"hvdtrain.zero3.grad.{u}")
        self._issued[("grad", u)] += 1
        self._reduced.add(u)
        if not self._pinned:
            self._release(u)

    def _finish(self, u: int) -> None:
        part = reducescatter_finish(self.world, self._pending.pop(u))
        shard = self.shards[u]
        shard.grad = part if shard.grad is None else shard.grad.add_(part)

    def _end_micro_batch(self, fill: float | None = None) -> None:
        for u in range(len(self.buckets)):
            self._reduce(u, fill)
        for u in list(self._gathers):  # prefetched but not used (the order changed): drained alike
            self._ensure(u)
        for u in list(self._gathered):
            self._release(u)
        if not self._recorded and self._order["backward"]:
            self._recorded = True
            self._per_micro_batch = dict(self._issued)
        self._issued = collections.Counter()
        self._reduced.clear()
        self._ready = [0] * len(self.buckets)
        self._backward = False

    def launch_rest(self, fill: float | None = None) -> None:
        """With `fill` (this rank ran out of memory mid-step): join every collective the other ranks
        still issue in this step, sending `fill` (NaN), so that theirs complete and every rank's
        average is non-finite."""
        if fill is None:
            self._end_micro_batch()
        else:
            self._replay(fill)

    def probe_trial_done(self, oom: bool) -> None:
        """A memory-probe trial is a micro-batch like any other here (its forward gathered, its
        backward reduce-scattered), so a rank that ran out of memory in it joins what its peers still
        issue, sending zeros; then every reduce-scatter is finished, so the slices hold the trial's
        gradient (the probe's first trial steps the optimizer with it to create its state)."""
        self._left = 0
        if oom:
            self._replay(0.0)  # leaves every unit marked reduced for the step: cleared below
        self._end_micro_batch()
        for u in sorted(self._pending):
            self._finish(u)

    def _owed(self) -> collections.Counter:
        """The collectives (kind, unit) the other ranks still issue in this step: the rest of this
        micro-batch's and all of the `_left` that follow. Each micro-batch issues the same ones, as
        recorded on the first; before that, the plain count: every unit gathered for forward and
        backward (the root once) and reduce-scattered once."""
        per = self._per_micro_batch or collections.Counter(
            {**{("params", u): 1 if u == self._root else 2 for u in range(len(self.buckets))},
             **{("grad", u): 1 for u in range(len(self.buckets))}})
        return collections.Counter({key: n * self._left + max(0, n - self._issued[key]) for key, n in per.items()})

    def _replay(self, fill: float) -> None:
        """Issue what `_owed` lists, keeping one instance of each name in flight and starting the next
        as soon as it completes: the others issue them in their own order, and each of theirs waits
        at most for the one before it under that name, which this rank has already issued."""
        owed = self._owed()
        flight: dict[tuple[str, int], Any] = {("params", u): h for u, h in self._gathers.items()}
        flight.update({("grad", u): p for u, p in self._pending.items()})
        self._gathers, self._pending = {}, {}
        while flight or +owed:
            for key in [k for k, n in owed.items() if n > 0 and k not in flight]:
                owed[key] -= 1
                flight[key] = self._launch_owed(key, fill)
            finished = [k for k, h in flight.items() if self.world.done(h if k[0] == "params" else h[1])]
            for key in finished:
                handle = flight.pop(key)
                self.world.wait(handle) if key[0] == "params" else reducescatter_finish(self.world, handle)
            if not finished:
                time.sleep(0.0005)
        self._after_replay(fill)

    def _launch_owed(self, key: tuple[str, int], fill: float) -> Any:
        kind, u = key
        if kind == "params":
            return self.world.allgather_async(self.shards[u].detach(), name=f"hvdtrain.zero3.params.{u}")
        nan = torch.full((self.buckets[u]["numel"],), fill, device=self.shards[u].device)
        return reducescatter_launch(self.world, self.codec.name, nan, f"hvdtrain.zero3.grad.{u}")[0]

    def _after_replay(self, fill: float) -> None:
        for u in list(self._gathered):
            self._release(u)
        for shard in self.shards:  # this rank's own verdict: not finite, like everyone's average
            shard.grad = torch.full_like(shard, fill)
        for bucket in self.buckets:
            for _, p in bucket["params"]:
                p.grad = None
        if not self._recorded:  # the order this attempt began to record is cut short: record again
            self._order = {"forward": [], "backward": []}
        self._issued = collections.Counter()
        self._reduced = set(range(len(self.buckets)))  # nothing more this step
        self._ready = [0] * len(self.buckets)
        self._backward = False

    def _synchronize(self) -> bool:
        self._end_micro_batch()
        for u in sorted(self._pending):
            self._finish(u)
        for s in self.shards:
            if s.grad is None:
                s.grad = torch.zeros_like(s)
        return self._agree_on_norm()

    def step(self) -> None:
        """Clip by the global norm and update this rank's slices; the next forward gathers them."""
        self._update_shards()

    # ---- whole parameters ----

    @contextlib.contextmanager
    def full_parameters(self, writeback: bool = False) -> Iterator[None]:
        """Every unit gathered for the body (evaluation, a whole state_dict, loading one); with
        `writeback`, each rank then takes its slices from the (possibly changed) full buckets.
        Holds the whole model on every rank meanwhile. All ranks must call."""
        self._pinned += 1
        try:
            for u in range(len(self.buckets)):
                self._launch_gather(u)
                if len(self._gathers) >= _WINDOW:
                    self._ensure(min(self._gathers))
            for u in range(len(self.buckets)):
                self._ensure(u)
            yield
            if writeback:
                for u, flat in enumerate(self.flat):
                    self.shards[u].copy_(self._mine(flat))
        finally:
            self._pinned -= 1
            if not self._pinned:
                for u in list(self._gathered):
                    self._release(u)

    def model_part(self, model: nn.Module) -> FullModelState:
        return FullModelState(model, self)

    def broadcast_initial(self, model: nn.Module) -> None:
        """The trainable parameters were broadcast from rank 0 when they were cut; buffers and frozen
        parameters (never cut) are left."""
        rest = {**dict(model.named_buffers()),
                **{name: p for name, p in model.named_parameters() if not p.requires_grad}}
        if rest:
            self.world.broadcast_parameters(rest)

    def unshard(self) -> None:
        """Gather every unit for good and detach the hooks: the model is a plain, whole model again."""
        for u in range(len(self.buckets)):
            self._ensure(u)
        self._pinned += 1
        self.remove()

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def memory(self) -> dict[str, int]:
        """Bytes this rank holds: parameter shards plus the most gathered buckets held at once so far
        (`gathered_peak`), gradient shards, optimizer state."""
        opt = sum(t.numel() * t.element_size() for st in (self.optimizer.state.values() if self.optimizer else [])
                  for t in st.values() if isinstance(t, torch.Tensor))
        params = sum(s.numel() * 4 for s in self.shards) + self.gathered_peak
        return {"params": params, "grads": sum(s.grad.numel() * 4 for s in self.shards if s.grad is not None),
                "optimizer": opt}


class FullModelState:
    """The model as a resumable part under ZeRO-3: its whole state_dict (every rank gathers, rank 0
    writes it), loaded by gathering, loading and re-cutting. All ranks call both."""

    def __init__(self, model: nn.Module, zero: Zero3Reducer) -> None:
        self.model, self.zero = model, zero

    def state_dict(self) -> dict[str, Any]:
        with self.zero.full_parameters():
            return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def load_state_dict(self, state: dict[str, Any]) -> Any:
        with self.zero.full_parameters(writeback=True):
            return self.model.load_state_dict(state)


def unit_buckets(model: nn.Module, units: list[tuple[str, nn.Module]],
                  n: int) -> tuple[list[dict[str, Any]], list[nn.Module]]:
    """One bucket per unit that owns parameters, in the units' order, and the root's bucket last
    (parameters claimed by no unit or by several). Padded to a multiple of n."""
    owners: dict[int, list[int]] = {}
    for u, (_, module) in enumerate(units):
        for p in module.parameters():
            if p.requires_grad and u not in owners.setdefault(id(p), []):
                owners[id(p)].append(u)
    per_unit: list[list[tuple[str, nn.Parameter]]] = [[] for _ in units]
    root: list[tuple[str, nn.Parameter]] = []
    seen: set[int] = set()
    for name, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        claimed = owners.get(id(p), [])
        (per_unit[claimed[0]] if len(claimed) == 1 else root).append((name, p))
    buckets, modules = [], []
    for (_, module), params in [*zip(units, per_unit), ((".", model), root)]:
        if params:
            offsets = [0]
            for _, p in params:
                offsets.append(offsets[-1] + p.numel())
            buckets.append({"params": params, "offsets": offsets[:-1], "numel": -(-offsets[-1] // n) * n})
            modules.append(module)
    if not buckets:
        raise ConfigError("memory.zero_stage=3: the model has no trainable parameters")
    return buckets, modules


def _free(flat: torch.Tensor) -> None:
    flat.untyped_storage().resize_(0)


def _tensors(output: Any) -> list[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, (tuple, list)):
        return [t for o in output for t in _tensors(o)]
    if isinstance(output, dict):
        return [t for o in output.values() for t in _tensors(o)]
    return []
