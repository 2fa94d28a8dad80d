"""Colocation: several roles (e.g. actor, rollout, reference) in ONE Ray actor per rank.

``create_colocated_worker_cls({"actor": RayClassWithInitArgs(ActorWorker, cfg), "ref": ...})`` returns a
``RayClassWithInitArgs`` of a generated ``Worker`` class. Each of its actors builds every role's worker in the
same process (the rank environment is set once, before any of them), and exposes each role's registered
method ``m`` as ``f"{prefix}_{m}"`` with the same dispatch settings. Build a ``RayWorkerGroup`` from it and call
``spawn(prefix_set)`` to get one group object per role. Roles in one process can share memory (weights, the
device), which is what the 3D-HybridEngine relies on.

Mesh names are per process: roles that register the same mesh name must register the same layout.
"""

from __future__ import annotations

from typing import Any

from hybridflow.controller.decorator import MethodSpec, get_registered_methods
from hybridflow.controller.worker import Worker
from hybridflow.controller.worker_group import RayClassWithInitArgs

__all__ = ["create_colocated_worker_cls"]


def _forwarder(prefix: str, method_name: str, spec: MethodSpec, doc: Any) -> Any:
    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        # The role's method is itself register-wrapped, so it materializes DataProtoFuture arguments.
        return getattr(self._hf_roles[prefix], method_name)(*args, **kwargs)

    forward.__name__ = f"{prefix}_{method_name}"
    forward.__doc__ = doc
    forward._hf_method_spec = spec
    return forward


def create_colocated_worker_cls(class_dict: dict[str, RayClassWithInitArgs]) -> RayClassWithInitArgs:
    """A ``RayClassWithInitArgs`` whose actors hold one worker per role of ``class_dict`` (prefix -> class).

    Raises:
        ValueError: ``class_dict`` is empty, a prefix is not an identifier, or two prefixed names collide
            (e.g. prefixes ``"a"`` and ``"a_b"`` with methods ``b_c`` and ``c``).
        TypeError: a value is not a ``RayClassWithInitArgs``.
    """
    if not class_dict:
        raise ValueError("create_colocated_worker_cls needs at least one role")
    roles: dict[str, dict[str, str]] = {}
    attrs: dict[str, Any] = {}
    for prefix, cia in class_dict.items():
        if not isinstance(prefix, str) or not prefix.isidentifier():
            raise ValueError(f"role prefix must be a Python identifier, got {prefix!r}")
        if not isinstance(cia, RayClassWithInitArgs):
            raise TypeError(f"class_dict[{prefix!r}] must be a RayClassWithInitArgs, got {type(cia).__name__}")
        roles[prefix] = {}
        for method_name, spec in get_registered_methods(cia.cls).items():
            full = f"{prefix}_{method_name}"
            if full in attrs or hasattr(Worker, full):
                raise ValueError(f"colocated method name {full!r} is produced twice; choose other role prefixes")
            attrs[full] = _forwarder(prefix, method_name, spec, getattr(cia.cls, method_name).__doc__)
            roles[prefix][method_name] = full
    specs = {prefix: (cia.cls, cia.args, cia.kwargs) for prefix, cia in class_dict.items()}

    def __init__(self: Any) -> None:
        Worker.__init__(self)
        self._hf_roles = {prefix: cls(*args, **kwargs) for prefix, (cls, args, kwargs) in specs.items()}

    def _query_dispatch_info(self: Any, mesh_name: str) -> tuple[int, bool]:
        found = {p: w._mesh_dispatch_info[mesh_name] for p, w in self._hf_roles.items()
                 if mesh_name in w._mesh_dispatch_info}
        if mesh_name in self._mesh_dispatch_info:
            found["<colocated>"] = self._mesh_dispatch_info[mesh_name]
        if not found:
            return Worker._query_dispatch_info(self, mesh_name)  # raises the standard KeyError
        if len(set(found.values())) > 1:
            raise ValueError(f"rank {self.rank}: roles register mesh {mesh_name!r} differently: {found}; "
                             "use a distinct mesh name per layout")
        return next(iter(found.values()))

    attrs.update(__init__=__init__, _query_dispatch_info=_query_dispatch_info, _hf_colocated_roles=roles,
                 __doc__=f"Colocated roles {sorted(class_dict)} in one process.")
    name = "Colocated_" + "_".join(class_dict)
    return RayClassWithInitArgs(type(name, (Worker,), attrs))
