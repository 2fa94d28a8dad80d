"""The SFT warm-start steps the tiny-model build scripts share (scripts/build_tiny_arith.py,
scripts/build_tiny_tool.py): the tokenizer wrapper, the Llama they train, the padded batch, the AdamW loop with
its warmup + cosine schedule, and the save. A repository helper, not part of the installed package.

The loop's arithmetic and the order of its random draws are those the shipped assets were built with: a script
that moves here must keep its own draws in its ``next_examples`` callback, in its own order.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
from pathlib import Path
from typing import Callable

import torch
from tokenizers import Tokenizer
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

logger = logging.getLogger(__name__)

PAD, BOS, EOS = "<pad>", "<s>", "</s>"
MAX_POSITIONS = 256
Example = tuple[list[int], list[int]]  # (token ids, labels: -100 where no loss)


def wrap_tokenizer(bpe: Tokenizer, chat_template: str) -> PreTrainedTokenizerFast:
    """``bpe`` (trained, specials :data:`PAD` :data:`BOS` :data:`EOS`) as a ``PreTrainedTokenizerFast`` with
    ``chat_template`` and :data:`MAX_POSITIONS` as its model max length."""
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token=BOS, eos_token=EOS, pad_token=PAD,
                                        model_max_length=MAX_POSITIONS)
    tokenizer.chat_template = chat_template
    return tokenizer


def build_model(tokenizer: PreTrainedTokenizerFast, seed: int) -> LlamaForCausalLM:
    """A freshly initialised fp32 Llama after ``torch.manual_seed(seed)``: hidden 128, 4 layers, 4 query heads
    and 2 key/value heads of dim 32, MLP 384, tied embeddings, :data:`MAX_POSITIONS` positions, vocab padded up
    to a multiple of 64 (about 0.85-0.9M parameters with a 512-token vocab)."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=64 * math.ceil(len(tokenizer) / 64), hidden_size=128, intermediate_size=384,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        max_position_embeddings=MAX_POSITIONS, rms_norm_eps=1e-6, tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, dtype="float32",
    )
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(bos_token_id=tokenizer.bos_token_id,
                                               eos_token_id=tokenizer.eos_token_id,
                                               pad_token_id=tokenizer.pad_token_id)
    return model


def make_batch(examples: list[Example], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded int64 (B, L) input ids (``pad_id``), attention mask and labels (-100 on padding), L the
    longest example."""
    width = max(len(ids) for ids, _ in examples)
    input_ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    label_ids = torch.full((len(examples), width), -100, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for row, (ids, labels) in enumerate(examples):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        label_ids[row, : len(labels)] = torch.tensor(labels)
        mask[row, : len(ids)] = 1
    return input_ids, mask, label_ids


def warmup_cosine(steps: int, *, divide_first: bool) -> Callable[[int], float]:
    """The lr factor of step ``step``: linear warmup over 5% of ``steps``, then cosine decay to 0.1.

    ``divide_first``: the cosine's argument as ``pi * ((step - warmup) / span)`` (tiny-arith's build) or, False,
    ``pi * (step - warmup) / span`` (tiny-tool's). The two float orders differ in the last bit on about a fifth
    of the steps, so each shipped build keeps its own to rebuild bit-identically."""
    warmup = max(1, steps // 20)
    span = max(1, steps - warmup)

    def lr_factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        arg = math.pi * ((step - warmup) / span) if divide_first else math.pi * (step - warmup) / span
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(arg))

    return lr_factor


def train_loop(model: torch.nn.Module, next_batch: Callable[[], dict], *, steps: int, lr: float,
               lr_factor: Callable[[int], float], log_every: int = 100) -> list[float]:
    """``steps`` SFT steps on the model inputs ``next_batch()`` returns (keyword arguments of the model's forward,
    ``labels`` included; called once per step, in order): AdamW (weight decay 0.01, betas 0.9/0.98) at
    ``lr * lr_factor(step)`` (:func:`warmup_cosine`), gradient-norm clip 1.0. Leaves the model in eval mode;
    returns the loss per step."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.98))
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    model.train()
    losses = []
    for step in range(steps):
        loss = model(**next_batch()).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
        if step % log_every == 0 or step == steps - 1:
            logger.info("sft step %d/%d loss %.4f", step, steps, loss.item())
    model.eval()
    return losses


def sft_loop(model: LlamaForCausalLM, next_examples: Callable[[], list[Example]], pad_id: int, *, steps: int,
             lr: float, lr_factor: Callable[[int], float], log_every: int) -> list[float]:
    """:func:`train_loop` on the text batches of the examples ``next_examples()`` returns (:func:`make_batch`)."""

    def next_batch() -> dict:
        input_ids, mask, labels = make_batch(next_examples(), pad_id)
        return {"input_ids": input_ids, "attention_mask": mask, "labels": labels}

    return train_loop(model, next_batch, steps=steps, lr=lr, lr_factor=lr_factor, log_every=log_every)


def save(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, out: Path) -> None:
    """Weights (safetensors), tokenizer and generation config into ``out`` (created). The tokenizer class is
    written as ``PreTrainedTokenizerFast``: transformers 5 writes its alias ``TokenizersBackend``, which
    transformers 4.x (e.g. in a vLLM image) cannot resolve."""
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    path = out / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    path.write_text(json.dumps(config, indent=2) + "\n")


def loss_tail_mean(losses: list[float], last: int = 50) -> float:
    """The mean of the last ``last`` losses (NaN without any)."""
    tail = losses[-last:] or [float("nan")]
    return sum(tail) / len(tail)


def base_parser(description: str, *, steps: int, batch_size: int) -> argparse.ArgumentParser:
    """The command line both build scripts start with: ``--out`` (required), ``--steps``, ``--batch-size`` and
    ``--lr`` (peak AdamW learning rate, default 3e-3) with their defaults."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--out", type=Path, required=True, help="output directory")
    parser.add_argument("--steps", type=int, default=steps, help="SFT steps")
    parser.add_argument("--batch-size", type=int, default=batch_size)
    parser.add_argument("--lr", type=float, default=3e-3, help="peak AdamW learning rate")
    return parser


def correct_fraction_main(description: str, build: Callable[..., dict], *, steps: int, batch_size: int,
                          correct_help: str, argv: list[str] | None = None) -> None:
    """The command line of a build script whose SFT mixes correct and wrong answers (tiny-arith, tiny-moe,
    tiny-vlm): :func:`base_parser`'s options plus ``--correct-fraction`` (default 0.35), ``--seed`` and
    ``--threads`` (torch CPU threads, default 1 as the shipped builds); runs ``build`` and prints its info JSON."""
    parser = base_parser(description, steps=steps, batch_size=batch_size)
    parser.add_argument("--correct-fraction", type=float, default=0.35, help=correct_help)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (the shipped build used 1)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.set_num_threads(args.threads)
    info = build(args.out, steps=args.steps, batch_size=args.batch_size, lr=args.lr,
                 correct_fraction=args.correct_fraction, seed=args.seed)
    print(json.dumps(info, indent=2))
