"""The applied gradient of a PPO mini-batch does not depend on how it is split: not over micro-batches (of a fixed
size or of a token budget, ``use_dynamic_bsz``), not over data-parallel ranks (2 gloo ranks with FSDP2; with the
budget the two ranks' own plans need different micro-batch counts), for every loss aggregation mode, with and
without DAPO's overlong filtering; and the logged loss is the loss of the whole mini-batch.

Reference: one process, no FSDP, the whole mini-batch in one micro-batch. Optimizer: SGD with lr 1 and no
clipping, so the weight change IS the gradient (Adam would hide differences by normalising them). With overlong
filtering the reference is the unfiltered update of the batch without its truncated rows: filtering must take
them out of the numerator and of the token/sequence counts alike.
"""

import pytest
import torch
from omegaconf import OmegaConf
from transformers import LlamaForCausalLM

from hybridflow.distributed.launch import spawn_ranks
from helpers.models import tiny_model
from hybridflow.config.schema import ActorConfig
from hybridflow.distributed import apply_fsdp2, build_mesh, iter_full_state
from hybridflow.algorithms.sampling import SamplingSpec
from hybridflow.protocol import DataProto
from hybridflow.workers.ppo_actor import PPOActor

MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
B, P, R, V = 8, 3, 5, 32


def _model() -> LlamaForCausalLM:
    return tiny_model(seed=0, vocab_size=V, tie_word_embeddings=True)


# rows 1 and 5 fill all R slots; row 1 was cut by the length limit (truncated), row 5 ended with an eos there
TRUNCATED = torch.tensor([False, True, False, False, False, False, False, False])


def _batch() -> DataProto:
    g = torch.Generator().manual_seed(1)
    lengths = torch.tensor([1, 5, 3, 2, 4, 5, 1, 3])  # different valid lengths per row
    response_mask = (torch.arange(R)[None, :] < lengths[:, None]).long()
    input_ids = torch.randint(0, V, (B, P + R), generator=g)
    attention_mask = torch.cat([torch.ones(B, P, dtype=torch.long), response_mask], dim=1)
    return DataProto.from_dict(tensors={
        "input_ids": input_ids, "responses": input_ids[:, P:], "attention_mask": attention_mask,
        "position_ids": torch.arange(P + R).expand(B, -1).clone(), "response_mask": response_mask,
        # old logprobs shifted away from the current ones so some tokens are clipped
        "old_log_probs": -torch.rand(B, R, generator=g) * 4, "advantages": torch.randn(B, R, generator=g),
        "truncated": TRUNCATED.clone(),
    })


def _config(mode: str, micro: int, overlong_filter: bool = False, entropy_coeff: float = 0.01,
            budget: int | None = None):
    cfg = OmegaConf.structured(ActorConfig)
    cfg.use_dynamic_bsz, cfg.ppo_max_token_len_per_gpu = budget is not None, budget or 1
    cfg.loss_agg_mode, cfg.ppo_micro_batch_size_per_gpu, cfg.grad_clip = mode, micro, 1e9
    cfg.entropy_coeff = entropy_coeff  # the entropy term is aggregated with the same normalisers
    cfg.overlong_filter = overlong_filter
    return cfg


def _actor(model, cfg) -> PPOActor:
    return PPOActor(model, torch.optim.SGD(model.parameters(), lr=1.0), cfg, SamplingSpec())


def _delta(actor: PPOActor, data: DataProto, mini: int) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """(weight change, logged metrics) of one update_policy call."""
    before = {k: v.clone() for k, v in iter_full_state(actor.module)}
    metrics = actor.update_policy(data, mini_batch_size=mini)
    return {k: before[k] - v for k, v in iter_full_state(actor.module)}, metrics


def _reference(mode: str, overlong_filter: bool) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    data = _batch()[~TRUNCATED] if overlong_filter else _batch()  # filtering == the truncated rows were never there
    return _delta(_actor(_model(), _config(mode, B)), data, len(data))


def _per_token_loss_one(actor: PPOActor, data: DataProto, all_truncated: bool) -> DataProto:
    """``data`` with advantages -1 and old logprobs = the actor's own: every token's clipped loss is ratio 1."""
    data.batch["advantages"] = -torch.ones(len(data), R)
    data.batch["old_log_probs"] = actor.compute_log_prob(data, micro_batch_size=len(data))[0]
    if all_truncated:
        data.batch["truncated"] = torch.ones(len(data), dtype=torch.bool)
    return data


MICROS = (1, 4)
FILTERS = (False, True)
# token budget: rank 0's rows cost 4 8 6 5 tokens (3 micro-batches of <= 9), rank 1's 7 8 4 6 (4): both run 4
BUDGET = 9


def _worker(rank: int, out: str) -> None:
    mesh = build_mesh(dp=2)
    deltas = {}
    for mode in MODES:
        for micro in MICROS:
            for filt in FILTERS:
                actor = _actor(apply_fsdp2(_model(), mesh), _config(mode, micro, filt))
                deltas[mode, micro, filt] = _delta(actor, _batch().chunk(2)[rank], B // 2)
        for filt in FILTERS:
            actor = _actor(apply_fsdp2(_model(), mesh), _config(mode, B, filt, budget=BUDGET))
            deltas[mode, "budget", filt] = _delta(actor, _batch().chunk(2)[rank], B // 2)
        for micro in MICROS:  # fsdp_config.reshard_after_forward=false: gathered weights kept to the backward
            actor = _actor(apply_fsdp2(_model(), mesh, reshard_after_forward=False), _config(mode, micro))
            deltas[mode, micro, "kept_gathered"] = _delta(actor, _batch().chunk(2)[rank], B // 2)
    for all_truncated in (False, True):  # per-token loss 1, token-mean, overlong filter on
        actor = _actor(apply_fsdp2(_model(), mesh), _config("token-mean", 1, True, entropy_coeff=0.0))
        data = _per_token_loss_one(actor, _batch().chunk(2)[rank], all_truncated)
        deltas["ones", all_truncated] = _delta(actor, data, B // 2)
    if rank == 0:
        torch.save(deltas, out)


@pytest.fixture(scope="module")
def dp_deltas(tmp_path_factory):
    """Weight changes from 2 gloo ranks (FSDP2), for every mode and micro-batch size, in one spawn."""
    out = str(tmp_path_factory.mktemp("dp") / "deltas.pt")
    spawn_ranks(_worker, out)
    return torch.load(out)


@pytest.mark.parametrize("overlong_filter", FILTERS, ids=["all_rows", "overlong_filtered"])
@pytest.mark.parametrize("mode", MODES)
def test_gradient_and_logged_loss_independent_of_micro_and_dp_split(mode, overlong_filter, dp_deltas):
    ref, ref_metrics = _reference(mode, overlong_filter)
    micro_split, metrics = _delta(_actor(_model(), _config(mode, 3, overlong_filter)), _batch(), B)  # 3, 3, 2
    for name in ref:
        torch.testing.assert_close(micro_split[name], ref[name], atol=1e-6, rtol=0)
    assert max(v.abs().max() for v in ref.values()) > 1e-4  # the test is not vacuous
    assert metrics["actor/pg_loss"] == pytest.approx(ref_metrics["actor/pg_loss"], abs=1e-6)
    budget_actor = _actor(_model(), _config(mode, B, overlong_filter, budget=BUDGET))
    budget_split, budget_metrics = _delta(budget_actor, _batch(), B)
    for name in ref:
        torch.testing.assert_close(budget_split[name], ref[name], atol=1e-6, rtol=0)
    assert budget_metrics["actor/pg_loss"] == pytest.approx(ref_metrics["actor/pg_loss"], abs=1e-6)
    for micro in (*MICROS, "budget"):
        dist_delta, dist_metrics = dp_deltas[mode, micro, overlong_filter]
        for name in ref:
            torch.testing.assert_close(dist_delta[name], ref[name], atol=1e-6, rtol=0, msg=f"{mode} micro={micro} {name}")
        # the logged loss is the whole mini-batch's, not a per-rank or per-micro-batch one
        assert dist_metrics["actor/pg_loss"] == pytest.approx(ref_metrics["actor/pg_loss"], abs=1e-6)


@pytest.mark.parametrize("mode", MODES)
def test_gradient_unchanged_when_fsdp_keeps_gathered_weights_to_the_backward(mode, dp_deltas):
    ref, ref_metrics = _reference(mode, False)
    for micro in MICROS:
        delta, metrics = dp_deltas[mode, micro, "kept_gathered"]
        for name in ref:
            torch.testing.assert_close(delta[name], ref[name], atol=1e-6, rtol=0, msg=f"{mode} micro={micro} {name}")
        assert metrics["actor/pg_loss"] == pytest.approx(ref_metrics["actor/pg_loss"], abs=1e-6)


def test_filtering_changes_the_update():
    # sanity check that the filtered runs above are not the unfiltered ones: row 1 has 5 of the 24 tokens
    full, _ = _reference("token-mean", False)
    filtered, _ = _reference("token-mean", True)
    assert max((full[k] - filtered[k]).abs().max() for k in full) > 1e-4


@pytest.mark.parametrize("micro", [1, 3, B])
def test_overlong_filtered_per_token_loss_one_by_hand(micro, dp_deltas):
    # every token's loss is 1 (ratio 1, advantage -1): the token-mean over the kept tokens is 1.0 whatever the
    # split; with every response truncated the loss is 0 and the gradient exactly 0 (weights unchanged, no NaN)
    for all_truncated in (False, True):
        actor = _actor(_model(), _config("token-mean", micro, True, entropy_coeff=0.0))
        delta, metrics = _delta(actor, _per_token_loss_one(actor, _batch(), all_truncated), B)
        dist_delta, dist_metrics = dp_deltas["ones", all_truncated]
        expected = 0.0 if all_truncated else 1.0
        for m in (metrics, dist_metrics):
            assert m["actor/pg_loss"] == pytest.approx(expected, abs=1e-5)
        if all_truncated:
            for d in (delta, dist_delta):
                assert all(torch.equal(v, torch.zeros_like(v)) for v in d.values())
            assert metrics["actor/grad_norm"] == 0.0 and dist_metrics["actor/grad_norm"] == 0.0
            assert metrics["actor/skipped_steps"] == 0.0
