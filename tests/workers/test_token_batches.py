"""Token-budget micro-batches (hybridflow/training/token_batches.py): the plan by hand, and two gloo ranks that need
different numbers of micro-batches (rank 0 holds 1 sequence, rank 1 holds 7) run the same number of forwards and
backwards (no deadlock) and apply the gradient of the whole batch."""

import torch
from omegaconf import OmegaConf
from transformers import LlamaConfig, LlamaForCausalLM

from hybridflow.distributed.launch import spawn_ranks
from hybridflow.algorithms.sampling import SamplingSpec
from hybridflow.config.schema import ActorConfig
from hybridflow.distributed import apply_fsdp2, build_mesh, iter_full_state
from hybridflow.protocol import DataProto
from hybridflow.workers.ppo_actor import PPOActor
from hybridflow.training.token_batches import (balanced_groups, gather_in_order, local_micro_count,
                                              micro_batch_indices)

V, P, R = 32, 3, 5
LENGTHS = [1, 5, 3, 2, 4, 5, 1, 3]  # response lengths; a row costs P + length valid tokens


def test_balanced_groups_longest_first_to_the_lightest():
    # costs 7 5 4 3 1: 7 -> g0, 5 -> g1, 4 -> g1 (5 < 7), 3 -> g0 (7 < 9), 1 -> g1 (9 < 10)
    assert balanced_groups([4, 7, 1, 5, 3], 2) == [[1, 4], [0, 2, 3]]
    assert balanced_groups([2], 3) == [[0], [], []]


def test_local_micro_count_is_the_fewest_groups_within_budget():
    assert local_micro_count([4, 4, 4], 12) == 1
    assert local_micro_count([4, 4, 4], 8) == 2  # ceil(12 / 8) = 2: {4, 4} and {4}
    # ceil(23 / 9) = 3 groups: 8 | 6 | 5 + 4 = 9 fits
    assert local_micro_count([4, 8, 6, 5], 9) == 3
    # ceil(25 / 9) = 3 groups would be 8 | 7 | 6 + 4 = 10 > 9: 4 groups
    assert local_micro_count([7, 8, 4, 6], 9) == 4
    assert local_micro_count([20, 20], 5) == 2  # longer than the budget: one micro-batch each


def test_micro_batch_indices_without_budget_are_consecutive_chunks_and_order_is_restored():
    data = DataProto.from_dict(tensors={"attention_mask": torch.ones(5, 3, dtype=torch.long)})
    assert [i.tolist() for i in micro_batch_indices(data, 2, None)] == [[0, 1], [2, 3], [4]]
    indices = [torch.tensor([3, 0]), torch.tensor([], dtype=torch.long), torch.tensor([1, 2])]
    parts = [torch.tensor([[30.0], [0.0]]), torch.tensor([[99.0]]), torch.tensor([[10.0], [20.0]])]
    assert gather_in_order(parts, indices, 4).flatten().tolist() == [0.0, 10.0, 20.0, 30.0]


def _model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True))


def _batch() -> DataProto:
    g = torch.Generator().manual_seed(1)
    lengths = torch.tensor(LENGTHS)
    response_mask = (torch.arange(R)[None, :] < lengths[:, None]).long()
    input_ids = torch.randint(0, V, (len(LENGTHS), P + R), generator=g)
    return DataProto.from_dict(tensors={
        "input_ids": input_ids, "responses": input_ids[:, P:],
        "attention_mask": torch.cat([torch.ones(len(LENGTHS), P, dtype=torch.long), response_mask], dim=1),
        "position_ids": torch.arange(P + R).expand(len(LENGTHS), -1).clone(), "response_mask": response_mask,
        "old_log_probs": -torch.rand(len(LENGTHS), R, generator=g) * 4,
        "advantages": torch.randn(len(LENGTHS), R, generator=g),
    })


def _actor(model, budget: int | None) -> PPOActor:
    cfg = OmegaConf.structured(ActorConfig)
    cfg.grad_clip, cfg.ppo_micro_batch_size_per_gpu = 1e9, len(LENGTHS)
    cfg.use_dynamic_bsz, cfg.ppo_max_token_len_per_gpu = budget is not None, budget or 1
    return PPOActor(model, torch.optim.SGD(model.parameters(), lr=1.0), cfg, SamplingSpec())


def _update(actor: PPOActor, data: DataProto, budget: int | None) -> tuple[torch.Tensor, dict]:
    log_prob = actor.compute_log_prob(data, len(data), max_token_len=budget)[0]
    before = {k: v.clone() for k, v in iter_full_state(actor.module)}
    actor.update_policy(data, mini_batch_size=len(data))
    return log_prob, {k: before[k] - v for k, v in iter_full_state(actor.module)}


def _worker(rank: int, out: str) -> None:
    data = _batch()[:1] if rank == 0 else _batch()[1:]  # 1 and 7 sequences
    # budget 9: rank 0 needs 1 micro-batch, rank 1 (costs 8 6 5 7 8 4 6) needs 6; rank 0 runs 5 dummies
    counts = [len(micro_batch_indices(data, 8, 9)), int(sum(len(i) == 0 for i in micro_batch_indices(data, 8, 9)))]
    actor = _actor(apply_fsdp2(_model(), build_mesh(dp=2)), 9)
    log_prob, delta = _update(actor, data, 9)
    torch.save({"counts": counts, "log_prob": log_prob, "delta": delta}, f"{out}.{rank}")


def test_ranks_with_different_micro_batch_counts_complete_and_apply_the_batch_gradient(tmp_path):
    out = str(tmp_path / "res")
    spawn_ranks(_worker, out)
    res = [torch.load(f"{out}.{r}") for r in range(2)]
    assert local_micro_count([P + n for n in LENGTHS[1:]], 9) == 6 and local_micro_count([P + LENGTHS[0]], 9) == 1
    assert res[0]["counts"] == [6, 5] and res[1]["counts"] == [6, 0]
    # reference: one process, the whole batch in one micro-batch (the loss is normalised by the batch totals, so
    # the uneven 1 + 7 split over ranks applies the same gradient)
    ref_log_prob, ref_delta = _update(_actor(_model(), None), _batch(), None)
    mask = _batch().batch["response_mask"].bool()
    got = torch.cat([res[0]["log_prob"], res[1]["log_prob"]])
    torch.testing.assert_close(got[mask], ref_log_prob[mask], atol=1e-5, rtol=0)
    for name, d in ref_delta.items():
        torch.testing.assert_close(res[0]["delta"][name], d, atol=1e-6, rtol=0, msg=name)
    assert max(d.abs().max() for d in ref_delta.values()) > 1e-4
