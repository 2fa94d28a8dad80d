"""score_batch: decode the masked response tokens of a batch and score each row by its data_source."""

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from hybridflow.protocol import DataProto
from hybridflow.rewards.batch import decode_responses, score_batch

WORDS = ["<pad>", "<unk>", "</s>", "####", "7", "8", "\\boxed{\\frac{1}{2}}", "\\boxed{3}", "so"]
V = {w: i for i, w in enumerate(WORDS)}


def tokenizer():
    backend = Tokenizer(models.WordLevel(vocab=V, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="</s>", pad_token="<pad>", unk_token="<unk>")


def batch(responses, masks, sources, truths):
    return DataProto.from_dict(
        tensors={"responses": torch.tensor(responses), "response_mask": torch.tensor(masks)},
        non_tensors={"data_source": sources, "ground_truth": truths, "extra_info": [{}] * len(sources)},
    )


def test_decode_and_score_mixed_sources():
    so, hashes, seven, eight, half, three, eos, pad = (
        V[w] for w in ["so", "####", "7", "8", "\\boxed{\\frac{1}{2}}", "\\boxed{3}", "</s>", "<pad>"])
    data = batch(
        responses=[[so, hashes, seven, eos], [hashes, eight, eos, pad], [so, half, eos, pad],
                   [so, three, hashes, eight]],
        # row 3: the mask stops after "so \boxed{3}", so the trailing "#### 8" is not part of the response
        masks=[[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 1, 0], [1, 1, 0, 0]],
        sources=["openai/gsm8k", "openai/gsm8k", "lighteval/MATH", "lighteval/MATH"],
        truths=["7", "7", "0.5", "8"],
    )
    tok = tokenizer()
    texts = decode_responses(tok, data)
    assert texts == ["so #### 7", "#### 8", "so \\boxed{\\frac{1}{2}}", "so \\boxed{3}"]
    assert score_batch(tok, data) == [1.0, 0.0, 1.0, 0.0]
    assert score_batch(None, data, texts=["#### 8", "#### 7", "\\boxed{1}", "\\boxed{8}"]) == [0.0, 1.0, 0.0, 1.0]


def test_errors_name_the_problem():
    data = batch([[V["7"]]], [[1]], ["nope/source"], ["7"])
    with pytest.raises(ValueError, match="'nope/source'"):
        score_batch(tokenizer(), data)
    with pytest.raises(ValueError, match="got 2 texts for 1 rows"):
        score_batch(None, data, texts=["a", "b"])
    bare = DataProto.from_dict(tensors={"responses": torch.tensor([[1]]), "response_mask": torch.tensor([[1]])})
    with pytest.raises(KeyError, match="data_source"):
        score_batch(None, bare, texts=["x"])
