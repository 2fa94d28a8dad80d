"""Measure the shipped ``tiny-arith`` model on held-out problems, optionally after a REINFORCE smoke run.

Usage (prints one JSON object)::

    python scripts/check_tiny_arith.py [--model builtin:tiny-arith] [--num-val 256] [--samples 4]
        [--rl-smoke [--rl-updates 60] [--rl-batch 64] [--rl-lr 1e-4]]

A repository script (the package ships the model as an asset; ``scripts/build_tiny_arith.py`` builds it).
Reports the greedy score and the mean temperature-1.0 (top-p 1, no top-k) sampled score on ``val`` prompts, plus
token lengths of prompts and of correct / incorrect sampled responses. The prompts, the generation and the scores go
through the path of validation in training and ``hybridflow eval`` (:mod:`hybridflow.rewards.validation`): prompts
by :class:`~hybridflow.data.dataset.RLHFDataset` (chat template), the ``hf`` rollout backend, rewards by
:func:`~hybridflow.rewards.batch.score_batch`; so ``greedy_score`` is ``hybridflow eval``'s ``mean@1`` on the same
rows.

``--rl-smoke`` then runs single-process REINFORCE with a batch-mean baseline (Williams 1992, eq. 11 with a
constant baseline): per update, ``--rl-batch`` train prompts, one temperature-1 sample each from the same rollout
backend, reward r in {0, 1}, loss = -mean_i[(r_i - mean(r)) * sum_t log pi(y_it | x_i, y_i,<t)], Adam. It checks
that RL can move the greedy val score, which is what the quickstart demo relies on.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from typing import Any, Optional

import torch

from hybridflow.algorithms import logprobs_from_logits
from hybridflow.data.builtin_task import make_builtin_rows
from hybridflow.data.dataset import collate_fn
from hybridflow.evaluation import prompt_dataset, rollout_config
from hybridflow.models.hf import get_eos_token_ids, load_causal_lm, load_tokenizer
from hybridflow.protocol import DataProto
from hybridflow.rewards.batch import score_batch
from hybridflow.rewards.validation import GREEDY, generate_and_score, score_passes
from hybridflow.rollout import BaseRollout, get_rollout_class

logger = logging.getLogger(__name__)

SAMPLED = {"do_sample": True, "temperature": 1.0, "top_p": 1.0, "top_k": -1}
RESPONSE_LENGTH = 32


def load(path: str, batch: int = 128) -> tuple[torch.nn.Module, Any, BaseRollout]:
    """(model in eval mode, tokenizer, the ``hf`` rollout generating from that model in place)."""
    model = load_causal_lm(path, torch.float32).eval()
    tokenizer = load_tokenizer(path)
    rollout = get_rollout_class("hf")(model, rollout_config(RESPONSE_LENGTH, batch),
                                      eos_token_id=get_eos_token_ids(path, tokenizer),
                                      pad_token_id=tokenizer.pad_token_id)
    return model, tokenizer, rollout


def prompts(tokenizer: Any, rows: list[dict]) -> DataProto:
    """The rows' prompts as training and ``hybridflow eval`` collate them (left-padded, chat template)."""
    dataset = prompt_dataset(rows, tokenizer, None)
    return collate_fn([dataset[i] for i in range(len(dataset))], tokenizer.pad_token_id)


def _mean(xs: list[float]) -> Optional[float]:
    return round(statistics.fmean(xs), 4) if xs else None


def evaluate(rollout: BaseRollout, tokenizer: Any, data: DataProto, *, samples: int, batch: int = 128,
             seed: int = 0) -> dict:
    """Greedy score, mean sampled score (``samples`` draws per prompt), and token lengths."""
    passes = {"greedy": GREEDY, **({"sampled": {**SAMPLED, "n": samples}} if samples else {})}
    lengths: dict[str, list[int]] = {"correct": [], "incorrect": []}

    def record_lengths(name: str, rows: DataProto, scores: list[float]) -> None:
        if name == "sampled":
            for length, score in zip(rows.batch["response_mask"].sum(-1).tolist(), scores):
                lengths["correct" if score > 0 else "incorrect"].append(length)

    results = score_passes(rollout.generate_sequences, lambda rows: score_batch(tokenizer, rows), data, passes,
                           batch, seed, lambda name: f"check ({name})", record_lengths)
    prompt_tokens = data.batch["attention_mask"].sum(-1).tolist()
    return {
        "num_prompts": len(data),
        "greedy_score": _mean(results["greedy"][0]),
        "sampled_score": _mean(results["sampled"][0]) if samples else None,
        "prompt_tokens_mean": _mean(prompt_tokens),
        "prompt_tokens_max": max(prompt_tokens),
        "response_tokens_correct_mean": _mean(lengths["correct"]),
        "response_tokens_incorrect_mean": _mean(lengths["incorrect"]),
    }


def _response_logprob_sum(model: torch.nn.Module, rows: DataProto) -> torch.Tensor:
    """Sum of log pi over each response's valid tokens, (N,) float32, with grad."""
    b = rows.batch
    width = b["responses"].shape[1]
    logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"],
                   position_ids=b["position_ids"]).logits[:, -width - 1:-1]
    return (logprobs_from_logits(logits, b["responses"]) * b["response_mask"]).sum(-1)


def rl_smoke(model: torch.nn.Module, rollout: BaseRollout, tokenizer: Any, val_data: DataProto, *, updates: int,
             batch: int, lr: float, seed: int, eval_every: int = 10) -> dict:
    """REINFORCE with a batch-mean baseline on train prompts; greedy val score along the way."""
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    train = prompts(tokenizer, make_builtin_rows("train", updates * batch, seed)).split(batch)
    curve, start = [], time.perf_counter()
    for step, chunk in enumerate(train):
        model.eval()
        ((rows, scores),) = generate_and_score(rollout.generate_sequences, lambda r: score_batch(tokenizer, r),
                                               chunk, {**SAMPLED, "n": 1}, None, seed + step, "rl")
        rewards = torch.tensor(scores)
        model.train()
        loss = -((rewards - rewards.mean()) * _response_logprob_sum(model, rows)).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        model.eval()
        if (step + 1) % eval_every == 0 or step + 1 == updates:
            greedy = evaluate(rollout, tokenizer, val_data, samples=0)["greedy_score"]
            curve.append({"update": step + 1, "train_reward": round(rewards.mean().item(), 4),
                          "val_greedy": greedy, "seconds": round(time.perf_counter() - start, 1)})
            logger.info("rl %s", curve[-1])
    return {"updates": updates, "batch": batch, "lr": lr,
            "seconds": round(time.perf_counter() - start, 1), "curve": curve}


def main(argv: list[str] | None = None) -> dict:
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
    model, tokenizer, rollout = load(args.model)
    val_data = prompts(tokenizer, make_builtin_rows("val", args.num_val, args.seed))
    result = {"model": args.model, "before": evaluate(rollout, tokenizer, val_data, samples=args.samples,
                                                      seed=args.seed)}
    if args.rl_smoke:
        result["rl"] = rl_smoke(model, rollout, tokenizer, val_data, updates=args.rl_updates, batch=args.rl_batch,
                                lr=args.rl_lr, seed=args.seed, eval_every=args.rl_eval_every)
        result["after"] = evaluate(rollout, tokenizer, val_data, samples=args.samples, seed=args.seed)
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
