"""Adaptive batch sizing: one controller owns micro-batch m, accumulation k, the LR factor and the
progress τ (steps of the starting batch B0 worth of progress); global batch B = ranks·m·k.

It is the loop's batch policy (hvdtrain/policy.py) and adds hooks to each step attempt
(hvdtrain/step.py). Collectives it adds, in this order and on every rank: the memory probe's
(before step 1); one stats allreduce per optimizer step attempt, started beside the gradient
buckets (hvdtrain/adaptive/stats.py); on decision steps (every D steps after warm-up, by the step
counter alone) one broadcast of rank 0's decision, started there and waited on after the next step,
which applies it (hvdtrain/adaptive/decision.py). An OOM on one rank never skips a collective: that
rank sends NaN in the buckets it has not sent (the reducer holds backward's last bucket until
synchronize, so one is always left), every rank sees a non-finite average and collects the stats at
once, and their OOM flag makes every rank retry the same samples with a smaller m and a larger k
(same B, same LR).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset, default_collate

from hvdtrain import optim
from hvdtrain.adaptive import goodput
from hvdtrain.adaptive.decision import PendingDecision
from hvdtrain.adaptive.gns import GradNormMeter, NoiseScale
from hvdtrain.adaptive.probe import Prober, probe
from hvdtrain.adaptive.stats import StepStats
from hvdtrain.comm.reducer import GradReducer, HookedBuckets
from hvdtrain.common import num_samples, shrink_after_oom
from hvdtrain.config import Config, parse_milestones
from hvdtrain.data import ShardedBatchSampler
from hvdtrain.errors import ConfigError
from hvdtrain.faults import FaultInjector
from hvdtrain.metrics import TrainLog
from hvdtrain.optim import LRSchedule
from hvdtrain.precision import Precision
from hvdtrain.state import Resumable
from hvdtrain.step import LossFn, Outcome, StepHooks
from hvdtrain.world import World


class AdaptiveController(StepHooks):
    """Owns (m, k, LR factor, τ); every change goes through it. Methods that communicate say so.
    The sampler must be made with `variable=True`: the controller reshapes it between steps."""

    survives_oom = True

    def __init__(self, world: World, cfg: Config, model: nn.Module, optimizer: torch.optim.Optimizer,
                 reducer: HookedBuckets, sampler: ShardedBatchSampler, dataset: Dataset, loss_fn: LossFn,
                 injector: FaultInjector | None = None, precision: Precision | None = None) -> None:
        ac, tc = cfg.adaptive, cfg.train
        self.world, self.cfg, self.ac = world, cfg, ac
        self.model, self.optimizer, self.sampler, self.dataset = model, optimizer, sampler, dataset
        self.loss_fn, self.hooks = loss_fn, self
        self.precision = precision or Precision()
        # An elastic run's controller takes B0 and B_max from any state it loads (the first world's),
        # which always comes from another world: it reshapes the batch and probes memory again.
        self.adopt = cfg.elastic.enabled
        samples = num_samples(dataset)
        shape = goodput.start_shape(world.size, tc.batch_size, tc.accumulation, ac.max_batch, samples)
        self.base, self.max_batch, self.min_k, self.m, self.k = shape
        self.cap = ac.max_micro_batch or self.max_batch // world.size
        self.sizes = [tc.batch_size * 2**i for i in range(12)] + [max(1, tc.batch_size // 2**i) for i in range(1, 6)]
        # Under ZeRO the loop steps a sharded optimizer: its kind and state are those of the inner one.
        self.inner: torch.optim.Optimizer = getattr(optimizer, "inner", optimizer)
        self.adam = isinstance(self.inner, (torch.optim.Adam, torch.optim.AdamW))
        self.milestones = parse_milestones(cfg.optim.milestones) if ac.policy == "decay_to_batch" else ()
        self.noise = NoiseScale(ac.smoothing, self.base)
        self.times = goodput.StepTimeModel({})
        self.injector = injector or FaultInjector(cfg.faults, world.rank)
        # ZeRO keeps slices of Adam's second moment, and the local norms need all of it on every rank
        # (4 bytes a parameter, what ZeRO exists to save): under ZeRO the noise scale is measured on
        # raw gradients, as with adaptive.precondition=false.
        self.sharded = not isinstance(reducer, GradReducer)
        if self.sharded and ac.precondition and self.adam:
            world.warn("adaptive: with memory.zero_stage the noise scale is measured on raw gradients "
                       "(adaptive.precondition applies to memory.zero_stage=0 only)")
        self.meter = GradNormMeter(model.parameters(), self.inner, ac.precondition and not self.sharded)
        self.reducer = reducer
        reducer.hold_last_bucket()  # backward's last bucket: an OOM can always poison it
        if isinstance(reducer, GradReducer) and self.meter.use_buckets(reducer.buckets):
            reducer.add_tap(self.meter.bucket_ready)
        self.stats = StepStats(world, self.noise, self.times)
        self.tau, self.lr_factor, self.probed, self.ooms = 0.0, 1.0, not ac.probe, 0
        self.samples, self._samples_before = 0, 0  # global samples trained, after and before this step
        self.decisions: list[list[int]] = []  # [step, m, k] of every change
        self.pending = PendingDecision(world)  # rank 0's last decision, on its way to every rank
        self.probe_report: dict[str, Any] | None = None  # logged after the first step
        self._oom_here, self._stats_handle, self.clock = False, None, goodput.StepClock()
        self.set_shape(self.m, self.k)

    @property
    def batch(self) -> int:
        return self.world.size * self.m * self.k

    def progress(self, step: int) -> float:
        """τ: the steps of B0 that the samples trained so far are worth (the loop's step count)."""
        return self.tau

    def parts(self) -> dict[str, Resumable]:
        return {"adaptive": self}

    def finish(self) -> None:
        """After the last step, on every rank: the last stats are applied and nothing is left in flight."""
        self.stats.collect()
        self.pending.values()

    def close(self) -> None:
        """Detach the norm meter's hooks (on every exit path of the loop)."""
        self.meter.remove()
        self.injector.detach()

    def set_shape(self, m: int, k: int) -> None:
        self.m, self.k = m, k
        self.sampler.reshape(m, k)

    # ---- data ----

    def batches(self) -> Iterator[list[Any]]:
        """This rank's micro-batches, step by step, with the (m, k) in force at each step; runs the
        memory probe first if it has not run. All ranks must iterate together."""
        if not self.probed:
            self.run_probe()
        epoch = self.sampler.epoch
        while self.sampler.epoch == epoch and not self.sampler.epoch_done:
            self.clock.step_begins()
            yield self._fetch()

    def _fetch(self) -> list[Any]:
        return [default_collate([self.dataset[i] for i in idx]) for idx in self.sampler.step_indices()]

    def run_probe(self) -> None:
        """Memory probe (before step 1, and again after an elastic reset). All ranks must call."""
        self.reducer.arm(last_micro_batch=False)  # the probe's backwards must not launch collectives
        # The inner optimizer: ZeRO's sharded step would add an allgather to each trial (the inner
        # one's step is local). Under stages 1-2 its slices get no gradient in the probe, so no state
        # is created (1/N anyway); under stage 3 the trials reduce-scatter into them like any step.
        prober = Prober(self.model, self.inner, self.dataset, self.loss_fn, self.world.device, self.injector,
                        self.world, self.reducer)
        limit = self.ac.max_micro_batch or self.max_batch // self.world.size
        started = time.perf_counter()
        result = probe(self.world, self.ac, prober, self.m, limit)
        self.cap, self.probed = result.cap, True
        self.sizes = sorted(set(self.sizes) | set(result.seconds))
        for m, seconds in result.seconds.items():
            self.times.record_probe(m, seconds)
        if self.m > self.cap or self.m < result.preferred:  # the same B, in micro-batches the probe prefers
            self.set_shape(*goodput.reshape(self.batch, self.world.size, min(self.cap, result.preferred), self.min_k,
                                         self.max_batch))
        self.probe_report = {"cap": self.cap, "preferred": result.preferred, "m": self.m, "k": self.k,
                             "seconds": round(time.perf_counter() - started, 3),
                             "step_ms": {str(m): round(1000 * t, 2) for m, t in sorted(result.seconds.items())}}

    # ---- one optimizer step: the lr, then the hooks of each attempt (hvdtrain/step.py) ----

    def set_lr(self, schedule: LRSchedule, step: int) -> float:
        """Set the lr: the user's schedule at progress τ, times the factor of the current batch."""
        phi = self.noise.phi
        rule = "linear" if self.milestones else self.ac.lr_rule  # decay_to_batch: B/B0 undoes the decays
        self.lr_factor = goodput.lr_factor(rule, self.adam, phi, self.batch, self.base)
        m = schedule.multiplier(self.tau) * self.lr_factor
        for group in self.optimizer.param_groups:
            group["lr"] = group["initial_lr"] * m
        return float(self.optimizer.param_groups[0]["lr"])

    def attempt_begins(self) -> None:
        self.meter.begin_step(self.k)
        self._oom_here = False
        self.clock.attempt_begins()

    def micro_batch_begins(self, j: int) -> None:
        self.clock.micro_batch_begins()
        self.meter.next_micro_batch()
        self.injector.micro_batch_begins(self.m)

    def before_sync(self, reducer: Any, oom: bool) -> None:
        """Start the stats allreduce (hvdtrain/adaptive/stats.py) beside the gradient buckets; a rank
        that ran out of memory sends NaN in the buckets it has left. All ranks call. The wait itself
        is known only after, so the previous step's goes, with the rest of that step's time (data,
        optimizer step, bookkeeping), which a larger batch amortises and the step-time model must
        therefore see."""
        self._oom_here = oom
        compute = self.clock.sync_begins()
        # The previous attempt's stats are picked up now, not between the last bucket's launch and
        # this attempt's stats: Horovod fuses the two only if they reach it within one cycle.
        self.stats.collect()
        if oom:
            reducer.launch_rest(fill=math.nan)
        elif self.meter.flat:
            reducer.launch_rest()  # a bucket a parameter got no gradient in still holds this rank's gradient
        local = 0.0 if oom else self.meter.local_sum(self._grad_scale() / self.k)
        self.meter.active = False
        self._stats_handle = self.stats.start(local, compute, self.clock.sync, self.clock.rest)

    def after_sync(self, reducer: Any, finite: bool) -> Outcome:
        """Settle the stats (applied a step later, or now if the average is not finite)."""
        self.clock.sync_done()
        g2 = None
        if finite and self.meter.settled:
            g2 = reducer.averaged_sq() if self.sharded else self.meter.global_sq(reducer.flats())
            g2 /= self._grad_scale() ** 2
        self.stats.settle(self._stats_handle, finite, g2, self.m, self.k)
        return Outcome.STEPPED if finite else Outcome.SKIPPED

    def _grad_scale(self) -> float:
        """fp16's loss scale, by which every gradient the statistics see is multiplied (1 otherwise);
        it changes only after the step's verdict, so one value holds for a whole attempt."""
        return self.precision.scaler.scale if self.precision.scaler is not None else 1.0

    def retry_after_oom(self, step: int) -> list[Any]:
        """A smaller m and a larger k for the same samples (same B, so the same lr); this rank's new
        micro-batches. Every rank calls after the same RETRY."""
        m, k = shrink_after_oom(self.m, self.k, self.ac.oom_shrink)
        self.ooms, self.cap = self.ooms + 1, min(self.cap, m)
        self.set_shape(m, k)
        return self._fetch()

    # ---- after the step ----

    def after_step(self, step: int, log: TrainLog) -> None:
        """Advance τ, log, and on decision steps take rank 0's decision. All ranks must call, right
        after the sampler has counted the step's samples."""
        self._samples_before, self.samples = self.samples, self.samples + self.batch
        phi = self.noise.phi
        r = goodput.gain(phi, self.batch, self.base)
        self.tau += r if self.ac.lr_rule == "adascale" and not self.milestones else self.batch / self.base
        eff = r * self.base / self.batch
        values = {"m": self.m, "k": self.k, "B": self.batch, "lr_factor": self.lr_factor, "gain": r,
                  "gns": phi if math.isfinite(phi) else None, "efficiency": eff, "progress": self.tau,
                  "g2": self.noise.g2.value, "trace": self.noise.trace.value, "ooms": self.ooms}
        log.run.write(step, "adaptive", values)
        loss = f"{log.last['loss']:.4f}" if "loss" in log.last else "-"
        log.bar.set_postfix(loss=loss, B=self.batch, m=self.m, k=self.k, lr=f"x{self.lr_factor:.2f}",
                            gns=f"{phi:.0f}" if math.isfinite(phi) else "-")
        self.clock.step_done()
        if self.probe_report:
            p, self.probe_report = self.probe_report, None
            log.event(step, "probe", **p)
            log.bar.write(f"hvdtrain: memory probe: micro-batch cap {p['cap']}, fastest per sample from "
                          f"{p['preferred']}, starting at m={p['m']} k={p['k']} ({p['seconds']:.2f} s)")
        if self.milestones:
            self._follow_decays(step, log)
            return
        if self.pending.waiting:
            self._take_decision(step, log)
        if step >= self.ac.warmup_steps and step % self.ac.decide_every == 0:
            self._decide(step)

    def eval_due(self, step: int, every: int) -> bool:
        """For `train.eval_every` under a changing batch: True once per `every` x B0 samples, so
        evaluations keep the user's spacing in data seen whatever B is. Same on every rank."""
        period = every * self.base
        return self.samples // period > self._samples_before // period

    def _decide(self, step: int) -> None:
        """Rank 0 decides; the broadcast starts here and is taken after the next step. All ranks call."""
        lim = goodput.Limits(self.world.size, self.base, self.max_batch, self.cap, self.min_k,
                             self.ac.hysteresis, self.ac.max_growth, self.ac.norm_test)
        decision, cause = None, None
        if self.world.is_root:
            try:
                m, k = goodput.decide(lim, self.times, self.noise.phi, (self.m, self.k), self.sizes)
                decision = (m, k, self.noise.phi)
            except Exception as exc:  # noqa: BLE001 - every rank raises it together, when the broadcast is taken
                cause = exc  # raised here alone, it would leave the others waiting in the broadcast
        self.pending.start(step, decision, cause)

    def _take_decision(self, step: int, log: TrainLog) -> None:
        """Apply the last decision step's decision from this step boundary on, on every rank."""
        # An OOM in the step between may have lowered the cap under this m: the OOM backstop, which
        # every rank takes alike, shrinks it again if it fails, so no special case here.
        m, k, phi = self.pending.take()
        ratio = goodput.second_moment_ratio(phi, self.batch, self.world.size * m * k)
        # Before _change so its batch event can say whether Adam's state was rescaled (non-Adam: no).
        rescaled = self.ac.rescale_adam and optim.rescale_second_moment(self.inner, ratio)
        self._change(step, m, k, log, phi, f"noise scale {phi:.0f}", **({"adam_v_scale": ratio} if rescaled else {}))

    def _follow_decays(self, step: int, log: TrainLog) -> None:
        # τ grows by B/B0, the same integers on every rank, so all ranks pass a milestone at the same
        # step and take the same (m, k) without a collective.
        decays = optim.decays(self.milestones, self.tau)
        lim = goodput.Limits(self.world.size, self.base, self.max_batch, self.cap, self.min_k, 0.0, 1.0, 0.0)
        m, k = goodput.decayed_batch(lim, self.cfg.optim.gamma, decays)
        self._change(step, m, k, log, self.noise.phi, f"lr decay {decays} taken as batch growth")

    def _change(self, step: int, m: int, k: int, log: TrainLog, phi: float, why: str, **extra: float) -> None:
        """`phi`: the noise scale logged with it: rank 0's broadcast one for a goodput decision, the
        same on every rank; this rank's own under decay_to_batch (no collective; only logged)."""
        if (m, k) != (self.m, self.k):
            old = self.batch
            self.set_shape(m, k)
            self.decisions.append([step, m, k])
            log.event(step, "batch", old=old, new=self.batch, m=m, k=k, gns=phi, **extra)
            log.bar.write(f"hvdtrain: step {step}: global batch {old} -> {self.batch} (m={m}, k={k}, {why})")

    # ---- state ----

    def state_dict(self) -> dict[str, Any]:
        """All ranks call at the same step (it takes a decision still in flight)."""
        return {"pending_stats": self.stats.state_dict(), "pending_decision": self.pending.state_dict(),
                "m": self.m, "k": self.k, "cap": self.cap, "sizes": list(self.sizes), "tau": self.tau,
                "samples": self.samples, "probed": self.probed, "ooms": self.ooms,
                "decisions": [list(d) for d in self.decisions],
                "noise": self.noise.state_dict(), "times": self.times.state_dict(), "base": self.base,
                "max_batch": self.max_batch, "ranks": self.world.size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """In an elastic run (`adopt`), B0 and B_max stay the first world's. Whenever the saved world
        had another size (an elastic run's checkpoint, too) or the run is elastic, (m, k) are
        reshaped for this world and the memory probe runs again (its hosts may differ)."""
        new_world = self.adopt
        if new_world:
            self.base, self.max_batch = int(state["base"]), int(state["max_batch"])
            self.noise.rebase(self.base)
        if int(state["base"]) != self.base:
            raise ConfigError(f"the checkpoint's starting global batch is {state['base']}, this run's is {self.base}; "
                              "resume with the same ranks x train.batch_size x train.accumulation")
        self.cap, self.sizes, self.tau = int(state["cap"]), [int(s) for s in state["sizes"]], float(state["tau"])
        self.probed, self.ooms = bool(state["probed"]), int(state["ooms"])
        self.samples = self._samples_before = int(state.get("samples", 0))  # absent before 2026-12-03
        self.decisions = [[int(x) for x in d] for d in state["decisions"]]
        self.noise.load_state_dict(state["noise"])
        self.times.load_state_dict(state["times"])
        self.set_shape(int(state["m"]), int(state["k"]))
        self.stats.load_state_dict(state.get("pending_stats"))  # absent before 2026-12-05
        self.pending.load_state_dict(state.get("pending_decision"))  # absent before 2026-12-06
        if new_world or int(state.get("ranks", self.world.size)) != self.world.size:
            # A decision for the old world's shape is dropped: the batch is reshaped for this one.
            old = int(state["ranks"]) * self.m * self.k
            self.pending.drop()
            self.probed, self.cap = not self.ac.probe, self.ac.max_micro_batch or self.max_batch // self.world.size
            self.set_shape(*goodput.reshape(old, self.world.size, self.m, self.min_k, self.max_batch))
