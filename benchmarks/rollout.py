"""Generation throughput of the ``hf`` and ``vllm`` rollout backends, measured in one run.

Both backends get the same prompts (the built-in task's validation questions, tokenized with the model's chat
template and left-padded as in training), the same model weights (the checkpoint; fp32) and the same sampling
settings, in the same process with the same torch thread count. Each backend first generates once untimed
(warm-up), then ``--repeats`` times timed; tokens/s is generated tokens (sum of ``response_mask``) over the timed
seconds. Prints ONE JSON object, with the vllm/hf throughput ratio. Needs vLLM (see README: vLLM backend).

    python benchmarks/rollout.py [--model builtin:tiny-arith] [--prompts 64] [--n 4] [--response-length 32]
                                 [--temperature 1.0] [--repeats 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from types import SimpleNamespace

import torch

from hybridflow.data.builtin_task import make_builtin_rows
from hybridflow.data.dataset import RLHFDataset, collate_fn
from hybridflow.models.hf import get_eos_token_ids, load_causal_lm, load_tokenizer
from hybridflow.rollout import HFRollout, VLLMRollout


def measure(rollout, prompts, repeats: int) -> dict:
    rollout.generate_sequences(prompts)  # warm-up
    tokens, seconds = 0, 0.0
    for _ in range(repeats):
        start = time.perf_counter()
        out = rollout.generate_sequences(prompts)
        seconds += time.perf_counter() - start
        tokens += int(out.batch["response_mask"].sum())
    return {"tokens_per_s": tokens / seconds, "generated_tokens": tokens, "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="builtin:tiny-arith")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--n", type=int, default=4, help="samples per prompt")
    parser.add_argument("--response-length", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    tokenizer = load_tokenizer(args.model)
    eos, pad = get_eos_token_ids(args.model, tokenizer), tokenizer.pad_token_id
    dataset = RLHFDataset(make_builtin_rows("val", args.prompts, seed=args.seed), tokenizer, max_prompt_length=256)
    prompts = collate_fn([dataset[i] for i in range(len(dataset))], pad_token_id=pad)
    prompts.meta_info["seed"] = args.seed
    config = SimpleNamespace(response_length=args.response_length, n=args.n, do_sample=True,
                             temperature=args.temperature, top_p=1.0, top_k=-1, micro_batch_size=args.prompts)
    max_model_len = prompts.batch["input_ids"].shape[1] + args.response_length

    start = time.perf_counter()
    vllm = VLLMRollout(args.model, config, eos, pad, dtype="float32", max_model_len=max_model_len)
    vllm_startup = time.perf_counter() - start
    hf = HFRollout(load_causal_lm(args.model, torch.float32).eval(), config, eos, pad)
    results = {"hf": measure(hf, prompts, args.repeats), "vllm": measure(vllm, prompts, args.repeats)}
    results["vllm"]["engine_startup_s"] = vllm_startup
    vllm.close()

    print(json.dumps({
        "model": args.model,
        "prompts": args.prompts,
        "samples_per_prompt": args.n,
        "response_length": args.response_length,
        "prompt_tokens_padded": prompts.batch["input_ids"].shape[1],
        "sampling": {"temperature": args.temperature, "top_p": 1.0, "top_k": -1, "seed": args.seed},
        "dtype": "float32",
        "torch_threads": args.threads,
        "repeats": args.repeats,
        **results,
        "vllm_over_hf": results["vllm"]["tokens_per_s"] / results["hf"]["tokens_per_s"],
    }, indent=2))


if __name__ == "__main__":
    main()
