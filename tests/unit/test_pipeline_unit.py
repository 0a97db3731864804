"""Pipeline pieces that need no ranks: the schedules, the cut, the layout and the config checks."""

import pytest
import torch
from torch import nn

from hvdtrain.config import Config, ModelConfig, ParallelConfig, from_dict
from hvdtrain.errors import ConfigError
from hvdtrain.parallel.layout import Layout
from hvdtrain.parallel.partition import Stage, boundaries, layer_times, pipeline_layers, shared_parameters, split
from hvdtrain.parallel.schedule import actions, peak_in_flight
from hvdtrain.tasks.models import GPT


@pytest.mark.parametrize("stages, m", [(2, 1), (2, 4), (4, 8), (4, 2), (3, 5)])
def test_1f1b_keeps_at_most_s_minus_stage_micro_batches_alive(stages, m):
    for s in range(stages):
        order = actions("1f1b", s, stages, m)
        assert sorted(order) == sorted([("F", j) for j in range(m)] + [("B", j) for j in range(m)])
        assert [j for k, j in order if k == "B"] == list(range(m))  # the last backward is the last action
        assert all(order.index(("F", j)) < order.index(("B", j)) for j in range(m))
        assert peak_in_flight(order) == min(stages - s, m)
        assert peak_in_flight(actions("gpipe", s, stages, m)) == m


def simulate(kind, stages, m):
    """Run every stage's order with blocking receives and non-blocking sends; False on a deadlock."""
    orders = [actions(kind, s, stages, m) for s in range(stages)]
    done, pos = set(), [0] * stages
    progressed = True
    while progressed:
        progressed = False
        for s in range(stages):
            if pos[s] == len(orders[s]):
                continue
            kind_, j = orders[s][pos[s]]
            needs = (s - 1, "F", j) if kind_ == "F" and s > 0 else (s + 1, "B", j) if kind_ == "B" and s < stages - 1 \
                else None
            if needs is None or needs in done:
                done.add((s, kind_, j))
                pos[s] += 1
                progressed = True
    return all(p == len(o) for p, o in zip(pos, orders))


@pytest.mark.parametrize("kind", ["1f1b", "gpipe"])
@pytest.mark.parametrize("stages, m", [(2, 1), (2, 8), (4, 3), (4, 8)])
def test_schedules_never_deadlock(kind, stages, m):
    assert simulate(kind, stages, m)


def test_split_minimises_the_largest_stage():
    assert split([1, 1, 1, 1], 2) == [0, 2, 4]
    assert split([10, 1, 1, 1, 1, 10], 2) == [0, 3, 6]
    assert split([5, 1, 1, 1, 1, 1, 1, 1], 2) == [0, 2, 8]
    with pytest.raises(ConfigError, match="exceeds the model's 2 layers"):
        split([1, 1], 3)


def test_gpt_cuts_into_stages_that_compose_to_its_forward():
    torch.manual_seed(0)
    gpt = GPT(ModelConfig(block_size=8, n_layer=4, n_head=2, n_embd=16))
    layers = pipeline_layers(gpt)
    bounds = boundaries(layers, 3, "params")
    assert bounds[0] == 0 and bounds[-1] == len(layers) == 6
    x = torch.randint(0, 256, (2, 8))
    out = x
    for s in range(3):
        out = Stage(layers[bounds[s]:bounds[s + 1]], bounds[s])(out)
    torch.testing.assert_close(out, gpt(x))
    # The tied embedding is held by the first and the last stage only.
    assert list(shared_parameters(layers, bounds).values()) == [{0, 2}]
    assert boundaries(layers, 2, "1,5") == [0, 1, 6]


class Leaky(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.scale = nn.Linear(2, 2), nn.Linear(2, 2), nn.Parameter(torch.ones(2))

    def pipeline_layers(self):
        return [self.a, self.b]  # forgets `scale`


def test_a_model_that_cannot_be_cut_is_named():
    with pytest.raises(ConfigError, match="cannot cut a Linear"):
        pipeline_layers(nn.Linear(2, 2))
    with pytest.raises(ConfigError, match="parameter scale of Leaky is in none of its pipeline layers"):
        pipeline_layers(Leaky())


def test_layout_and_its_errors():
    layout = Layout.of(2, 6)
    assert (layout.stages, layout.replicas) == (2, 3)
    assert layout.stage_ranks(1) == [1, 3, 5] and layout.ends() == list(range(6))
    assert Layout.of(4, 8).ends() == [0, 3, 4, 7]
    with pytest.raises(ConfigError, match="pipeline_stages=4 does not divide the 6 ranks"):
        Layout.of(4, 6)


@pytest.mark.parametrize("raw, message", [
    ({"parallel": {"schedule": "zb"}}, "parallel.schedule='zb' is not allowed; choose one of 1f1b, gpipe"),
    ({"parallel": {"pipeline_stages": 2, "balance": "3"}}, "parallel.balance='3' is not allowed"),
    ({"parallel": {"pipeline_stages": 2}}, "train.on_oom=retry cannot be combined with parallel.pipeline_stages=2"),
    ({"parallel": {"pipeline_stages": 2}, "train": {"on_oom": "stop"}, "memory": {"zero_stage": 1}},
     "memory.zero_stage cannot be combined"),
    ({"parallel": {"pipeline_stages": 2}, "train": {"on_oom": "stop"}, "elastic": {"enabled": True}},
     "elastic.enabled cannot be combined"),
])
def test_pipeline_config_refusals_name_the_field(raw, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        from_dict(Config, raw)


def test_pipeline_config_accepts_a_layer_list_and_time():
    assert ParallelConfig(pipeline_stages=2, balance="3,5").balance == "3,5"
    assert ParallelConfig(pipeline_stages=2, balance="time").balance == "time"


class Slow(nn.Module):
    def forward(self, x):
        import time

        time.sleep(0.02)
        return x * 1.0


def test_balance_by_time_gives_a_slow_layer_a_stage_of_its_own():
    torch.manual_seed(0)
    layers = [nn.Linear(8, 8), Slow(), nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)]
    times = layer_times(layers, torch.randn(4, 8))
    assert max(times) == times[1] >= 0.02
    assert all(p.grad is None for layer in layers for p in layer.parameters())
    assert boundaries(layers, 2, "time", times) in ([0, 1, 5], [0, 2, 5])
    assert boundaries(layers, 3, "time", times)[1:3] in ([1, 2], [2, 3])
