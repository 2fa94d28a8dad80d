"""Activation memory per rank of one long sequence with Ulysses sequence parallelism (sp=1 vs sp=2), and the longest
sequence whose activations fit under a per-rank cap with and without it. Prints JSON.

What is measured: the bytes autograd keeps for the backward of one training forward + backward of the fsdp2 engine
(``torch.autograd.graph.saved_tensors_hooks``: every tensor saved for backward, each storage counted once,
parameters excluded), i.e. the activation memory that must be live at the end of the forward, per rank. It is a
count of tensor bytes, not a timing, so it does not depend on the machine's load. The sequence is one prompt +
response of ``--tokens`` tokens on a tiny Llama (hidden 64, 4 heads / 2 KV heads, 2 layers, vocabulary 1024),
fp32, padded path (``use_remove_padding`` packs the same single row).

Longest sequence under ``--cap-mib``: activation bytes are affine in the length at these sizes (CPU SDPA keeps
O(S) per head: its output and log-sum-exp), so each setting is measured at two lengths, the line solved for the
cap, and the answer verified by one more measurement at that length (it must fit; one token more is predicted not
to). Usage: ``python benchmarks/sp_memory.py --tokens 8192 --cap-mib 64``.
"""

from __future__ import annotations

import argparse
import json
import platform

import torch

from _gloo import run_gloo_ranks  # benchmarks/_gloo.py (this script's folder is on sys.path)
from hybridflow.distributed import build_mesh
from hybridflow.protocol import DataProto
from hybridflow.training import FSDP2Engine

VOCAB = 1024


def _model() -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1 << 17,
                         attn_implementation="sdpa")
    return AutoModelForCausalLM.from_config(config)


def _micro(tokens: int) -> DataProto:
    ids = torch.randint(0, VOCAB, (1, tokens), generator=torch.Generator().manual_seed(tokens))
    mask = torch.ones_like(ids)
    half = tokens // 2
    return DataProto.from_dict(tensors={"input_ids": ids, "attention_mask": mask,
                                        "position_ids": torch.arange(tokens)[None], "responses": ids[:, half:]})


def activation_bytes(engine: FSDP2Engine, tokens: int) -> int:
    """Bytes saved for backward by one forward + backward of a ``tokens``-long sequence on this rank."""
    params = {p.data_ptr() for p in engine.module.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    micro = _micro(tokens)
    engine.set_train(True)
    engine.zero_grad()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        engine.forward_backward(micro, lambda out: out["log_probs"].mean())
    return sum(seen.values())


def _longest(engine: FSDP2Engine, cap: int, probes: tuple[int, int], sp: int) -> dict:
    """The longest length (a multiple of ``sp``) whose activations fit under ``cap`` bytes: affine fit on two
    measured lengths, solved, then measured once more."""
    (s0, s1), (b0, b1) = probes, [activation_bytes(engine, s) for s in probes]
    slope = (b1 - b0) / (s1 - s0)
    longest = int((cap - b0) / slope + s0) // sp * sp
    measured = activation_bytes(engine, longest)
    return {"tokens": longest, "measured_bytes": measured, "fits": measured <= cap, "bytes_per_token": slope}


def _rank(rank: int, sp: int, tokens: int, cap: int, probes: tuple[int, int], out_path: str) -> None:
    mesh = build_mesh(dp=sp) if sp > 1 else None
    model = _model()
    engine = FSDP2Engine.from_module(model, torch.optim.SGD(model.parameters(), lr=0.0), mesh=mesh,
                                     replicated=mesh is not None, sp=sp)
    result = {"sp": sp, "tokens": tokens, "activation_bytes": activation_bytes(engine, tokens),
              "longest_under_cap": _longest(engine, cap, probes, sp)}
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(result, f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192, help="sequence length measured with sp=1 and sp=2")
    parser.add_argument("--cap-mib", type=float, default=64.0, help="per-rank activation cap for the longest length")
    args = parser.parse_args()
    cap = int(args.cap_mib * 2 ** 20)
    probes = (args.tokens // 4, args.tokens // 2)
    runs = {sp: run_gloo_ranks(_rank, sp, sp, args.tokens, cap, probes) for sp in (1, 2)}
    one, two = runs[1], runs[2]
    print(json.dumps({
        "model": "llama hidden 64, 4 heads / 2 kv, 2 layers, vocab 1024, fp32", "tokens": args.tokens,
        "activation_mib_per_rank": {f"sp={sp}": r["activation_bytes"] / 2 ** 20 for sp, r in runs.items()},
        "ratio_sp2_over_sp1": two["activation_bytes"] / one["activation_bytes"],
        "cap_mib": args.cap_mib,
        "longest_tokens_under_cap": {f"sp={sp}": r["longest_under_cap"] for sp, r in runs.items()},
        "machine": f"{platform.processor() or platform.machine()}, torch {torch.__version__}",
    }, indent=1))


if __name__ == "__main__":
    main()
