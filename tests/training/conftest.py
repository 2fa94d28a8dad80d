"""Fixtures shared by the training-engine tests."""

import os

import pytest

from hybridflow.distributed.launch import free_port


@pytest.fixture(scope="module")
def megatron_1rank():
    """A one-rank gloo process group with megatron-core's model-parallel state (tp = pp = 1) and its CUDA RNG
    tracker seeded through the CPU adapter, for building Megatron models in this process; torn down after the
    module."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from hybridflow.training.megatron_cpu import cpu_adapter

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    with cpu_adapter("cpu"):
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
        model_parallel_cuda_manual_seed(0)
    yield
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
