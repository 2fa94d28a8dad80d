"""Reward/cost-model scoring at the last valid token: left-padded prompts, right-padded responses, pad == eos."""

import pytest
import torch
from transformers import LlamaForCausalLM, LlamaForSequenceClassification, LlamaForTokenClassification

from helpers.models import tiny_config
from hybridflow.workers.rm_worker import last_token_scores, last_valid_index, load_score_model

EOS = PAD = 2  # the pad token is the eos token


def _config(**kw):
    return tiny_config(vocab_size=32, hidden_size=16, intermediate_size=32, eos_token_id=EOS, pad_token_id=PAD, **kw)


def test_last_valid_index_from_the_mask_only():
    mask = torch.tensor([[0, 0, 1, 1, 1, 0],   # left and right padding
                         [1, 1, 1, 1, 1, 1],   # none
                         [0, 1, 1, 0, 0, 0]])  # short
    assert last_valid_index(mask).tolist() == [4, 5, 2]
    scores = torch.arange(18.0).reshape(3, 6)
    assert last_token_scores(scores, mask).tolist() == [4.0, 11.0, 14.0]


def _sequences():
    """Two (prompt, response) pairs; the second response ends with eos (== pad) and is shorter."""
    return [([5, 6, 7], [8, 9, 10, 11]), ([12, 13, 14, 15, 16], [17, EOS])]


def _batch(pairs, prompt_len=5, response_len=4):
    """Left-padded prompts + right-padded responses, all padding with PAD (== EOS)."""
    ids, mask = [], []
    for prompt, response in pairs:
        p = [PAD] * (prompt_len - len(prompt)) + prompt
        r = response + [PAD] * (response_len - len(response))
        ids.append(p + r)
        mask.append([0] * (prompt_len - len(prompt)) + [1] * (len(prompt) + len(response))
                    + [0] * (response_len - len(response)))
    mask = torch.tensor(mask)
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    return torch.tensor(ids), mask, position_ids


@pytest.mark.parametrize("cls", [LlamaForSequenceClassification, LlamaForTokenClassification])
def test_padded_batch_scores_equal_unpadded_single_sequences(tmp_path, cls):
    torch.manual_seed(0)
    reference = cls(_config(num_labels=1)).eval()
    reference.save_pretrained(tmp_path)
    model = load_score_model(str(tmp_path), torch.float32)
    ids, mask, pos = _batch(_sequences())
    with torch.no_grad():
        got = last_token_scores(model(input_ids=ids, attention_mask=mask, position_ids=pos).logits.squeeze(-1), mask)
        # reference: each sequence alone, unpadded, backbone + score head read at its final position
        want = [reference.score(reference.model(input_ids=torch.tensor([p + r])).last_hidden_state)[0, -1, 0]
                for p, r in _sequences()]
    assert torch.allclose(got, torch.stack(want), atol=1e-5)
    # Hugging Face's own pooling finds the last non-pad token by comparing with pad_token_id: with pad == eos it
    # reads the token before the eos of the second sequence, which is a different score.
    if cls is LlamaForSequenceClassification:
        with torch.no_grad():
            hf = reference(input_ids=ids, attention_mask=mask, position_ids=pos).logits.reshape(-1)
        assert not torch.allclose(hf[1], got[1], atol=1e-4)


def test_a_causal_lm_is_not_a_score_model(tmp_path):
    LlamaForCausalLM(_config()).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="no trained score head"):
        load_score_model(str(tmp_path), torch.float32)


def test_missing_directory_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a local directory"):
        load_score_model(str(tmp_path / "nope"), torch.float32)
