"""``register``: declare how a worker method is dispatched, executed and collected.

A registered method is a step of the dataflow. The decorator stores a ``MethodSpec`` on the function;
``RayWorkerGroup`` reads it and binds a driver-side method of the same name that

1. splits the driver's arguments into per-rank arguments (the *dispatch mode*, see ``dispatch.py``),
2. calls the method on every rank, or on rank 0 only (the *execute mode*),
3. waits for the results and combines them (the dispatch mode's collect function), or returns a future at once:
   a ``DataProtoFuture`` for every call of a mode that collects a ``DataProto``, the ``ObjectRef`` list with
   ``blocking=False`` for other modes.

Inside the worker, the wrapper waits for the pool's previous call (``WAIT_KEY``), then materializes future
arguments (``DataProtoFuture``, ``Joined``: ``futures.materialize``) before the method runs, so a method always sees
plain ``DataProto`` values. An exception raised in the user's own code (a plugin's loss, a
user's worker class; :meth:`hybridflow.errors.UserCodeError.wrap`) leaves the method as a
:class:`~hybridflow.errors.UserCodeError` (one line and the user's frames); hybridflow's own errors and a
``UserError`` leave it unchanged. A method that declares the columns it reads
(``batch_keys``, ``non_tensor_batch_keys``) is sent only those of its ``DataProto`` arguments.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from enum import Enum
from typing import Any, Callable, Optional, Union

import ray

from hybridflow.controller.futures import materialize
from hybridflow.errors import UserCodeError, UserError
from hybridflow.protocol import DataProto

__all__ = ["Dispatch", "Execute", "MethodSpec", "register", "get_method_spec", "get_registered_methods"]


class Dispatch(Enum):
    """Built-in dispatch modes (see ``dispatch.py`` for what each does). Custom modes are strings."""

    ONE_TO_ALL = "ONE_TO_ALL"
    ALL_TO_ALL = "ALL_TO_ALL"
    DP_COMPUTE_PROTO = "DP_COMPUTE_PROTO"
    RANK_ZERO = "RANK_ZERO"
    MESH_COMPUTE_PROTO = "MESH_COMPUTE_PROTO"


class Execute(Enum):
    """Which ranks run the method: every rank, or rank 0 only."""

    ALL = "ALL"
    RANK_ZERO = "RANK_ZERO"


@dataclass(frozen=True)
class MethodSpec:
    """What ``register`` stored on a method."""

    dispatch_mode: Union[Dispatch, str]
    execute_mode: Execute
    blocking: bool
    mesh_name: Optional[str]
    batch_keys: Optional[tuple[str, ...]] = None  # the tensor columns it may read (None: all)
    non_tensor_batch_keys: Optional[tuple[str, ...]] = None  # the non-tensor columns it may read (None: all)
    rows_per_row: bool = False  # returns the same number of rows for every input row (a rollout: n per prompt)

    def select_inputs(self, value: Any) -> Any:
        """``value`` as the method reads it: a ``DataProto`` cut to the declared columns it has (shallow: tensors
        are shared; ``meta_info`` is kept), anything else (a future included: it is cut where it is fetched)
        unchanged."""
        if not isinstance(value, DataProto) or (self.batch_keys is None and self.non_tensor_batch_keys is None):
            return value

        def kept(wanted: Optional[tuple[str, ...]], columns: dict) -> dict:
            return dict(columns) if wanted is None else {k: columns[k] for k in wanted if k in columns}

        return DataProto(batch=kept(self.batch_keys, value.batch),
                         non_tensor_batch=kept(self.non_tensor_batch_keys, value.non_tensor_batch),
                         meta_info=value.meta_info)


_SPEC_ATTR = "_hf_method_spec"


def get_method_spec(func: Any) -> Optional[MethodSpec]:
    """The ``MethodSpec`` stored by ``register`` on ``func``, or ``None`` for an unregistered attribute."""
    spec = getattr(func, _SPEC_ATTR, None)
    return spec if isinstance(spec, MethodSpec) else None


def get_registered_methods(cls: type) -> dict[str, MethodSpec]:
    """``{method name: MethodSpec}`` for every ``register``-ed method of ``cls`` (inherited ones included)."""
    found = {}
    for name in dir(cls):
        spec = get_method_spec(getattr(cls, name, None))
        if spec is not None:
            found[name] = spec
    return found


#: keyword arguments of this prefix carry the ``ObjectRef``s a call was ordered after (``submit_after``): Ray starts
#: the call once they are ready; the method never sees them
AFTER_PREFIX = "_hf_after_"

#: this keyword argument (of the :data:`AFTER_PREFIX`) holds a list of ``ObjectRef``s the rank waits for, failed or
#: not, before the method runs: the previous call on the group's resource pool (``worker_group._PoolOrder``)
WAIT_KEY = AFTER_PREFIX + "pool"


def _accepting_after(func: Callable) -> inspect.Signature:
    """``func``'s signature, with a ``**kwargs`` (for the :data:`AFTER_PREFIX` refs) unless it has one."""
    sig = inspect.signature(func)
    params = list(sig.parameters.values())
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return sig
    return sig.replace(parameters=params + [inspect.Parameter("_hf_after", inspect.Parameter.VAR_KEYWORD)])


def register(
    dispatch_mode: Union[Dispatch, str] = Dispatch.ALL_TO_ALL,
    execute_mode: Execute = Execute.ALL,
    blocking: bool = True,
    mesh_name: Optional[str] = None,
    batch_keys: Optional[tuple[str, ...]] = None,
    non_tensor_batch_keys: Optional[tuple[str, ...]] = None,
    rows_per_row: bool = False,
) -> Callable[[Callable], Callable]:
    """Mark a ``Worker`` method as callable on the whole group.

    Args:
        dispatch_mode: a ``Dispatch`` member or the name of a mode added with ``register_dispatch_mode``
            (looked up when the worker group is built).
        execute_mode: ``Execute.ALL`` (every rank runs) or ``Execute.RANK_ZERO`` (only rank 0 runs).
        blocking: for modes that do not collect a ``DataProto``, ``False`` makes the group method return at once
            the list of Ray ``ObjectRef`` objects of the ranks whose output counts. A ``DataProto``-collecting mode's
            call always returns a ``DataProtoFuture`` at once (read lazily).
        mesh_name: the layout name for ``Dispatch.MESH_COMPUTE_PROTO`` (required there, rejected elsewhere).
        batch_keys / non_tensor_batch_keys: the tensor / non-tensor columns the method may read (a superset: a
            column a config may add is listed; absent ones are skipped). The driver-side call sends only these
            of each ``DataProto`` argument (less to serialize and move); ``None`` (default) sends all.
        rows_per_row: the method returns the same number of rows for every input row, each input row's rows
            together and in order (a rollout: ``n`` per prompt). Its future's outputs are then equal consecutive
            slices of the result, and a next call split into as many chunks hands rank ``i`` output ``i`` straight
            from Ray (``DataProtoFuture.split_by_rank``) instead of each rank fetching every output.

    Raises:
        TypeError: a wrong argument type (including ``@register`` written without parentheses).
        ValueError: ``mesh_name`` missing for ``MESH_COMPUTE_PROTO`` or given for another mode.
    """
    if callable(dispatch_mode) and not isinstance(dispatch_mode, (Dispatch, str)):
        raise TypeError("register must be called: write @register(...) (with parentheses), not @register")
    if not isinstance(dispatch_mode, (Dispatch, str)):
        raise TypeError(f"dispatch_mode must be a Dispatch or a registered mode name, got {dispatch_mode!r}")
    if not isinstance(execute_mode, Execute):
        raise TypeError(f"execute_mode must be an Execute, got {execute_mode!r}")
    if not isinstance(blocking, bool):
        raise TypeError(f"blocking must be a bool, got {blocking!r}")
    if dispatch_mode is Dispatch.MESH_COMPUTE_PROTO:
        if not isinstance(mesh_name, str) or not mesh_name:
            raise ValueError("Dispatch.MESH_COMPUTE_PROTO needs mesh_name='<layout name>'")
    elif mesh_name is not None:
        raise ValueError(f"mesh_name={mesh_name!r} only applies to Dispatch.MESH_COMPUTE_PROTO, not {dispatch_mode}")
    for name, keys in (("batch_keys", batch_keys), ("non_tensor_batch_keys", non_tensor_batch_keys)):
        if keys is not None and (not isinstance(keys, tuple) or not all(isinstance(k, str) for k in keys)):
            raise TypeError(f"{name} must be a tuple of column names or None, got {keys!r}")
    if not isinstance(rows_per_row, bool):
        raise TypeError(f"rows_per_row must be a bool, got {rows_per_row!r}")
    spec = MethodSpec(dispatch_mode, execute_mode, blocking, mesh_name, batch_keys, non_tensor_batch_keys,
                      rows_per_row)

    def decorator(func: Callable) -> Callable:
        @functools.wraps(func)
        def inner(*args: Any, **kwargs: Any) -> Any:
            previous = kwargs.get(WAIT_KEY)
            if previous:  # the pool's previous call has ended (its outcome is its caller's to read)
                ray.wait(previous, num_returns=len(previous), fetch_local=False)
            args = tuple(materialize(a) for a in args)
            kwargs = {k: materialize(v) for k, v in kwargs.items() if not k.startswith(AFTER_PREFIX)}
            try:
                return func(*args, **kwargs)
            except UserError:
                raise
            except Exception as exc:  # raised in the user's code (a plugin, a worker class): one line and its frames
                wrapped = UserCodeError.wrap(exc, f"{func.__qualname__}()")
                if wrapped is None:  # hybridflow's or a library's own error: a bug, its traceback is kept
                    raise
                raise wrapped from exc

        setattr(inner, _SPEC_ATTR, spec)
        inner.__signature__ = _accepting_after(func)  # Ray checks a call's arguments against the signature,
        del inner.__wrapped__  # which it reads from the innermost function it can unwrap to: stop it here
        return inner

    return decorator
