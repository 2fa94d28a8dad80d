"""Resharding the actor from its training layout to its generation layout: the 3D-HybridEngine against the naive
path and against the transport's own limit, on CPU with gloo ranks.

A Llama model (>= 50M parameters, built in memory on the meta device, then sharded and filled on each rank) is
laid out for training (FSDP2 over dp, DTensor tp), and each rank then builds its generation shard (tp_g) three
ways, in the same run, each timed barrier to barrier (median of ``--repeats``):

* ``engine_s``: :meth:`hybridflow.engine.HybridEngine.switch_to_generation` (gathers only inside each rank's
  micro data-parallel group, bucketed point-to-point transfers);
* ``naive_s``: every rank gathers every full tensor (``DTensor.full_tensor``, one weight at a time), then keeps
  its generation slice;
* ``collective_s``: one plain ``all_gather`` across the same ranks, same backend, producing the same total bytes
  as the generation shards hold (each rank ends with as many bytes as the largest generation shard);
  ``collective_recv_matched_s``: the same, sized so that each rank *receives* as many bytes as the engine's
  busiest receiver does (the engine's own overlap is not moved).

Also reported: ``peak_extra_bytes`` (largest over ranks of the tensor memory allocated during the engine's switch,
measured with :class:`hybridflow.engine.TensorMemoryTracker`), the naive path's peak, ``model_bytes``, the
layouts, and ``shards_match`` (the engine's shards are bit-identical to the naive ones).

    python benchmarks/reshard.py [--dp 2 --tp 2 --tp-g 2] [--layers 12 --hidden 512] [--repeats 3]

Prints ONE JSON object. Timings on a shared machine are noisy; no assertion is made here.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor
from transformers import LlamaConfig, LlamaForCausalLM

from hybridflow.distributed import build_mesh, parallelize_model
from hybridflow.engine import HybridEngine, TensorMemoryTracker
from hybridflow.engine.plan import local_slices


def _config(args) -> LlamaConfig:
    return LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
                       num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4,
                       tie_word_embeddings=True)


def _timed(fn, repeats: int) -> tuple[float, object]:
    times, result = [], None
    for _ in range(repeats):
        result = None
        dist.barrier()
        start = time.perf_counter()
        result = fn()
        dist.barrier()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def _naive(engine: HybridEngine) -> dict[str, torch.Tensor]:
    """Every rank gathers every full weight, then keeps its generation slice."""
    rank, out = engine.rank, {}
    for p in engine.plan.params:
        param = engine.train_module.get_parameter(p.name)
        full = param.full_tensor() if isinstance(param, DTensor) else param.detach()
        out[p.name] = full[local_slices(p.gen_boxes[rank], tuple((0, n) for n in p.shape))].clone()
        del full
    return out


def _worker(rank: int, world: int, port: int, args, out_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    with torch.device("meta"):
        model = LlamaForCausalLM(_config(args))
    model = parallelize_model(model, build_mesh(dp=args.dp, tp=args.tp))
    model.to_empty(device="cpu")
    model.tie_weights()
    with torch.no_grad():  # deterministic per-rank values: the full model is whatever the shards make it
        gen = torch.Generator().manual_seed(1000 + rank)
        for param in model.parameters():
            local = param.to_local() if isinstance(param, DTensor) else param
            local.copy_(torch.randn(local.shape, generator=gen) * 0.02)
    engine = HybridEngine(model, build_mesh(dp=args.dp, tp=args.tp), gen_tp=args.tp_g,
                          bucket_bytes=args.bucket_mb << 20)
    plan = engine.plan

    def engine_switch():
        engine.switch_to_training()  # free the previous repeat's copy first (outside the measured memory)
        with TensorMemoryTracker() as mem:
            module = engine.switch_to_generation()
        return mem.peak_bytes, {n: p.detach() for n, p in module.named_parameters()}

    def naive():
        with TensorMemoryTracker() as mem:
            shards = _naive(engine)
        return mem.peak_bytes, shards

    gen_bytes = max(plan.gen_bytes(r) for r in range(world))
    recv_bytes = max(plan.recv_bytes(r) for r in range(world))

    def collective(out_bytes: int):
        numel = out_bytes // 4 // world * world
        inp = torch.ones(numel // world)
        out = torch.empty(numel)
        dist.all_gather_single(out, inp)
        return out.numel() * 4

    engine_s, (engine_peak, engine_shards) = _timed(engine_switch, args.repeats)
    naive_s, (naive_peak, naive_shards) = _timed(naive, args.repeats)
    collective_s, collective_bytes = _timed(lambda: collective(gen_bytes), args.repeats)
    matched_s, _ = _timed(lambda: collective(recv_bytes * world // (world - 1)), args.repeats)
    match = all(torch.equal(engine_shards[n], naive_shards[n]) for n in naive_shards)
    stats = torch.tensor([engine_peak, naive_peak, int(match)], dtype=torch.float64)
    dist.all_reduce(stats[:2], op=dist.ReduceOp.MAX)
    dist.all_reduce(stats[2:], op=dist.ReduceOp.MIN)
    if rank == 0:
        summary = plan.summary()
        result = {
            "engine_s": round(engine_s, 4), "naive_s": round(naive_s, 4), "collective_s": round(collective_s, 4),
            "collective_recv_matched_s": round(matched_s, 4),
            "engine_over_collective": round(engine_s / collective_s, 3),
            "engine_over_naive": round(engine_s / naive_s, 3),
            "peak_extra_bytes": int(stats[0]), "naive_peak_extra_bytes": int(stats[1]),
            "model_bytes": plan.model_bytes(), "params": sum(p.numel() for p in model.parameters()),
            "tp_g": args.tp_g, "train_layout": summary["train"], "generation_layout": summary["generate"],
            "world_size": world, "backend": dist.get_backend(), "bucket_bytes": args.bucket_mb << 20,
            "collective_bytes_per_rank": collective_bytes, "gen_shard_bytes_max": gen_bytes,
            "engine_recv_bytes_max": recv_bytes,
            "micro_dp_groups": [r["micro_dp_group"] for r in summary["ranks"]],
            "shards_match": bool(stats[2]), "repeats": args.repeats, "threads_per_rank": args.threads,
        }
        with open(out_path, "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--tp-g", dest="tp_g", type=int, default=2)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--bucket-mb", dest="bucket_mb", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    args = parser.parse_args()
    world = args.dp * args.tp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        mp.spawn(_worker, args=(world, port, args, out), nprocs=world, join=True)
        with open(out) as f:
            print(json.dumps(json.load(f)))


if __name__ == "__main__":
    main()
