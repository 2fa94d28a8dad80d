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

import json
import logging
import random
import sys
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/_sft.py, also when imported by its path
from _sft import (BOS, EOS, PAD, build_model, correct_fraction_main, loss_tail_mean, save, sft_loop,  # noqa: E402
                  warmup_cosine, wrap_tokenizer)
from hybridflow.data.builtin_task import DATA_SOURCE, ArithProblem, make_builtin_problems  # noqa: E402

logger = logging.getLogger(__name__)

TOKENIZER_VOCAB_SIZE = 512
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
    return wrap_tokenizer(bpe, CHAT_TEMPLATE)


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


def _example(encoded: tuple, full: bool) -> tuple[list[int], list[int]]:
    """``(ids, labels)`` of one SFT example: the prompt then the full or the shortcut response, labels on the
    response only."""
    prompt, full_ids, short_ids = encoded
    response = full_ids if full else short_ids
    return prompt + response, [-100] * len(prompt) + response


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

    def next_examples() -> list[tuple[list[int], list[int]]]:
        indices = [rng.randrange(len(problems)) for _ in range(batch_size)]
        use_full = [rng.random() < correct_fraction for _ in range(batch_size)]
        for i in indices:
            if i not in encoded:
                encoded[i] = _encode(tokenizer, problems[i])
        return [_example(encoded[i], full) for i, full in zip(indices, use_full)]

    return sft_loop(model, next_examples, tokenizer.pad_token_id, steps=steps, lr=lr,
                    lr_factor=warmup_cosine(steps, divide_first=True), log_every=200)


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
    save(model, tokenizer, out)
    info = {
        "task": DATA_SOURCE,
        "seed": seed,
        "sft_steps": steps,
        "batch_size": batch_size,
        "lr": lr,
        "correct_fraction": correct_fraction,
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "tokenizer_vocab": len(tokenizer),
        "final_loss_mean_last_50": loss_tail_mean(losses),
        "build_seconds": round(time.perf_counter() - start, 1),
        "torch_threads": torch.get_num_threads(),
    }
    (out / "build_info.json").write_text(json.dumps(info, indent=2) + "\n")
    return info


def main(argv: list[str] | None = None) -> None:
    correct_fraction_main(__doc__.splitlines()[0], build, steps=1500, batch_size=64,
                          correct_help="share of SFT responses that are the full correct solution", argv=argv)


if __name__ == "__main__":
    main()
