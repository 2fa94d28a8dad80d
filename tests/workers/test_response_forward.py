"""response_forward cuts the columns no row attends to (common left padding, response slots after the longest
response); the outputs at every attended response position equal those of the uncut forward."""

import torch

from helpers.models import tiny_model
from hybridflow.protocol import DataProto
from hybridflow.training.micro import response_forward


def _batch(prompt_lens, response_lens, P=7, R=6, vocab=50):
    g = torch.Generator().manual_seed(0)
    B = len(prompt_lens)
    ids = torch.randint(1, vocab, (B, P + R), generator=g)
    mask = torch.zeros(B, P + R, dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompt_lens, response_lens)):
        mask[i, P - p : P + r] = 1
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    pos[:, P:] = pos[:, P - 1 : P] + torch.arange(1, R + 1)  # response slots continue from the last prompt token
    return DataProto.from_dict(tensors={"input_ids": ids, "attention_mask": mask, "position_ids": pos}), mask[:, P:]


def _uncut(model, data, R):
    b = data.batch
    return model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], position_ids=b["position_ids"],
                 use_cache=False).logits[:, -R - 1 : -1]


def test_cut_forward_equals_the_full_forward_on_attended_positions():
    model = tiny_model(seed=0, eval=True, vocab_size=50, num_attention_heads=4, num_key_value_heads=2)
    # prompts of 3-5 of 7 slots (2 common left-pad columns), responses of 2-4 of 6 slots (2 unused at the end)
    data, response_mask = _batch(prompt_lens=[5, 3, 4], response_lens=[2, 4, 3])
    with torch.no_grad():
        cut, full = response_forward(model, data, 6), _uncut(model, data, 6)
    assert cut.shape == full.shape == (3, 6, 50)
    valid = response_mask.bool()
    assert torch.allclose(cut[valid], full[valid], atol=1e-5)
    assert (cut[:, 4:] == 0).all()  # slots after the longest response: every row's padding
