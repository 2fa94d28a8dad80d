"""Measure the shipped ``tiny-arith`` model on held-out problems, optionally after a REINFORCE smoke run.

Usage (prints one JSON object)::

    python -m hybridflow.models.builtin.check_tiny_arith [--model builtin:tiny-arith] [--num-val 256]
        [--samples 4] [--rl-smoke [--rl-updates 60] [--rl-batch 64] [--rl-lr 1e-4]]

Reports the greedy score and the mean temperature-1.0 (top-p 1, no top-k) sampled score on ``val``
prompts, scored by ``hybridflow.rewards.default_compute_score`` exactly as the RL run scores them,
plus token lengths of prompts and of correct / incorrect responses.

``--rl-smoke`` then runs single-process REINFORCE with a batch-mean baseline (Williams 1992,
eq. 11 with a constant baseline): per update, ``--rl-batch`` train prompts, one temperature-1 sample
each, reward r in {0, 1}, loss = -mean_i[(r_i - mean(r)) * sum_t log pi(y_it | x_i, y_i,<t)], Adam.
It checks that RL can move the greedy val score, which is what the quickstart demo relies on.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hybridflow.data.builtin_task import make_builtin_rows
from hybridflow.models.builtin import resolve_model_path
from hybridflow.rewards import default_compute_score

logger = logging.getLogger(__name__)


def load(path: str):
    """Load (model in eval mode, tokenizer) from a directory or a ``builtin:`` name."""
    path = resolve_model_path(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(path)
    return model.eval(), tokenizer


def encode_prompts(tokenizer, rows: list[dict]) -> list[list[int]]:
    """Prompt token ids: each row's chat messages through the chat template, no extra specials."""
    texts = [
        tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False)
        for row in rows
    ]
    return [tokenizer(t, add_special_tokens=False).input_ids for t in texts]


def _left_pad(prompts: list[list[int]], pad_id: int):
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = torch.tensor(p)
        mask[row, width - len(p):] = 1
    return ids, mask


@torch.no_grad()
def generate(model, tokenizer, prompts: list[list[int]], *, do_sample: bool, max_new_tokens: int = 32):
    """Generate one response per prompt; returns response ids cut after the first EOS (EOS kept)."""
    ids, mask = _left_pad(prompts, tokenizer.pad_token_id)
    sampling = {"do_sample": True, "temperature": 1.0, "top_p": 1.0, "top_k": 0} if do_sample else {
        "do_sample": False}
    out = model.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **sampling,
    )
    responses = []
    for row in out[:, ids.shape[1]:].tolist():
        if tokenizer.eos_token_id in row:
            row = row[: row.index(tokenizer.eos_token_id) + 1]
        responses.append(row)
    return responses


def score(tokenizer, rows: list[dict], responses: list[list[int]]) -> list[float]:
    """Reward of each decoded response (specials skipped) under its row's data source."""
    return [
        default_compute_score(
            row["data_source"], tokenizer.decode(resp, skip_special_tokens=True),
            row["reward_model"]["ground_truth"], row["extra_info"],
        )
        for row, resp in zip(rows, responses)
    ]


def evaluate(model, tokenizer, rows: list[dict], *, samples: int, batch: int = 128) -> dict:
    """Greedy score, mean sampled score (``samples`` draws per prompt), and token lengths."""
    prompts = encode_prompts(tokenizer, rows)
    greedy, sampled, lengths = [], [], {"correct": [], "incorrect": []}
    for start in range(0, len(rows), batch):
        chunk_rows, chunk = rows[start:start + batch], prompts[start:start + batch]
        greedy += score(tokenizer, chunk_rows, generate(model, tokenizer, chunk, do_sample=False))
        for _ in range(samples):
            responses = generate(model, tokenizer, chunk, do_sample=True)
            rewards = score(tokenizer, chunk_rows, responses)
            sampled += rewards
            for resp, r in zip(responses, rewards):
                lengths["correct" if r > 0 else "incorrect"].append(len(resp))

    def mean(xs):
        return round(statistics.fmean(xs), 4) if xs else None

    return {
        "num_prompts": len(rows),
        "greedy_score": mean(greedy),
        "sampled_score": mean(sampled),
        "prompt_tokens_mean": mean([len(p) for p in prompts]),
        "prompt_tokens_max": max(len(p) for p in prompts),
        "response_tokens_correct_mean": mean(lengths["correct"]),
        "response_tokens_incorrect_mean": mean(lengths["incorrect"]),
    }


def _response_logprob_sum(model, prompts, responses, pad_id: int) -> torch.Tensor:
    """Sum of log pi over each response's tokens, (B,) float32, with grad."""
    seqs = [p + r for p, r in zip(prompts, responses)]
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    resp_mask = torch.zeros((len(seqs), width), dtype=torch.bool)
    for row, (p, s) in enumerate(zip(prompts, seqs)):
        ids[row, : len(s)] = torch.tensor(s)
        mask[row, : len(s)] = 1
        resp_mask[row, len(p): len(s)] = True
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
    logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return (logp * resp_mask[:, 1:]).sum(-1)


def rl_smoke(model, tokenizer, val_rows, *, updates: int, batch: int, lr: float, seed: int,
             eval_every: int = 10) -> dict:
    """REINFORCE with a batch-mean baseline on train prompts; greedy val score along the way."""
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    train_rows = make_builtin_rows("train", updates * batch, seed)
    curve, start = [], time.perf_counter()
    for step in range(updates):
        rows = train_rows[step * batch:(step + 1) * batch]
        prompts = encode_prompts(tokenizer, rows)
        model.eval()
        responses = generate(model, tokenizer, prompts, do_sample=True)
        rewards = torch.tensor(score(tokenizer, rows, responses))
        advantages = rewards - rewards.mean()
        model.train()
        loss = -(advantages * _response_logprob_sum(model, prompts, responses,
                                                    tokenizer.pad_token_id)).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        model.eval()
        if (step + 1) % eval_every == 0 or step + 1 == updates:
            greedy = evaluate(model, tokenizer, val_rows, samples=0)["greedy_score"]
            curve.append({"update": step + 1, "train_reward": round(rewards.mean().item(), 4),
                          "val_greedy": greedy, "seconds": round(time.perf_counter() - start, 1)})
            logger.info("rl %s", curve[-1])
    return {"updates": updates, "batch": batch, "lr": lr,
            "seconds": round(time.perf_counter() - start, 1), "curve": curve}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin:tiny-arith")
    parser.add_argument("--num-val", type=int, default=256)
    parser.add_argument("--samples", type=int, default=4, help="sampled responses per val prompt")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rl-smoke", action="store_true", help="also run the REINFORCE smoke test")
    parser.add_argument("--rl-updates", type=int, default=60)
    parser.add_argument("--rl-batch", type=int, default=64)
    parser.add_argument("--rl-lr", type=float, default=1e-4)
    parser.add_argument("--rl-eval-every", type=int, default=10, help="updates between val evals")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    model, tokenizer = load(args.model)
    val_rows = make_builtin_rows("val", args.num_val, args.seed)
    result = {"model": args.model, "before": evaluate(model, tokenizer, val_rows, samples=args.samples)}
    if args.rl_smoke:
        result["rl"] = rl_smoke(model, tokenizer, val_rows, updates=args.rl_updates,
                                batch=args.rl_batch, lr=args.rl_lr, seed=args.seed,
                                eval_every=args.rl_eval_every)
        result["after"] = evaluate(model, tokenizer, val_rows, samples=args.samples)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
