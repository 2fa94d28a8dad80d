"""Training forwards of a vision-language model (tiny random Qwen2.5-VL): the carried mrope positions make the
padded (left-padded) and the packed (``use_remove_padding``) response logprobs equal each row's own unpadded
forward with the model computing its positions; an image-less rank on 2 gloo ranks (FSDP2) does not hang and the
gradients equal one process's; the vision tower can be frozen; a VLM critic has a scalar head."""

from __future__ import annotations

import os

import numpy as np
import torch
from omegaconf import OmegaConf

from hybridflow.config.schema import OptimConfig
from hybridflow.distributed.launch import spawn_ranks
from hybridflow.models import vlm
from hybridflow.protocol import DataProto
from hybridflow.training import EngineSpec, ParallelLayout, get_engine_class
from hybridflow.training.micro import response_forward
from tests.helpers.vlm import random_image, save_tiny_vlm, tiny_vlm

R = 5


def _batch(processor, prompts, seed: int = 0):
    """A left-padded rollout-like batch over ``prompts`` [(text, images)] with random responses of lengths 5, 3,
    4, ...; returns (DataProto, [(prompt ids, response ids, Processed)])."""
    rows = [processor.process(text, images) for text, images in prompts]
    g = torch.Generator().manual_seed(seed)
    resp = [torch.randint(3, 400, ((5, 3, 4)[i % 3],), generator=g) for i in range(len(rows))]
    P, B = max(len(x.input_ids) for x in rows), len(rows)
    ids = torch.zeros(B, P + R, dtype=torch.long)
    mask = torch.zeros(B, P + R, dtype=torch.long)
    responses = torch.zeros(B, R, dtype=torch.long)
    for i, (x, r) in enumerate(zip(rows, resp)):
        n = len(x.input_ids)
        ids[i, P - n:P], mask[i, P - n:P] = torch.tensor(x.input_ids), 1
        ids[i, P:P + len(r)], mask[i, P:P + len(r)], responses[i, :len(r)] = r, 1, r
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    grid = torch.cat([x.image_grid_thw for x in rows])
    mrope = vlm.extend_rope_positions(vlm.rope_positions(ids[:, :P], mask[:, :P], grid, processor.image_token_id, 2),
                                      pos[:, :P], pos)
    inputs = np.empty(B, dtype=object)
    inputs[:] = [{"pixel_values": x.pixel_values, "image_grid_thw": x.image_grid_thw} for x in rows]
    data = DataProto.from_dict(tensors={"input_ids": ids, "attention_mask": mask, "position_ids": pos,
                                        "responses": responses, "response_mask": (responses != 0).long(),
                                        vlm.MROPE_KEY: mrope}, non_tensors={vlm.INPUTS_KEY: inputs})
    return data, list(zip(rows, resp))


PROMPTS = [("Question: look <image> and <image> count\n", [(56, 56, 0), (60, 90, 1)]),
           ("Question: hi <image> ok\n", [(30, 40, 2)]),
           ("Question: plain text\n", [])]


def _prompts(spec=PROMPTS):
    return [(text, [random_image(h, w, s) for h, w, s in images]) for text, images in spec]


def _reference_logprobs(model, processor, rows):
    """Each row alone, unpadded; the model computes its own mrope positions (from ``mm_token_type_ids``)."""
    out = []
    for x, r in rows:
        seq = torch.cat([torch.tensor(x.input_ids), r])[None]
        kw = {"pixel_values": x.pixel_values, "image_grid_thw": x.image_grid_thw} if x.images else {}
        logits = model(input_ids=seq, mm_token_type_ids=(seq == processor.image_token_id).int(), use_cache=False,
                       **kw).logits[0, len(x.input_ids) - 1:-1]
        out.append(torch.log_softmax(logits.float(), -1).gather(-1, r[:, None])[:, 0])
    return out


def _max_diff(logits, responses, reference):
    lp = torch.log_softmax(logits.float(), -1).gather(-1, responses[..., None])[..., 0]
    return max((lp[i, :len(ref)] - ref).abs().max().item() for i, ref in enumerate(reference))


@torch.no_grad()
def test_mrope_logprobs_padded_and_packed_equal_single_sequence():
    model, processor = tiny_vlm()
    data, rows = _batch(processor, _prompts())
    reference = _reference_logprobs(model, processor, rows)
    responses = data.batch["responses"]
    padded = _max_diff(response_forward(model, data, R), responses, reference)
    packed = _max_diff(response_forward(model, data, R, remove_padding=True), responses, reference)
    assert padded <= 1e-5 and packed <= 1e-5, (padded, packed)
    # the trap the carried positions avoid: the same padded batch with 1-D positions differs measurably
    b = data.batch
    pixels = torch.cat([x.pixel_values for x, _ in rows])
    grid = torch.cat([x.image_grid_thw for x, _ in rows])
    flat = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], position_ids=b["position_ids"],
                 pixel_values=pixels, image_grid_thw=grid).logits[:, -R - 1:-1]
    assert _max_diff(flat, responses, reference) > 1e-4


def test_freeze_vision_tower_and_value_head(tmp_path):
    path = save_tiny_vlm(str(tmp_path / "vlm"))
    model = vlm.load_vision_model(path, torch.float32)
    frozen = vlm.freeze_vision_tower(model)
    assert frozen == len(list(model.model.visual.parameters())) > 0
    assert all(p.requires_grad for n, p in model.named_parameters() if "visual" not in n)
    critic = vlm.load_vision_model(path, torch.float32, value_head=True)
    assert critic.lm_head.weight.shape == (1, 64)
    assert critic.lm_head.weight.data_ptr() != critic.model.language_model.embed_tokens.weight.data_ptr()
    data, _ = _batch(vlm.ImageTextProcessor.from_pretrained(path), _prompts())
    assert response_forward(critic, data, R).shape == (3, R, 1)


def _engine(path: str, freeze: bool = False):
    model = OmegaConf.create({"path": path, "dtype": "float32", "trust_remote_code": False,
                              "enable_gradient_checkpointing": False, "freeze_vision_tower": freeze})
    return get_engine_class("fsdp2").build(EngineSpec(
        kind="policy", model=model, layout=ParallelLayout(dp=2), device="cpu",
        optim=OmegaConf.structured(OptimConfig), total_steps=1, grad_clip=1e9, fsdp_size=-1))


# rank 0: rows with images; rank 1: a text-only micro-batch (its vision tower runs only the dummy forward)
RANK_PROMPTS = [PROMPTS[:2], [("Question: only text\n", []), ("Question: more text here\n", [])]]


def _loss(out, mask):
    return -(out["log_probs"] * mask).sum() / 10.0


def _rank_grads(rank: int, root: str, freeze: bool) -> dict:
    engine = _engine(os.path.join(root, "model"), freeze)
    engine.set_train(True)
    engine.zero_grad()
    data, _ = _batch(vlm.ImageTextProcessor.from_pretrained(os.path.join(root, "model")),
                     _prompts(RANK_PROMPTS[rank]), seed=rank)
    engine.forward_backward_micro_batches([data], [lambda out: _loss(out, data.batch["response_mask"])])
    engine.optimizer_step()  # (frozen: the tower has no optimizer state; no clipping at grad_clip=1e9)
    return {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
            for n, p in engine.module.named_parameters() if p.grad is not None}


def _rank_worker(rank: int, root: str) -> None:
    grads = {freeze: _rank_grads(rank, root, freeze) for freeze in (False, True)}
    if rank == 0:
        torch.save(grads, os.path.join(root, "grads.pt"))


def test_image_less_rank_fsdp2_two_ranks_equal_one_process(tmp_path):
    root = str(tmp_path)
    path = save_tiny_vlm(os.path.join(root, "model"))
    spawn_ranks(_rank_worker, root, world=2)
    grads, frozen = (torch.load(os.path.join(root, "grads.pt"))[k] for k in (False, True))
    model = vlm.load_vision_model(path, torch.float32).train()
    processor = vlm.ImageTextProcessor.from_pretrained(path)
    total = 0.0
    for rank, spec in enumerate(RANK_PROMPTS):  # FSDP2 averages the ranks' gradients
        data, _ = _batch(processor, _prompts(spec), seed=rank)
        logits = response_forward(model, data, R)
        lp = torch.log_softmax(logits.float(), -1).gather(-1, data.batch["responses"][..., None])[..., 0]
        total = total + _loss({"log_probs": lp}, data.batch["response_mask"]) / 2
    total.backward()
    expected = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert any("visual" in n for n in grads)
    assert grads.keys() == expected.keys()
    worst = max((grads[n] - expected[n]).abs().max().item() for n in expected)
    assert worst <= 1e-6, worst
    # freeze_vision_tower: no tower gradients; every other gradient as without freezing
    assert frozen.keys() == {n for n in expected if not n.startswith("model.visual.")}
    assert max((frozen[n] - expected[n]).abs().max().item() for n in frozen) <= 1e-6
