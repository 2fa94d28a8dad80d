"""The resharding plan of the 3D-HybridEngine: which rank sends which slice of which weight to whom when the
actor switches from its training layout (dp x tp x pp) to its generation layout (dp_g x tp_g) on the same ranks.

Pure Python (no torch.distributed): the plan is computed from parameter shapes and the two layouts, the same
on every rank, and can be printed and checked on its own.

Layouts (HybridFlow, Sheng et al. 2024, Sec. 5, "optimized parallel grouping"):

* Training: rank ``r = (s * dp + d) * tp + t`` (tp fastest, then dp, then pp: Megatron-core's order, the
  ``ParallelLayout`` of the engine contract; with ``pp = 1`` the row-major ``("dp", "tp")`` DeviceMesh). Per
  weight: a weight of pipeline stage ``pp_stage`` is held only by the ranks of that stage (None: every stage);
  a weight split over tp on ``tp_dim`` gives rank t the t-th of ``tp`` ``torch.chunk`` chunks of that dim; then
  ``dp_dim`` (FSDP2: 0) cuts the tp-local piece into ``dp`` ``torch.chunk`` pieces and rank (d, t) keeps piece
  d, or, with ``dp_dim = None`` (Megatron-core DDP / distributed optimizer), every dp rank keeps the whole
  tp-local piece (dp replication). Every local piece is one box of the full tensor, or nothing.
* Generation: ``pp_g = 1``: every generation rank holds its tp_g chunk of *all* layers. Rank r gets
  coordinates ``(dp_g rank, tp_g rank)`` chosen so that its generation shard overlaps its own training shard
  (:func:`generation_coords`); the training dp and pp indices are folded into one replica index
  ``e = d * pp + s`` (dp-major, so with ``pp = 1`` it is d). With ``m = tp / tp_g`` (generation less split than
  training) the ``m`` consecutive training tp ranks of one (d, s) whose chunks make up one generation chunk
  share a tp_g rank, and one rank of each such micro data-parallel group forms a generation tp group (stride
  m), as in the paper: a generation tp group then lies inside one pipeline stage and receives the other
  stages' layers from their holders. With ``k = tp_g / tp`` (generation more split) each training chunk is
  divided among ``k`` replica indices, chosen (dp-major) so that FSDP pieces line up with their generation
  sub-chunks; with pp > 1 and k not dividing dp, the stages of one dp rank take different sub-chunks.

Each rank then receives, for every weight, the intersections of its generation box with the training boxes
of the ranks that hold them. Where several ranks hold the same box (tp replication, dp replication) the plan
picks, in order: the rank itself (a local copy; a generation box that is a contiguous part of the rank's own
training box needs no copy at all: it is used in place), a rank it already receives from, a rank of its own
training dp index (its own model replica), then the holder that has sent least so far (spreading sends over
holders). The ranks a rank receives from form its micro data-parallel group
(:meth:`ReshardPlan.micro_dp_group`); nothing is gathered from outside it, and only ``tp_g = 1`` makes a rank
hold a full copy of the model. With pp > 1 the group necessarily spans the stages: a stage-0 rank receives the
stage-1 layers of its generation chunk from stage-1 ranks of its own dp index.

Legend: ``Box``: per dim a half-open ``(start, stop)`` range of the full tensor; W: world size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence

__all__ = [
    "Box",
    "Bucket",
    "Layout",
    "ParamPlan",
    "ReshardPlan",
    "Transfer",
    "build_reshard_plan",
    "chunk_range",
    "generation_coords",
    "plan_from_weight_specs",
]

Box = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Layout:
    """A (dp, tp, pp) layout of ``dp * tp * pp`` ranks: rank ``(s * dp + d) * tp + t`` has coordinates
    ``(d, t, s)`` (the engine contract's ``ParallelLayout`` order: tp fastest, then dp, then pp). Generation
    layouts have ``pp = 1``.

    Raises:
        ValueError: a size below 1.
    """

    dp: int
    tp: int
    pp: int = 1
    ep: int = 1  # training expert parallelism: an ep_dim weight is split over runs of ep ranks of (dp, tp) order

    def __post_init__(self) -> None:
        if self.dp < 1 or self.tp < 1 or self.pp < 1:
            raise ValueError(f"layout sizes must be >= 1, got dp={self.dp} tp={self.tp} pp={self.pp}")

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    def coords(self, rank: int) -> tuple[int, int, int]:
        """``(dp rank, tp rank, pp rank)`` of global ``rank``."""
        rest, t = divmod(rank, self.tp)
        s, d = divmod(rest, self.dp)
        return d, t, s

    def rank_of(self, d: int, t: int, s: int = 0) -> int:
        """Inverse of :meth:`coords`."""
        return (s * self.dp + d) * self.tp + t

    def __str__(self) -> str:
        return f"dp={self.dp} x tp={self.tp}" + (f" x pp={self.pp}" if self.pp > 1 else "")


def chunk_range(n: int, parts: int, i: int) -> tuple[int, int]:
    """``[start, stop)`` of chunk ``i`` when ``n`` items are cut like ``torch.chunk(.., parts)``: chunks of
    ``ceil(n / parts)``, the last ones shorter or empty (FSDP2's sharding rule; DTensor ``Shard`` likewise)."""
    size = math.ceil(n / parts) if n else 0
    start = min(i * size, n)
    return start, min(start + size, n)


def generation_coords(train: Layout, gen: Layout) -> tuple[tuple[int, int], ...]:
    """For every global rank its ``(dp_g rank, tp_g rank)`` in the generation layout (see the module doc:
    replica index ``e = d * pp + s``; ``m = tp / tp_g``: ``(e * m + t % m, t // m)``; ``k = tp_g / tp``:
    ``(e % (dp * pp / k), t * k + e // (dp * pp / k))``). Every rank's generation chunk overlaps its own
    training chunk of the weights it holds (HybridFlow, Sec. 5, Fig. 8).

    Raises:
        ValueError: different world sizes, a generation layout with pp > 1, or neither of tp and tp_g divides
            the other.
    """
    if train.world_size != gen.world_size:
        raise ValueError(f"training layout {train} and generation layout {gen} must cover the same ranks")
    if gen.pp != 1:
        raise ValueError(f"the generation layout has no pipeline stages, got {gen}")
    replicas = train.dp * train.pp
    coords = []
    for rank in range(train.world_size):
        d, t, s = train.coords(rank)
        e = d * train.pp + s
        if train.tp % gen.tp == 0:
            m = train.tp // gen.tp  # micro-dp size: training tp ranks per generation tp rank
            coords.append((e * m + t % m, t // m))
        elif gen.tp % train.tp == 0:
            k = gen.tp // train.tp  # generation chunks per training chunk, spread over replica indices
            per = replicas // k  # k divides dp * pp: k * tp = tp_g divides the world dp * tp * pp
            coords.append((e % per, t * k + e // per))
        else:
            raise ValueError(f"generation tp_g={gen.tp} and training tp={train.tp}: one must divide the other")
    return tuple(coords)


def _intersect(a: Box, b: Box) -> Optional[Box]:
    out = tuple((max(s0, s1), min(e0, e1)) for (s0, e0), (s1, e1) in zip(a, b))
    return out if all(s < e for s, e in out) else None


def box_numel(box: Box) -> int:
    return math.prod(e - s for s, e in box)


def local_slices(region: Box, within: Box) -> tuple[slice, ...]:
    """Index of ``region`` (full-tensor coordinates) inside a local tensor that holds the box ``within``."""
    return tuple(slice(s - w0, e - w0) for (s, e), (w0, _) in zip(region, within))


def is_contiguous_region(region: Box, within: Box) -> bool:
    """Whether ``region`` is one contiguous range of a row-major tensor holding the box ``within``: leading
    dims of extent 1, then one partial dim, then only full dims."""
    full_after = True
    for d in reversed(range(len(region))):
        (s, e), (w0, w1) = region[d], within[d]
        if not full_after and e - s != 1:
            return False
        if (s, e) != (w0, w1):
            full_after = False
    return True


@dataclass(frozen=True)
class Transfer:
    """``region`` (a box of the full tensor) goes from training rank ``src`` to generation rank ``dst``
    (``src == dst``: a local copy)."""

    src: int
    dst: int
    region: Box

    @property
    def numel(self) -> int:
        return box_numel(self.region)


Bucket = tuple[tuple[int, tuple[Transfer, ...]], ...]  # (parameter index, its transfers in this bucket)


@dataclass(frozen=True)
class ParamPlan:
    """One weight: ``train_boxes[r]`` / ``gen_boxes[r]`` are the boxes rank r holds in each layout
    (``train_boxes[r]`` None: rank r holds none of it in training, another pipeline stage does);
    ``transfers`` cover every generation box exactly once. ``train_dim`` / ``gen_dim``: the dim split over tp
    (None: replicated over tp); ``dp_dim``: the dim dp splits in training (None: replicated over dp);
    ``pp_stage``: the training pipeline stage holding it (None: all). ``itemsize``: bytes per element."""

    name: str
    shape: tuple[int, ...]
    train_dim: Optional[int]
    gen_dim: Optional[int]
    train_boxes: tuple[Optional[Box], ...]
    gen_boxes: tuple[Box, ...]
    transfers: tuple[Transfer, ...]
    itemsize: int = 4
    dp_dim: Optional[int] = 0
    pp_stage: Optional[int] = None

    def holds(self, rank: int) -> bool:
        """Whether ``rank`` holds a (possibly empty) training piece of this weight (its stage does)."""
        return self.train_boxes[rank] is not None

    def aliased(self, rank: int) -> bool:
        """Whether rank's generation shard is a contiguous part of its own training shard, so it can be used
        in place (a view: no copy, no memory)."""
        gen, train = self.gen_boxes[rank], self.train_boxes[rank]
        if train is None:
            return False
        inside = all(t0 <= g0 and g1 <= t1 for (g0, g1), (t0, t1) in zip(gen, train))
        return inside and is_contiguous_region(gen, train)

    def gen_shape(self, rank: int) -> tuple[int, ...]:
        return tuple(e - s for s, e in self.gen_boxes[rank])

    def train_shape(self, rank: int) -> Optional[tuple[int, ...]]:
        """Shape of rank's training shard (None: it holds none)."""
        box = self.train_boxes[rank]
        return None if box is None else tuple(e - s for s, e in box)


@dataclass(frozen=True)
class ReshardPlan:
    """The whole switch: layouts, every rank's generation coordinates, one :class:`ParamPlan` per weight."""

    train: Layout
    gen: Layout
    coords: tuple[tuple[int, int], ...]
    params: tuple[ParamPlan, ...]
    _by_name: dict = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_by_name", {p.name: p for p in self.params})

    def __getitem__(self, name: str) -> ParamPlan:
        return self._by_name[name]

    def gen_dp_rank(self, rank: int) -> int:
        return self.coords[rank][0]

    def gen_tp_rank(self, rank: int) -> int:
        return self.coords[rank][1]

    def gen_tp_groups(self) -> list[list[int]]:
        """Global ranks of each generation tp group, indexed by dp_g rank, each ordered by tp_g rank."""
        groups: list[list[int]] = [[0] * self.gen.tp for _ in range(self.gen.dp)]
        for rank, (d, t) in enumerate(self.coords):
            groups[d][t] = rank
        return groups

    def sources(self, rank: int) -> list[int]:
        """Other ranks that send to ``rank``."""
        return sorted({tr.src for p in self.params for tr in p.transfers if tr.dst == rank and tr.src != rank})

    def micro_dp_group(self, rank: int) -> list[int]:
        """``rank`` and the ranks it gathers from: all its generation shard comes from inside this group."""
        return sorted({rank, *self.sources(rank)})

    def recv_bytes(self, rank: int) -> int:
        return sum(tr.numel * p.itemsize for p in self.params for tr in p.transfers if tr.dst == rank != tr.src)

    def send_bytes(self, rank: int) -> int:
        return sum(tr.numel * p.itemsize for p in self.params for tr in p.transfers if tr.src == rank != tr.dst)

    def gen_bytes(self, rank: int, count_aliased: bool = True) -> int:
        """Bytes of ``rank``'s generation shard (``count_aliased=False``: only what must be newly allocated)."""
        return sum(box_numel(p.gen_boxes[rank]) * p.itemsize for p in self.params
                   if count_aliased or not p.aliased(rank))

    def model_bytes(self) -> int:
        return sum(math.prod(p.shape) * p.itemsize for p in self.params)

    def peak_extra_bytes(self, rank: int, bucket_bytes: int, in_place: bool = True) -> int:
        """The most tensor memory a switch run by this plan allocates on ``rank``: its generation shard less
        what is used in place (``in_place=False``: nothing is, e.g. with parameter offload), plus the largest
        bucket's packed send / receive buffers (at most what the rank sends plus receives in that bucket,
        bounded by ``bucket_bytes`` except for a single row larger than it; see :meth:`buckets`)."""
        loads = [0]
        for bucket in self.buckets(bucket_bytes):
            moved = 0
            for index, transfers in bucket:
                size = self.params[index].itemsize
                moved += sum(tr.numel * size for tr in transfers if tr.src != tr.dst and rank in (tr.src, tr.dst))
            loads.append(moved)
        return self.gen_bytes(rank, count_aliased=not in_place) + max(loads)

    def buckets(self, bucket_bytes: int) -> list[Bucket]:
        """The transfers grouped into buckets, in parameter order: on every rank the bytes sent plus received
        within one bucket stay <= ``bucket_bytes`` (a transfer is cut into row ranges to fit; only a single row
        larger than the bucket exceeds it). Local copies cost nothing and ride along. A bucket lists
        ``(parameter index, transfers)`` pairs, the same on every rank."""
        world = self.train.world_size
        buckets: list[Bucket] = []
        current: dict[int, list[Transfer]] = {}
        load = [0] * world
        for i, p in enumerate(self.params):
            for tr in p.transfers:
                pieces = [tr] if tr.src == tr.dst else _split_rows(tr, max(1, bucket_bytes // p.itemsize))
                for piece in pieces:
                    cost = 0 if piece.src == piece.dst else piece.numel * p.itemsize
                    if cost and current and max(load[piece.src], load[piece.dst]) + cost > bucket_bytes:
                        buckets.append(tuple((k, tuple(v)) for k, v in current.items()))
                        current, load = {}, [0] * world
                    current.setdefault(i, []).append(piece)
                    if cost:
                        load[piece.src] += cost
                        load[piece.dst] += cost
        if current:
            buckets.append(tuple((k, tuple(v)) for k, v in current.items()))
        return buckets

    def summary(self) -> dict:
        """A JSON-friendly overview: layouts, coordinates, and per rank its micro-dp group and byte counts."""
        return {
            "train": {"dp": self.train.dp, "tp": self.train.tp, "pp": self.train.pp},
            "generate": {"dp": self.gen.dp, "tp": self.gen.tp},
            "model_bytes": self.model_bytes(),
            "ranks": [
                {"rank": r, "gen_dp": self.coords[r][0], "gen_tp": self.coords[r][1],
                 "micro_dp_group": self.micro_dp_group(r), "recv_bytes": self.recv_bytes(r),
                 "send_bytes": self.send_bytes(r), "gen_bytes": self.gen_bytes(r),
                 "new_bytes": self.gen_bytes(r, count_aliased=False)}
                for r in range(self.train.world_size)
            ],
        }


def _split_rows(tr: Transfer, max_numel: int) -> list[Transfer]:
    """``tr`` cut along dim 0 into pieces of at most ``max_numel`` elements (at least one row each)."""
    (start, stop), rest = tr.region[0], tr.region[1:]
    rows = max(1, max_numel // max(1, box_numel(rest)))
    return [Transfer(tr.src, tr.dst, ((a, min(a + rows, stop)), *rest)) for a in range(start, stop, rows)]


def _train_box(shape: Sequence[int], tp_dim: Optional[int], dp_dim: Optional[int], stage: Optional[int],
               layout: Layout, rank: int, ep_dim: Optional[int] = None) -> Optional[Box]:
    """Rank's training box of a weight (module doc): None outside its pipeline stage; tp chunk of ``tp_dim``,
    then dp piece of ``dp_dim`` of that chunk (``dp_dim`` None: the whole tp chunk); an expert weight
    (``ep_dim``) is chunk ``(d * tp + t) % ep`` of ``layout.ep`` along it (Megatron's expert groups)."""
    d, t, s = layout.coords(rank)
    if stage is not None and stage != s:
        return None
    box = [(0, n) for n in shape]
    if ep_dim is not None and layout.ep > 1:
        box[ep_dim] = chunk_range(shape[ep_dim], layout.ep, (d * layout.tp + t) % layout.ep)
    if tp_dim is not None and layout.tp > 1:
        box[tp_dim] = chunk_range(shape[tp_dim], layout.tp, t)
    if dp_dim is not None:
        start, stop = box[dp_dim]
        a, b = chunk_range(stop - start, layout.dp, d)
        box[dp_dim] = (start + a, start + b)
    return tuple(box)


def _gen_box(shape: Sequence[int], dim: Optional[int], tp: int, tp_rank: int) -> Box:
    box = [(0, n) for n in shape]
    if dim is not None and tp > 1:
        if shape[dim] % tp:
            raise ValueError(f"generation tp_g={tp} must divide dim {dim} of size {shape[dim]}")
        box[dim] = chunk_range(shape[dim], tp, tp_rank)
    return tuple(box)


def _check_dims(name: str, shape: tuple[int, ...], dims: dict[str, Optional[int]], stage: Optional[int],
                layout: Layout) -> None:
    for key, dim in dims.items():
        if dim is not None and not 0 <= dim < len(shape):
            raise ValueError(f"weight {name!r} of shape {shape}: {key}={dim} is not one of its dims")
    if stage is not None and not 0 <= stage < layout.pp:
        raise ValueError(f"weight {name!r}: pp_stage={stage} outside the {layout.pp} pipeline stages of {layout}")


def _choose_sources(staged: list, train: Layout) -> dict[tuple[int, int, Box], int]:
    """``(weight index, dst, training box) -> src`` for every piece a generation box needs (module doc: the rank
    itself, then a rank it already receives from, then one of its own training dp index, then the least loaded).
    Pass 1 takes the pieces with a single holder (they fix the groups), pass 2 the replicated ones."""
    world = train.world_size
    senders: list[set[int]] = [set() for _ in range(world)]  # ranks each rank already receives from
    sent = [0] * world
    dp_of = [train.coords(r)[0] for r in range(world)]
    chosen: dict[tuple[int, int, Box], int] = {}
    for replicated in (False, True):
        for i, (_, _, gen_boxes, holders) in enumerate(staged):
            for box, ranks in holders.items():
                if (len(ranks) > 1) != replicated:
                    continue
                for dst in range(world):
                    region = _intersect(box, gen_boxes[dst])
                    if region is None:
                        continue
                    if dst in ranks:
                        src = dst
                    else:
                        near = [r for r in ranks if r in senders[dst]]
                        src = min(near or ranks, key=lambda r: (dp_of[r] != dp_of[dst], sent[r], r))
                    chosen[i, dst, box] = src
                    if src != dst:
                        senders[dst].add(src)
                        sent[src] += box_numel(region)
    return chosen


def build_reshard_plan(
    shapes: Mapping[str, Sequence[int]],
    train_dims: Mapping[str, Optional[int]],
    gen_dims: Mapping[str, Optional[int]],
    train: Layout,
    gen: Layout,
    itemsizes: Optional[Mapping[str, int]] = None,
    dp_dims: Optional[Mapping[str, Optional[int]]] = None,
    pp_stages: Optional[Mapping[str, Optional[int]]] = None,
    ep_dims: Optional[Mapping[str, Optional[int]]] = None,
) -> ReshardPlan:
    """Plan the switch from ``train`` to ``gen`` for the weights ``shapes`` (name -> full shape, in the order
    the ranks will process them).

    Args:
        train_dims / gen_dims: name -> the dim split over tp in each layout, or None (replicated over tp).
        itemsizes: name -> bytes per element (default 4).
        dp_dims: name -> the dim training dp splits (default 0, FSDP2), or None (replicated over dp).
        pp_stages: name -> the training pipeline stage holding the weight (default None: every stage).
        ep_dims: name -> the dim training expert parallelism splits (``train.ep`` chunks), default None.

    Sources: see the module doc (and :func:`_choose_sources`).

    Raises:
        ValueError: layouts that do not fit (see :func:`generation_coords`), a split dim not divisible by tp_g,
            a dim outside the weight's dims, a stage outside ``[0, train.pp)``.
        KeyError: a weight without a dim entry.
    """
    coords = generation_coords(train, gen)
    world = train.world_size
    itemsizes, dp_dims, pp_stages, ep_dims = itemsizes or {}, dp_dims or {}, pp_stages or {}, ep_dims or {}
    meta, staged = [], []
    for name, shape in shapes.items():
        shape = tuple(int(n) for n in shape)
        tdim, gdim, ddim, stage = train_dims[name], gen_dims[name], dp_dims.get(name, 0), pp_stages.get(name)
        _check_dims(name, shape, {"tp_dim": tdim, "gen_dim": gdim, "dp_dim": ddim}, stage, train)
        train_boxes = tuple(_train_box(shape, tdim, ddim, stage, train, r, ep_dims.get(name)) for r in range(world))
        gen_boxes = tuple(_gen_box(shape, gdim, gen.tp, coords[r][1]) for r in range(world))
        holders: dict[Box, list[int]] = {}
        for r, box in enumerate(train_boxes):
            if box is not None and box_numel(box):
                holders.setdefault(box, []).append(r)
        meta.append((name, shape, tdim, gdim, ddim, stage))
        staged.append((name, train_boxes, gen_boxes, holders))
    chosen = _choose_sources(staged, train)
    params = []
    for i, ((name, shape, tdim, gdim, ddim, stage), (_, train_boxes, gen_boxes, holders)) in enumerate(
            zip(meta, staged)):
        transfers = []
        for dst in range(world):
            for box in holders:  # insertion order: by first holder rank, the same on every rank
                region = _intersect(box, gen_boxes[dst])
                if region is not None:
                    transfers.append(Transfer(chosen[i, dst, box], dst, region))
        params.append(ParamPlan(name, shape, tdim, gdim, train_boxes, gen_boxes, tuple(transfers),
                                int(itemsizes.get(name, 4)), ddim, stage))
    return ReshardPlan(train, gen, coords, tuple(params))


def plan_from_weight_specs(specs: Mapping[str, object], gen_dims: Mapping[str, Optional[int]], train: Layout,
                           gen: Layout) -> ReshardPlan:
    """:func:`build_reshard_plan` from a training engine's ``weight_specs()`` (name -> an object with ``shape``,
    ``element_size``, ``tp_dim``, ``dp_dim``, ``pp_stage``, optionally ``ep_dim``: :class:`hybridflow.training.WeightSpec`, read by
    attribute so this module stays free of torch), in their order.

    Raises:
        ValueError / KeyError: as :func:`build_reshard_plan`.
    """
    return build_reshard_plan(
        {n: w.shape for n, w in specs.items()}, {n: w.tp_dim for n, w in specs.items()}, gen_dims, train, gen,
        {n: w.element_size for n, w in specs.items()}, {n: w.dp_dim for n, w in specs.items()},
        {n: w.pp_stage for n, w in specs.items()}, {n: getattr(w, "ep_dim", None) for n, w in specs.items()})
