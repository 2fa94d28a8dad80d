"""Generation throughput of the ``hf`` and ``vllm`` rollout backends, measured in one run.

Both backends get the same prompts (the built-in task's validation questions, tokenized with the model's chat
template and left-padded as in training), the same model weights (the checkpoint; fp32) and the same sampling
settings, in the same process with the same torch thread count. Each backend first generates once untimed
(warm-up), then ``--repeats`` times timed; tokens/s is generated tokens (sum of ``response_mask``) over the timed
seconds. Prints ONE JSON line, with the vllm/hf throughput ratio and the machine's load average. Needs vLLM (see
docs/how-to/vllm.md).

``--shape medium`` is the compute-bound shape of docs/performance.md: the ~25M-parameter ``medium`` preset of
:mod:`hybridflow.models.presets` (random init), 64 prompts x 4 samples, 128 new tokens (each option can still be
overridden). ``--backends hf`` measures hf only (no vLLM installed).

    python benchmarks/rollout.py [--shape tiny|medium] [--model builtin:tiny-arith|medium|DIR] [--prompts 64] [--n 4]
                                 [--response-length 32] [--temperature 1.0] [--repeats 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from types import SimpleNamespace

import torch

from hybridflow.data.builtin_task import make_builtin_rows
from hybridflow.data.dataset import RLHFDataset, collate_fn
from hybridflow.models.hf import get_eos_token_ids, load_causal_lm, load_tokenizer
from hybridflow.models.presets import parameter_count, resolve_benchmark_model
from hybridflow.rollout import HFRollout, VLLMRollout

SHAPES = {  # option defaults per --shape
    "tiny": {"model": "builtin:tiny-arith", "prompts": 64, "n": 4, "response_length": 32},
    "medium": {"model": "medium", "prompts": 64, "n": 4, "response_length": 128},
}


def measure(rollout, prompts, repeats: int) -> dict:
    rollout.generate_sequences(prompts)  # warm-up
    tokens, seconds = 0, 0.0
    for _ in range(repeats):
        start = time.perf_counter()
        out = rollout.generate_sequences(prompts)
        seconds += time.perf_counter() - start
        tokens += int(out.batch["response_mask"].sum())
    return {"tokens_per_s": tokens / seconds, "generated_tokens": tokens, "seconds": seconds}


def _args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny", help="defaults of the options below")
    parser.add_argument("--model", default=None)
    parser.add_argument("--prompts", type=int, default=None)
    parser.add_argument("--n", type=int, default=None, help="samples per prompt")
    parser.add_argument("--response-length", type=int, default=None)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backends", default="hf,vllm", help="comma-separated: hf, vllm")
    args = parser.parse_args()
    for key, value in SHAPES[args.shape].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def main() -> None:
    args = _args()
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as work:
        path = resolve_benchmark_model(args.model, work)
        results, prompts = _measure_backends(args, path)
        params = parameter_count(path)
    summary = {
        "benchmark": "rollout", "shape": args.shape, "model": args.model, "parameters": params,
        "prompts": args.prompts, "samples_per_prompt": args.n, "response_length": args.response_length,
        "prompt_tokens_padded": prompts.batch["input_ids"].shape[1],
        "sampling": {"temperature": args.temperature, "top_p": 1.0, "top_k": -1, "seed": args.seed},
        "dtype": "float32", "torch_threads": args.threads, "repeats": args.repeats,
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()], **results,
    }
    if "hf" in results and "vllm" in results:
        summary["vllm_over_hf"] = results["vllm"]["tokens_per_s"] / results["hf"]["tokens_per_s"]
    print(json.dumps(summary))


def _measure_backends(args, path: str) -> tuple[dict, object]:
    """Tokens/s of each backend of ``--backends`` on the same prompts; returns (results, prompts)."""
    tokenizer = load_tokenizer(path)
    eos, pad = get_eos_token_ids(path, tokenizer), tokenizer.pad_token_id
    dataset = RLHFDataset(make_builtin_rows("val", args.prompts, seed=args.seed), tokenizer, max_prompt_length=256)
    prompts = collate_fn([dataset[i] for i in range(len(dataset))], pad_token_id=pad)
    prompts.meta_info["seed"] = args.seed
    config = SimpleNamespace(response_length=args.response_length, n=args.n, do_sample=True,
                             temperature=args.temperature, top_p=1.0, top_k=-1, micro_batch_size=args.prompts)
    max_model_len = prompts.batch["input_ids"].shape[1] + args.response_length
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    results = {}
    if "vllm" in backends:
        start = time.perf_counter()
        vllm = VLLMRollout(path, config, eos, pad, dtype="float32", max_model_len=max_model_len)
        startup = time.perf_counter() - start
        results["vllm"] = {**measure(vllm, prompts, args.repeats), "engine_startup_s": startup}
        vllm.close()
    if "hf" in backends:
        hf = HFRollout(load_causal_lm(path, torch.float32).eval(), config, eos, pad)
        results["hf"] = measure(hf, prompts, args.repeats)
    return results, prompts


if __name__ == "__main__":
    import sys

    from hybridflow.cli import run_script

    sys.exit(run_script(main))  # a config typo or a bad path: one line, not a traceback
