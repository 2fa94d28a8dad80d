"""Tiny tokenizer + model for the multi-turn tests (not a test module).

The tokenizer is character-level (WordLevel over single characters) with ChatML markup tokens and a Hermes tool
format; its chat template renders ``tools=``, ``tool`` messages (as ``<tool_response>`` user turns) and, in the
reasoning variant, drops the ``<think>...</think>`` part of every assistant message but the last (as reasoning
templates do). A few whole phrases are single added tokens so that a *bigram* model can speak them.

The model is a real ``LlamaForCausalLM`` checkpoint whose next-token distribution depends on the current token
only: the decoder layer's output projections are zero (the residual stream is the token's one-hot embedding) and
``lm_head`` holds a hand-written log-probability table, so every sampling logprob is known in closed form
(``log 0.5`` for a coin flip, ``~0`` for a sure token). Both rollout backends load it (head_dim 32 for vLLM).
"""

from __future__ import annotations

import math
import string
from pathlib import Path

import pytest
import torch
import transformers
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

from hybridflow.protocol import DataProto

QUESTIONS = ["what is 2+3?", "add 2 and 3", "sum?"]
SPECIAL = ["<pad>", "<unk>", "<|im_start|>", "<|im_end|>"]
CALL = '{"name": "calculator", "arguments": {"expression": "2+3"}}'
BAD_CALL = '{"name": "calculator", "arguments": {"expression": "2**999"}}'
ANSWER = "The answer is 5."
THOUGHT = "<think>I should add.</think>"
FULL_CALL = "<tool_call>" + CALL + "</tool_call>"  # one token, only where the tool tags are plain characters
MARKUP = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
PHRASES = [CALL, BAD_CALL, ANSWER, THOUGHT]
SURE = 0.0  # logit of the only likely next token
NEVER = -30.0  # logit of every other token (mass e^-30 each)

TEMPLATE = (
    "{%- if tools -%}{{ '<|im_start|>system\\nTools:' }}{%- for t in tools -%}{{ ' ' + t['function']['name'] }}"
    "{%- endfor -%}{{ '<|im_end|>\\n' }}{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'tool' -%}{{ '<|im_start|>user\\n<tool_response>\\n' + m['content'] + "
    "'\\n</tool_response><|im_end|>\\n' }}"
    "{%- elif m['role'] == 'assistant' -%}"
    "{%- set content = m['content'] -%}"
    "{%- if DROP_THINK and not loop.last and '</think>' in content -%}"
    "{%- set content = content.split('</think>')[-1] -%}{%- endif -%}"
    "{{ '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' }}"
    "{%- else -%}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)


def build_tokenizer(reasoning: bool = False, tool_tokens: bool = True) -> transformers.PreTrainedTokenizerFast:
    """The character-level chat tokenizer; ``tool_tokens=False`` leaves ``<tool_call>``/``</tool_call>`` as
    plain characters (multi-token stop strings)."""
    chars = sorted(set(string.ascii_letters + string.digits + string.punctuation + " \n"))
    vocab = {tok: i for i, tok in enumerate(SPECIAL + chars)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", unk_token="<unk>",
                                               eos_token="<|im_end|>")
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    tok.add_tokens(MARKUP + PHRASES if tool_tokens else MARKUP[2:] + PHRASES + [FULL_CALL])
    tok.chat_template = TEMPLATE.replace("DROP_THINK", "true" if reasoning else "false")
    return tok


def coin_table(tok) -> dict[str, dict[str, float]]:
    """Next-token probabilities: after the generation prompt's newline a fair coin between calling the
    calculator and answering; the reasoning variant thinks first."""
    return {"\n": {"<tool_call>": 0.5, ANSWER: 0.5}, "<tool_call>": {CALL: 1.0}, CALL: {"</tool_call>": 1.0},
            ANSWER: {"<|im_end|>": 1.0}}


def reasoning_table(tok) -> dict[str, dict[str, float]]:
    return {"\n": {THOUGHT: 1.0}, THOUGHT: {"<tool_call>": 0.5, ANSWER: 0.5}, "<tool_call>": {CALL: 1.0},
            CALL: {"</tool_call>": 1.0}, ANSWER: {"<|im_end|>": 1.0}}


def build_bigram_model(tok, table: dict[str, dict[str, float]], path: Path) -> Path:
    """Write the bigram ``LlamaForCausalLM`` of ``table`` (token -> {next token: probability}; any other token
    is followed by ``<|im_end|>``) with ``tok`` to ``path``; returns ``path``."""
    vocab = len(tok)
    hidden = 128
    assert vocab <= hidden, vocab
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=512, tie_word_embeddings=False,
        rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model = transformers.LlamaForCausalLM(config).float()
    eos = tok.eos_token_id
    logits = torch.full((vocab, vocab), NEVER)  # [current, next]
    logits[:, eos] = SURE
    for current, nexts in table.items():
        row = tok.convert_tokens_to_ids(current)
        logits[row] = NEVER
        for token, p in nexts.items():
            logits[row, tok.convert_tokens_to_ids(token)] = math.log(p)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight.zero_()
        model.model.embed_tokens.weight[:, :vocab] = torch.eye(vocab)
        model.model.norm.weight.fill_(1.0)
        model.lm_head.weight.zero_()
        model.lm_head.weight[:, :vocab] = logits.T / math.sqrt(hidden)  # rmsnorm(one-hot) = sqrt(hidden) one-hot
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def expected_log_prob(table: dict[str, dict[str, float]], tok, current: int, nxt: int) -> float:
    """The closed-form log-probability of ``nxt`` after ``current`` under :func:`build_bigram_model`."""
    vocab = len(tok)
    nexts = table.get(tok.convert_ids_to_tokens(current), {"<|im_end|>": 1.0})
    likely = {tok.convert_tokens_to_ids(t): math.log(p) for t, p in nexts.items()}
    z = sum(math.exp(v) for v in likely.values()) + (vocab - len(likely)) * math.exp(NEVER)
    return likely.get(nxt, NEVER) - math.log(z)


def prompts_batch(tok, tools, questions=QUESTIONS, meta=None) -> DataProto:
    """Left-padded prompts: each question as a user message rendered with ``tools=``."""
    rows = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}], tools=tools, tokenize=False,
                                               add_generation_prompt=True), add_special_tokens=False)
            for q in questions]
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), tok.pad_token_id)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row):] = torch.tensor(row)
        mask[i, width - len(row):] = 1
    return DataProto.from_dict(tensors={"input_ids": ids, "attention_mask": mask,
                                        "position_ids": (mask.cumsum(-1) - 1).clamp(min=0)}, meta_info=meta or {})


def check_record_against_table(out, tok, table) -> None:
    """Every mask-1 token has the closed-form sampling logprob of the bigram table (so it was sampled by the
    model, in the recorded context); every mask-0 token is code-made and matches the template's rendering."""
    b = out.batch
    for row in range(len(out)):
        prompt = b["prompts"][row][b["attention_mask"][row, : b["prompts"].shape[1]].bool()].tolist()
        length = int(b["attention_mask"][row, b["prompts"].shape[1]:].sum())
        ids, mask = b["responses"][row, :length].tolist(), b["response_mask"][row, :length].tolist()
        lps = b["rollout_log_probs"][row, :length].tolist()
        assert b["response_mask"][row, length:].sum() == 0 and b["attention_mask"][row, -1] in (0, 1)
        context = prompt + ids
        for t, (token, m, lp) in enumerate(zip(ids, mask, lps)):
            if m:
                assert math.isfinite(lp)
                assert lp == pytest.approx(expected_log_prob(table, tok, context[len(prompt) + t - 1], token),
                                           abs=1e-4)
            else:
                assert lp == 0.0
        spans = out.non_tensor_batch["turn_spans"][row]
        assert [s[1] for s in spans] == [0] + [s[2] for s in spans[:-1]] and spans[-1][2] == length
        for kind, start, end in spans:
            assert set(mask[start:end]) == {1 if kind == "model" else 0}
            if kind == "observation":  # end-of-turn markup + the tool message + next generation prompt, code-made
                text = tok.decode(ids[start:end], skip_special_tokens=False)
                assert text == "<|im_end|>\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n" \
                               "<|im_start|>assistant\n"
        assert spans[-1][0] == "model"
        # positions continue over observations: the trainer's forward sees one contiguous sequence
        pos = b["position_ids"][row, b["prompts"].shape[1]:b["prompts"].shape[1] + length]
        assert pos.tolist() == list(range(len(prompt), len(prompt) + length))
