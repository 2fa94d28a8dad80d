"""The CPU adapter for megatron-core 0.16.1: lets its models, pipeline schedule, DDP and distributed optimizer run
on CPU with gloo (CI, laptops). Inactive on GPU: :func:`cpu_adapter` is a ``nullcontext`` for any other device.

megatron-core assumes CUDA in a few places that are not guarded by a device option. Inside :func:`cpu_adapter`:

* ``torch.cuda.current_device()`` returns ``"cpu"`` (rotary embedding ``inv_freq``, pipeline p2p shape tensors,
  attention masks, DDP grad buffers and the distributed optimizer allocate on it);
* a :class:`torch.overrides.TorchFunctionMode` maps ``device="cuda"`` (or ``cuda:N``) of any torch call to CPU
  (``torch.zeros(..., device="cuda")`` in the pipeline schedules' token counters, grad-norm helpers), and
  ``Tensor.cuda()`` / ``Tensor.to("cuda")`` to no-ops, and ``Tensor.type()`` names CPU tensors as their CUDA
  type (``torch.cuda.FloatTensor``: the distributed optimizer's parameter-type check);
* ``torch.cuda.synchronize`` is a no-op (p2p communication);
* the RNG-state helpers of ``megatron.core.tensor_parallel.random`` (``_get_cuda_rng_state``,
  ``_set_cuda_rng_state``) and ``torch.cuda.get_rng_state`` / ``manual_seed`` use the CPU generator, so the
  model-parallel RNG tracker (dropout forks) works.

For mixture-of-experts models with expert parallelism (the all-to-all token dispatcher over gloo, which supports
``all_to_all_single`` with uneven splits) three more, each a crash without it:

* ``torch.cuda.Stream`` / ``current_stream`` / ``stream`` are stand-ins (:class:`_HostStream`: waits and events are
  no-ops; work on CPU is synchronous), for the dispatcher's device-to-host side stream;
* ``megatron.core.transformer.moe.moe_utils.te_general_gemm`` is ``None`` (the router's gating linear references
  it, but it is only defined when TransformerEngine imports: a NameError without TE);
* the dispatcher's ``maybe_move_tensor_to_cpu(..., as_numpy=True)`` turns a CPU tensor of split sizes into a
  list (it only converts CUDA tensors, and ``all_to_all_single`` rejects a tensor there: TypeError).

Nothing else of megatron-core is changed; fused CUDA kernels (TransformerEngine, apex, fused softmax/rope/bias
kernels) must be switched off in the TransformerConfig (:func:`hybridflow.models.megatron_convert.transformer_config`
does that on CPU).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator
from unittest import mock

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["cpu_adapter"]


def _is_cuda(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return isinstance(device, str) and device.startswith("cuda")


class _CudaToCpu(TorchFunctionMode):
    """Rewrites ``device="cuda"`` arguments to CPU and makes ``Tensor.cuda()`` / ``.to("cuda")`` no-ops."""

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], "cpu", *args[2:])
        result = func(*args, **kwargs)
        if func is torch.Tensor.type and len(args) == 1 and not kwargs and result.startswith("torch."):
            return result if ".cuda." in result else "torch.cuda." + result[len("torch."):]
        return result


class _HostEvent:
    """Stand-in for ``torch.cuda.Event``: CPU work is synchronous, so it is always complete."""

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


class _HostStream:
    """Stand-in for ``torch.cuda.Stream`` on CPU (every op is synchronous): waits are no-ops."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        return None

    def wait_stream(self, other: Any) -> None:
        return None

    def wait_event(self, event: Any) -> None:
        return None

    def record_event(self, event: Any = None) -> _HostEvent:
        return _HostEvent()

    def synchronize(self) -> None:
        return None


_HOST_STREAM = _HostStream()


def _moe_patches() -> list:
    """The three MoE / expert-parallel shims of the module docstring (empty if megatron-core lacks the MoE
    package)."""
    try:
        from megatron.core.transformer.moe import moe_utils, token_dispatcher
    except ImportError:
        return []
    original = moe_utils.maybe_move_tensor_to_cpu

    def to_host(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.tolist()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    return [
        mock.patch.object(torch.cuda, "Stream", _HostStream),
        mock.patch.object(torch.cuda, "current_stream", lambda *a, **k: _HOST_STREAM),
        mock.patch.object(torch.cuda, "stream", lambda *a, **k: contextlib.nullcontext()),
        mock.patch.object(moe_utils, "te_general_gemm", None, create=True),
        mock.patch.object(token_dispatcher, "maybe_move_tensor_to_cpu", to_host),
    ]


@contextlib.contextmanager
def _active() -> Iterator[None]:
    from megatron.core.tensor_parallel import random as mg_random

    def set_state(state: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        torch.set_rng_state(state)

    patches = [
        mock.patch.object(torch.cuda, "current_device", lambda: "cpu"),
        mock.patch.object(torch.cuda, "synchronize", lambda *a, **k: None),
        mock.patch.object(torch.cuda, "get_rng_state", lambda *a, **k: torch.get_rng_state()),
        mock.patch.object(torch.cuda, "manual_seed", lambda seed: torch.manual_seed(seed)),
        mock.patch.object(mg_random, "_get_cuda_rng_state", lambda *a, **k: torch.get_rng_state()),
        mock.patch.object(mg_random, "_set_cuda_rng_state", set_state),
        *_moe_patches(),
    ]
    with contextlib.ExitStack() as stack:
        for patch in patches:
            stack.enter_context(patch)
        stack.enter_context(_CudaToCpu())
        yield


def cpu_adapter(device: str) -> contextlib.AbstractContextManager:
    """The adapter above when ``device`` is ``cpu``; a ``nullcontext`` otherwise (GPU: megatron-core unchanged).

    Re-entrant: nested uses are cheap no-ops of the same patches.
    """
    return _active() if device == "cpu" else contextlib.nullcontext()
