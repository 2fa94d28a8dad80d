"""``hf`` rollout backend: a hand-written decoding loop over a Hugging Face causal LM with a KV cache.

Runs anywhere PyTorch runs (the CPU default). We decode ourselves instead of calling ``model.generate``
so the log-probability of each sampled token is taken under exactly the distribution it was drawn from
(temperature, top-k and top-p applied, then renormalized), which is what importance-sampling corrections
between the rollout and the trainer need.

Shape legend: B prompts, n samples per prompt, N = B*n rows, P prompt tokens, R = response_length
response tokens, V vocabulary.
"""

from __future__ import annotations

import difflib
import logging
import time
from typing import Any, Callable, Iterable, Optional, Sequence, Union

import torch

from hybridflow.algorithms.sampling import SamplingSpec, sampling_logits
from hybridflow.protocol import DataProto
from hybridflow.rollout.base import BaseRollout, RolloutAsleepError, register_rollout
from hybridflow.rollout.batching import as_id_list, build_rollout_output, prompt_tensors, resolve_sampling_params
from hybridflow.rollout.routing_record import attach_routing, decode_routing
from hybridflow.rollout.vision import add_rollout_positions, vision_chunk, vision_rows

logger = logging.getLogger(__name__)

__all__ = ["HFRollout"]


def _next_tokens(
    logits: torch.Tensor,
    do_sample: bool,
    temperature: float,
    top_k: int,
    top_p: float,
    generator: Optional[torch.Generator],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row and its log-probability.

    Greedy (``do_sample`` false or ``temperature == 0``): argmax, logprob under log_softmax(logits).
    Sampling: draw from the tempered, top-k / top-p truncated and renormalized distribution
    (:func:`~hybridflow.algorithms.sampling.sampling_logits`, the definition the trainer recomputes with);
    the logprob is under that same distribution.

    Args:
        logits: (N, V) float32 logits of the last position.

    Returns:
        tokens (N,) long, logprobs (N,) float32.
    """
    if not do_sample or temperature == 0:
        tokens = logits.argmax(dim=-1)
        logprobs = logits.log_softmax(dim=-1)
    else:
        logprobs = sampling_logits(logits, SamplingSpec(temperature, top_k, top_p)).log_softmax(dim=-1)
        tokens = torch.multinomial(logprobs.exp(), 1, generator=generator).squeeze(-1)
    return tokens, logprobs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def _param_alias_groups(module: torch.nn.Module) -> list[list[str]]:
    """Names of parameters that share one tensor (tied weights), one list per shared tensor."""
    by_id: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(param), []).append(name)
    return [names for names in by_id.values() if len(names) > 1]


def _retie(module: torch.nn.Module, alias_groups: list[list[str]]) -> None:
    """Make every name of each alias group point at the group's first parameter again.

    Device moves through ``Module.to``/``to_empty`` may replace parameter objects one by one, which
    unties tied weights; this restores the sharing recorded at construction.
    """
    for names in alias_groups:
        shared = module.get_parameter(names[0])
        for name in names[1:]:
            owner_name, _, leaf = name.rpartition(".")
            setattr(module.get_submodule(owner_name), leaf, shared)


@register_rollout("hf", uses_hybrid_engine=True, supports_int8_quantization=True, lora_adapter_sync=True,
                  records_routing=True)
class HFRollout(BaseRollout):
    """Rollout backend over a Hugging Face causal LM, decoding with ``DynamicCache``.

    Args:
        module: a ``transformers`` causal LM (``PreTrainedModel``). It is used in place (not copied), so
            it may be shared with a trainer; generation switches it to eval mode and restores its mode.
        config: attribute-access sampling config: ``response_length`` (int, max new tokens), ``n``
            (samples per prompt), ``do_sample``, ``temperature``, ``top_p``, ``top_k`` (-1 disables),
            ``micro_batch_size`` (prompts per decoding loop).
        eos_token_id: id or ids that end a response.
        pad_token_id: id written to response slots after a row's end.

    Per-call ``meta_info`` overrides: ``do_sample``, ``temperature``, ``top_p``, ``top_k``, ``n``,
    ``response_length``; ``eos_token_id`` (int or list) ids are *added* to the constructor's ids; ``seed``
    (int): sampling draws from a ``torch.Generator`` seeded with it, so the same call (same prompts, same
    config and ``micro_batch_size``, same device) returns the same samples. Without a seed, sampling uses
    the global torch RNG.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        config: Any,
        eos_token_id: Union[int, Sequence[int]],
        pad_token_id: int,
    ) -> None:
        self.module = module
        self.config = config
        self.eos_token_ids = as_id_list(eos_token_id)
        self.pad_token_id = int(pad_token_id)
        if not self.eos_token_ids:
            raise ValueError("HFRollout needs at least one eos_token_id, got none")
        self._alias_groups = _param_alias_groups(module)
        self._device = next(module.parameters()).device
        self._sleep_level = 0  # 0 awake, 1 weights offloaded, 2 weights discarded
        self._missing_weights: set[str] = set()  # parameters to load before generating (after level-2 sleep)
        self._buffer_backup: dict[str, torch.Tensor] = {}

    # ------------------------------------------------------------------ generation
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """Generate responses for left-padded prompts (see :meth:`BaseRollout.generate_sequences`).

        Args:
            prompts: ``input_ids`` (B, P) long, ``attention_mask`` (B, P) with 0 on left padding,
                ``position_ids`` (B, P) long. ``meta_info`` overrides as in the class docstring.

        Returns:
            DataProto on the device of ``prompts.batch["input_ids"]``, N = B*n rows, interleaved
            (p0, p0, p1, p1, ...), tensors:
            ``prompts`` (N, P) long; ``responses`` (N, R) long, pad_token_id after a row's end;
            ``input_ids`` (N, P+R) = cat(prompts, responses); ``attention_mask`` (N, P+R) = cat(prompt
            mask, response_mask); ``position_ids`` (N, P+R): prompt positions, then last prompt position
            + 1, + 2, ... for every response slot, padded ones included; ``response_mask`` (N, R) long, 1 on
            generated tokens up to and including the first eos; ``rollout_log_probs`` (N, R) float32,
            logprob of each token under the distribution it was drawn from, 0 where response_mask is 0;
            ``truncated`` (N,) bool, True where the response used all R slots without emitting an eos;
            with ``config.record_routing`` and an MoE model ``routed_experts`` (N, P+R, Ly, k) int16, the experts
            each MoE layer routed each token to (:mod:`hybridflow.rollout.routing_record`).
            meta_info: ``num_generated_tokens`` (int, sum of response_mask), ``generate_seconds`` (float).
            The input's non-tensor columns and meta_info are not carried over; repeat the input batch with
            ``repeat(n, interleave=True)`` to align it with the output.

        Raises:
            RolloutAsleepError: called while asleep, or before reloading weights after a level-2 sleep.
            KeyError: a prompt tensor is missing.
            ValueError: prompt tensors of different shapes, or invalid sampling parameters.
        """
        self._check_ready()
        params = resolve_sampling_params(self.config, prompts.meta_info)
        input_ids, attention_mask, position_ids = prompt_tensors(prompts)
        out_device = input_ids.device
        n = params["n"]
        vision = vision_rows(prompts, n)  # a VLM's images and mrope positions, rows repeated n times
        if n > 1:
            input_ids, attention_mask, position_ids = (
                t.repeat_interleave(n, dim=0) for t in (input_ids, attention_mask, position_ids)
            )
        eos_ids = torch.tensor(
            sorted(set(self.eos_token_ids + as_id_list(prompts.meta_info.get("eos_token_id")))),
            device=self._device,
        )
        generator = None
        if prompts.meta_info.get("seed") is not None:
            generator = torch.Generator(device=self._device).manual_seed(int(prompts.meta_info["seed"]))

        rows_per_call = max(1, int(self.config.micro_batch_size)) * n
        start = time.perf_counter()
        was_training = self.module.training
        self.module.eval()
        chunks, routings = [], []  # routings: an MoE model's routing per decode (record_routing)
        try:
            for i in range(0, input_ids.shape[0], rows_per_call):
                rows = slice(i, i + rows_per_call)
                with decode_routing(self.module, getattr(self.config, "record_routing", False)) as routing:
                    chunks.append(self._decode(input_ids[rows].to(self._device), attention_mask[rows].to(self._device),
                                               position_ids[rows].to(self._device), eos_ids, params, generator,
                                               vision_chunk(vision, i, i + rows_per_call, self._device)))
                routings.append(routing.rectangle(len(chunks[-1][0]), input_ids.shape[1], params["response_length"]))
        finally:
            self.module.train(was_training)
        seconds = time.perf_counter() - start
        responses, response_mask, log_probs = (torch.cat(parts).to(out_device) for parts in zip(*chunks))

        out = add_rollout_positions(build_rollout_output(
            input_ids, attention_mask, position_ids, responses, response_mask, log_probs, seconds, eos_ids.cpu()
        ), vision)
        attach_routing(out, routings)
        logger.debug("hf rollout: %d rows, %d tokens in %.3fs", len(out), out.meta_info["num_generated_tokens"],
                     seconds)
        return out

    @torch.no_grad()
    def _decode(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        eos_ids: torch.Tensor,
        params: dict[str, Any],
        generator: Optional[torch.Generator],
        vision: Optional[dict] = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Decode one micro-batch of (N, P) prompts; returns responses (N, R), response_mask (N, R),
        logprobs (N, R) float32, on the model's device. ``vision``: a VLM micro-batch's images and (3, N, P)
        positions (:func:`hybridflow.rollout.vision.vision_chunk`)."""
        rows, length = input_ids.shape[0], params["response_length"]
        responses = torch.full((rows, length), self.pad_token_id, dtype=torch.long, device=input_ids.device)
        log_probs = torch.zeros((rows, length), dtype=torch.float32, device=input_ids.device)
        # response tokens per row: the step at which the row emitted its eos (1-based), else R
        lengths = torch.full((rows,), length, dtype=torch.long, device=input_ids.device)
        finished = torch.zeros(rows, dtype=torch.bool, device=input_ids.device)
        forward = self._step_forward(attention_mask, input_ids.shape[1] + length, params["n"], vision)
        last = position_ids[:, -1:] if vision is None else vision["positions"][..., -1:]  # (N, 1) or (3, N, 1)
        step_ids, step_positions = input_ids, (position_ids if vision is None else vision["positions"])
        for step in range(length):
            logits = forward(step_ids, step_positions)
            tokens, token_log_probs = _next_tokens(
                logits, params["do_sample"], params["temperature"], params["top_k"], params["top_p"], generator
            )
            tokens = tokens.masked_fill(finished, self.pad_token_id)
            log_probs[:, step] = token_log_probs.masked_fill(finished, 0.0)
            responses[:, step] = tokens
            newly_finished = ~finished & torch.isin(tokens, eos_ids)
            lengths[newly_finished] = step + 1
            finished |= newly_finished
            if bool(finished.all()):
                break
            step_ids = tokens.unsqueeze(-1)
            step_positions = last + step + 1
        del forward  # the KV cache
        response_mask = (torch.arange(length, device=input_ids.device) < lengths.unsqueeze(-1)).long()
        return responses, response_mask, log_probs

    def _step_forward(self, attention_mask: torch.Tensor, capacity: int, copies: int,
                      vision: Optional[dict] = None) -> Callable:
        """The decoding forward of one micro-batch with prompt mask ``attention_mask`` (N, P) and at most
        ``capacity`` tokens: ``forward(ids (N, L), positions (N, L)) -> logits (N, V)`` float32 of the last
        position, the KV cache kept inside. With ``fast_decode`` (default) and a Llama-family model,
        :class:`~hybridflow.rollout.fast_decode.LeanDecoder`, which runs the prompt forward once per group of
        ``copies`` identical rows (the n samples of a prompt); otherwise the module's own forward over a
        :func:`~hybridflow.rollout.kv_cache.preallocated_cache`, the mask growing by one column a step. ``vision``:
        the prefill (first call) also gets the images (a VLM: never the lean decoder)."""
        # imported here: importing the rollout registry stays light
        from hybridflow.models.hf import accepts_logits_to_keep
        from hybridflow.rollout.fast_decode import lean_decoder
        from hybridflow.rollout.kv_cache import preallocated_cache

        lean = lean_decoder(self.module) if getattr(self.config, "fast_decode", True) and vision is None else None
        if lean is not None:
            lean.start(attention_mask, capacity, copies)
            return lean.step
        cache = preallocated_cache(self.module.config, capacity)
        # the output head on the last position only (the prompt's other positions are never read)
        last = {"logits_to_keep": 1} if accepts_logits_to_keep(self.module) else {}
        masks = [attention_mask]  # the mask of the next call: the prompt's, then one more column a step
        images = [vision["inputs"]] if vision else []  # the prefill's pixel_values / image_grid_thw

        def forward(ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            output = self.module(input_ids=ids, attention_mask=masks[-1], position_ids=positions,
                                 past_key_values=cache, use_cache=True, **last, **(images.pop() if images else {}))
            masks[-1] = torch.cat([masks[-1], masks[-1].new_ones((ids.shape[0], 1))], dim=1)
            return output.logits[:, -1, :].float()

        return forward

    # ------------------------------------------------------------------ weights and memory
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy ``(name, tensor)`` pairs into the module's parameters (or buffers) in place.

        Tensors are cast to the parameter's dtype and device. Tied parameters share one tensor, so a
        weight for any of their names (``lm_head.weight`` or ``model.embed_tokens.weight``) updates all.

        Raises:
            KeyError: unknown name (the message lists close and a few known names).
            ValueError: shape mismatch.
            RolloutAsleepError: called while asleep.
        """
        if self._sleep_level:
            raise RolloutAsleepError("HFRollout.load_weights called while asleep; call wake() first")
        targets = dict(self.module.named_parameters(remove_duplicate=False))
        targets.update(self.module.named_buffers(remove_duplicate=False))
        aliases = {name: group for group in self._alias_groups for name in group}
        with torch.no_grad():
            for name, tensor in weights:
                target = targets.get(name)
                if target is None:
                    close = difflib.get_close_matches(name, targets, n=3)
                    raise KeyError(
                        f"load_weights: model has no parameter {name!r}; close names: {close}; "
                        f"first known names: {list(targets)[:5]}"
                    )
                if tuple(target.shape) != tuple(tensor.shape):
                    raise ValueError(
                        f"load_weights: {name!r} has shape {tuple(target.shape)}, got {tuple(tensor.shape)}"
                    )
                target.copy_(tensor)
                self._missing_weights.difference_update(aliases.get(name, [name]))

    def sleep(self, level: int = 1) -> None:
        """Free memory until :meth:`wake` (see :meth:`BaseRollout.sleep`).

        Level 1 moves the module to CPU (on a CPU model nothing is freed); level 2 moves its parameters to
        the ``meta`` device (buffers such as rotary frequencies are kept on CPU), so every parameter must
        be reloaded with :meth:`load_weights` after :meth:`wake`. Do not use level 2 when the module is
        shared with a trainer. The KV cache lives only inside a generate call, so nothing else is held.

        Raises:
            ValueError: ``level`` is not 1 or 2.
        """
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 (offload weights) or 2 (discard weights), got {level}")
        if self._sleep_level:
            return
        if level == 2:
            self._buffer_backup = {
                name: buf.detach().to("cpu", copy=True) for name, buf in self.module.named_buffers()
            }
            self.module.to("meta")
        else:
            self.module.to("cpu")
        _retie(self.module, self._alias_groups)
        self._sleep_level = level

    def wake(self) -> None:
        """Bring the module back to its device; after a level-2 sleep its weights are uninitialized until
        :meth:`load_weights` has covered every parameter (generate raises until then)."""
        if not self._sleep_level:
            return
        if self._sleep_level == 2:
            self.module.to_empty(device=self._device)
            with torch.no_grad():
                for name, buf in self.module.named_buffers():
                    buf.copy_(self._buffer_backup[name])
            self._buffer_backup = {}
            self._missing_weights = {name for name, _ in self.module.named_parameters(remove_duplicate=False)}
        else:
            self.module.to(self._device)
        _retie(self.module, self._alias_groups)
        self._sleep_level = 0

    def _check_ready(self) -> None:
        if self._sleep_level:
            raise RolloutAsleepError("HFRollout.generate_sequences called while asleep; call wake() first")
        if self._missing_weights:
            raise RolloutAsleepError(
                f"HFRollout woke from a level-2 sleep but {len(self._missing_weights)} parameters were not "
                f"reloaded (e.g. {sorted(self._missing_weights)[:3]}); call load_weights first"
            )
