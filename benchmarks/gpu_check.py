"""GPU check, one command: does hybridflow run on CUDA/NCCL in bf16 with the vLLM rollout colocated with the
FSDP actor? A few minutes on one GPU; prints ONE JSON object; exits non-zero when anything fails.

    python benchmarks/gpu_check.py [--steps 4] [--reshard-gpus N]

The model is a small real-architecture one (Qwen2: 12 layers, hidden 1024, GQA 16/4 heads, ~0.1 B parameters)
built from a config with random weights (``initializer_range`` 0.1, so its next-token distributions are peaked
and a change of weights shows in the logprobs) and written to a temporary directory with the tokenizer of the
shipped ``builtin:tiny-arith`` model (vocabulary 512): no download. Three parts, each in its own process (so one
part's CUDA and vLLM state cannot leak into the next), all of which must pass:

* ``ppo``: ``hybridflow train quickstart`` with ``rollout.name=vllm``, ``trainer.device=cuda``, one GPU shared
  by the actor+rollout+reference worker and the critic (Ray colocation), bf16, ``--steps`` steps. Reported per
  step: ``rollout/logprob_diff_max`` (max |vLLM sampling logprob - FSDP actor's recomputed logprob| over
  response tokens: both start from the same checkpoint, so step 1 shows the bf16 kernel difference; from step
  2 on the engine runs on weights synced in memory after each update), ``rollout/kl``, tokens/s
  (``perf/throughput``) and step time. Passes when every step ran and later steps' diff stays within
  ``2 x step 1 + 0.05`` nats.
* ``sync``: a vLLM engine and a bf16 Hugging Face copy of the model (the trainer's side) in one process on one
  GPU. The copy's weights are perturbed (Gaussian noise, 0.5 x the init std), then sampled responses of the
  engine are scored by the copy before and after ``load_weights`` (the in-memory sync the actor worker uses):
  the synced mean |logprob difference| must be under a tenth of the stale one. Then device memory in use
  (``torch.cuda.mem_get_info``: all allocations on the GPU, vLLM's own allocator included) before
  ``sleep(1)``, asleep and after ``wake()``, and that greedy decoding after waking is unchanged; the same for
  ``sleep(2)`` + ``wake()`` + a full ``load_weights``. Also the engine's sampling tokens/s on 512 prompts.
* ``reshard``: the 3D-HybridEngine (:class:`hybridflow.engine.HybridEngine`) switching a bf16 Llama from its
  FSDP training layout to its generation layout over ``--reshard-gpus`` GPUs with NCCL (default: all visible
  ones), against one plain ``all_gather`` of the same bytes and against the naive full gather (pieces of
  ``benchmarks/reshard.py``); the engine's shards must equal the naive ones. On one GPU both are local copies.

Without a GPU (``torch.cuda.is_available()`` false) or without vLLM it stops at once with a message on stderr
and exit status 2. Not yet run on a GPU by the project (see docs/how-to/docker.md, "The GPU check").
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

HERE = Path(__file__).resolve().parent
EXIT_NO_GPU = 2
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")
MODEL = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=12, num_attention_heads=16,
             num_key_value_heads=4, max_position_embeddings=512, initializer_range=0.1, tie_word_embeddings=True)
PART_TIMEOUT_S = {"sync": 600, "reshard": 300, "ppo": 900}


def preflight() -> str | None:
    """Why this machine cannot run the check (no GPU, no vLLM, no NCCL), or None."""
    if not torch.cuda.is_available():
        return (f"gpu_check: no GPU: torch.cuda.is_available() is False (torch {torch.__version__}, CUDA build "
                f"{torch.version.cuda or 'none'}); run it on a machine with an NVIDIA GPU and the CUDA build of torch")
    if importlib.util.find_spec("vllm") is None:
        return 'gpu_check: vllm is not installed (pip install -e ".[vllm]")'
    if not torch.distributed.is_nccl_available():
        return "gpu_check: this torch build has no NCCL"
    return None


def write_model_dir(path: Path) -> Path:
    """A random-init Qwen2 checkpoint (bf16) with the tokenizer of ``builtin:tiny-arith``, in ``path``."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from hybridflow.models.builtin import resolve_model_path

    source = Path(resolve_model_path("builtin:tiny-arith"))
    base = json.loads((source / "config.json").read_text())
    config = Qwen2Config(vocab_size=base["vocab_size"], bos_token_id=base["bos_token_id"],
                         eos_token_id=base["eos_token_id"], pad_token_id=base["pad_token_id"], **MODEL)
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    for name in TOKENIZER_FILES:
        shutil.copy(source / name, path / name)
    return path


# ---------------------------------------------------------------------------------------------------- part: ppo
def part_ppo(model_dir: Path, work: Path, steps: int) -> dict:
    """A short PPO run through the real driver and Ray workers; see the module docstring."""
    from hybridflow.config import load_config
    from hybridflow.trainer.main import run_ppo

    run_dir = work / "ppo_run"
    cfg = load_config("quickstart", [
        f"actor_rollout_ref.model.path={model_dir}", "actor_rollout_ref.model.dtype=bfloat16",
        "actor_rollout_ref.rollout.name=vllm", "trainer.device=cuda", "trainer.n_gpus_per_node=1",
        f"trainer.total_training_steps={steps}", "trainer.val_before_train=false", "trainer.test_freq=-1",
        "trainer.save_freq=-1", "trainer.logger=[console,jsonl]", "trainer.plot_curves=false",
        f"trainer.default_local_dir={run_dir}", "data.max_response_length=64",
    ])
    start = time.perf_counter()
    run_ppo(cfg)
    wall = time.perf_counter() - start
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "rollout/logprob_diff_max" in r]
    diffs = [r["rollout/logprob_diff_max"] for r in train]
    bound = 2 * diffs[0] + 0.05 if diffs else 0.0
    return {
        "steps": [r["step"] for r in train], "logprob_diff_max": diffs, "kl": [r.get("rollout/kl") for r in train],
        "tokens_per_s": [r.get("perf/throughput") for r in train], "step_s": [r.get("timing_s/step") for r in train],
        "gen_s": [r.get("timing_s/gen") for r in train], "wall_s": round(wall, 1),
        "sync_bound": bound, "ok": len(train) == steps and all(d <= bound for d in diffs[1:]),
    }


# --------------------------------------------------------------------------------------------------- part: sync
def _prompts(count: int, length: int, vocab: int, seed: int):
    """``count`` prompts of ``length`` random tokens (ids 3..vocab-1: no pad/bos/eos), no padding needed."""
    from hybridflow.protocol import DataProto

    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, vocab, (count, length), generator=gen)
    mask = torch.ones_like(input_ids)
    positions = torch.arange(length).expand(count, length).clone()
    return DataProto.from_dict(tensors={"input_ids": input_ids, "attention_mask": mask, "position_ids": positions})


@torch.no_grad()
def _trainer_logprobs(model, out) -> torch.Tensor:
    """(N, R) fp32 logprobs of the sampled response tokens under ``model`` (one forward over prompt+response)."""
    batch = out.batch
    p, r = batch["prompts"].shape[1], batch["responses"].shape[1]
    logits = model(input_ids=batch["input_ids"].cuda(), attention_mask=batch["attention_mask"].cuda(),
                   position_ids=batch["position_ids"].cuda(), use_cache=False).logits.float()
    logp = logits[:, p - 1:p - 1 + r].log_softmax(-1)
    return logp.gather(-1, batch["responses"].cuda().unsqueeze(-1)).squeeze(-1).cpu()


def _logprob_gap(engine, model, prompts) -> dict:
    """Mean / max |engine sampling logprob - model logprob| over the response tokens of one seeded sample."""
    out = engine.generate_sequences(prompts)
    mask = out.batch["response_mask"].bool()
    gap = (out.batch["rollout_log_probs"] - _trainer_logprobs(model, out)).abs()[mask]
    return {"mean": gap.mean().item(), "max": gap.max().item(), "tokens": int(mask.sum())}


def _used_gib() -> float:
    free, total = torch.cuda.mem_get_info()
    return round((total - free) / 2**30, 3)


def _sleep_cycle(engine, level: int, greedy, reload_state) -> dict:
    """Device memory before / during / after a ``sleep(level)`` and whether greedy decoding is unchanged."""
    before_tokens = engine.generate_sequences(greedy).batch["responses"]
    torch.cuda.synchronize()
    used = {"before_sleep_gib": _used_gib()}
    engine.sleep(level)
    used["asleep_gib"] = _used_gib()
    engine.wake()
    if level == 2:
        engine.load_weights(reload_state())
    used["after_wake_gib"] = _used_gib()
    used["freed_gib"] = round(used["before_sleep_gib"] - used["asleep_gib"], 3)
    used["greedy_unchanged"] = bool(torch.equal(engine.generate_sequences(greedy).batch["responses"], before_tokens))
    return used


def part_sync(model_dir: Path, work: Path, steps: int) -> dict:
    """vLLM engine + trainer copy on one GPU: in-memory weight sync, sleep/wake memory, tokens/s."""
    from transformers import AutoModelForCausalLM

    from hybridflow.rollout import VLLMRollout

    prompt_len, response_len = 16, 64
    cfg = SimpleNamespace(response_length=response_len, n=1, do_sample=True, temperature=1.0, top_p=1.0, top_k=-1,
                          micro_batch_size=64, gpu_memory_utilization=0.3)
    config = json.loads((model_dir / "config.json").read_text())
    engine = VLLMRollout(str(model_dir), cfg, eos_token_id=config["eos_token_id"],
                         pad_token_id=config["pad_token_id"], dtype="bfloat16",
                         max_model_len=prompt_len + response_len)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()
    vocab = config["vocab_size"]
    sampled = _prompts(64, prompt_len, vocab, seed=1)
    sampled.meta_info.update(seed=7)
    result = {"before_perturbation": _logprob_gap(engine, model, sampled)}
    gen = torch.Generator(device="cuda").manual_seed(3)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=gen, device="cuda", dtype=param.dtype)
                       * (0.5 * MODEL["initializer_range"]))
    result["stale"] = _logprob_gap(engine, model, sampled)
    start = time.perf_counter()
    engine.load_weights(model.state_dict().items())
    torch.cuda.synchronize()
    result["load_weights_s"] = round(time.perf_counter() - start, 3)
    result["synced"] = _logprob_gap(engine, model, sampled)
    greedy = _prompts(32, prompt_len, vocab, seed=2)
    greedy.meta_info.update(do_sample=False)
    result["sleep_level_1"] = _sleep_cycle(engine, 1, greedy, None)
    result["sleep_level_2"] = _sleep_cycle(engine, 2, greedy, lambda: model.state_dict().items())
    many = _prompts(512, prompt_len, vocab, seed=4)
    many.meta_info.update(seed=11)
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = engine.generate_sequences(many)
    seconds = time.perf_counter() - start
    result["rollout_tokens_per_s"] = round(out.meta_info["num_generated_tokens"] / seconds, 1)
    engine.close()
    sleeps = (result["sleep_level_1"], result["sleep_level_2"])
    result["ok"] = (result["synced"]["mean"] < 0.1 * result["stale"]["mean"]
                    and all(s["greedy_unchanged"] and s["freed_gib"] > 0 for s in sleeps))
    return result


# ------------------------------------------------------------------------------------------------ part: reshard
def _reshard_rank(rank: int, world: int, port: int, args: SimpleNamespace, out_path: str) -> None:
    import torch.distributed as dist

    sys.path.insert(0, str(HERE))
    from reshard import _config, _naive  # benchmarks/reshard.py: the model config and the naive gather

    from hybridflow.distributed import build_mesh, parallelize_model
    from hybridflow.engine import HybridEngine

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl")
    with torch.device("meta"):
        model = _config_model(_config(args))
    model = parallelize_model(model, build_mesh(dp=world))
    model.to_empty(device="cuda")
    model.tie_weights()
    gen = torch.Generator(device="cuda").manual_seed(1000 + rank)
    with torch.no_grad():
        for param in model.parameters():
            local = param.to_local() if hasattr(param, "to_local") else param
            local.copy_(torch.randn(local.shape, generator=gen, device="cuda", dtype=local.dtype) * 0.02)
    engine = HybridEngine(model, build_mesh(dp=world), gen_tp=args.tp_g, bucket_bytes=64 << 20)

    def switch():
        engine.switch_to_training()
        return {n: p.detach().clone() for n, p in engine.switch_to_generation().named_parameters()}

    gen_bytes = max(engine.plan.gen_bytes(r) for r in range(world))
    numel = gen_bytes // 2 // world * world  # bf16

    def all_gather():
        out = torch.empty(numel, device="cuda", dtype=torch.bfloat16)
        dist.all_gather_single(out, torch.ones(numel // world, device="cuda", dtype=torch.bfloat16))
        return out

    engine_s, shards = _timed_cuda(switch, args.repeats)
    naive_s, naive = _timed_cuda(lambda: _naive(engine), args.repeats)
    gather_s, _ = _timed_cuda(all_gather, args.repeats)
    match = torch.tensor([int(all(torch.equal(shards[n], naive[n]) for n in naive))], device="cuda")
    dist.all_reduce(match, op=dist.ReduceOp.MIN)
    if rank == 0:
        Path(out_path).write_text(json.dumps({
            "world_size": world, "backend": dist.get_backend(), "tp_g": args.tp_g,
            "model_bytes": engine.plan.model_bytes(), "gen_shard_bytes_max": gen_bytes,
            "engine_s": round(engine_s, 5), "naive_s": round(naive_s, 5), "all_gather_s": round(gather_s, 5),
            "engine_over_all_gather": round(engine_s / gather_s, 3), "shards_match": bool(match.item()),
            "ok": bool(match.item()),
        }))
    dist.destroy_process_group()


def _config_model(config):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM(config).to(torch.bfloat16)


def _timed_cuda(fn, repeats: int):
    """Median seconds of ``fn`` over ``repeats`` runs, device-synchronized and barrier to barrier."""
    import torch.distributed as dist

    times, result = [], None
    for _ in range(repeats):
        dist.barrier()
        torch.cuda.synchronize()
        start = time.perf_counter()
        result = fn()
        torch.cuda.synchronize()
        dist.barrier()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def part_reshard(model_dir: Path, work: Path, steps: int, gpus: int | None = None) -> dict:
    """The engine's reshard vs one all-gather over the visible GPUs (NCCL), a 24-layer bf16 Llama."""
    import torch.multiprocessing as mp

    world = gpus or torch.cuda.device_count()
    args = SimpleNamespace(vocab=32000, hidden=1024, layers=24, tp_g=1, repeats=5)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = work / "reshard.json"
    mp.spawn(_reshard_rank, args=(world, port, args, str(out)), nprocs=world, join=True)
    return json.loads(out.read_text())


# ------------------------------------------------------------------------------------------------------ driver
PARTS = {"sync": part_sync, "reshard": part_reshard, "ppo": part_ppo}


def _run_part(name: str, model_dir: Path, work: Path, args: argparse.Namespace) -> dict:
    """Run one part in a fresh Python process; its JSON, or what went wrong (status and stderr's tail)."""
    out = work / f"{name}.result.json"
    cmd = [sys.executable, __file__, "--part", name, "--model-dir", str(model_dir), "--work", str(work),
           "--steps", str(args.steps), "--part-out", str(out)]
    if args.reshard_gpus:
        cmd += ["--reshard-gpus", str(args.reshard_gpus)]
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=PART_TIMEOUT_S[name])
    except subprocess.TimeoutExpired as exc:
        return {"ok": False, "error": f"timed out after {exc.timeout} s", "stderr_tail": str(exc.stderr)[-3000:]}
    seconds = round(time.perf_counter() - start, 1)
    if proc.returncode != 0 or not out.is_file():
        return {"ok": False, "error": f"exit status {proc.returncode}", "part_s": seconds,
                "stderr_tail": proc.stderr[-3000:]}
    return {**json.loads(out.read_text()), "part_s": seconds}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=4, help="PPO steps of the ppo part")
    parser.add_argument("--reshard-gpus", type=int, default=None, help="GPUs of the reshard part (default: all)")
    parser.add_argument("--part", choices=sorted(PARTS), help=argparse.SUPPRESS)  # internal: one part
    parser.add_argument("--model-dir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--part-out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    problem = preflight()
    if problem:
        print(problem, file=sys.stderr)
        return EXIT_NO_GPU
    if args.part:
        extra = {"gpus": args.reshard_gpus} if args.part == "reshard" else {}
        result = PARTS[args.part](args.model_dir, args.work, args.steps, **extra)
        args.part_out.write_text(json.dumps(result))
        return 0
    with tempfile.TemporaryDirectory(prefix="hybridflow_gpu_check_") as tmp:
        work = Path(tmp)
        model_dir = write_model_dir(work / "model")
        report = {"gpu": torch.cuda.get_device_name(0), "gpus_visible": torch.cuda.device_count(),
                  "torch": torch.__version__, "cuda": torch.version.cuda, "model": {"arch": "Qwen2", **MODEL}}
        report["vllm"] = importlib.metadata.version("vllm")  # not imported here: stdout carries only the JSON
        for name in PARTS:
            report[name] = _run_part(name, model_dir, work, args)
    report["ok"] = all(report[name]["ok"] for name in PARTS)
    print(json.dumps(report))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
