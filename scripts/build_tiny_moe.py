"""Build the shipped ``tiny-moe`` model: a Qwen3-MoE-architecture model for the built-in arithmetic task.

Usage::

    python scripts/build_tiny_moe.py --out hybridflow/assets/tiny-moe [--steps N] [--threads 1]

A repository script, not part of the installed package (the package ships the built model as an asset).

Steps (all seeded):

1. Take the shipped ``tiny-arith`` model and its tokenizer (reused unchanged: same vocabulary, chat template and
   special tokens, so prompts tokenize identically).
2. Build a ``Qwen3MoeConfig`` model of the same trunk (hidden 128, 4 layers, 4 query heads and 2 key/value heads
   of dim 32, tied embeddings, 256 positions, fp32) whose MLP is a mixture of 8 experts, top-2
   (``moe_intermediate_size`` 48, gate weights renormalised over the two chosen experts). It is initialised by
   *sparse upcycling* (Komatsuzaki et al. 2022, "Sparse Upcycling: Training Mixture-of-Experts from Dense
   Checkpoints", sec. 3), here with the dense MLP's 384 hidden units split into 8 disjoint slices of 48, one per
   expert: the embeddings, attention and norms are copied; expert e gets the rows e*48..(e+1)*48 of the dense
   ``gate_proj``/``up_proj`` and those columns of ``down_proj`` times 8 (the router starts near uniform, so the
   two chosen experts get gate weights ~1/2 each; a uniformly random pair holds each expert with probability 2/8,
   so the expected output, 8 * 1/2 * 2/8 * (sum of the 8 slices), is the dense MLP's). Qwen3-MoE's q/k norms start
   at 1 (the dense Llama has none), so the copied attention is close to, not equal to, the dense one.
3. A short SFT (default 300 steps, AdamW, warmup + cosine) on the same full/shortcut mixture as ``tiny-arith``
   (``scripts/build_tiny_arith.py``: full solution with probability ``--correct-fraction``, else the shortcut
   mistake), so temperature-1 sampling is right a fraction of the time and GRPO has something to raise.
4. Save weights (safetensors), tokenizer, ``generation_config.json`` and ``build_info.json``.
"""

from __future__ import annotations

import json
import logging
import random
import sys
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer, GenerationConfig, LlamaForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/_sft.py, also when imported by its path
from _sft import correct_fraction_main, loss_tail_mean, save, sft_loop, warmup_cosine  # noqa: E402
from build_tiny_arith import _encode, _example  # noqa: E402
from hybridflow.data.builtin_task import DATA_SOURCE, make_builtin_problems  # noqa: E402
from hybridflow.models.builtin import BUILTIN_MODELS  # noqa: E402

logger = logging.getLogger(__name__)

NUM_EXPERTS, TOP_K = 8, 2


def moe_config(dense) -> Qwen3MoeConfig:
    """The Qwen3-MoE config of the dense Llama config ``dense``'s trunk, with :data:`NUM_EXPERTS` experts whose
    hidden units together are the dense MLP's."""
    return Qwen3MoeConfig(
        vocab_size=dense.vocab_size, hidden_size=dense.hidden_size, num_hidden_layers=dense.num_hidden_layers,
        num_attention_heads=dense.num_attention_heads, num_key_value_heads=dense.num_key_value_heads,
        head_dim=dense.head_dim, max_position_embeddings=dense.max_position_embeddings,
        rms_norm_eps=dense.rms_norm_eps, tie_word_embeddings=True, num_experts=NUM_EXPERTS,
        num_experts_per_tok=TOP_K, moe_intermediate_size=dense.intermediate_size // NUM_EXPERTS,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], intermediate_size=dense.intermediate_size,
        router_aux_loss_coef=0.0, bos_token_id=dense.bos_token_id, eos_token_id=dense.eos_token_id,
        pad_token_id=dense.pad_token_id, dtype="float32",
    )


def upcycle(dense: LlamaForCausalLM, seed: int) -> Qwen3MoeForCausalLM:
    """The MoE model of :func:`moe_config` with ``dense``'s weights sparse-upcycled (module docstring, step 2)."""
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(moe_config(dense.config)).float()
    src = dense.state_dict()
    width = dense.config.intermediate_size // NUM_EXPERTS
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if name in src:  # embeddings, attention, norms, head
                tensor.copy_(src[name])
        for i, layer in enumerate(model.model.layers):
            mlp = f"model.layers.{i}.mlp."
            gate, up, down = (src[mlp + k + ".weight"] for k in ("gate_proj", "up_proj", "down_proj"))
            experts = layer.mlp.experts
            for e in range(NUM_EXPERTS):
                rows = slice(e * width, (e + 1) * width)
                experts.gate_up_proj[e].copy_(torch.cat([gate[rows], up[rows]]))
                experts.down_proj[e].copy_(down[:, rows] * NUM_EXPERTS)  # gate ~1/2 x chosen 2/8 of the time
    model.generation_config = GenerationConfig(**dense.generation_config.to_dict())
    return model


def build(out: Path, *, steps: int, batch_size: int = 64, lr: float = 2e-3, correct_fraction: float = 0.35,
          seed: int = 0, num_train_problems: int = 20000) -> dict:
    """Upcycle tiny-arith, SFT it on the mixture, save everything into ``out``; return the build info."""
    start = time.perf_counter()
    source = BUILTIN_MODELS["tiny-arith"]
    tokenizer = AutoTokenizer.from_pretrained(source)
    model = upcycle(LlamaForCausalLM.from_pretrained(source, dtype=torch.float32), seed)
    problems = make_builtin_problems("train", num_train_problems, seed)
    rng = random.Random(seed)

    def next_examples():
        picks = [(rng.randrange(len(problems)), rng.random() < correct_fraction) for _ in range(batch_size)]
        return [_example(_encode(tokenizer, problems[i]), full) for i, full in picks]

    losses = sft_loop(model, next_examples, tokenizer.pad_token_id, steps=steps, lr=lr,
                      lr_factor=warmup_cosine(steps, divide_first=True), log_every=25)
    save(model, tokenizer, out)
    info = {"task": DATA_SOURCE, "architecture": "Qwen3MoeForCausalLM", "upcycled_from": "tiny-arith",
            "num_experts": NUM_EXPERTS, "top_k": TOP_K, "seed": seed, "sft_steps": steps, "batch_size": batch_size,
            "lr": lr, "correct_fraction": correct_fraction,
            "num_parameters": sum(p.numel() for p in model.parameters()),
            "first_loss": losses[0] if losses else None, "final_loss_mean_last_50": loss_tail_mean(losses),
            "build_seconds": round(time.perf_counter() - start, 1), "torch_threads": torch.get_num_threads()}
    (out / "build_info.json").write_text(json.dumps(info, indent=2) + "\n")
    return info


def main(argv: list[str] | None = None) -> None:
    correct_fraction_main(__doc__.splitlines()[0], build, steps=300, batch_size=64,
                          correct_help="share of SFT responses that are the full correct solution", argv=argv)


if __name__ == "__main__":
    main()
