"""Metrics crossing dp ranks are pooled by kind: on 2 gloo ranks with unequal token counts and the extremes on
different ranks, an update's mean / max / min / std / sum metrics are those of all the samples of both ranks
(computed here from the gathered samples), on every rank -- not the average of the ranks' values. Once through
``update_mini_batches`` with a model-free engine (every kind, several mini- and micro-batches), once through the
PPO actor's importance-weight metrics (``actor/is_weight_max`` ...)."""

import os

import pytest
import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from helpers.models import tiny_model
from hybridflow.algorithms.sampling import SamplingSpec
from hybridflow.config.schema import ActorConfig
from hybridflow.distributed.launch import spawn_ranks
from hybridflow.protocol import DataProto
from hybridflow.training import EngineSpec, ParallelLayout, update_mini_batches
from hybridflow.training.micro import global_agg_kwargs
from hybridflow.training.update import loss_metric
from hybridflow.utils.metrics import Max, Mean, Min, Std, accumulate
from hybridflow.workers.ppo_actor import PPOActor

P, R, V = 2, 4, 32
LENGTHS = {0: [3, 1, 2, 1], 1: [4, 4, 3, 4]}  # 7 valid response tokens on rank 0, 15 on rank 1
GRAD_NORMS = [1.0, 3.0]  # what the engine reports for the two mini-batches


def _data(rank: int) -> DataProto:
    g = torch.Generator().manual_seed(10 + rank)
    lengths = torch.tensor(LENGTHS[rank])
    mask = (torch.arange(R)[None, :] < lengths[:, None]).long()
    ids = torch.randint(0, V, (len(lengths), P + R), generator=g)
    x = torch.randn(len(lengths), R, generator=g)
    x[0, 0] = 50.0 if rank == 0 else x[0, 0]  # the largest sample on rank 0, the smallest on rank 1
    x[1, 1] = -50.0 if rank == 1 else x[1, 1]
    return DataProto.from_dict(tensors={
        "input_ids": ids, "responses": ids[:, P:], "position_ids": torch.arange(P + R).expand(len(lengths), -1),
        "attention_mask": torch.cat([torch.ones(len(lengths), P, dtype=torch.long), mask], 1),
        "response_mask": mask, "x": x, "advantages": torch.randn(len(lengths), R, generator=g)})


class _ModelFreeEngine:
    """What ``update_mini_batches`` calls on an engine, without a model: each loss sees empty outputs."""

    spec = EngineSpec(kind="value", model=None, layout=ParallelLayout(dp=2), device="cpu")
    skipped_steps = 0

    def __init__(self):
        self.steps = 0

    def set_train(self, mode):
        pass

    def zero_grad(self):
        pass

    def forward_backward_micro_batches(self, micros, fns, **kwargs):
        return [fn({}) for fn in fns]

    def optimizer_step(self):
        self.steps += 1
        return GRAD_NORMS[self.steps - 1], False


def _probe_loss(micro, outputs, agg, stats):
    x, mask = micro.batch["x"], micro.batch["response_mask"]
    valid = x[mask.bool()]
    for key, metric in (("mean", Mean.of(valid)), ("max", Max.of(valid)), ("min", Min.of(valid)),
                        ("std", Std.of(valid))):
        accumulate(stats, f"probe/x_{key}", metric)
    loss = (x * mask).sum() / agg["num_tokens"]  # token-mean aggregation of x
    accumulate(stats, "probe/loss", loss_metric(loss, agg, float(mask.sum())))
    return loss


def _gathered(values: torch.Tensor) -> torch.Tensor:
    out = [None, None]
    dist.all_gather_object(out, values)
    return torch.cat(out)


def _rank(rank: int, out: str) -> None:
    data = _data(rank)
    metrics = update_mini_batches(_ModelFreeEngine(), data, _probe_loss, lambda mini: global_agg_kwargs(mini, R),
                                  mini_batch_size=2, micro_batch_size=1, epochs=1, shuffle=False, seed=0,
                                  prefix="probe")
    x = _gathered(data.batch["x"][data.batch["response_mask"].bool()]).double()
    valid_tokens = int(_gathered(data.batch["attention_mask"].flatten()).sum())
    # the actor: pi_theta / mu with mu the current policy shifted per token, extremes on different ranks
    torch.manual_seed(0)
    cfg = OmegaConf.structured(ActorConfig)
    cfg.ppo_micro_batch_size_per_gpu = 1
    model = tiny_model(seed=0, vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=1)
    actor = PPOActor(model, torch.optim.SGD(model.parameters(), lr=0.0), cfg, SamplingSpec())
    log_prob = actor.compute_log_prob(data, micro_batch_size=len(data))[0]
    shift = torch.linspace(-0.5, 0.5, R * len(data)).view(len(data), R)
    shift[0, 0] = 2.0 if rank == 0 else shift[0, 0]
    shift[1, 0] = -2.0 if rank == 1 else shift[1, 0]
    data.batch["old_log_probs"], data.batch["rollout_log_probs"] = log_prob, log_prob - shift
    actor_metrics = actor.update_policy(data, mini_batch_size=len(data))
    w = _gathered(shift.exp()[data.batch["response_mask"].bool()]).double()
    torch.save({"metrics": metrics, "x": x, "valid_tokens": valid_tokens, "actor": actor_metrics, "w": w},
               os.path.join(out, f"rank{rank}.pt"))


@pytest.fixture(scope="module")
def per_rank(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("pool"))
    spawn_ranks(_rank, out)
    return [torch.load(os.path.join(out, f"rank{r}.pt")) for r in range(2)]


def test_update_metrics_are_the_statistics_of_both_ranks_samples(per_rank):
    x = per_rank[0]["x"]
    assert len(x) == 22 and x.max() == 50.0 and x.min() == -50.0
    expected = {"probe/x_mean": x.mean().item(), "probe/x_max": 50.0, "probe/x_min": -50.0,
                "probe/x_std": x.std(unbiased=False).item(), "probe/loss": x.mean().item(),
                "probe/grad_norm": sum(GRAD_NORMS) / 2, "probe/skipped_steps": 0.0,
                "perf/probe_valid_tokens": per_rank[0]["valid_tokens"]}
    for rank in range(2):  # the same pooled values on every rank
        got = per_rank[rank]["metrics"]
        assert {k: got[k] for k in expected} == pytest.approx(expected, rel=1e-5, abs=1e-9)  # x is fp32


def test_actor_importance_weight_extremes_are_the_extremes_over_both_ranks(per_rank):
    w = per_rank[0]["w"]
    assert w.max() == pytest.approx(torch.tensor(2.0).exp().item())  # rank 0's token
    assert w.min() == pytest.approx(torch.tensor(-2.0).exp().item())  # rank 1's token
    expected = {"actor/is_weight_max": w.max().item(), "actor/is_weight_min": w.min().item(),
                "actor/is_weight_mean": w.mean().item()}
    for rank in range(2):
        got = per_rank[rank]["actor"]
        assert {k: got[k] for k in expected} == pytest.approx(expected, rel=1e-4)
