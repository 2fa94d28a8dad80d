"""Build the shipped ``tiny-vlm`` model: tokenizer, image processor, Qwen2.5-VL weights, SFT warm start.

Usage::

    python scripts/build_tiny_vlm.py --out hybridflow/assets/tiny-vlm [--steps N]

A repository script, not part of the installed package (the package ships the built model as an asset).

Steps (all seeded):

1. Train a byte-level BPE tokenizer (full 256-byte alphabet; specials ``<pad>`` ``<s>`` ``</s>`` and Qwen's vision
   tokens ``<|vision_start|>`` ``<|vision_end|>`` ``<|image_pad|>`` ``<|video_pad|>``) on the task's text. Its chat
   template renders a user turn as ``"Question: {content}\\n"``, where each ``<image>`` placeholder of a string
   content (verl's convention) or each ``{"type": "image"}`` part of a list content becomes
   ``<|vision_start|><|image_pad|><|vision_end|>``; the generation prompt is ``"Answer:"``.
2. Build a ``Qwen2_5_VLConfig`` model (:func:`hybridflow.models.vlm_build.tiny_qwen2_5_vl_config`: text hidden
   128, 3 layers, heads of dim 32; one vision block of width 64, patch 14, merge 2) and the PIL image processor
   (56 x 56 images stay 56 x 56: 16 patches, 4 image tokens).
3. SFT on the counting task (:mod:`hybridflow.data.vlm_task`) with a *mixture* of responses: the correct
   ``#### {count}`` with probability ``--correct-fraction`` (default 0.35), otherwise the off-by-one mistake
   ``#### {count + 1}``. Loss on the response tokens and the final ``</s>`` only. Prompts go through the same
   processor an RL run uses (``mm_token_type_ids`` passed so the 3-D rope sees the image). The model thus has
   to read the image (the two candidate answers depend on the count) but prefers the wrong one: greedy decoding
   scores about 0, temperature-1 sampling about ``correct_fraction`` times the share of images it counts right.
4. Measure on 200 val problems the exact probability of each answer ``#### k`` (k = 1..6; teacher-forced), i.e.
   the expected score of temperature-1 sampling, the greedy-answer accuracy, and the share of images whose two
   most likely answers are ``count`` and ``count + 1`` (the model read the image).
5. Save weights (safetensors), tokenizer, image processor (``preprocessor_config.json``; transformers cannot
   save the full Qwen2.5-VL processor without torchvision), ``generation_config.json`` and ``build_info.json``.

Deterministic for a fixed seed and thread count (float reductions depend on threads).
"""

from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GenerationConfig, Qwen2_5_VLForConditionalGeneration

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/_sft.py
from _sft import (BOS, EOS, PAD, correct_fraction_main, loss_tail_mean, save, train_loop,  # noqa: E402
                  warmup_cosine, wrap_tokenizer)
from hybridflow.data.vlm_task import (COUNTS, DATA_SOURCE, IMAGE_PLACEHOLDER, QUESTION, CountProblem,  # noqa: E402
                                      make_count_problems)
from hybridflow.models.vlm_build import (VISION_TOKENS, image_only_processor, tiny_image_processor,  # noqa: E402
                                         tiny_qwen2_5_vl_config)


TOKENIZER_VOCAB_SIZE = 320
_IMAGE_SPAN = "<|vision_start|><|image_pad|><|vision_end|>"
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- set content = message['content'] -%}"
    "{%- if content is string -%}{%- set text = content | replace('" + IMAGE_PLACEHOLDER + "', '" + _IMAGE_SPAN
    + "') -%}"
    "{%- else -%}{%- set ns = namespace(text='') -%}"
    "{%- for part in content -%}"
    "{%- if part['type'] == 'image' -%}{%- set ns.text = ns.text + '" + _IMAGE_SPAN + "' -%}"
    "{%- else -%}{%- set ns.text = ns.text + part['text'] -%}{%- endif -%}"
    "{%- endfor -%}{%- set text = ns.text -%}"
    "{%- endif -%}"
    "{%- if message['role'] == 'system' -%}{{ text + '\\n' }}"
    "{%- elif message['role'] == 'user' -%}{{ 'Question: ' + text + '\\n' }}"
    "{%- elif message['role'] == 'assistant' -%}{{ 'Answer: ' + text + eos_token + '\\n' }}"
    "{%- else -%}{{ raise_exception('unknown role: ' + message['role']) }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ 'Answer:' }}{%- endif -%}"
)
ANSWERS = tuple(range(COUNTS[0], COUNTS[-1] + 2))  # every answer the SFT shows: count and count + 1


def build_tokenizer(vocab_size: int = TOKENIZER_VOCAB_SIZE):
    """The byte-level BPE tokenizer (trained on the question and every answer line) with the chat template."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[PAD, BOS, EOS, *VISION_TOKENS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), min_frequency=2,
                                  show_progress=False)
    corpus = [f"Question: {QUESTION}\nAnswer: #### {k}\n" for k in ANSWERS for _ in range(4)]
    bpe.train_from_iterator(corpus, trainer=trainer)
    return wrap_tokenizer(bpe, CHAT_TEMPLATE)


def encode_problems(processor, problems: list[CountProblem]) -> dict:
    """The processor's output for each problem's prompt: ``input_ids`` / ``attention_mask`` /
    ``mm_token_type_ids`` int64 (N, P) (every prompt has the same text and image size, so no padding),
    ``pixel_values`` fp32 (N, patches, 1176), ``image_grid_thw`` int64 (N, 3)."""
    text = processor.tokenizer.apply_chat_template([{"role": "user", "content": IMAGE_PLACEHOLDER + QUESTION}],
                                                   add_generation_prompt=True, tokenize=False)
    enc = processor(text=[text] * len(problems), images=[[p.image] for p in problems], return_tensors="pt",
                    return_mm_token_type_ids=True)
    enc = dict(enc)
    enc["pixel_values"] = enc["pixel_values"].reshape(len(problems), -1, enc["pixel_values"].shape[-1])
    return enc


def response_ids(tokenizer, answer: int) -> list[int]:
    """Token ids of the response ``" #### {answer}"`` followed by EOS."""
    return tokenizer(f" #### {answer}", add_special_tokens=False).input_ids + [tokenizer.eos_token_id]


def make_batch(enc: dict, rows: list[int], responses: list[list[int]], pad_id: int) -> dict:
    """Model inputs for prompts ``rows`` of ``enc`` followed by ``responses`` (right-padded with ``pad_id``);
    ``labels`` are -100 on the prompt and the padding."""
    prompt = enc["input_ids"][rows]
    width = prompt.shape[1] + max(len(r) for r in responses)
    n = len(rows)
    input_ids = torch.full((n, width), pad_id, dtype=torch.long)
    labels = torch.full((n, width), -100, dtype=torch.long)
    mask = torch.zeros((n, width), dtype=torch.long)
    input_ids[:, : prompt.shape[1]] = prompt
    mask[:, : prompt.shape[1]] = 1
    for i, response in enumerate(responses):
        end = prompt.shape[1] + len(response)
        input_ids[i, prompt.shape[1]: end] = torch.tensor(response)
        labels[i, prompt.shape[1]: end] = torch.tensor(response)
        mask[i, prompt.shape[1]: end] = 1
    mm_types = torch.zeros_like(input_ids)
    mm_types[:, : prompt.shape[1]] = enc["mm_token_type_ids"][rows]
    pixels = enc["pixel_values"][rows]
    return {"input_ids": input_ids, "attention_mask": mask, "labels": labels, "mm_token_type_ids": mm_types,
            "pixel_values": pixels.reshape(-1, pixels.shape[-1]), "image_grid_thw": enc["image_grid_thw"][rows]}


def sft_train(model, tokenizer, enc: dict, counts: list[int], *, steps: int, batch_size: int, lr: float,
              correct_fraction: float, seed: int) -> list[float]:
    """SFT on the correct / off-by-one mixture (fresh Bernoulli(correct_fraction) draw per example): AdamW
    (weight decay 0.01, betas 0.9/0.98), warmup + cosine (``_sft.warmup_cosine``), gradient clip 1.0. Returns
    the loss per step; leaves the model in eval mode."""
    rng = random.Random(seed)

    def next_batch() -> dict:
        rows = [rng.randrange(len(counts)) for _ in range(batch_size)]
        answers = [counts[r] if rng.random() < correct_fraction else counts[r] + 1 for r in rows]
        return make_batch(enc, rows, [response_ids(tokenizer, a) for a in answers], tokenizer.pad_token_id)

    return train_loop(model, next_batch, steps=steps, lr=lr, lr_factor=warmup_cosine(steps, divide_first=True))


@torch.no_grad()
def answer_probabilities(model, tokenizer, enc: dict) -> torch.Tensor:
    """fp32 (N, len(ANSWERS)): the exact probability of each full response ``" #### k</s>"`` per prompt
    (teacher-forced product of token probabilities)."""
    n = enc["input_ids"].shape[0]
    columns = []
    for answer in ANSWERS:
        response = response_ids(tokenizer, answer)
        batch = make_batch(enc, list(range(n)), [response] * n, tokenizer.pad_token_id)
        labels = batch.pop("labels")
        logits = model(**batch).logits.float()
        logprobs = torch.log_softmax(logits[:, :-1], dim=-1)
        targets = labels[:, 1:]
        picked = logprobs.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        columns.append((picked * (targets != -100)).sum(-1).exp())
    return torch.stack(columns, dim=1)


def evaluate(model, tokenizer, processor, seed: int, num: int = 200) -> dict:
    """The val metrics of step 4 of the module docstring, on ``num`` val problems."""
    problems = make_count_problems("val", num, seed)
    probs = answer_probabilities(model, tokenizer, encode_problems(processor, problems))
    counts = torch.tensor([p.count for p in problems])
    column = counts - ANSWERS[0]
    top2 = probs.topk(2, dim=1).indices
    read = ((top2 == column[:, None]).any(1) & (top2 == column[:, None] + 1).any(1)).float()
    return {"val_expected_sample_score": probs[torch.arange(num), column].mean().item(),
            "val_greedy_score": (probs.argmax(1) == column).float().mean().item(),
            "val_read_image_share": read.mean().item(),
            "val_answer_mass": probs.sum(1).mean().item()}


def build(out: Path, *, steps: int, batch_size: int = 64, lr: float = 3e-3, correct_fraction: float = 0.35,
          seed: int = 0, num_train_problems: int = 4000, num_eval_problems: int = 200) -> dict:
    """Build tokenizer, image processor and model, SFT them, save everything into ``out``; return the build info."""
    start = time.perf_counter()
    tokenizer = build_tokenizer()
    image_processor = tiny_image_processor()
    processor = image_only_processor(image_processor, tokenizer)
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(tiny_qwen2_5_vl_config(tokenizer))
    model.generation_config = GenerationConfig(bos_token_id=tokenizer.bos_token_id,
                                               eos_token_id=tokenizer.eos_token_id,
                                               pad_token_id=tokenizer.pad_token_id)
    problems = make_count_problems("train", num_train_problems, seed)
    enc = encode_problems(processor, problems)
    losses = sft_train(model, tokenizer, enc, [p.count for p in problems], steps=steps, batch_size=batch_size,
                       lr=lr, correct_fraction=correct_fraction, seed=seed)
    metrics = evaluate(model, tokenizer, processor, seed, num_eval_problems)
    save(model, tokenizer, out)
    image_processor.save_pretrained(out)
    info = {"task": DATA_SOURCE, "seed": seed, "sft_steps": steps, "batch_size": batch_size, "lr": lr,
            "correct_fraction": correct_fraction, "num_train_problems": num_train_problems,
            "num_parameters": sum(p.numel() for p in model.parameters()),
            "num_vision_parameters": sum(p.numel() for p in model.model.visual.parameters()),
            "tokenizer_vocab": len(tokenizer), "final_loss_mean_last_50": loss_tail_mean(losses), **metrics,
            "build_seconds": round(time.perf_counter() - start, 1), "torch_threads": torch.get_num_threads()}
    (out / "build_info.json").write_text(json.dumps(info, indent=2) + "\n")
    return info


def main(argv: list[str] | None = None) -> None:
    correct_fraction_main(__doc__.splitlines()[0], build, steps=1200, batch_size=64,
                          correct_help="share of SFT responses that are the correct count", argv=argv)


if __name__ == "__main__":
    main()
