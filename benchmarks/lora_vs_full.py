"""LoRA vs full fine-tuning on the same model and batch: trainable parameters, optimizer-state bytes, peak RSS and
the time of one PPO update (one process, fp32, no Ray; each variant in a fresh subprocess so peak RSS is its own).

Usage: python benchmarks/lora_vs_full.py [--model builtin:tiny-arith] [--rank 16] [--batch 32] [--steps 3]
Prints one JSON line per variant and one with the LoRA / full ratios. Figures from a loaded machine are not
performance claims.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time


def run_variant(model: str, rank: int, batch: int, steps: int) -> dict[str, float]:
    """One variant in this process: ``rank`` 0 is full fine-tuning. Returns its measurements."""
    import resource

    import torch

    from hybridflow.algorithms.sampling import SamplingSpec
    from hybridflow.config import load_config
    from hybridflow.models.hf import load_causal_lm
    from hybridflow.models.lora import apply_lora
    from hybridflow.protocol import DataProto
    from hybridflow.workers.optim import build_optimizer
    from hybridflow.workers.ppo_actor import PPOActor

    torch.manual_seed(0)
    cfg = load_config(None, [f"actor_rollout_ref.model.lora_rank={rank}", f"actor_rollout_ref.model.path={model}"])
    module = load_causal_lm(model, torch.float32)
    if rank:
        module = apply_lora(module, cfg.actor_rollout_ref.model)
    optimizer = build_optimizer(module, cfg.actor_rollout_ref.actor.optim)
    actor = PPOActor(module, optimizer, cfg.actor_rollout_ref.actor, SamplingSpec())
    prompt, response = 16, 16
    ids = torch.randint(3, module.config.vocab_size, (batch, prompt + response))
    data = DataProto.from_dict(tensors={
        "input_ids": ids, "responses": ids[:, prompt:], "attention_mask": torch.ones_like(ids),
        "position_ids": torch.arange(prompt + response).expand(batch, -1).clone(),
        "response_mask": torch.ones(batch, response, dtype=torch.long),
        "old_log_probs": -torch.rand(batch, response), "advantages": torch.randn(batch, response)})
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        actor.update_policy(data, mini_batch_size=batch)
        times.append(time.perf_counter() - start)
    state_bytes = sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values()
                      if torch.is_tensor(t))
    return {"lora_rank": rank, "trainable_params": sum(p.numel() for p in module.parameters() if p.requires_grad),
            "optimizer_state_bytes": state_bytes, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "update_s": min(times)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin:tiny-arith")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--variant", type=int, default=None, help=argparse.SUPPRESS)  # the subprocess entry
    args = parser.parse_args()
    if args.variant is not None:
        print(json.dumps(run_variant(args.model, args.variant, args.batch, args.steps)))
        return
    rows = []
    for rank in (0, args.rank):
        cmd = [sys.executable, __file__, "--model", args.model, "--batch", str(args.batch), "--steps",
               str(args.steps), "--variant", str(rank)]
        rows.append(json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines()[-1]))
        print(json.dumps(rows[-1]))
    full, lora = rows
    print(json.dumps({f"lora/full {k}": lora[k] / full[k] for k in
                      ("trainable_params", "optimizer_state_bytes", "peak_rss_mb", "update_s")}))


if __name__ == "__main__":
    from hybridflow.cli import run_script

    sys.exit(run_script(main))  # a config typo or a bad path: one line, not a traceback
