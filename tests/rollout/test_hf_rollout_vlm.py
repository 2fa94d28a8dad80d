"""The ``hf`` rollout on image prompts (tiny random Qwen2.5-VL): sampled responses' rollout logprobs equal the
trainer's recomputation (padded and packed forwards over the carried mrope positions) with the KV cache, several
micro-batches and n > 1; a changed vision-tower weight loaded into the rollout changes its logprobs exactly as
the trainer's; vision special tokens are never generated."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import torch

from hybridflow.algorithms.sampling import SamplingSpec, sampling_logits
from hybridflow.data.multimodal import collate_multimodal
from hybridflow.models import vlm
from hybridflow.protocol import DataProto
from hybridflow.rollout.hf_rollout import HFRollout
from hybridflow.rollout.vision import prompt_vision_keys, share_vision_columns
from hybridflow.training.micro import response_forward
from tests.helpers.vlm import random_image, tiny_vlm

R, TEMPERATURE = 6, 0.8


def _prompt_batch(processor):
    specs = [("Question: look <image> and <image> count\n", [(56, 56, 0), (60, 90, 1)]),
             ("Question: plain text only\n", []),
             ("Question: hi <image> ok\n", [(30, 40, 2)])]
    features = []
    for i, (text, images) in enumerate(specs):
        out = processor.process(text, [random_image(h, w, s) for h, w, s in images])
        features.append({"input_ids": torch.tensor(out.input_ids), "raw_prompt": text, "data_source": "d",
                         "ground_truth": "1", "extra_info": {}, "index": i,
                         vlm.INPUTS_KEY: {"pixel_values": out.pixel_values, "image_grid_thw": out.image_grid_thw},
                         vlm.DATA_KEY: {"image": out.images}})
    batch = collate_multimodal(features, processor.tokenizer.pad_token_id, processor.image_token_id, 2)
    keys = ["input_ids", "attention_mask", "position_ids"] + prompt_vision_keys(batch)
    prompts = share_vision_columns(batch.pop(batch_keys=keys), batch)  # as the PPO driver's pop_prompts
    prompts.meta_info["seed"] = 7
    return batch, prompts


def _generate(model, prompts, **overrides):
    config = SimpleNamespace(**{**dict(response_length=R, n=2, do_sample=True, temperature=TEMPERATURE, top_p=1.0,
                                       top_k=-1, micro_batch_size=2), **overrides})
    return HFRollout(model, config, eos_token_id=2, pad_token_id=0)


def _trainer_logprobs(model, batch, out, remove_padding):
    full = batch.repeat(2, interleave=True).union(out)
    with torch.no_grad():
        logits = response_forward(model, full, R, remove_padding)
    logits = sampling_logits(logits.float(), SamplingSpec(TEMPERATURE), keep=out.batch["responses"])
    lp = torch.log_softmax(logits, -1).gather(-1, out.batch["responses"][..., None])[..., 0]
    return lp * out.batch["response_mask"]


def test_rollout_logprobs_equal_trainer_recomputation_and_weight_sync():
    model, processor = tiny_vlm()
    batch, prompts = _prompt_batch(processor)
    rollout = _generate(model, prompts)
    out = rollout.generate_sequences(prompts)
    assert out.batch["responses"].shape == (6, R) and out.batch[vlm.MROPE_KEY].shape[:2] == (6, 3)
    banned = torch.tensor([processor.image_token_id, processor.tokenizer.convert_tokens_to_ids(vlm.VISION_START)])
    assert not torch.isin(out.batch["responses"], banned).any()
    rollout_lp = out.batch["rollout_log_probs"]
    for remove_padding in (False, True):
        diff = (_trainer_logprobs(model, batch, out, remove_padding) - rollout_lp).abs().max().item()
        print(f"rollout vs trainer logprobs, remove_padding={remove_padding}: max abs diff {diff:.2e}")
        assert diff <= 1e-4, (remove_padding, diff)

    # a vision-tower weight changed in the trainer reaches the rollout through load_weights (a separate copy)
    trainer = copy.deepcopy(model)
    rollout_model = copy.deepcopy(model)
    rollout = _generate(rollout_model, prompts)
    merger = [p for n, p in trainer.named_parameters() if n.startswith("model.visual.merger") and p.dim() == 2][-1]
    with torch.no_grad():
        merger.add_(torch.randn(merger.shape, generator=torch.Generator().manual_seed(0)))  # image embeddings change
    rollout.load_weights([(n, p.detach()) for n, p in trainer.named_parameters() if "visual" in n])
    synced = rollout.generate_sequences(prompts)
    before = _trainer_logprobs(model, batch, synced, False)
    after = _trainer_logprobs(trainer, batch, synced, False)
    image_rows = torch.tensor([0, 1, 4, 5])  # rows of prompts with images (n=2, adjacent)
    assert (before - after)[image_rows].abs().max() > 1e-3  # the change matters to image prompts ...
    assert torch.equal(before[2:4], after[2:4])  # (not to the text-only prompt)
    synced_diff = (synced.batch["rollout_log_probs"] - after).abs().max().item()
    print(f"after the vision-tower sync: rollout vs trainer {synced_diff:.2e}, "
          f"change {(before - after)[image_rows].abs().max().item():.2e}")
    assert synced_diff <= 1e-4  # ... and the rollout has it


def test_multi_turn_context_with_images_matches_trainer():
    """A later turn's context (prompt + a turn + a text observation, as MultiTurnLoop sends it) gets the prompt's
    images and positions continuing the prompt's mrope; the logprobs sampled from it equal the trainer's forward
    over the whole trajectory (the observation inside the response, mask 0)."""
    from hybridflow.rollout.multi_turn import _left_pad
    from hybridflow.rollout.vision import vision_rows, with_context_vision

    model, processor = tiny_vlm()
    batch, prompts = _prompt_batch(processor)
    rows = vision_rows(prompts, 1)
    mask = prompts.batch["attention_mask"].bool()
    earlier = [[40, 41, 42], [50], [60, 61]]  # a model turn + an observation per row (text tokens)
    contexts = [prompts.batch["input_ids"][i][mask[i]].tolist() + earlier[i] for i in range(3)]
    ctx = with_context_vision(_left_pad(contexts, 0, {"seed": 3, "n": 1}), rows)
    full_positions = (ctx.batch["attention_mask"].cumsum(-1) - 1).clamp(min=0)
    width = prompts.batch["input_ids"].shape[1]
    for i in range(3):  # the context's mrope == the trainer's extension of the prompt's over the same tokens
        n = len(contexts[i])
        text = torch.arange(n)[None, :]
        prompt_len = int(mask[i].sum())
        expected = vlm.extend_rope_positions(
            prompts.batch[vlm.MROPE_KEY][i:i + 1, :, width - prompt_len:], text[:, :prompt_len], text)
        assert torch.equal(ctx.batch[vlm.MROPE_KEY][i][:, -n:], expected[0])
        assert torch.equal(full_positions[i][-n:], text[0])
    out = _generate(model, ctx, n=1).generate_sequences(ctx)
    # the trainer's view: prompt, then response = the earlier turn + observation (mask 0) + this turn
    P = width
    responses = torch.zeros(3, len(max(earlier, key=len)) + R, dtype=torch.long)
    resp_mask = torch.zeros_like(responses)
    for i in range(3):
        k = len(earlier[i])
        turn = out.batch["responses"][i][out.batch["response_mask"][i].bool()]
        responses[i, :k], responses[i, k:k + len(turn)] = torch.tensor(earlier[i]), turn
        resp_mask[i, :k + len(turn)] = 1
    ids = torch.cat([prompts.batch["input_ids"], responses], 1)
    attn = torch.cat([prompts.batch["attention_mask"], resp_mask], 1)
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    full = batch.union(DataProto.from_dict(tensors={
        "input_ids": ids, "attention_mask": attn, "position_ids": pos, "responses": responses,
        vlm.MROPE_KEY: vlm.extend_rope_positions(prompts.batch[vlm.MROPE_KEY], pos[:, :P], pos)}))
    with torch.no_grad():
        logits = response_forward(model, full, responses.shape[1])
    logits = sampling_logits(logits.float(), SamplingSpec(TEMPERATURE), keep=responses)
    lp = torch.log_softmax(logits, -1).gather(-1, responses[..., None])[..., 0]
    worst = 0.0
    for i in range(3):
        k, m = len(earlier[i]), int(out.batch["response_mask"][i].sum())
        worst = max(worst, (lp[i, k:k + m] - out.batch["rollout_log_probs"][i, :m]).abs().max().item())
    print(f"multi-turn context: rollout vs trainer logprobs max abs diff {worst:.2e}")
    assert worst <= 1e-4, worst


def test_generation_under_the_trainer_s_autocast_matches_its_bf16_logprobs():
    """``model.dtype=auto`` picking bf16 compute on CPU: the trainer forwards its fp32 weights under bf16
    ``torch.autocast`` (the replicated fsdp2 engine), and the 3D-HybridEngine's generation model holds the same
    fp32 weights. Generating under :func:`generation_autocast` samples from the policy the trainer recomputes, up
    to bf16 rounding of a decode step against one forward; generating in fp32 does not: the gap is then the whole
    bf16-vs-fp32 difference of the forward. The shipped builtin:tiny-vlm (trained: confident logits, as in
    vlm_grpo_quickstart; measured 5.6e-4 packed / 0 padded against 2.0e-2)."""
    from hybridflow.engine.gen_precision import generation_autocast
    from hybridflow.models.builtin import resolve_model_path

    engine = SimpleNamespace(train_engine=SimpleNamespace(compute_dtype=torch.bfloat16), dtype=torch.float32,
                             device=torch.device("cpu"))
    path = resolve_model_path("builtin:tiny-vlm")
    model, processor = vlm.load_vision_model(path, torch.float32), vlm.ImageTextProcessor.from_pretrained(path)
    batch, prompts = _prompt_batch(processor)
    gaps = {}
    for matched in (True, False):
        with generation_autocast(engine) if matched else torch.autocast("cpu", enabled=False):
            out = _generate(model, prompts).generate_sequences(prompts)
        for remove_padding in (False, True):
            with torch.autocast("cpu", dtype=torch.bfloat16):  # FSDP2Engine.forward with autocast_dtype bf16
                trainer = _trainer_logprobs(model, batch, out, remove_padding)
            gaps[matched, remove_padding] = (trainer - out.batch["rollout_log_probs"]).abs().max().item()
    print(f"rollout vs bf16-autocast trainer logprobs (matched, remove_padding): {gaps}")
    for remove_padding in (False, True):  # within 2**-10 (a bf16 step of a logit near 1/8); fp32: 4x that at least
        assert gaps[True, remove_padding] <= 2**-10 and gaps[False, remove_padding] > 4 * 2**-10


def test_generation_autocast_only_where_the_trainer_computes_in_16_bit_over_other_weights():
    from hybridflow.engine.gen_precision import generation_autocast

    def engine(compute, weights):
        return SimpleNamespace(train_engine=SimpleNamespace(compute_dtype=compute), dtype=weights,
                               device=torch.device("cpu"))

    for case in (None, engine(torch.float32, torch.float32), engine(torch.bfloat16, torch.bfloat16),
                 engine(None, torch.float32)):
        with generation_autocast(case):
            assert not torch.is_autocast_enabled("cpu")
    with generation_autocast(engine(torch.bfloat16, torch.float32)):
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
