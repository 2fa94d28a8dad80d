"""The single-controller layer: workers, dispatch modes, resource pools and Ray worker groups.

Knows nothing about RL. See ``worker_group.py`` for the flow of one call.
"""

from hybridflow.controller.decorator import Dispatch, Execute, MethodSpec, get_method_spec, register
from hybridflow.controller.dispatch import (
    DispatchError,
    DispatchMode,
    DispatchPlan,
    MeshDispatchInfo,
    get_dispatch_mode,
    register_dispatch_mode,
)
from hybridflow.controller.futures import CallTimeoutError, DataProtoFuture, WorkerError
from hybridflow.controller.resource_pool import ResourceError, ResourcePool, ResourcePoolManager
from hybridflow.controller.unread import raise_unread_errors
from hybridflow.controller.worker import Worker
from hybridflow.controller.worker_group import RayClassWithInitArgs, RayWorkerGroup
from hybridflow.controller.colocated import ColocatedWorkerGroup, can_colocate, create_colocated, create_groups

__all__ = [
    "CallTimeoutError",
    "ColocatedWorkerGroup",
    "DataProtoFuture",
    "Dispatch",
    "DispatchError",
    "DispatchMode",
    "DispatchPlan",
    "Execute",
    "MeshDispatchInfo",
    "MethodSpec",
    "RayClassWithInitArgs",
    "RayWorkerGroup",
    "ResourceError",
    "ResourcePool",
    "ResourcePoolManager",
    "Worker",
    "WorkerError",
    "can_colocate",
    "create_colocated",
    "create_groups",
    "get_dispatch_mode",
    "get_method_spec",
    "raise_unread_errors",
    "register",
    "register_dispatch_mode",
]
