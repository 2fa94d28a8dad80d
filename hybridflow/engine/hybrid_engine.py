"""The 3D-HybridEngine (HybridFlow, Sheng et al. 2024, Sec. 5): the actor trains in one layout and generates in
another, on the same ranks, resharding its weights in between without redundant copies.

Lifecycle (every rank of the actor group calls these together, in the same order):

1. ``HybridEngine(train_engine, gen_tp)`` with the actor's training engine (:class:`hybridflow.training.TrainEngine`;
   the layout (its ``ParallelLayout``: dp x tp x pp), shard boxes and shards come from its :meth:`weight_specs`
   (``tp_dim``, ``dp_dim``, ``pp_stage``) / :meth:`iter_shards`, its offload from :meth:`offload` /
   :meth:`onload`), or ``HybridEngine(module, mesh, gen_tp)`` for a module already sharded on ``mesh`` (wrapped
   in an ``fsdp2`` engine). With pp > 1 a rank holds only its stage's weights (absent from ``iter_shards``);
   its generation shard still covers every layer, the other stages' parts received from their holders. It
   computes the
   :class:`~hybridflow.engine.plan.ReshardPlan`, creates the generation tp process groups and the generation
   model's skeleton (meta device: no memory).
2. :meth:`switch_to_generation` before generating: each rank assembles exactly its generation shard from its
   micro data-parallel group (bucketed point-to-point transfers of at most ``bucket_bytes`` per rank and
   bucket; its own overlap is copied locally, or used in place when it is the whole shard), installs it in the
   generation model and returns that model; then offloads training state to host memory if configured.
   A no-op when the generation weights are already current.
3. :meth:`switch_to_training` before the next forward/backward of the training module: frees the generation
   copy and brings offloaded training state back. Since switching back always drops the generation copy, the
   next switch to generation gathers the updated weights.

Shapes: the plan's boxes; the generation model holds (V/tp_g, H) embeddings, (heads/tp_g * head_dim, H) q
projections etc. (see :mod:`hybridflow.engine.tp_model`).
"""

from __future__ import annotations

import logging
import time
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from hybridflow.distributed.shm_comm import ShmGroup
from hybridflow.engine.plan import (Bucket, Layout, ReshardPlan, is_contiguous_region, local_slices,
                                    plan_from_weight_specs)
from hybridflow.engine.moe_generation import build_generation_model, generation_dims
from hybridflow.engine.tp_model import TPGroup
from hybridflow.training import FSDP2Engine, TrainEngine

logger = logging.getLogger(__name__)

__all__ = ["HybridEngine", "DEFAULT_BUCKET_BYTES"]

DEFAULT_BUCKET_BYTES = 64 << 20


class HybridEngine:
    """Switches an actor between its training layout (fsdp2: dp x tp; megatron: dp x tp x pp) and a
    tensor-parallel generation model (HybridFlow, Sheng et al. 2024, Sec. 5).

    Args:
        train: the actor's training engine over all ranks of the default group (``layout`` covering them, dp x
            tp x pp; ``module`` a Hugging Face model of the same config with real buffers (rotary tables); its
            parameters may be a ``meta`` skeleton when the engine stores the weights elsewhere); or the sharded
            causal LM (its parameters DTensors on ``mesh``, or plain tensors on a single rank), then with ``mesh``.
        mesh: with a module, the training DeviceMesh, ``("dp",)`` or ``("dp", "tp")``; None with an engine.
        gen_tp: tp_g, the generation tensor-parallel size (dp_g = world / tp_g).
        bucket_bytes: bound on the bytes one rank sends plus receives per bucket (larger transfers are cut
            into row ranges; see :meth:`ReshardPlan.buckets`). Peak extra memory of a switch: the newly
            allocated generation shard plus at most one bucket of packed send/receive buffers.
        optimizer, param_offload, optimizer_offload: with a module, the training optimizer and what to move to
            host memory while generating; with an engine these are its own (``spec.param_offload`` ...).

    Raises:
        ValueError: layouts that do not fit (the engine's layout must cover the world; tp_g must divide or be a
            multiple of tp, and divide the world), or tp_g not dividing the heads, kv heads, MLP width or
            vocabulary.
        KeyError: ``gen_tp > 1`` for an architecture without a tensor-parallel plan.
    """

    def __init__(self, train: TrainEngine | torch.nn.Module, mesh: Optional[DeviceMesh] = None, gen_tp: int = 1,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, optimizer: Optional[torch.optim.Optimizer] = None,
                 param_offload: bool = False, optimizer_offload: bool = False) -> None:
        if isinstance(train, torch.nn.Module):
            train = FSDP2Engine.from_module(train, optimizer, mesh=mesh, param_offload=param_offload,
                                            optimizer_offload=optimizer_offload)
        world = dist.get_world_size() if dist.is_initialized() else 1
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        if gen_tp < 1 or world % gen_tp:
            raise ValueError(f"rollout tensor_model_parallel_size={gen_tp} must divide the {world} ranks")
        self.train_engine = train
        self.train_module = train.module  # its HF config and buffers; the weights come through the engine
        self.param_offload = train.spec.param_offload
        self.offloads = train.spec.param_offload or train.spec.optimizer_offload
        layout = train.layout.weight_layout()  # sp: the weights shard over dp x sp (only data is shared)
        if layout.dp * layout.tp * layout.pp != world:
            raise ValueError(f"the {train.spec.role}'s training layout dp={layout.dp} x tp={layout.tp} x "
                             f"pp={layout.pp} does not cover the {world} ranks of the default group")
        specs = train.weight_specs()
        self.device, dtype = _device_and_dtype(train)
        self.dtype = dtype
        self.plan: ReshardPlan = plan_from_weight_specs(  # MoE: experts split over tp_g (moe_generation)
            specs, generation_dims(train.module, gen_tp), Layout(layout.dp, layout.tp, layout.pp, layout.ep),
            Layout(world // gen_tp, gen_tp))
        self.bucket_bytes = bucket_bytes
        self.buckets = self.plan.buckets(bucket_bytes)
        self.tp = self._make_tp_group()
        self.module = build_generation_model(self.train_module.config, self.tp, dtype)
        self._skeleton = dict(self.module.named_parameters())
        if set(self._skeleton) != set(specs):
            only_gen, only_train = sorted(set(self._skeleton) - set(specs)), sorted(set(specs) - set(self._skeleton))
            raise RuntimeError(f"generation model and training model name their weights differently: only in "
                               f"generation {only_gen[:3]}, only in training {only_train[:3]}")
        # every (module, attribute) a weight is registered under: tied weights have several
        canonical = {id(p): name for name, p in self._skeleton.items()}
        self._aliases: dict[str, list[tuple[torch.nn.Module, str]]] = {}
        for name, param in self.module.named_parameters(remove_duplicate=False):
            owner, _, leaf = name.rpartition(".")
            self._aliases.setdefault(canonical[id(param)], []).append((self.module.get_submodule(owner), leaf))
        self._ready = False
        self._offloaded = False

    # ------------------------------------------------------------------ layout
    @property
    def gen_dp_rank(self) -> int:
        """This rank's data-parallel index in the generation layout (its chunk of a generate batch)."""
        return self.plan.gen_dp_rank(self.rank)

    @property
    def gen_tp_rank(self) -> int:
        return self.plan.gen_tp_rank(self.rank)

    @property
    def is_ready(self) -> bool:
        """Whether the generation model holds current weights."""
        return self._ready

    def _make_tp_group(self) -> TPGroup:
        size = self.plan.gen.tp
        if size == 1:
            return TPGroup(None, 0, 1, [0])
        mine = None
        for ranks in self.plan.gen_tp_groups():  # every rank creates every group, in the same order
            group = dist.new_group(sorted(ranks))
            if self.rank in ranks:
                mine = (group, sorted(ranks))
        group, members = mine
        # CPU (gloo): the decode loop's per-layer collectives through shared memory where the members share a host
        shm = ShmGroup.create(group) if dist.get_backend(group) == "gloo" else None
        return TPGroup(group, self.gen_tp_rank, size, [self.plan.gen_tp_rank(r) for r in members], shm)

    # ------------------------------------------------------------------ switches
    @torch.no_grad()
    def switch_to_generation(self) -> torch.nn.Module:
        """Assemble this rank's generation shard and return the generation model (see the module doc)."""
        if self._ready:
            return self.module
        start = time.perf_counter()
        self.onload_training_state()
        local = self._local_shards()
        gen: dict[str, torch.Tensor] = {}
        for bucket in self.buckets:
            self._transfer(bucket, local, gen)
        for name, tensor in gen.items():
            param = torch.nn.Parameter(tensor, requires_grad=False)
            for owner, leaf in self._aliases[name]:
                owner._parameters[leaf] = param
        for name, buf in self.train_module.named_buffers():
            owner, _, leaf = name.rpartition(".")
            self.module.get_submodule(owner)._buffers[leaf] = buf
        self._ready = True
        if self.offloads:
            self.offload_training_state()
        logger.debug("rank %d: switched to generation in %.3fs", self.rank, time.perf_counter() - start)
        return self.module

    def switch_to_training(self) -> None:
        """Free the generation copy and bring offloaded training state back (a no-op when already training)."""
        if self._ready:
            for name, param in self._skeleton.items():
                for owner, leaf in self._aliases[name]:
                    owner._parameters[leaf] = param
            self._ready = False
        self.onload_training_state()

    def check_lockstep(self, tokens: torch.Tensor) -> None:
        """Check that every rank of this generation tp group produced the same ``tokens`` (e.g. responses
        (N, R) long); one small all-reduce.

        Raises:
            RuntimeError: the peers' tokens differ (their decode loops diverged).
        """
        if self.tp.size == 1:
            return
        flat = tokens.reshape(-1).to(device=self.device, dtype=torch.int64)
        position = torch.arange(1, flat.numel() + 1, dtype=torch.int64, device=self.device)
        digest = torch.stack([flat.sum(), (flat * position).sum(), torch.tensor(flat.numel(), device=self.device)])
        bounds = torch.cat([digest, -digest])
        dist.all_reduce(bounds, op=dist.ReduceOp.MAX, group=self.tp.group)
        if not torch.equal(bounds[:3], -bounds[3:]):
            raise RuntimeError(f"rank {self.rank}: the generation tp group (dp_g rank {self.gen_dp_rank}) produced "
                               "different tokens on different ranks; its decode loops are out of lockstep")

    def offload_training_state(self) -> None:
        """The training engine's :meth:`~hybridflow.training.TrainEngine.offload` (parameters and grads, optimizer
        state, as its spec says); a no-op for what is already on the host (always on CPU)."""
        self.train_engine.offload()
        self._offloaded = True

    def onload_training_state(self) -> None:
        """Undo :meth:`offload_training_state`."""
        if not self._offloaded:
            return
        self.train_engine.onload()
        self._offloaded = False

    # ------------------------------------------------------------------ transfer
    def _local_shards(self) -> dict[str, torch.Tensor]:
        """This rank's training shards from the engine's shard iterator, checked against the plan's boxes: every
        weight the plan says this rank holds, with its box's shape, and none other (a weight of another
        pipeline stage must be absent).

        Raises:
            RuntimeError: a missing, unexpected or misshapen shard, or one in another dtype than the generation
                model's (a receiver allocates what it does not hold in that dtype: the messages would not match).
        """
        local = dict(self.train_engine.iter_shards())
        for p in self.plan.params:
            expected = p.train_shape(self.rank)
            tensor = local.get(p.name)
            got = None if tensor is None else tuple(tensor.shape)
            if got != expected:
                raise RuntimeError(f"rank {self.rank}: training shard of {p.name!r}: the engine yields {_say(got)}, "
                                   f"the reshard plan expects {_say(expected)} (layout {self.plan.train}, "
                                   f"tp_dim={p.train_dim}, dp_dim={p.dp_dim}, pp_stage={p.pp_stage})")
            if tensor is not None and tensor.dtype != self.dtype:
                raise RuntimeError(f"rank {self.rank}: training shard of {p.name!r} is {tensor.dtype}, the generation "
                                   f"model is {self.dtype}; the engine must hold every weight in one dtype")
        unknown = sorted(set(local) - {p.name for p in self.plan.params})
        if unknown:
            raise RuntimeError(f"rank {self.rank}: iter_shards yields weights weight_specs does not list: "
                               f"{unknown[:3]}")
        return local

    def _transfer(self, bucket: Bucket, local: dict[str, torch.Tensor], gen: dict[str, torch.Tensor]) -> None:
        """Run one bucket: allocate (or alias) the generation shards it starts, post this rank's sends and
        receives, copy the local overlap meanwhile, then unpack.

        Messages from one rank to another, in order: one per transfer whose region is contiguous in the
        receiver's shard (received in place), then one packed buffer with the rest (the plan decides which is
        which, so both sides agree)."""
        me = self.rank
        direct_sends, direct_recvs, packed_sends, packed_recvs = [], [], {}, {}
        local_copies = []
        for index, transfers in bucket:
            p = self.plan.params[index]
            source = local.get(p.name)  # None: another pipeline stage holds this weight
            if p.name not in gen:
                if p.aliased(me) and not self.param_offload:  # a view of the training shard: nothing to copy
                    gen[p.name] = source[local_slices(p.gen_boxes[me], p.train_boxes[me])]
                elif source is not None:
                    gen[p.name] = torch.empty(p.gen_shape(me), dtype=source.dtype, device=source.device)
                else:
                    gen[p.name] = torch.empty(p.gen_shape(me), dtype=self.dtype, device=self.device)
            in_place = p.aliased(me) and not self.param_offload
            for tr in transfers:  # bucket order, then plan order: the same on sender and receiver
                direct = is_contiguous_region(tr.region, p.gen_boxes[tr.dst])
                if tr.src == me and tr.dst != me:
                    piece = source[local_slices(tr.region, p.train_boxes[me])]
                    if direct:
                        direct_sends.append((piece.contiguous(), tr.dst))
                    else:
                        packed_sends.setdefault(tr.dst, []).append(piece)
                elif tr.dst == me and not in_place:
                    target = gen[p.name][local_slices(tr.region, p.gen_boxes[me])]
                    if tr.src == me:
                        local_copies.append((target, source[local_slices(tr.region, p.train_boxes[me])]))
                    elif direct:
                        direct_recvs.append((target, tr.src))
                    else:
                        packed_recvs.setdefault(tr.src, []).append(target)
        ops = [dist.P2POp(dist.isend, tensor, peer) for tensor, peer in direct_sends]
        ops += [dist.P2POp(dist.irecv, tensor, peer) for tensor, peer in direct_recvs]
        ops += [dist.P2POp(dist.isend, _pack(pieces), peer) for peer, pieces in packed_sends.items()]
        recv_buffers = {peer: torch.empty(sum(t.numel() for t in targets), dtype=targets[0].dtype,
                                          device=targets[0].device) for peer, targets in packed_recvs.items()}
        ops += [dist.P2POp(dist.irecv, buffer, peer) for peer, buffer in recv_buffers.items()]
        requests = dist.batch_isend_irecv(ops) if ops else []
        for target, source in local_copies:
            target.copy_(source)
        for request in requests:
            request.wait()
        for peer, targets in packed_recvs.items():
            _unpack(recv_buffers.pop(peer), targets)


def _say(shape: Optional[tuple[int, ...]]) -> str:
    return "no shard" if shape is None else f"shape {shape}"


def _device_and_dtype(train: TrainEngine) -> tuple[torch.device, torch.dtype]:
    """Where and in which dtype generation shards of weights this rank does not hold are allocated: those of the
    engine module's first parameter, or, when the module is a skeleton on ``meta`` (an engine storing its
    weights elsewhere), the engine's device (the current CUDA device for ``cuda``) in that parameter's dtype."""
    first = next(train.module.parameters())
    if first.device.type != "meta":
        return first.device, first.dtype
    device = torch.device(train.spec.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device, first.dtype


def _pack(pieces: list[torch.Tensor]) -> torch.Tensor:
    buffer = torch.empty(sum(p.numel() for p in pieces), dtype=pieces[0].dtype, device=pieces[0].device)
    offset = 0
    for piece in pieces:
        buffer[offset:offset + piece.numel()].view(piece.shape).copy_(piece)
        offset += piece.numel()
    return buffer


def _unpack(buffer: torch.Tensor, targets: list[torch.Tensor]) -> None:
    offset = 0
    for target in targets:
        target.copy_(buffer[offset:offset + target.numel()].view(target.shape))
        offset += target.numel()
