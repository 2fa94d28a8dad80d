"""Any local Hugging Face causal LM: a 2-step PPO run from a saved directory of a model that is not the built-in one.

The model is a tiny grouped-query-attention Llama with tied embeddings (hidden 64, 4 query heads and 2 key-value
heads of dim 16). Its tokenizer is sentencepiece-style (a Unigram model with the Metaspace pre-tokenizer and
decoder), has a chat template, and has NO pad token; its generation_config lists two eos ids (``</s>`` and
``<|end|>``). The data comes from GSM8K-format rows through ``hybridflow data``'s converter.
"""

import json
import string

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import GenerationConfig, PreTrainedTokenizerFast

from helpers.models import tiny_model
from hybridflow.config import load_config
from hybridflow.data.preprocess import convert
from hybridflow.models.hf import get_eos_token_ids, load_tokenizer

SPECIAL = ["<unk>", "<s>", "</s>", "<|end|>"]  # ids 0..3
WORDS = ["the", "how", "many", "does", "have", "let's", "think", "step", "by", "and", "output", "final", "answer",
         "after", "####"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant]{% endif %}"
)


def save_tiny_gqa_llama(path):
    """Write model, tokenizer and generation_config to ``path``; return the tokenizer."""
    chars = sorted(set(string.printable) - set(string.whitespace))
    pieces = ([(t, 0.0) for t in SPECIAL] + [("\u2581", -2.0)] + [("\u2581" + w, -3.0) for w in WORDS]
              + [(c, -5.0) for c in chars] + [("\u2581" + c, -6.0) for c in chars])
    backend = Tokenizer(models.Unigram(pieces, unk_id=0))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
    backend.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                                        unk_token="<unk>", additional_special_tokens=["<|end|>"])
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    tiny_model(seed=0, vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
               pad_token_id=None, max_position_embeddings=512).save_pretrained(path)
    GenerationConfig(bos_token_id=1, eos_token_id=[2, 3]).save_pretrained(path)
    return tokenizer


def write_gsm8k_jsonl(path, count, offset):
    with open(path, "w") as f:
        for i in range(offset, offset + count):
            a, b = 3 + i, 1000 + 7 * i
            f.write(json.dumps({"question": f"Tom has {a} cats and {b} dogs. How many pets does he have?",
                                "answer": f"{a} + {b} = {a + b}\n#### {a + b:,}"}) + "\n")


def test_saved_model_loads_with_hybridflow_rules(tmp_path):
    """The directory is what the PPO test relies on: no pad token, two eos ids, GQA, tied embeddings."""
    model_dir = tmp_path / "model"
    save_tiny_gqa_llama(model_dir)
    tokenizer = load_tokenizer(str(model_dir))
    assert tokenizer.pad_token_id == tokenizer.convert_tokens_to_ids("</s>") == 2  # the pad rule: pad = eos
    assert get_eos_token_ids(str(model_dir), tokenizer) == [2, 3]
    config = json.loads((model_dir / "config.json").read_text())
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["tie_word_embeddings"]) == (4, 2, True)
    # sentencepiece-style: the word boundary marker is part of the pieces and round-trips through decode
    ids = tokenizer("how many cats", add_special_tokens=False)["input_ids"]
    assert tokenizer.convert_ids_to_tokens(ids[:2]) == ["\u2581how", "\u2581many"]
    assert tokenizer.decode(ids) == "how many cats"


@pytest.mark.slow
def test_two_ppo_steps_from_saved_hf_directory(tmp_path):
    model_dir = tmp_path / "model"
    save_tiny_gqa_llama(model_dir)
    write_gsm8k_jsonl(tmp_path / "train.jsonl", 8, 0)
    write_gsm8k_jsonl(tmp_path / "test.jsonl", 4, 100)
    train = convert("gsm8k", tmp_path / "train.jsonl", tmp_path / "data").output
    val = convert("gsm8k", tmp_path / "test.jsonl", tmp_path / "data").output
    out = tmp_path / "run"
    cfg = load_config("quickstart", [
        f"actor_rollout_ref.model.path={model_dir}",
        f"data.train_files={train}",
        f"data.val_files={val}",
        "data.max_prompt_length=160",
        "data.max_response_length=8",
        "data.train_batch_size=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
        "critic.ppo_mini_batch_size=2",
        "critic.ppo_micro_batch_size_per_gpu=1",
        "trainer.total_training_steps=2",
        "trainer.test_freq=2",
        "trainer.val_before_train=false",
        "trainer.logger=[jsonl]",
        f"trainer.default_local_dir={out}",
    ])
    from hybridflow.trainer.main import run_ppo  # Ray loads only here

    run_ppo(cfg)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if "rollout/logprob_diff_max" in r]
    assert [r["step"] for r in train_rows] == [1, 2]
    # before the first update the trainer's recomputed logprobs equal the rollout's sampling logprobs (fp32)
    assert train_rows[0]["rollout/logprob_diff_max"] <= 1e-5
    assert "val/score/openai/gsm8k" in rows[-1]
