"""Build the shipped ``tiny-arith`` model: tokenizer, Llama weights, SFT warm start.

Usage::

    python scripts/build_tiny_arith.py --out hybridflow/assets/tiny-arith [--steps N]

A repository script, not part of the installed package (the package ships the built model as an asset).

Steps (all seeded):

1. Train a byte-level BPE tokenizer (``tokenizers``; full 256-byte alphabet, so any text encodes and
   decodes exactly; specials ``<pad>`` ``<s>`` ``</s>``) on the train split's text, wrap it in
   ``PreTrainedTokenizerFast`` with a chat template rendering a user turn as
   ``"Question: {content}\\n"`` and the generation prompt as ``"Answer:"``.
2. Build a ``LlamaConfig`` model: hidden 128, 4 layers, 4 query heads and 2 key/value heads of dim 32,
   MLP 384, tied embeddings, 256 positions, fp32; vocab padded up to a multiple of 64.
3. SFT on a *mixture*: for each example the response is the full two-step solution with probability
   ``--correct-fraction`` (default 0.35) and otherwise the shortcut mistake (stop after step one and
   answer the intermediate count). Loss on response tokens (and the final ``</s>``) only. The prompt
   is rendered with ``tokenizer.apply_chat_template(..., add_generation_prompt=True)`` exactly as the
   RL run does, and prompt and response are tokenized separately, so token boundaries match rollout.
   The model thus learns the arithmetic but puts ~35% on continuing after line one: greedy decoding
   takes the shortcut (score ~0) while temperature-1 sampling is right ~1/3 of the time.
4. Save weights (safetensors), tokenizer, ``generation_config.json`` and ``build_info.json``.

The run is deterministic for a fixed seed and thread count (float reductions depend on threads).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import random
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from hybridflow.data.builtin_task import DATA_SOURCE, ArithProblem, make_builtin_problems

logger = logging.getLogger(__name__)

PAD, BOS, EOS = "<pad>", "<s>", "</s>"
TOKENIZER_VOCAB_SIZE = 512
MAX_POSITIONS = 256
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}{{ message['content'] + '\\n' }}"
    "{%- elif message['role'] == 'user' -%}{{ 'Question: ' + message['content'] + '\\n' }}"
    "{%- elif message['role'] == 'assistant' -%}"
    "{{ 'Answer: ' + message['content'] + eos_token + '\\n' }}"
    "{%- else -%}{{ raise_exception('unknown role: ' + message['role']) }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ 'Answer:' }}{%- endif -%}"
)


def render_prompt(tokenizer: PreTrainedTokenizerFast, question: str) -> str:
    """The prompt text the RL run feeds the model: the chat template with the generation prompt."""
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
    )


def response_text(solution: str) -> str:
    """The response text after ``"Answer:"`` (a space, then the solution; EOS is added as an id)."""
    return " " + solution


def build_tokenizer(problems: list[ArithProblem], vocab_size: int = TOKENIZER_VOCAB_SIZE):
    """Train the byte-level BPE tokenizer on prompts and both solution kinds of ``problems``."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD, BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    corpus = []
    for p in problems:
        corpus.append(f"Question: {p.question}\nAnswer: {p.solution}\n")
        corpus.append(f"Answer: {p.shortcut_solution}\n")
    bpe.train_from_iterator(corpus, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        model_max_length=MAX_POSITIONS,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_model(tokenizer: PreTrainedTokenizerFast, seed: int) -> LlamaForCausalLM:
    """A freshly initialised fp32 Llama sized for the task (about 0.9M parameters)."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=64 * math.ceil(len(tokenizer) / 64),
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=MAX_POSITIONS,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return model


def _encode(tokenizer, problem: ArithProblem):
    """Token ids (prompt, full-solution response, shortcut response); responses end in EOS."""
    eos = [tokenizer.eos_token_id]
    prompt = render_prompt(tokenizer, problem.question)
    full = response_text(problem.solution)
    short = response_text(problem.shortcut_solution)
    return tuple(
        tokenizer(text, add_special_tokens=False).input_ids + tail
        for text, tail in ((prompt, []), (full, eos), (short, eos))
    )


def _make_batch(examples, use_full, pad_id):
    """Right-padded (B, L) input ids, attention mask, and labels (-100 outside the response)."""
    seqs, labels = [], []
    for (prompt, full_ids, short_ids), full in zip(examples, use_full):
        response = full_ids if full else short_ids
        seqs.append(prompt + response)
        labels.append([-100] * len(prompt) + response)
    width = max(len(s) for s in seqs)
    input_ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    label_ids = torch.full((len(seqs), width), -100, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for row, (seq, lab) in enumerate(zip(seqs, labels)):
        input_ids[row, : len(seq)] = torch.tensor(seq)
        label_ids[row, : len(lab)] = torch.tensor(lab)
        mask[row, : len(seq)] = 1
    return input_ids, mask, label_ids


def sft_train(
    model: LlamaForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    problems: list[ArithProblem],
    *,
    steps: int,
    batch_size: int,
    lr: float,
    correct_fraction: float,
    seed: int,
) -> list[float]:
    """SFT on the full/shortcut mixture (fresh Bernoulli(correct_fraction) draw per example).

    AdamW, linear warmup (5% of steps) then cosine decay to 10% of ``lr``. Returns the loss per step.
    """
    rng = random.Random(seed)
    encoded: dict[int, tuple] = {}  # problem index -> _encode(...), filled on first use
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.98))
    warmup = max(1, steps // 20)

    def lr_factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    model.train()
    losses = []
    for step in range(steps):
        indices = [rng.randrange(len(problems)) for _ in range(batch_size)]
        use_full = [rng.random() < correct_fraction for _ in range(batch_size)]
        for i in indices:
            if i not in encoded:
                encoded[i] = _encode(tokenizer, problems[i])
        examples = [encoded[i] for i in indices]
        input_ids, mask, labels = _make_batch(examples, use_full, tokenizer.pad_token_id)
        loss = model(input_ids=input_ids, attention_mask=mask, labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
        if step % 200 == 0 or step == steps - 1:
            logger.info("sft step %d/%d loss %.4f", step, steps, loss.item())
    model.eval()
    return losses


def _portable_tokenizer_class(out: Path) -> None:
    """Name the tokenizer class ``PreTrainedTokenizerFast`` (transformers 5 writes its alias
    ``TokenizersBackend``, which transformers 4.x -- e.g. in a vLLM image -- cannot resolve)."""
    path = out / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    path.write_text(json.dumps(config, indent=2) + "\n")


def build(
    out: Path,
    *,
    steps: int,
    batch_size: int = 64,
    lr: float = 3e-3,
    correct_fraction: float = 0.35,
    seed: int = 0,
    num_train_problems: int = 20000,
) -> dict:
    """Build tokenizer + model, SFT them, save everything into ``out``; return the build info."""
    start = time.perf_counter()
    problems = make_builtin_problems("train", num_train_problems, seed)
    tokenizer = build_tokenizer(problems)
    model = build_model(tokenizer, seed)
    losses = sft_train(
        model, tokenizer, problems, steps=steps, batch_size=batch_size, lr=lr,
        correct_fraction=correct_fraction, seed=seed,
    )
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    _portable_tokenizer_class(out)
    tail = losses[-50:] or [float("nan")]
    info = {
        "task": DATA_SOURCE,
        "seed": seed,
        "sft_steps": steps,
        "batch_size": batch_size,
        "lr": lr,
        "correct_fraction": correct_fraction,
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "tokenizer_vocab": len(tokenizer),
        "final_loss_mean_last_50": sum(tail) / len(tail),
        "build_seconds": round(time.perf_counter() - start, 1),
        "torch_threads": torch.get_num_threads(),
    }
    (out / "build_info.json").write_text(json.dumps(info, indent=2) + "\n")
    return info


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="output directory")
    parser.add_argument("--steps", type=int, default=1500, help="SFT steps")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3, help="peak AdamW learning rate")
    parser.add_argument("--correct-fraction", type=float, default=0.35,
                        help="share of SFT responses that are the full correct solution")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (the shipped build used 1)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.set_num_threads(args.threads)
    info = build(
        args.out, steps=args.steps, batch_size=args.batch_size, lr=args.lr,
        correct_fraction=args.correct_fraction, seed=args.seed,
    )
    print(json.dumps(info, indent=2))


if __name__ == "__main__":
    main()
