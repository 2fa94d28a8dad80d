"""Replicated data parallelism (``fsdp_config.fsdp_size=1``): the ``auto`` size rule, explicit values and their
errors, the config-load check, and the gradient average on 2 gloo ranks against values worked out by hand."""

import os

import pytest
import torch

from hybridflow.distributed.launch import spawn_ranks
from hybridflow.config import load_config
from hybridflow.config.loader import ConfigError
from hybridflow.distributed import fsdp, replicate
from hybridflow.distributed.fsdp import UNSHARDED_MEMORY_SHARE
from hybridflow.distributed.replicate import TRAINED_STATE_COPIES, GradientBuckets, resolve_fsdp_size


def _model(n_params: int) -> torch.nn.Module:
    return torch.nn.Linear(n_params, 1, bias=False)  # n_params fp32 weights = 4 * n_params bytes


def _resolve(setting, model, **kw):
    args = {"trained": True, "param_offload": False, "lora": False, "tp": 1, "dp": 2, **kw}
    return resolve_fsdp_size(setting, model, "cpu", **args)


def test_auto_replicates_only_a_model_whose_training_state_fits_the_share(monkeypatch):
    memory = 16 * 4 * 4000  # the share is 16000 bytes: 4000 fp32 values
    monkeypatch.setattr(fsdp, "rank_memory_bytes", lambda device: memory)
    assert UNSHARDED_MEMORY_SHARE * memory == 16000 and TRAINED_STATE_COPIES == 4
    assert _resolve("auto", _model(1000)) is True  # weights, grads, 2 moments = exactly the share
    assert _resolve("auto", _model(1001)) is False
    # a frozen model (reference) keeps only its weights: 4x larger still fits
    assert _resolve("auto", _model(4000), trained=False) is True
    assert _resolve("auto", _model(4001), trained=False) is False


@pytest.mark.parametrize("ask", [{"param_offload": True}, {"lora": True}, {"tp": 2}])
def test_auto_shards_when_something_asks_for_sharding(ask):
    assert _resolve("auto", _model(8), **ask) is False


@pytest.mark.parametrize("setting, expected", [(1, True), ("1", True), (-1, False), ("-1", False), (2, False)])
def test_explicit_values_win_whatever_the_size(setting, expected):
    assert _resolve(setting, _model(8)) is expected  # 2 = dp: shard over every rank, the same as -1


def test_bad_values_name_the_key():
    with pytest.raises(ValueError, match="fsdp_size must be auto, -1 .* got 3 .hybrid sharding"):
        _resolve(3, _model(8), dp=4)
    with pytest.raises(ValueError, match="fsdp_size=1 .replicated. is not supported with tensor parallelism"):
        _resolve(1, _model(8), tp=2)


def test_config_load_refuses_hybrid_sharding_and_replicated_tp():
    with pytest.raises(ConfigError,
                       match=r"critic.fsdp_config.fsdp_size must be auto, -1 .* got '?4'? .sharding over groups"):
        load_config("quickstart", ["critic.fsdp_config.fsdp_size=4"])
    with pytest.raises(ConfigError, match="fsdp_size=1 .replicated. is not supported with "
                                          "actor_rollout_ref.actor.tensor_model_parallel_size=2"):
        load_config("quickstart", ["actor_rollout_ref.actor.fsdp_config.fsdp_size=1",
                                   "actor_rollout_ref.actor.tensor_model_parallel_size=2"])
    assert load_config("quickstart", []).critic.fsdp_config.fsdp_size == "auto"


def _average(rank: int, out: str) -> None:
    a = torch.nn.Parameter(torch.zeros(2, 3))
    b = torch.nn.Parameter(torch.zeros(5))
    c = torch.nn.Parameter(torch.zeros(4))  # only rank 1 has a gradient for it
    frozen = torch.nn.Parameter(torch.zeros(3), requires_grad=False)
    a.grad = torch.full((2, 3), float(rank + 1))  # 1 and 2 -> 1.5
    b.grad = torch.arange(5.0) * (1 if rank == 0 else 3)  # k and 3k -> 2k
    if rank == 1:
        c.grad = torch.full((4,), 8.0)  # 0 and 8 -> 4
    replicate.BUCKET_BYTES = 24  # several buckets: a alone, then b, then c
    grads = GradientBuckets([a, b, c, frozen])  # keeps the gradients already there
    assert len(grads.buffers) == 3 and a.grad.data_ptr() == grads.buffers[0].data_ptr()
    grads.all_reduce()
    first = {"a": a.grad.clone(), "b": b.grad.clone(), "c": c.grad.clone(), "frozen": frozen.grad}
    # a second mini-batch: zeroed in place, backward accumulates into the same buffers, averaged again
    grads.zero()
    (a * (rank + 1.0)).sum().backward()  # d/da = rank + 1: 1 and 2 -> 1.5
    b.grad = torch.full((5,), 4.0 * rank)  # replaced (not accumulated): copied into the buffer -> 2
    grads.all_reduce()
    second = {"a": a.grad, "b": b.grad, "c": c.grad, "views": a.grad.data_ptr() == grads.buffers[0].data_ptr()}
    torch.save({"first": first, "second": second}, os.path.join(out, f"r{rank}.pt"))


def test_gradients_are_averaged_over_the_ranks(tmp_path):
    spawn_ranks(_average, str(tmp_path))
    for rank in (0, 1):
        saved = torch.load(tmp_path / f"r{rank}.pt")
        got = saved["first"]
        torch.testing.assert_close(got["a"], torch.full((2, 3), 1.5), rtol=0, atol=0)
        torch.testing.assert_close(got["b"], torch.arange(5.0) * 2, rtol=0, atol=0)
        torch.testing.assert_close(got["c"], torch.full((4,), 4.0), rtol=0, atol=0)
        assert got["frozen"] is None
        got = saved["second"]
        torch.testing.assert_close(got["a"], torch.full((2, 3), 1.5), rtol=0, atol=0)
        torch.testing.assert_close(got["b"], torch.full((5,), 2.0), rtol=0, atol=0)
        torch.testing.assert_close(got["c"], torch.zeros(4), rtol=0, atol=0)  # zeroed, no gradient on either rank
        assert got["views"]  # backward accumulated into the buffer: .grad is still its view
