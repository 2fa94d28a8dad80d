"""A bf16 ``megatron`` actor generates through the 3D-HybridEngine on 2 gloo ranks, at (tp=1, pp=2) with tp_g 1 and
2, and at (tp=1, pp=1, dp=2) with tp_g 1 (before the fix: a gloo size mismatch between the stages, fp32 norm weights
sent into bf16 buffers, and a float/bf16 matmul in the lean decoder).

Reference: greedy generation of the same checkpoint loaded by transformers in bf16 in one process. With tp_g = 1
every generation rank holds the whole model, bit-equal to the reference's weights, so tokens and rollout
logprobs are equal exactly. With tp_g = 2 the row-parallel partial sums are rounded to bf16 before the all-reduce,
so logits differ from the one-process model by bf16 rounding: the logprobs of the same tokens are compared within a
bf16 tolerance instead. The megatron engine's own bf16 forward of the reference's sequences (the training side's
view of them, ``rollout/logprob_diff`` of a run) agrees with the reference's logprobs within that tolerance too.
"""

from __future__ import annotations

import os

import pytest
import torch
import transformers
from omegaconf import OmegaConf

from helpers.generation import greedy_rollout, left_padded_prompts
from hybridflow.distributed.launch import spawn_ranks
from hybridflow.config.schema import OptimConfig
from hybridflow.training import EngineSpec, ParallelLayout, get_engine_class
from tests.helpers.models import tiny_model

V, P, R = 64, 6, 5  # vocab, prompt tokens, response tokens
CASES = ((2, 1), (2, 2), (1, 1))  # (pp, tp_g) on 2 ranks, tp = 1, dp = 2 / pp
# two bf16 ulps of a logit in [1, 2) (2 * 2**-7): one rounding step of a logit moves a logprob by at most about
# that; observed here: 2e-3
BF16_ATOL = 2 * 2**-7


def _reference(path: str):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    return greedy_rollout(model, R, V).generate_sequences(left_padded_prompts(P, V))


def _case(rank: int, path: str, pp: int, tp_g: int, reference) -> dict:
    from hybridflow.engine import HybridEngine

    model = OmegaConf.create({"path": path, "dtype": "bfloat16", "trust_remote_code": False,
                              "enable_gradient_checkpointing": False})
    engine = get_engine_class("megatron").build(EngineSpec(
        kind="policy", model=model, layout=ParallelLayout(dp=2 // pp, pp=pp), device="cpu",
        optim=OmegaConf.structured(OptimConfig), total_steps=1))
    hybrid = HybridEngine(engine, gen_tp=tp_g)
    module = hybrid.switch_to_generation()
    chunk = left_padded_prompts(P, V).chunk(hybrid.plan.gen.dp)[hybrid.gen_dp_rank]
    out = greedy_rollout(module, R, V).generate_sequences(chunk)
    hybrid.check_lockstep(out.batch["responses"])
    hybrid.switch_to_training()
    engine.set_train(False)
    with torch.no_grad():
        train_logprobs = engine.forward(reference)["log_probs"]
    return {"gen_dp": hybrid.gen_dp_rank, "dp_g": hybrid.plan.gen.dp, "responses": out.batch["responses"],
            "log_probs": out.batch["rollout_log_probs"], "train_log_probs": train_logprobs,
            "dtype": next(module.parameters()).dtype}


def _worker(rank: int, root: str) -> None:
    from megatron.core import parallel_state

    reference = torch.load(os.path.join(root, "reference.pt"), weights_only=False)
    results = {}
    for pp, tp_g in CASES:
        results[pp, tp_g] = _case(rank, os.path.join(root, "model"), pp, tp_g, reference)
        parallel_state.destroy_model_parallel()
    torch.save(results, os.path.join(root, f"res.{rank}"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    pytest.importorskip("megatron.core")
    root = str(tmp_path_factory.mktemp("megatron_bf16_gen"))
    path = os.path.join(root, "model")
    tiny_model(transformers.LlamaForCausalLM, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
               max_position_embeddings=64).save_pretrained(path)
    reference = _reference(path)
    torch.save(reference, os.path.join(root, "reference.pt"))
    spawn_ranks(_worker, root, world=2)
    return reference, [torch.load(os.path.join(root, f"res.{r}"), weights_only=False) for r in range(2)]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"pp{c[0]}-tpg{c[1]}")
def test_bf16_megatron_actor_generates_the_reference_tokens(case, runs) -> None:
    reference, per_rank = runs
    want_tokens, want_logp = reference.batch["responses"], reference.batch["rollout_log_probs"]
    valid = reference.batch["response_mask"].bool()
    assert want_tokens.ne(0).sum() > len(want_tokens)  # real tokens were generated
    for rank, res in enumerate(per_rank):
        got = res[case]
        assert got["dtype"] == torch.bfloat16, rank
        rows = torch.arange(len(want_tokens)).chunk(got["dp_g"])[got["gen_dp"]]
        if case[1] == 1:  # whole bf16 model on each rank: the reference's computation exactly
            assert torch.equal(got["responses"], want_tokens[rows]), rank
            assert torch.equal(got["log_probs"], want_logp[rows]), rank
        else:  # same tokens, logprobs within bf16 rounding of the tp all-reduce
            assert torch.equal(got["responses"], want_tokens[rows]), rank
            torch.testing.assert_close(got["log_probs"], want_logp[rows], rtol=0, atol=BF16_ATOL)
        diff = (got["train_log_probs"] - want_logp)[valid].abs().max()
        assert diff <= BF16_ATOL, (rank, float(diff))
