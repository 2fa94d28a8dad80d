"""Resharding the actor from its training layout to its generation layout: the 3D-HybridEngine against the naive
path and against the transport's own limit, on CPU with gloo ranks (HybridFlow, Sheng et al. 2024, Sec. 5).

A Llama model (>= 50M parameters, built in memory on the meta device, then sharded and filled on each rank) is
laid out for training, and each rank then builds its generation shard (tp_g), each way timed barrier to barrier
(median of ``--repeats``). Two training layouts (``--layout``):

* ``fsdp2`` (default): FSDP2 over dp, DTensor tp (``--dp --tp``);
* ``megatron``: Megatron-core's layout (``--dp --tp --pp``): each rank holds only its pipeline stage's weights
  (layers cut into pp equal runs, embedding on the first stage, final norm and head on the last), tp-local
  chunks (column-parallel q/k/v, gate/up, vocab-parallel embedding / head, row-parallel o/down), replicated over
  dp, served by a small stand-in engine (:class:`MegatronLayoutEngine`: the engine contract's layout, weight specs
  and shards; no model compute), so this needs no megatron-core.

Timed:

* ``engine_s``: :meth:`hybridflow.engine.HybridEngine.switch_to_generation` (gathers only inside each rank's
  micro data-parallel group, bucketed point-to-point transfers);
* ``naive_s`` (fsdp2 only): every rank gathers every full tensor (``DTensor.full_tensor``, one weight at a time),
  then keeps its generation slice;
* ``collective_s``: one plain ``all_gather`` across the same ranks, same backend, producing the same total bytes
  as the generation shards hold (each rank ends with as many bytes as the largest generation shard);
  ``collective_recv_matched_s``: the same, sized so that each rank *receives* as many bytes as the engine's
  busiest receiver does (the engine's own overlap is not moved).

Also reported: ``engine_over_collective`` (the ratio), ``peak_extra_bytes`` (largest over ranks of the tensor
memory allocated during the engine's switch, measured with :class:`hybridflow.engine.TensorMemoryTracker`) next
to ``peak_bound_bytes`` = model bytes / tp_g + one bucket, the naive path's peak, ``model_bytes``, the layouts,
``shards_match`` (the engine's shards are bit-identical to the naive ones / to slices of the full tensors), and
``load_avg_1m`` (the machine's load average when the run ended: figures from a loaded machine say little).

    python benchmarks/reshard.py [--dp 2 --tp 2 --tp-g 2] [--layers 12 --hidden 512] [--repeats 3]
    python benchmarks/reshard.py --layout megatron --dp 1 --tp 2 --pp 2 --tp-g 2

Prints ONE JSON object. Timings on a shared machine are noisy; no assertion is made here.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from typing import Callable, Iterator, Optional

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from transformers import LlamaConfig, LlamaForCausalLM

from _gloo import run_gloo_ranks  # benchmarks/_gloo.py (this script's folder is on sys.path)
from hybridflow.distributed import build_mesh, parallelize_model
from hybridflow.engine import HybridEngine, TensorMemoryTracker
from hybridflow.engine.plan import local_slices
from hybridflow.training import EngineSpec, ParallelLayout, TrainEngine, WeightSpec


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


ROWWISE = ("o_proj", "down_proj")


def _megatron_tp_dim(name: str) -> Optional[int]:
    """Megatron-core's tp split in HF names: norms replicated, row-parallel o/down on dim 1, the rest (column-
    parallel q/k/v, gate/up, vocab-parallel embedding and head) on dim 0."""
    if "norm" in name:
        return None
    return 1 if any(f".{k}." in name for k in ROWWISE) else 0


def _stage(name: str, pp: int, layers: int) -> Optional[int]:
    """Layers in pp equal runs; embedding on the first stage, final norm and head on the last."""
    if pp == 1:
        return None
    if name.startswith("model.layers."):
        return int(name.split(".")[2]) * pp // layers
    return 0 if name.startswith("model.embed_tokens") else pp - 1


def _full_tensor(index: int, shape: tuple[int, ...]) -> torch.Tensor:
    """Parameter ``index``'s full value, the same on every rank (so dp replicas agree)."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(1000 + index)) * 0.02


class MegatronLayoutEngine(TrainEngine):
    """Stand-in for a Megatron-core engine: its layout, weight specs and shards (its stage's parameters, tp-local
    chunks, replicated over dp), a ``meta`` skeleton as ``module`` with real rotary buffers; no compute."""

    def __init__(self, spec: EngineSpec, module: torch.nn.Module, shards: dict, specs: dict) -> None:
        self.spec, self.layout, self.module = spec, spec.layout, module
        self.optimizer = self.lr_scheduler = None
        self.skipped_steps = 0
        self._shards, self._specs = shards, specs

    @classmethod
    def build(cls, spec: EngineSpec) -> "MegatronLayoutEngine":
        config = spec.model
        with torch.device("meta"):
            module = LlamaForCausalLM(config)
        module.model.rotary_emb = type(module.model.rotary_emb)(config=config)  # real buffers
        d, t, s = spec.layout.coords(dist.get_rank())
        specs, shards = {}, {}
        for index, (name, param) in enumerate(module.named_parameters()):
            tp_dim, stage = _megatron_tp_dim(name), _stage(name, spec.layout.pp, config.num_hidden_layers)
            specs[name] = WeightSpec(tuple(param.shape), param.element_size(), tp_dim, dp_dim=None, pp_stage=stage)
            if stage in (None, s):
                full = _full_tensor(index, tuple(param.shape))
                shards[name] = (full if tp_dim is None else full.chunk(spec.layout.tp, dim=tp_dim)[t]).clone()
        return cls(spec, module, shards, specs)

    def iter_shards(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self._shards.items())

    def weight_specs(self) -> dict[str, WeightSpec]:
        return dict(self._specs)

    def offload(self) -> None:
        pass

    def onload(self, optimizer: bool = True) -> None:
        pass

    def _unused(self, *args: object, **kwargs: object) -> None:
        raise NotImplementedError("the benchmark's stand-in engine only serves shards")

    set_train = forward = zero_grad = optimizer_step = lr_scheduler_step = iter_weights = _unused
    save_checkpoint = load_checkpoint = _unused


def _fsdp2_engine(args: argparse.Namespace, rank: int) -> tuple[HybridEngine, Callable[[], dict]]:
    """The FSDP2(/tp) actor with deterministic per-rank values, and the naive path's shards."""
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
    return engine, lambda: _naive(engine)


def _megatron_engine(args: argparse.Namespace, rank: int) -> tuple[HybridEngine, Callable[[], dict]]:
    """The stand-in Megatron-layout actor, and the expected shards: slices of the full tensors."""
    spec = EngineSpec(kind="policy", model=_config(args), layout=ParallelLayout(dp=args.dp, tp=args.tp, pp=args.pp),
                      device="cpu")
    engine = HybridEngine(MegatronLayoutEngine.build(spec), gen_tp=args.tp_g, bucket_bytes=args.bucket_mb << 20)

    def expected() -> dict[str, torch.Tensor]:
        names = list(engine.train_engine.weight_specs())
        return {p.name: _full_tensor(names.index(p.name), p.shape)[
            local_slices(p.gen_boxes[rank], tuple((0, n) for n in p.shape))] for p in engine.plan.params}

    return engine, expected


def _worker(rank: int, args: argparse.Namespace, out_path: str) -> None:
    world = dist.get_world_size()
    engine, reference = (_megatron_engine if args.layout == "megatron" else _fsdp2_engine)(args, rank)
    plan = engine.plan

    def engine_switch():
        engine.switch_to_training()  # free the previous repeat's copy first (outside the measured memory)
        with TensorMemoryTracker() as mem:
            module = engine.switch_to_generation()
        return mem.peak_bytes, {n: p.detach() for n, p in module.named_parameters()}

    def naive():
        with TensorMemoryTracker() as mem:
            shards = reference()
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
    naive_s, (naive_peak, naive_shards) = _timed(naive, 1 if args.layout == "megatron" else args.repeats)
    collective_s, collective_bytes = _timed(lambda: collective(gen_bytes), args.repeats)
    matched_s, _ = _timed(lambda: collective(recv_bytes * world // (world - 1)), args.repeats)
    match = all(torch.equal(engine_shards[n], naive_shards[n]) for n in naive_shards)
    stats = torch.tensor([engine_peak, naive_peak, int(match)], dtype=torch.float64)
    dist.all_reduce(stats[:2], op=dist.ReduceOp.MAX)
    dist.all_reduce(stats[2:], op=dist.ReduceOp.MIN)
    if rank == 0:
        _write_result(out_path, args, engine, {
            "engine_s": round(engine_s, 4), "collective_s": round(collective_s, 4),
            "collective_recv_matched_s": round(matched_s, 4),
            "engine_over_collective": round(engine_s / collective_s, 3),
            "peak_extra_bytes": int(stats[0]), "shards_match": bool(stats[2]),
            "collective_bytes_per_rank": collective_bytes, "gen_shard_bytes_max": gen_bytes,
            "engine_recv_bytes_max": recv_bytes,
            **({} if args.layout == "megatron" else {
                "naive_s": round(naive_s, 4), "engine_over_naive": round(engine_s / naive_s, 3),
                "naive_peak_extra_bytes": int(stats[1])})})


def _write_result(out_path: str, args: argparse.Namespace, engine: HybridEngine, timed: dict) -> None:
    plan, summary = engine.plan, engine.plan.summary()
    result = {
        **timed, "layout": args.layout, "model_bytes": plan.model_bytes(),
        "peak_bound_bytes": plan.model_bytes() // args.tp_g + (args.bucket_mb << 20),
        "params": sum(math.prod(p.shape) for p in plan.params), "tp_g": args.tp_g,
        "train_layout": summary["train"], "generation_layout": summary["generate"],
        "world_size": plan.train.world_size, "backend": dist.get_backend(), "bucket_bytes": args.bucket_mb << 20,
        "micro_dp_groups": [r["micro_dp_group"] for r in summary["ranks"]],
        "repeats": args.repeats, "threads_per_rank": args.threads, "load_avg_1m": round(os.getloadavg()[0], 2),
    }
    with open(out_path, "w") as f:
        json.dump(result, f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--pp", type=int, default=1, help="pipeline stages (--layout megatron only)")
    parser.add_argument("--tp-g", dest="tp_g", type=int, default=2)
    parser.add_argument("--layout", choices=("fsdp2", "megatron"), default="fsdp2",
                        help="training layout: FSDP2 + DTensor tp, or Megatron-core's (dp x tp x pp, dp-replicated)")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--bucket-mb", dest="bucket_mb", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    args = parser.parse_args()
    if args.pp > 1 and args.layout != "megatron":
        parser.error("--pp needs --layout megatron (fsdp2 has no pipeline parallelism)")
    world = args.dp * args.tp * args.pp
    print(json.dumps(run_gloo_ranks(_worker, world, args, threads=args.threads)))


if __name__ == "__main__":
    main()
