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
