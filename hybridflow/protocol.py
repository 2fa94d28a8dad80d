"""``DataProto``: the batch that flows between the driver and the worker groups.

A ``DataProto`` is three things:

* ``batch``: ``dict[str, torch.Tensor]``; every tensor has the batch dimension first, ``(B, ...)``.
* ``non_tensor_batch``: ``dict[str, np.ndarray]``; every array has the batch dimension first, ``(B, ...)``;
  ``dtype=object`` holds per-sample Python objects (strings, dicts).
* ``meta_info``: a plain ``dict`` for batch-level values (temperature, eos id, metrics ...).

Notation: ``B`` is the batch size (rows), ``N`` the number of pieces.

Method names and argument orders follow verl's ``DataProto`` so driver code ports directly; the
differences are: ``batch`` is a plain dict (not a ``TensorDict``), an integer index returns a
length-1 ``DataProto`` (not a ``DataProtoItem``), ``reorder`` requires a permutation and
``split`` of an empty batch returns an empty list.

Copy rules (one rule for every method):

* Every method that returns a *new* ``DataProto`` gives it its own deep copy of ``meta_info``.
* Tensors and arrays are shared with ``self`` where torch/numpy share them: contiguous slices are views,
  index arrays (lists, masks, ``repeat``, ``reorder``, padding) produce copies. ``select(deepcopy=True)``
  copies everything. Object arrays hold references: a repeated row's ``dict`` is the same object.
* Pickling (what Ray does) writes only the bytes a tensor view covers, not its whole parent storage, and carries
  CPU tensors as numpy buffers (torch's own tensor pickling is ~40x slower for small tensors).

This module imports neither Ray nor ``torch.distributed``.
"""

from __future__ import annotations

import copy
import logging
from typing import Any, Iterable, Optional, Sequence, Union

import numpy as np
import torch

logger = logging.getLogger(__name__)

Index = Union[int, slice, Sequence[int], np.ndarray, torch.Tensor]

__all__ = ["WORKER_TIME_PREFIX", "DataProto", "pad_dataproto_to_divisor", "unpad_dataproto"]

#: ``meta_info`` keys with this prefix hold one rank's seconds inside a worker method, one key per method
#: (``hybridflow.workers.timing.report_time``); collecting the ranks' outputs keeps the slowest counted rank's
#: (``hybridflow.controller.dispatch.collect_dp_compute_data_proto``)
WORKER_TIME_PREFIX = "worker_s/"


def _to_object_array(values: Sequence[Any]) -> np.ndarray:
    """Return a 1-D ``dtype=object`` array with one element per item of ``values``.

    ``np.array(list_of_equal_length_lists, dtype=object)`` would build a 2-D array; this never does.
    """
    out = np.empty(len(values), dtype=object)
    for i, v in enumerate(values):
        out[i] = v
    return out


def _values_equal(a: Any, b: Any) -> bool:
    """Structural equality for tensors, arrays (object arrays elementwise), dicts, lists and scalars.

    NaNs in the same positions of float tensors/arrays count as equal.
    """
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        if a.shape != b.shape or a.dtype != b.dtype:
            return False
        b = b.to(a.device)
        if a.is_floating_point() or a.is_complex():
            return bool(torch.allclose(a, b, rtol=0.0, atol=0.0, equal_nan=True))
        return bool(torch.equal(a, b))
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        if not (isinstance(a, np.ndarray) and isinstance(b, np.ndarray)) or a.shape != b.shape:
            return False
        if a.dtype == object or b.dtype == object:
            return all(_values_equal(x, y) for x, y in zip(a.reshape(-1), b.reshape(-1)))
        return bool(np.array_equal(a, b, equal_nan=a.dtype.kind in "fc" and b.dtype.kind in "fc"))
    if isinstance(a, dict) or isinstance(b, dict):
        if not (isinstance(a, dict) and isinstance(b, dict)) or a.keys() != b.keys():
            return False
        return all(_values_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) or isinstance(b, (list, tuple)):
        if type(a) is not type(b) or len(a) != len(b):
            return False
        return all(_values_equal(x, y) for x, y in zip(a, b))
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - objects whose == is not a bool are simply "not equal"
        return False


def _compact(t: torch.Tensor) -> torch.Tensor:
    """Return ``t``, or a compact copy when it is a view onto a larger storage (so pickling stays small)."""
    if t.layout == torch.strided and t.untyped_storage().nbytes() > t.numel() * t.element_size():
        return t.clone(memory_format=torch.contiguous_format)
    return t


def _to_wire(t: torch.Tensor) -> Any:
    """A picklable form of ``t`` that is cheap to (un)pickle: a CPU strided tensor becomes ``(array, dtype)``,
    a numpy array of its bytes (``dtype`` None when numpy has the tensor's dtype, else the torch dtype whose bytes
    the ``uint8`` array holds: bf16, fp8). Other tensors (CUDA, sparse, requiring grad) stay tensors.

    Why: torch pickles a CPU storage through ``torch.save`` into bytes (~0.15 ms per small tensor each way, measured
    with 16x96 tensors), while a numpy array pickles its buffer as is (and out of band under Ray's pickle 5); a
    worker-group call moves a dozen tensors four times (driver -> rank -> driver)."""
    if t.device.type != "cpu" or t.layout != torch.strided or t.requires_grad:
        return t
    t = t.contiguous()
    try:
        return t.numpy(), None
    except TypeError:  # a dtype numpy lacks: carry the bytes
        return t.view(torch.uint8).numpy(), t.dtype  # (..., n * itemsize); DataProto tensors are never 0-d


def _wire_form(t: torch.Tensor) -> Any:
    """:func:`_to_wire` of ``t``; a tensor that stays a tensor is first made compact (a numpy array pickles only
    its own bytes, so a CPU view needs no copy; torch's pickling would write the view's whole parent storage)."""
    wire = _to_wire(t)
    return _compact(wire) if isinstance(wire, torch.Tensor) else wire


def _from_wire(value: Any) -> torch.Tensor:
    """The tensor :func:`_to_wire` encoded (its own writable memory)."""
    if isinstance(value, torch.Tensor):
        return value
    array, dtype = value
    tensor = torch.from_numpy(array if array.flags.writeable else array.copy())
    return tensor if dtype is None else tensor.view(dtype)


def _column_store(name: str, doc: str) -> property:
    """A ``DataProto`` attribute that first adds the columns of the pending futures (:meth:`DataProto.union`)."""

    def get(self: "DataProto") -> Any:
        return (self._settle() if self._pending else self).__dict__[name]

    def put(self: "DataProto", value: Any) -> None:
        (self._settle() if self._pending else self).__dict__[name] = value

    return property(get, put, doc=doc)


class DataProto:
    """A batch of ``B`` rows: tensors ``(B, ...)``, numpy columns ``(B, ...)`` and batch-level ``meta_info``.

    ``union`` of a future (an object whose type sets ``__dataproto_future__`` and whose ``get()`` returns a
    ``DataProto``, e.g. a worker-group call's) records it without waiting; the first read of ``batch``,
    ``non_tensor_batch`` or ``meta_info`` waits for the pending futures, in union order, and adds their columns.

    Raises:
        TypeError: a key is not a ``str``, a ``batch`` value is not a ``torch.Tensor``, a
            ``non_tensor_batch`` value is not a ``np.ndarray``, or a value is 0-dimensional.
        ValueError: the columns disagree on the batch size; the message lists every key and its size.
        Reading a column after a pending future's producer failed raises what that future's ``get()`` raises.
    """

    batch = _column_store("_batch", "dict[str, torch.Tensor]: the tensor columns, each (B, ...).")
    non_tensor_batch = _column_store("_non_tensor", "dict[str, np.ndarray]: the numpy columns, each (B, ...).")
    meta_info = _column_store("_meta", "dict: batch-level values.")

    def __init__(self, batch: Optional[dict] = None, non_tensor_batch: Optional[dict] = None,
                 meta_info: Optional[dict] = None) -> None:
        self._pending: list = []
        self.batch = {} if batch is None else dict(batch)
        self.non_tensor_batch = {} if non_tensor_batch is None else dict(non_tensor_batch)
        self.meta_info = {} if meta_info is None else meta_info
        if not isinstance(self.meta_info, dict):
            raise TypeError(f"meta_info must be a dict, got {type(self.meta_info).__name__}")
        self.check_consistency()

    def _settle(self) -> "DataProto":
        """Wait for the pending futures, in union order, and add their columns and ``meta_info``; returns self."""
        pending, self._pending = self._pending, []
        for future in pending:
            self.union(future.get())
        return self

    def split_pending(self) -> tuple["DataProto", list]:
        """``(columns present now, pending futures)``, without waiting: the first (``self`` if nothing is pending)
        shares this batch's columns and a copy of ``meta_info``; adding the futures' outputs gives the batch."""
        now = self.__dict__
        if not self._pending:
            return self, []
        return DataProto(now["_batch"], now["_non_tensor"], dict(now["_meta"])), list(self._pending)

    # ------------------------------------------------------------------ construction / validation
    def check_consistency(self) -> None:
        """Check types and that every column has the same first dimension (see the class's Raises)."""
        for name, store, kind in (
            ("batch", self.batch, torch.Tensor),
            ("non_tensor_batch", self.non_tensor_batch, np.ndarray),
        ):
            for key, value in store.items():
                if not isinstance(key, str):
                    raise TypeError(f"{name} keys must be str, got {key!r} ({type(key).__name__})")
                if not isinstance(value, kind):
                    raise TypeError(
                        f"{name}[{key!r}] must be a {kind.__module__}.{kind.__name__}, got {type(value).__name__}"
                    )
                if value.ndim == 0:
                    raise TypeError(f"{name}[{key!r}] is 0-dimensional; the first dimension must be the batch")
        self._sizes()

    def _sizes(self) -> int:
        """Return the common batch size (0 when there are no columns); raise ValueError listing sizes if they differ."""
        sizes = {f"batch[{k!r}]": int(v.shape[0]) for k, v in self.batch.items()}
        sizes.update({f"non_tensor_batch[{k!r}]": int(v.shape[0]) for k, v in self.non_tensor_batch.items()})
        distinct = set(sizes.values())
        if len(distinct) > 1:
            listing = ", ".join(f"{k}: {s}" for k, s in sizes.items())
            raise ValueError(f"DataProto columns disagree on the batch size (first dimension): {listing}")
        return distinct.pop() if distinct else 0

    @classmethod
    def from_dict(
        cls,
        tensors: Optional[dict[str, torch.Tensor]] = None,
        non_tensors: Optional[dict[str, Union[np.ndarray, Sequence[Any]]]] = None,
        meta_info: Optional[dict] = None,
    ) -> "DataProto":
        """Build from explicit tensor and non-tensor dicts. Lists/tuples in ``non_tensors`` become 1-D object arrays.

        The dicts are not copied deeply: the tensors/arrays become the columns of the result.
        """
        non_tensors = {
            k: _to_object_array(v) if isinstance(v, (list, tuple)) else v for k, v in (non_tensors or {}).items()
        }
        return cls(batch=dict(tensors or {}), non_tensor_batch=non_tensors, meta_info=meta_info or {})

    @classmethod
    def from_single_dict(cls, data: dict[str, Any], meta_info: Optional[dict] = None) -> "DataProto":
        """Build from one dict: tensors go to ``batch``; arrays, lists and tuples to ``non_tensor_batch``.

        Lists and tuples become 1-D ``dtype=object`` arrays (one element per row).

        Raises:
            TypeError: a value is neither a tensor, an array, a list nor a tuple (the message names the key).
        """
        tensors: dict[str, torch.Tensor] = {}
        non_tensors: dict[str, np.ndarray] = {}
        for key, value in data.items():
            if isinstance(value, torch.Tensor):
                tensors[key] = value
            elif isinstance(value, np.ndarray):
                non_tensors[key] = value
            elif isinstance(value, (list, tuple)):
                non_tensors[key] = _to_object_array(value)
            else:
                raise TypeError(
                    f"from_single_dict: value for key {key!r} is a {type(value).__name__}; expected a "
                    "torch.Tensor, np.ndarray, list or tuple (put batch-level values in meta_info)"
                )
        return cls(batch=tensors, non_tensor_batch=non_tensors, meta_info=meta_info or {})

    # ------------------------------------------------------------------ size / repr
    @property
    def batch_size(self) -> int:
        """Number of rows ``B``; 0 when there are no columns. Re-validates sizes (columns may have been set by hand)."""
        return self._sizes()

    def __len__(self) -> int:
        return self.batch_size

    def __repr__(self) -> str:
        cols = ", ".join(f"{k}: {tuple(v.shape)} {v.dtype}" for k, v in self.batch.items())
        ncols = ", ".join(f"{k}: {tuple(v.shape)} {v.dtype}" for k, v in self.non_tensor_batch.items())
        return (
            f"DataProto(batch_size={self.batch_size}, batch={{{cols}}}, non_tensor_batch={{{ncols}}}, "
            f"meta_info_keys={sorted(self.meta_info, key=str)})"
        )

    def print_size(self, prefix: str = "") -> str:
        """Log (INFO) and return the memory held by the tensors and the numeric numpy columns, in MiB.

        Object arrays count only their pointer array (the Python objects they reference are not measured).
        """
        tensor_bytes = sum(t.numel() * t.element_size() for t in self.batch.values())
        array_bytes = sum(a.nbytes for a in self.non_tensor_batch.values())
        message = (
            f"{prefix}DataProto size: batch {tensor_bytes / 2**20:.3f} MiB, "
            f"non_tensor_batch {array_bytes / 2**20:.3f} MiB (B={self.batch_size})"
        )
        logger.info(message)
        return message

    # ------------------------------------------------------------------ indexing
    def _normalize_index(self, idx: Index) -> Union[slice, np.ndarray]:
        """Turn any supported index into a unit-step slice (kept, so results are views) or an int64 array."""
        n = self.batch_size
        if isinstance(idx, (int, np.integer)) and not isinstance(idx, bool):
            i = int(idx)
            if not -n <= i < n:
                raise IndexError(f"index {i} is out of range for a DataProto of batch size {n}")
            i %= n
            return slice(i, i + 1)
        if isinstance(idx, slice):
            start, stop, step = idx.indices(n)
            if step == 1:
                return slice(start, max(start, stop))
            return np.arange(start, stop, step, dtype=np.int64)
        if isinstance(idx, torch.Tensor):
            idx = idx.detach().cpu().numpy()
        elif not isinstance(idx, np.ndarray):
            if not isinstance(idx, (list, tuple, range)):
                raise TypeError(
                    f"unsupported index type {type(idx).__name__}; use int, slice, list, np.ndarray or torch.Tensor"
                )
            idx = np.asarray(idx)
        if idx.ndim != 1:
            raise IndexError(f"an index array must be 1-D, got shape {idx.shape}")
        if idx.dtype == bool:
            if idx.shape[0] != n:
                raise IndexError(f"boolean mask has length {idx.shape[0]} but the batch size is {n}")
            return np.flatnonzero(idx).astype(np.int64)
        if idx.size == 0:
            return idx.astype(np.int64)
        if idx.dtype.kind not in "iu":
            raise TypeError(f"an index array must hold integers or booleans, got dtype {idx.dtype}")
        idx = idx.astype(np.int64)
        bad = idx[(idx < -n) | (idx >= n)]
        if bad.size:
            raise IndexError(f"indices {bad.tolist()[:8]} are out of range for a DataProto of batch size {n}")
        return idx % max(n, 1)

    def _take(self, idx: Union[slice, np.ndarray]) -> "DataProto":
        """New DataProto of the rows ``idx`` (a normalized index); meta_info is deep-copied."""
        if isinstance(idx, slice):
            batch = {k: v[idx] for k, v in self.batch.items()}
            non_tensor = {k: v[idx] for k, v in self.non_tensor_batch.items()}
        else:
            batch = {k: v[torch.as_tensor(idx, device=v.device)] for k, v in self.batch.items()}
            non_tensor = {k: v[idx] for k, v in self.non_tensor_batch.items()}
        return DataProto(batch=batch, non_tensor_batch=non_tensor, meta_info=copy.deepcopy(self.meta_info))

    def __getitem__(self, idx: Index) -> "DataProto":
        """Rows of the batch as a new ``DataProto``.

        ``idx`` may be an ``int`` (result has batch size 1; negative counts from the end), a ``slice``
        (unit step: tensors are views), or a 1-D integer or boolean ``list`` / ``np.ndarray`` /
        ``torch.Tensor`` (copies). Raises ``IndexError`` for out-of-range indices or a mask of the
        wrong length, ``TypeError`` for other index types.
        """
        return self._take(self._normalize_index(idx))

    # ------------------------------------------------------------------ key manipulation
    @staticmethod
    def _check_keys(kind: str, wanted: Iterable[str], present: dict) -> list[str]:
        wanted = [wanted] if isinstance(wanted, str) else list(wanted)
        missing = [k for k in wanted if k not in present]
        if missing:
            raise KeyError(f"{kind} has no keys {missing}; available: {sorted(present)}")
        return wanted

    def select(
        self,
        batch_keys: Optional[Iterable[str]] = None,
        non_tensor_batch_keys: Optional[Iterable[str]] = None,
        meta_info_keys: Optional[Iterable[str]] = None,
        deepcopy: bool = False,
    ) -> "DataProto":
        """New ``DataProto`` with a subset of the keys; ``None`` for a group keeps all of that group's keys.

        Tensors and arrays are shared with ``self`` unless ``deepcopy=True`` (then cloned / deep-copied);
        ``meta_info`` is always deep-copied. Raises ``KeyError`` naming missing keys.
        """
        bk = list(self.batch) if batch_keys is None else self._check_keys("batch", batch_keys, self.batch)
        nk = (
            list(self.non_tensor_batch)
            if non_tensor_batch_keys is None
            else self._check_keys("non_tensor_batch", non_tensor_batch_keys, self.non_tensor_batch)
        )
        mk = (
            list(self.meta_info)
            if meta_info_keys is None
            else self._check_keys("meta_info", meta_info_keys, self.meta_info)
        )
        batch = {k: self.batch[k] for k in bk}
        non_tensor = {k: self.non_tensor_batch[k] for k in nk}
        if deepcopy:
            batch = {k: v.clone() for k, v in batch.items()}
            non_tensor = copy.deepcopy(non_tensor)
        meta_info = copy.deepcopy({k: self.meta_info[k] for k in mk})
        return DataProto(batch=batch, non_tensor_batch=non_tensor, meta_info=meta_info)

    def pop(
        self,
        batch_keys: Optional[Iterable[str]] = None,
        non_tensor_batch_keys: Optional[Iterable[str]] = None,
        meta_info_keys: Optional[Iterable[str]] = None,
    ) -> "DataProto":
        """Remove the given keys from ``self`` and return them as a new ``DataProto``.

        ``None`` for a group pops nothing from it (verl's convention). All keys are checked before
        anything is removed; raises ``KeyError`` naming missing keys.
        """
        bk = self._check_keys("batch", batch_keys or [], self.batch)
        nk = self._check_keys("non_tensor_batch", non_tensor_batch_keys or [], self.non_tensor_batch)
        mk = self._check_keys("meta_info", meta_info_keys or [], self.meta_info)
        return DataProto(
            batch={k: self.batch.pop(k) for k in bk},
            non_tensor_batch={k: self.non_tensor_batch.pop(k) for k in nk},
            meta_info={k: self.meta_info.pop(k) for k in mk},
        )

    def rename(self, old_keys: Union[str, Sequence[str]], new_keys: Union[str, Sequence[str]]) -> "DataProto":
        """Rename columns in place in ``batch`` or ``non_tensor_batch`` (wherever each old key is); returns ``self``.

        Raises:
            ValueError: ``old_keys`` and ``new_keys`` differ in length, or a new key already exists.
            KeyError: an old key is in neither dict.
        """
        old = [old_keys] if isinstance(old_keys, str) else list(old_keys)
        new = [new_keys] if isinstance(new_keys, str) else list(new_keys)
        if len(old) != len(new):
            raise ValueError(f"rename: {len(old)} old keys {old} but {len(new)} new keys {new}")
        existing = (set(self.batch) | set(self.non_tensor_batch)) - set(old)
        clashes = [k for k in new if k in existing]
        if clashes or len(set(new)) != len(new):
            raise ValueError(f"rename: new keys {clashes or new} would overwrite or duplicate existing columns")
        missing = [k for k in old if k not in self.batch and k not in self.non_tensor_batch]
        if missing:
            raise KeyError(f"rename: no column named {missing}")
        moved = []
        for o, n in zip(old, new):
            store = self.batch if o in self.batch else self.non_tensor_batch
            moved.append((store, n, store.pop(o)))
        for store, n, value in moved:
            store[n] = value
        return self

    def union(self, other: "DataProto") -> "DataProto":
        """Add ``other``'s columns and ``meta_info`` to ``self`` in place (a future: when first read, see the class);
        returns ``self``. A ``DataProto`` with no columns at all takes ``other``'s batch size.
        Raises ``ValueError`` when the batch sizes differ, or when a key present in both (in ``batch``,
        ``non_tensor_batch`` or ``meta_info``) holds different values; the message names the key.
        """
        if getattr(type(other), "__dataproto_future__", False):
            self._pending.append(other)
            return self
        n_self, n_other = self.batch_size, other.batch_size
        has_columns = bool(self.batch or self.non_tensor_batch)
        if has_columns and (other.batch or other.non_tensor_batch) and n_self != n_other:
            raise ValueError(f"union: batch sizes differ ({n_self} vs {n_other})")
        for name, mine, theirs in (
            ("batch", self.batch, other.batch),
            ("non_tensor_batch", self.non_tensor_batch, other.non_tensor_batch),
            ("meta_info", self.meta_info, other.meta_info),
        ):
            for key in mine.keys() & theirs.keys():
                if not _values_equal(mine[key], theirs[key]):
                    raise ValueError(f"union: key {key!r} is in both {name}s with different values")
        for key, value in other.batch.items():
            self.batch.setdefault(key, value)
        for key, value in other.non_tensor_batch.items():
            self.non_tensor_batch.setdefault(key, value)
        for key, value in other.meta_info.items():
            if key not in self.meta_info:
                self.meta_info[key] = copy.deepcopy(value)
        self.check_consistency()
        return self

    # ------------------------------------------------------------------ splitting / joining
    def chunk(self, chunks: int) -> list["DataProto"]:
        """Split into ``chunks`` equal pieces of ``B // chunks`` rows (views), in order.

        Raises ``ValueError`` when ``chunks < 1`` or ``B`` is not divisible by ``chunks``
        (pad first with ``pad_dataproto_to_divisor``).
        """
        if not isinstance(chunks, int) or chunks < 1:
            raise ValueError(f"chunk: chunks must be a positive int, got {chunks!r}")
        n = self.batch_size
        if n % chunks:
            raise ValueError(
                f"chunk: batch size {n} is not divisible by chunks={chunks}; "
                "use pad_dataproto_to_divisor(data, chunks) first and unpad_dataproto(...) on the result"
            )
        size = n // chunks
        return [self._take(slice(i * size, (i + 1) * size)) for i in range(chunks)]

    def split(self, split_size: int) -> list["DataProto"]:
        """Split into pieces of ``split_size`` rows (views); the last piece may be smaller; ``B == 0`` gives ``[]``."""
        if not isinstance(split_size, int) or split_size < 1:
            raise ValueError(f"split: split_size must be a positive int, got {split_size!r}")
        n = self.batch_size
        return [self._take(slice(s, min(s + split_size, n))) for s in range(0, n, split_size)]

    @staticmethod
    def concat(data: Sequence["DataProto"]) -> "DataProto":
        """Concatenate along the batch dimension; ``meta_info`` is a deep copy of the first element's.

        Raises:
            ValueError: ``data`` is empty, the pieces have different keys (the message names the keys
                that differ and the piece), or a tensor's trailing shape differs between pieces.
        """
        data = list(data)
        if not data:
            raise ValueError("concat: got an empty list")
        first = data[0]
        for i, d in enumerate(data[1:], start=1):
            for name, a, b in (
                ("batch", first.batch, d.batch),
                ("non_tensor_batch", first.non_tensor_batch, d.non_tensor_batch),
            ):
                if a.keys() != b.keys():
                    raise ValueError(
                        f"concat: {name} keys differ between piece 0 and piece {i}: only in piece 0: "
                        f"{sorted(a.keys() - b.keys())}, only in piece {i}: {sorted(b.keys() - a.keys())}"
                    )
        batch = {}
        for key in first.batch:
            parts = [d.batch[key] for d in data]
            shapes = {tuple(p.shape[1:]) for p in parts}
            if len(shapes) > 1:
                raise ValueError(
                    f"concat: batch[{key!r}] has different trailing shapes across pieces: {sorted(shapes)}"
                )
            batch[key] = torch.cat(parts, dim=0)
        non_tensor = {}
        for key in first.non_tensor_batch:
            parts = [d.non_tensor_batch[key] for d in data]
            shapes = {tuple(p.shape[1:]) for p in parts}
            if len(shapes) > 1:
                raise ValueError(
                    f"concat: non_tensor_batch[{key!r}] has different trailing shapes across pieces: {sorted(shapes)}"
                )
            non_tensor[key] = np.concatenate(parts, axis=0)
        return DataProto(batch=batch, non_tensor_batch=non_tensor, meta_info=copy.deepcopy(first.meta_info))

    def repeat(self, repeat_times: int = 2, interleave: bool = True) -> "DataProto":
        """Repeat every row ``repeat_times`` times: ``interleave=True`` gives ``[a, a, b, b]``, else ``[a, b, a, b]``.

        Result batch size ``B * repeat_times``; tensors are copies. Raises ``ValueError`` for ``repeat_times < 1``.
        """
        if not isinstance(repeat_times, int) or repeat_times < 1:
            raise ValueError(f"repeat: repeat_times must be a positive int, got {repeat_times!r}")
        rows = np.arange(self.batch_size, dtype=np.int64)
        idx = np.repeat(rows, repeat_times) if interleave else np.tile(rows, repeat_times)
        return self._take(idx)

    def reorder(self, indices: Union[Sequence[int], np.ndarray, torch.Tensor]) -> None:
        """Permute the rows in place: row ``i`` becomes old row ``indices[i]``.

        Raises ``ValueError`` unless ``indices`` is a permutation of ``range(B)``.
        """
        idx = indices.detach().cpu().numpy() if isinstance(indices, torch.Tensor) else np.asarray(indices)
        n = self.batch_size
        is_perm = idx.ndim == 1 and idx.shape[0] == n and (n == 0 or idx.dtype.kind in "iu")
        if not (is_perm and np.array_equal(np.sort(idx), np.arange(n))):
            raise ValueError(f"reorder: indices must be a permutation of range({n}), got {idx.tolist()[:16]}")
        taken = self._take(idx.astype(np.int64))
        self.batch, self.non_tensor_batch = taken.batch, taken.non_tensor_batch

    def to(self, device: Union[str, torch.device]) -> "DataProto":
        """Move every tensor to ``device`` in place; returns ``self``. Numpy columns stay on the host."""
        self.batch = {k: v.to(device) for k, v in self.batch.items()}
        return self

    # ------------------------------------------------------------------ pickling
    def __getstate__(self) -> dict:
        # A slice/chunk is a view; plain pickling of a view writes its parent's whole storage.
        state = dict((self._settle() if self._pending else self).__dict__)
        state["_batch"] = {k: _wire_form(v) for k, v in self._batch.items()}
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._batch = {k: _from_wire(v) for k, v in self._batch.items()}


def pad_dataproto_to_divisor(data: DataProto, size_divisor: int) -> tuple[DataProto, int]:
    """Pad ``data`` so its batch size is a multiple of ``size_divisor``.

    Padding rows are copies of rows ``0, 1, 2, ...`` (wrapping around when more than ``B`` are needed),
    so they are valid data; drop them afterwards with ``unpad_dataproto(result, pad_size)``.

    Returns ``(padded, pad_size)``; when no padding is needed, ``(data, 0)`` with ``data`` itself.
    Raises ``ValueError`` for ``size_divisor < 1``.
    """
    if not isinstance(size_divisor, int) or size_divisor < 1:
        raise ValueError(f"pad_dataproto_to_divisor: size_divisor must be a positive int, got {size_divisor!r}")
    n = len(data)
    pad_size = (-n) % size_divisor
    if pad_size == 0:
        return data, 0
    idx = np.concatenate([np.arange(n), np.arange(pad_size) % n]).astype(np.int64)
    return data._take(idx), pad_size


def unpad_dataproto(data: DataProto, pad_size: int) -> DataProto:
    """Drop the last ``pad_size`` rows (added by ``pad_dataproto_to_divisor``); ``pad_size == 0`` returns ``data``.
    Raises ``ValueError`` when ``pad_size`` is negative or larger than the batch size."""
    n = len(data)
    if not 0 <= pad_size <= n:
        raise ValueError(f"unpad_dataproto: pad_size must be in [0, {n}], got {pad_size}")
    return data if pad_size == 0 else data[: n - pad_size]
