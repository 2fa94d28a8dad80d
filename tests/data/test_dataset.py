"""Tests for hybridflow.data.dataset with a tiny offline word-level tokenizer (no downloads).

Vocabulary ids are fixed below, so every expected id list is written out by hand.
"""

import functools
import logging

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from torch.utils.data import DataLoader
from transformers import PreTrainedTokenizerFast

from hybridflow.data.dataset import RLHFDataset, collate_fn, compute_position_ids, first_rows, load_rows
from hybridflow.errors import DataError
from hybridflow.protocol import DataProto

WORDS = ["<pad>", "<unk>", "<s>", "</s>", "<|user|>", "<|system|>", "<|assistant|>",
         "what", "is", "2", "+", "3", "?", "be", "brief", "hi"]
V = {w: i for i, w in enumerate(WORDS)}  # <pad>=0 <unk>=1 <s>=2 </s>=3 <|user|>=4 <|system|>=5 <|assistant|>=6
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def make_tokenizer(chat_template=None, bos=True):
    tok = Tokenizer(models.WordLevel(vocab=V, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>" if bos else None,
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        additional_special_tokens=["<|user|>", "<|system|>", "<|assistant|>"],
    )
    hf.chat_template = chat_template
    return hf


def row(prompt, truth="5", index=None, source="toy"):
    extra = {"split": "train"} if index is None else {"split": "train", "index": index}
    return {
        "data_source": source,
        "prompt": prompt,
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": truth},
        "extra_info": extra,
    }


def user(text):
    return [{"role": "user", "content": text}]


# ---------------------------------------------------------------- prompt text and tokens
def test_chat_template_tokens_have_single_bos():
    ds = RLHFDataset([row(user("what is 2 + 3 ?"), index=7)], make_tokenizer(TEMPLATE), max_prompt_length=16)
    item = ds[0]
    # <s> <|user|> what is 2 + 3 ? <|assistant|>
    assert item["input_ids"].tolist() == [2, 4, 7, 8, 9, 10, 11, 12, 6]
    assert item["input_ids"].dtype == torch.long
    assert item["raw_prompt"] == "<s><|user|> what is 2 + 3 ? <|assistant|>"
    assert item["ground_truth"] == "5" and item["data_source"] == "toy"
    assert item["extra_info"] == {"split": "train", "index": 7} and item["index"] == 7


def test_no_template_joins_contents_with_newline_and_adds_bos():
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    item = RLHFDataset([row(msgs)], make_tokenizer(None), max_prompt_length=16)[0]
    assert item["raw_prompt"] == "be brief\nhi"
    assert item["input_ids"].tolist() == [2, 13, 14, 15]
    assert item["index"] == 0  # no extra_info.index -> position in rows


def test_plain_string_prompt_used_as_is_even_with_template():
    item = RLHFDataset([row("hi hi")], make_tokenizer(TEMPLATE), max_prompt_length=16)[0]
    assert item["raw_prompt"] == "hi hi" and item["input_ids"].tolist() == [2, 15, 15]


def test_tokenizer_without_bos_adds_nothing():
    item = RLHFDataset([row("what is 3")], make_tokenizer(None, bos=False), max_prompt_length=16)[0]
    assert item["input_ids"].tolist() == [7, 8, 11]


def test_numeric_ground_truth_becomes_str_and_item_is_a_copy():
    ds = RLHFDataset([row("hi", truth=42)], make_tokenizer(), max_prompt_length=4)
    first = ds[0]
    assert first["ground_truth"] == "42"
    first["extra_info"]["split"] = "changed"
    first["input_ids"][0] = 99
    assert ds[0]["extra_info"]["split"] == "train" and ds[0]["input_ids"].tolist() == [2, 15]


# ---------------------------------------------------------------- truncation
ROWS = [row("hi"), row("what is 2 + 3 ?"), row("hi hi")]  # token counts with bos: 2, 7, 3


def test_truncation_error_names_row_and_length():
    with pytest.raises(ValueError, match=r"row 1: prompt has 7 tokens > max_prompt_length=4"):
        RLHFDataset(ROWS, make_tokenizer(), max_prompt_length=4)


def test_truncation_left_and_right():
    left = RLHFDataset(ROWS, make_tokenizer(), max_prompt_length=4, truncation="left")
    right = RLHFDataset(ROWS, make_tokenizer(), max_prompt_length=4, truncation="right")
    assert left[1]["input_ids"].tolist() == [9, 10, 11, 12]  # 2 + 3 ?
    assert right[1]["input_ids"].tolist() == [2, 7, 8, 9]  # <s> what is 2
    assert left[0]["input_ids"].tolist() == right[0]["input_ids"].tolist() == [2, 15]
    assert len(left) == len(right) == 3 and left.num_filtered == 0


def test_truncation_filter_counts_and_warns(caplog):
    with caplog.at_level(logging.WARNING, logger="hybridflow.data.dataset"):
        ds = RLHFDataset(ROWS, make_tokenizer(), max_prompt_length=4, truncation="filter")
    assert len(ds) == 2 and ds.num_filtered == 1
    assert [ds[i]["input_ids"].tolist() for i in range(2)] == [[2, 15], [2, 15, 15]]
    assert [ds[i]["index"] for i in range(2)] == [0, 2]  # original positions are kept
    assert "filtered out 1 of 3" in caplog.text


def test_filter_everything_raises():
    with pytest.raises(ValueError, match="all 3 rows"):
        RLHFDataset(ROWS, make_tokenizer(), max_prompt_length=1, truncation="filter")


def test_bad_arguments():
    with pytest.raises(ValueError, match="truncation"):
        RLHFDataset(ROWS, make_tokenizer(), max_prompt_length=4, truncation="middle")
    with pytest.raises(ValueError, match="max_prompt_length"):
        RLHFDataset(ROWS, make_tokenizer(), max_prompt_length=0)


# ---------------------------------------------------------------- malformed rows
@pytest.mark.parametrize(
    "bad, message",
    [
        ({k: v for k, v in row("hi").items() if k != "prompt"}, "row 1: missing prompt key 'prompt'"),
        (row(3), "row 1: 'prompt' must be a str or a non-empty list"),
        (row([]), r"row 1: .*\(empty\)"),
        (row([{"role": "user"}]), "row 1: message 0 of 'prompt'"),
        ({**row("hi"), "reward_model": {"style": "rule"}}, "row 1: missing reward_model.ground_truth"),
        ({k: v for k, v in row("hi").items() if k != "reward_model"}, "row 1: missing reward_model.ground_truth"),
        (row("hi", truth=None), "row 1: reward_model.ground_truth must be a str"),
        (row("hi", source=None), "row 1: data_source must be a str"),
        (row(""), "row 1: prompt has no tokens"),
    ],
)
def test_malformed_row_errors_name_row(bad, message):
    tokenizer = make_tokenizer(bos=False)
    with pytest.raises(ValueError, match=message):
        RLHFDataset([row("hi"), bad], tokenizer, max_prompt_length=8)


def test_custom_prompt_key():
    r = row("unused")
    r["question"] = user("hi")
    ds = RLHFDataset([r], make_tokenizer(TEMPLATE), max_prompt_length=8, prompt_key="question")
    assert ds[0]["input_ids"].tolist() == [2, 4, 15, 6]


# ---------------------------------------------------------------- collate
def test_compute_position_ids_by_hand():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 0, 0, 0, 1]])
    expected = torch.tensor([[0, 0, 0, 1, 2], [0, 1, 2, 3, 4], [0, 0, 0, 0, 0]])
    assert torch.equal(compute_position_ids(mask), expected)


def test_collate_left_pads_to_longest_in_batch():
    ds = RLHFDataset(ROWS, make_tokenizer(), max_prompt_length=32)
    batch = collate_fn([ds[0], ds[1], ds[2]], pad_token_id=0, max_prompt_length=32)
    assert isinstance(batch, DataProto) and len(batch) == 3
    # longest prompt has 7 tokens, so P = 7 (not max_prompt_length = 32)
    assert batch.batch["input_ids"].tolist() == [
        [0, 0, 0, 0, 0, 2, 15],
        [2, 7, 8, 9, 10, 11, 12],
        [0, 0, 0, 0, 2, 15, 15],
    ]
    assert batch.batch["attention_mask"].tolist() == [
        [0, 0, 0, 0, 0, 1, 1],
        [1, 1, 1, 1, 1, 1, 1],
        [0, 0, 0, 0, 1, 1, 1],
    ]
    assert batch.batch["position_ids"].tolist() == [
        [0, 0, 0, 0, 0, 0, 1],
        [0, 1, 2, 3, 4, 5, 6],
        [0, 0, 0, 0, 0, 1, 2],
    ]
    for key in ("input_ids", "attention_mask", "position_ids"):
        assert batch.batch[key].dtype == torch.long
    nt = batch.non_tensor_batch
    assert all(nt[k].dtype == object and nt[k].shape == (3,) for k in nt)
    assert list(nt["raw_prompt"]) == ["hi", "what is 2 + 3 ?", "hi hi"]
    assert list(nt["ground_truth"]) == ["5", "5", "5"] and list(nt["index"]) == [0, 1, 2]
    assert list(nt["data_source"]) == ["toy"] * 3 and nt["extra_info"][2] == {"split": "train"}


def test_collate_errors():
    ds = RLHFDataset(ROWS, make_tokenizer(), max_prompt_length=32)
    with pytest.raises(ValueError, match="item 1 has 7 tokens > max_prompt_length=5"):
        collate_fn([ds[0], ds[1]], pad_token_id=0, max_prompt_length=5)
    with pytest.raises(ValueError, match="pad_token_id"):
        collate_fn([ds[0]], pad_token_id=None, max_prompt_length=32)
    with pytest.raises(ValueError, match="empty"):
        collate_fn([], pad_token_id=0, max_prompt_length=32)


def test_dataloader_with_partial_collate():
    tokenizer = make_tokenizer(TEMPLATE)
    rows = [row(user("hi"), index=10), row(user("what is 2 + 3 ?"), index=11), row(user("be brief"), index=12)]
    ds = RLHFDataset(rows, tokenizer, max_prompt_length=16)
    loader = DataLoader(
        ds, batch_size=2, shuffle=False,
        collate_fn=functools.partial(collate_fn, pad_token_id=tokenizer.pad_token_id, max_prompt_length=16),
    )
    batches = list(loader)
    assert [len(b) for b in batches] == [2, 1]
    assert batches[0].batch["input_ids"].tolist()[0] == [0, 0, 0, 0, 0, 2, 4, 15, 6]
    assert list(batches[1].non_tensor_batch["index"]) == [12]


# ---------------------------------------------------------------- parquet
def write_parquet(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)


def test_parquet_round_trip(tmp_path):
    a = [row(user("hi"), index=0), row(user("what is 2 + 3 ?"), truth="5", index=1)]
    b = [row(user("be brief"), truth="x", index=2)]
    write_parquet(tmp_path / "a.parquet", a)
    write_parquet(tmp_path / "b.parquet", b)
    loaded = load_rows([tmp_path / "a.parquet", str(tmp_path / "b.parquet")])
    assert loaded == a + b
    assert load_rows(tmp_path / "b.parquet") == b
    ds = RLHFDataset(loaded, make_tokenizer(TEMPLATE), max_prompt_length=16)
    assert [ds[i]["index"] for i in range(3)] == [0, 1, 2]
    assert ds[2]["input_ids"].tolist() == [2, 4, 13, 14, 6]


def test_plain_string_prompts_and_partial_index_in_parquet(tmp_path):
    # parquet unifies struct fields: the row without extra_info.index reads back with index None
    write_parquet(tmp_path / "s.parquet", [row("hi hi", index=5), row("hi")])
    rows = load_rows(str(tmp_path / "s.parquet"))
    assert [r["prompt"] for r in rows] == ["hi hi", "hi"]
    assert rows[1]["extra_info"] == {"split": "train", "index": None}
    ds = RLHFDataset(rows, make_tokenizer(TEMPLATE), max_prompt_length=8)
    assert [ds[0]["index"], ds[1]["index"]] == [5, 1]
    assert ds[1]["input_ids"].tolist() == [2, 15]


def test_load_rows_errors(tmp_path):
    missing = tmp_path / "nope.parquet"
    with pytest.raises(FileNotFoundError, match="nope.parquet"):
        load_rows(missing)
    bad = [{k: v for k, v in row("hi").items() if k != "reward_model"}]
    write_parquet(tmp_path / "bad.parquet", bad)
    with pytest.raises(ValueError, match=r"bad\.parquet has no required column 'reward_model'"):
        load_rows(tmp_path / "bad.parquet")
    with pytest.raises(ValueError, match="question"):
        write_parquet(tmp_path / "ok.parquet", [row("hi")])
        load_rows(tmp_path / "ok.parquet", prompt_key="question")
    with pytest.raises(ValueError, match="no parquet files"):
        load_rows([])


def test_index_must_be_int():
    r = row("hi")
    r["extra_info"] = {"index": "seven"}
    with pytest.raises(ValueError, match="row 0: extra_info.index"):
        RLHFDataset([r], make_tokenizer(), max_prompt_length=8)


# ---------------------------------------------------------------- every over-long prompt at once, row limits
def test_truncation_error_reports_every_offender_in_one_line():
    # token counts with bos: 2, 7, 3, 9, 4 -> over 3: rows 1, 3 and 4; the longest is row 3 with 9
    rows = [row("hi"), row("what is 2 + 3 ?"), row("hi hi"), row("what is 2 + 3 ? hi hi"), row("what is 2")]
    with pytest.raises(DataError) as info:
        RLHFDataset(rows, make_tokenizer(), max_prompt_length=3)
    message = str(info.value)
    assert info.value.row == 3 and "\n" not in message
    assert message.startswith("row 3: prompt has 9 tokens > max_prompt_length=3")
    for text in ("3 of 5 prompts", "data.max_prompt_length >= 9", "data.truncation (one of error, left, right, filter)"):
        assert text in message


def test_truncation_error_names_the_first_of_equally_long_prompts():
    rows = [row("hi"), row("hi hi hi"), row("hi hi hi")]  # 2, 4, 4 tokens
    with pytest.raises(DataError, match=r"^row 1: prompt has 4 tokens > max_prompt_length=2, .* 2 of 3 prompts"):
        RLHFDataset(rows, make_tokenizer(), max_prompt_length=2)


def test_first_rows_keeps_the_first_n():
    rows = [{"i": i} for i in range(5)]
    assert first_rows(rows, 2) == [{"i": 0}, {"i": 1}]
    assert first_rows(rows, -1) == rows and first_rows(rows, 9) == rows
    for bad in (0, -2):
        with pytest.raises(ValueError, match=rf"--max-samples must be -1 \(all rows\) or >= 1, got {bad}"):
            first_rows(rows, bad, "--max-samples")
