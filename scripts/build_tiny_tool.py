"""Build the shipped ``tiny-tool`` model: tokenizer, Llama weights, SFT warm start on the tool-use task.

Usage (from the repository root); the shipped asset is these two stages (``build_info.json`` records both)::

    python scripts/build_tiny_tool.py --out /tmp/tiny-tool-stage1 --call-fraction 0.7
    python scripts/build_tiny_tool.py --out hybridflow/assets/tiny-tool --init-from /tmp/tiny-tool-stage1 \
        --steps 250 --call-fraction 0.9 --seed 2

(stage 1 took 662 s and stage 2 255 s on one thread of a 2-core machine under heavy load, load average 15-35;
copying the numbers into the call is what needs the steps: after stage 1 the calls had the right format but
mostly wrong digits.)

Steps (all seeded):

1. Train a byte-level BPE tokenizer (``tokenizers``; full 256-byte alphabet, so any text round-trips; every digit
   its own token, so copying a number is copying digits) on the train split's text. Specials ``<pad>`` ``<s>``
   ``</s>``; the four Hermes tool strings ``<tool_call>`` ``</tool_call>`` ``<tool_response>`` ``</tool_response>``
   are added (non-special) tokens, so they are never split and survive ``skip_special_tokens``. The chat template
   (:data:`CHAT_TEMPLATE`) renders ``tools=`` as a ``<tools>NAMES</tools>`` line, a user turn as
   ``Question: ...``, an assistant turn as ``Answer:CONTENT <tool_call>{json}</tool_call></s>`` (the content keeps
   the model's leading space) and a ``tool``
   message as ``<tool_response>TEXT</tool_response>``; every message renders the same whatever precedes it, so a
   tool message alone (with the generation prompt) is exactly the observation the multi-turn loop appends.
2. Build a ``LlamaConfig`` model: hidden 128, 4 layers, 4 query heads and 2 key/value heads of dim 32 (vLLM needs
   head_dim >= 32), MLP 384, tied embeddings, 256 positions, fp32; vocab padded up to a multiple of 64.
3. SFT on a *mixture*: a share ``--tool-fraction`` (default 0.3) of responses calls the calculator with
   the problem's expression, gets the observation and answers ``#### RESULT``; the others answer
   ``#### ANSWER`` directly. ``--call-fraction`` (>= tool fraction) puts more examples on the calculator path
   without changing the 30%: the extra ones leave their first two tokens (the choice to call) unlabelled
   (:func:`draw_example`) (the right number as the target, which a model this small cannot compute, so its
   direct answers are usually wrong). Loss on model tokens (with their ``</s>``) only. The prompt is
   ``apply_chat_template(messages, tools=..., add_generation_prompt=True)`` and each segment (prompt, model turn,
   observation, model turn) is tokenized on its own, as the rollout does.
4. Save weights (safetensors), tokenizer, ``generation_config.json`` and ``build_info.json``.

The run is deterministic for a fixed seed and thread count (float reductions depend on threads).
"""

from __future__ import annotations

import json
import logging
import math
import random
import re
import sys
import time
from pathlib import Path

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/_sft.py, also when imported by its path
from _sft import (BOS, EOS, PAD, base_parser, build_model, loss_tail_mean, save, sft_loop,  # noqa: E402
                  warmup_cosine, wrap_tokenizer)
from hybridflow.data.tool_task import DATA_SOURCE, TOOL_NAME, ToolProblem, make_tool_problems, tool_call_text  # noqa: E402

logger = logging.getLogger(__name__)

TOOL_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
TOKENIZER_VOCAB_SIZE = 512
# The schema the SFT prompts carry (only its name is rendered); the calculator tool's own schema renders the same.
CALCULATOR_SCHEMA = {
    "type": "function",
    "function": {
        "name": TOOL_NAME,
        "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                       "required": ["expression"]},
    },
}
CHAT_TEMPLATE = (
    "{%- if tools and messages and messages[0]['role'] in ('system', 'user') -%}"
    "{{ '<tools>' }}"
    "{%- for tool in tools -%}{%- set fn = tool['function'] if tool['function'] is defined else tool -%}"
    "{{ (', ' if not loop.first else '') + fn['name'] }}{%- endfor -%}"
    "{{ '</tools>\\n' }}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}{{ message['content'] + '\\n' }}"
    "{%- elif message['role'] == 'user' -%}{{ 'Question: ' + message['content'] + '\\n' }}"
    "{%- elif message['role'] == 'assistant' -%}{{ 'Answer:' }}"
    "{%- if message['content'] -%}{{ message['content'] }}{%- endif -%}"
    "{%- for call in message['tool_calls'] or [] -%}"
    "{%- set fn = call['function'] if call['function'] is defined else call -%}"
    "{%- set args = fn['arguments'] if fn['arguments'] is string else fn['arguments'] | tojson -%}"
    "{{ ' <tool_call>{\"name\": ' + fn['name'] | tojson + ', \"arguments\": ' + args + '}</tool_call>' }}"
    "{%- endfor -%}"
    "{{ eos_token }}"
    "{%- elif message['role'] == 'tool' -%}{{ '<tool_response>' + message['content'] + '</tool_response>\\n' }}"
    "{%- else -%}{{ raise_exception('unknown role: ' + message['role']) }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ 'Answer:' }}{%- endif -%}"
)


def render_prompt(tokenizer: PreTrainedTokenizerFast, question: str) -> str:
    """The prompt text of a problem: the chat template with ``tools=[calculator]`` and the generation prompt."""
    return tokenizer.apply_chat_template([{"role": "user", "content": question}], tools=[CALCULATOR_SCHEMA],
                                         add_generation_prompt=True, tokenize=False)


def render_observation(tokenizer: PreTrainedTokenizerFast, result: str) -> str:
    """The observation text after a tool call: the ``tool`` message alone with the generation prompt."""
    return tokenizer.apply_chat_template([{"role": "tool", "content": result}], add_generation_prompt=True,
                                         tokenize=False)


def segments(tokenizer: PreTrainedTokenizerFast, problem: ToolProblem, use_tool: bool) -> list[tuple[str, bool]]:
    """The conversation as ``(text, is_model_turn)`` segments; model turns end in EOS (added as an id)."""
    final = (" #### " + str(problem.answer), True)
    if not use_tool:
        return [(render_prompt(tokenizer, problem.question), False), final]
    return [(render_prompt(tokenizer, problem.question), False),
            (" " + tool_call_text(problem.expression), True),
            (render_observation(tokenizer, str(problem.answer)), False), final]


BRANCH_TOKENS = 2  # the first tokens of the first model turn: " <tool_call>" vs " ####" (call or answer)


def encode(tokenizer: PreTrainedTokenizerFast, problem: ToolProblem, use_tool: bool,
           branch_label: bool = True) -> tuple[list[int], list[int]]:
    """``(ids, labels)``: each segment tokenized on its own (no specials), EOS after each model turn; labels are
    the ids on model turns (and their EOS) and -100 elsewhere; without ``branch_label`` also -100 on the first
    ``BRANCH_TOKENS`` model tokens (the example then teaches the call, not the choice to call)."""
    ids: list[int] = []
    labels: list[int] = []
    for text, is_model in segments(tokenizer, problem, use_tool):
        part = tokenizer(text, add_special_tokens=False).input_ids + ([tokenizer.eos_token_id] if is_model else [])
        if is_model and not branch_label and len(labels) == len(ids) and all(x == -100 for x in labels):
            labels += [-100] * BRANCH_TOKENS + part[BRANCH_TOKENS:]
        else:
            labels += part if is_model else [-100] * len(part)
        ids += part
    return ids, labels


def draw_example(rng: random.Random, tool_fraction: float, call_fraction: float) -> tuple[bool, bool]:
    """``(use_tool, branch_label)`` of one SFT example: a tool path with probability ``call_fraction`` (>=
    ``tool_fraction``), whose choice-to-call tokens are labelled with probability ``r`` chosen so that among the
    examples whose first tokens are labelled a share ``tool_fraction`` calls: ``r * c / (r * c + 1 - c) = t``."""
    if not rng.random() < call_fraction:
        return False, True
    r = 1.0 if call_fraction >= 1.0 else tool_fraction * (1 - call_fraction) / ((1 - tool_fraction) * call_fraction)
    return True, rng.random() < r


def build_tokenizer(problems: list[ToolProblem], vocab_size: int = TOKENIZER_VOCAB_SIZE) -> PreTrainedTokenizerFast:
    """Train the byte-level BPE tokenizer (digits split one per token) on the texts of ``problems``."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)])
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[PAD, BOS, EOS], min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    corpus = []
    for p in problems:
        corpus.append(f"<tools>{TOOL_NAME}</tools>\nQuestion: {p.question}\nAnswer:")
        corpus.append(f" {tool_call_text(p.expression)}<tool_response>{p.answer}</tool_response>\nAnswer: #### ")
    bpe.train_from_iterator(corpus, trainer=trainer)
    bpe.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])
    return wrap_tokenizer(bpe, CHAT_TEMPLATE)


def sft_train(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, problems: list[ToolProblem], *,
              steps: int, batch_size: int, lr: float, tool_fraction: float, seed: int,
              call_fraction: float | None = None) -> list[float]:
    """SFT on the tool/direct mixture (a fresh :func:`draw_example` per example; ``call_fraction`` None means
    ``tool_fraction``, i.e. every example labels its choice).

    AdamW, linear warmup (5% of steps) then cosine decay to 10% of ``lr``. Returns the loss per step.
    """
    rng = random.Random(seed)

    def next_examples() -> list[tuple[list[int], list[int]]]:
        return [encode(tokenizer, problems[rng.randrange(len(problems))],
                       *draw_example(rng, tool_fraction, call_fraction or tool_fraction))
                for _ in range(batch_size)]

    return sft_loop(model, next_examples, tokenizer.pad_token_id, steps=steps, lr=lr,
                    lr_factor=warmup_cosine(steps, divide_first=False), log_every=50)


def build(out: Path, *, steps: int, batch_size: int = 16, lr: float = 3e-3, tool_fraction: float = 0.3,
          seed: int = 0, num_train_problems: int = 20000, call_fraction: float | None = None,
          init_from: Path | None = None) -> dict:
    """Build tokenizer + model (or load both from ``init_from``, a previous build: a further SFT stage), SFT them,
    save everything into ``out``; return the build info (with ``init_from``, the earlier stages under
    ``"stages"``)."""
    start = time.perf_counter()
    problems = make_tool_problems("train", num_train_problems, seed)
    if init_from is None:
        tokenizer = build_tokenizer(problems)
        model = build_model(tokenizer, seed)
    else:
        tokenizer = PreTrainedTokenizerFast.from_pretrained(init_from)
        model = LlamaForCausalLM.from_pretrained(init_from)
    losses = sft_train(model, tokenizer, problems, steps=steps, batch_size=batch_size, lr=lr,
                       tool_fraction=tool_fraction, seed=seed, call_fraction=call_fraction)
    save(model, tokenizer, out)
    info = {
        "task": DATA_SOURCE, "seed": seed, "sft_steps": steps, "batch_size": batch_size, "lr": lr,
        "tool_fraction": tool_fraction, "call_fraction": call_fraction or tool_fraction,
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "tokenizer_vocab": len(tokenizer), "final_loss_mean_last_50": loss_tail_mean(losses),
        "build_seconds": round(time.perf_counter() - start, 1), "torch_threads": torch.get_num_threads(),
    }
    if init_from is not None:
        earlier = json.loads((Path(init_from) / "build_info.json").read_text())
        info["stages"] = earlier.pop("stages", []) + [earlier]
    (out / "build_info.json").write_text(json.dumps(info, indent=2) + "\n")
    return info


_CALL_RE = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)


def plus_times_value(expression: str) -> int | None:
    """The value of an expression of non-negative integers, ``+`` and ``*`` (usual precedence); None otherwise."""
    if not re.fullmatch(r"\s*\d+(\s*[+*]\s*\d+)*\s*", expression):
        return None
    return sum(math.prod(int(x) for x in term.split("*")) for term in expression.split("+"))


def parse_call(text: str) -> str | None:
    """The ``expression`` argument of the first well-formed calculator call in ``text``, or None."""
    match = _CALL_RE.search(text)
    if not match:
        return None
    try:
        call = json.loads(match.group(1))
        return call["arguments"]["expression"] if call.get("name") == TOOL_NAME else None
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


@torch.no_grad()
def _generate(model, tokenizer, texts: list[str], do_sample: bool, max_new_tokens: int) -> list[str]:
    """One model turn per text (left-padded batch), decoded without special tokens."""
    tokenizer.padding_side = "left"
    batch = tokenizer(texts, add_special_tokens=False, return_tensors="pt", padding=True)
    out = model.generate(**batch, do_sample=do_sample, temperature=1.0 if do_sample else None, top_k=0,
                         max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id)
    return tokenizer.batch_decode(out[:, batch.input_ids.shape[1]:], skip_special_tokens=True)


def check(model, tokenizer, problems: list[ToolProblem], *, do_sample: bool, seed: int = 0) -> dict:
    """Two-turn behaviour on ``problems``: the share of first turns calling the calculator, of correct calls (the
    expression's value is the answer), and of right final answers (``#### N``) when each call is answered with
    its value as the observation (a call that does not parse gets ``error`` and ends the episode).
    A check of the warm start, not the training loop: the multi-turn rollout is ``hybridflow.rollout``'s."""
    torch.manual_seed(seed)
    prompts = [render_prompt(tokenizer, p.question) for p in problems]
    first = _generate(model, tokenizer, prompts, do_sample, 48)
    calls = [parse_call(t) for t in first]
    values = [None if c is None else plus_times_value(c) for c in calls]
    second_idx = [i for i, v in enumerate(values) if v is not None]
    second = _generate(model, tokenizer, [prompts[i] + first[i] + EOS + render_observation(tokenizer, str(values[i]))
                                          for i in second_idx], do_sample, 16) if second_idx else []
    final = dict(zip(second_idx, second))
    right = [gsm8k_answer(final.get(i, first[i] if "<tool_call>" not in first[i] else "")) == p.answer
             for i, p in enumerate(problems)]
    n = len(problems)
    return {"tool_call_fraction": sum("<tool_call>" in t for t in first) / n,
            "correct_call_fraction": sum(v == p.answer for v, p in zip(values, problems)) / n,
            "score": sum(right) / n,
            "direct_score": sum(r for r, t in zip(right, first) if "<tool_call>" not in t)
            / max(1, sum("<tool_call>" not in t for t in first))}


def gsm8k_answer(text: str) -> int | None:
    """The integer after the last ``####`` in ``text``, or None."""
    found = re.findall(r"####\s*(\d+)", text)
    return int(found[-1]) if found else None


def main(argv: list[str] | None = None) -> None:
    parser = base_parser(__doc__.splitlines()[0], steps=500, batch_size=16)
    parser.add_argument("--tool-fraction", type=float, default=0.3,
                        help="share of SFT responses that call the calculator")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-train-problems", type=int, default=20000, help="distinct train problems drawn")
    parser.add_argument("--call-fraction", type=float, default=None,
                        help="share of SFT examples on the calculator path (>= --tool-fraction; the extra ones "
                             "teach the call without labelling the choice to call); default --tool-fraction")
    parser.add_argument("--init-from", type=Path, default=None,
                        help="continue from this earlier build (its tokenizer and weights): a further SFT stage")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (the shipped build used 1)")
    parser.add_argument("--check", type=int, default=0, metavar="N",
                        help="only check the model in --out on N val problems (greedy and sampled) and print JSON")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.set_num_threads(args.threads)
    if args.check:
        model = LlamaForCausalLM.from_pretrained(args.out).eval()
        tokenizer = PreTrainedTokenizerFast.from_pretrained(args.out)
        problems = make_tool_problems("val", args.check, args.seed)
        print(json.dumps({mode: check(model, tokenizer, problems, do_sample=mode == "sampled")
                          for mode in ("greedy", "sampled")}, indent=2))
        return
    info = build(args.out, steps=args.steps, batch_size=args.batch_size, lr=args.lr,
                 tool_fraction=args.tool_fraction, seed=args.seed, num_train_problems=args.num_train_problems,
                 call_fraction=args.call_fraction, init_from=args.init_from)
    print(json.dumps(info, indent=2))


if __name__ == "__main__":
    main()
