import json
import re
from pathlib import Path

import pytest

from hybridflow.data.builtin_task import (
    DATA_SOURCE,
    make_builtin_problems,
    make_builtin_rows,
    problem_keys,
)
from hybridflow.models.builtin import BUILTIN_MODELS, resolve_model_path
from hybridflow.rewards import default_compute_score

_EQUATION = re.compile(r"^(\d+) ([+-]) (\d+) = (\d+)$")


def test_rows_follow_the_verl_schema():
    rows = make_builtin_rows("train", 5, seed=3)
    assert len(rows) == 5
    for i, row in enumerate(rows):
        assert set(row) == {"data_source", "prompt", "ability", "reward_model", "extra_info"}
        assert row["data_source"] == DATA_SOURCE == "hybridflow/arith"
        assert row["ability"] == "math"
        assert row["prompt"] == [{"role": "user", "content": row["prompt"][0]["content"]}]
        assert row["prompt"][0]["content"].endswith("?")
        assert row["reward_model"]["style"] == "rule"
        assert row["reward_model"]["ground_truth"].isdigit()
        assert row["extra_info"]["split"] == "train" and row["extra_info"]["index"] == i
        assert row["extra_info"]["answer"].endswith("#### " + row["reward_model"]["ground_truth"])


def test_rows_are_deterministic_in_seed():
    assert make_builtin_rows("val", 20, seed=1) == make_builtin_rows("val", 20, seed=1)
    assert make_builtin_rows("val", 20, seed=1) != make_builtin_rows("val", 20, seed=2)


def test_train_and_val_are_disjoint_problems():
    train_keys, val_keys = set(problem_keys("train")), set(problem_keys("val"))
    assert train_keys and val_keys and not train_keys & val_keys
    # about VAL_PERCENT = 10% of all problems are held out
    assert 0.07 < len(val_keys) / (len(train_keys) + len(val_keys)) < 0.13
    # drawn rows (any seeds) never share a problem, also by question text
    train = make_builtin_problems("train", 3000, seed=0)
    val = make_builtin_problems("val", 500, seed=7)
    assert not {p.key for p in train} & {p.key for p in val}
    assert not {p.question for p in train} & {p.question for p in val}
    assert {p.key for p in val} <= val_keys


def test_keys_are_unique_until_the_split_is_exhausted():
    n_val = len(problem_keys("val"))
    problems = make_builtin_problems("val", n_val, seed=0)
    assert len({p.key for p in problems}) == n_val
    assert len(make_builtin_problems("val", n_val + 5, seed=0)) == n_val + 5


def test_solutions_do_the_arithmetic_of_the_question():
    for p in make_builtin_problems("train", 200, seed=4):
        op1, op2, a, b, c = p.key
        numbers = [int(n) for n in re.findall(r"\d+", p.question)]
        assert numbers == [a, b, c]
        line1, line2, final = p.solution.split("\n")
        x1, o1, y1, r1 = _EQUATION.match(line1).groups()
        x2, o2, y2, r2 = _EQUATION.match(line2).groups()
        # recompute independently with Python's eval on the equation text
        assert eval(f"{x1}{o1}{y1}") == int(r1) and eval(f"{x2}{o2}{y2}") == int(r2)
        assert (int(x1), o1, int(y1), o2, int(y2)) == (a, op1, b, op2, c)
        assert r1 == x2 and int(r2) == p.answer >= 1 and final == f"#### {p.answer}"
        assert p.shortcut_solution == f"{line1}\n#### {r1}"


def test_reference_scores_one_and_perturbations_score_zero():
    for row in make_builtin_rows("val", 100, seed=0):
        truth = row["reward_model"]["ground_truth"]
        reference = row["extra_info"]["answer"]
        assert default_compute_score(row["data_source"], reference, truth) == 1.0
        head = reference.rsplit("#### ", 1)[0]
        for wrong in (int(truth) + 1, int(truth) - 1, 0):
            assert default_compute_score(row["data_source"], f"{head}#### {wrong}", truth) == 0.0
        assert default_compute_score(row["data_source"], head, truth) == 0.0  # no marker


def test_shortcut_mistake_always_scores_zero():
    for p in make_builtin_problems("train", 500, seed=2):
        assert default_compute_score(DATA_SOURCE, p.shortcut_solution, str(p.answer)) == 0.0


def test_bad_arguments():
    with pytest.raises(ValueError, match="test"):
        make_builtin_rows("test", 3, seed=0)
    with pytest.raises(ValueError, match="-1"):
        make_builtin_rows("train", -1, seed=0)


def test_resolve_model_path(tmp_path):
    assert resolve_model_path("builtin:tiny-arith") == BUILTIN_MODELS["tiny-arith"]
    assert resolve_model_path(str(tmp_path)) == str(tmp_path)
    assert resolve_model_path("no/such/local/model") == "no/such/local/model"  # a path, not a hub id: unchanged
    # (an org/name hub id resolves to its snapshot: tests/models/test_hub_ids.py)
    with pytest.raises(ValueError, match="builtin:tiny-arith"):
        resolve_model_path("builtin:nope")


def _load(path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)


def _check_tokenizer(tokenizer):
    assert (tokenizer.pad_token, tokenizer.bos_token, tokenizer.eos_token) == ("<pad>", "<s>", "</s>")
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Ann has 2 apples."}], add_generation_prompt=True,
        tokenize=False,
    )
    assert prompt == "Question: Ann has 2 apples.\nAnswer:"
    text = prompt + " 2 + 3 = 5\n#### 5 ünïcode ✓"
    assert tokenizer.decode(tokenizer(text, add_special_tokens=False).input_ids) == text


def test_build_script_end_to_end(tmp_path, repo_script):
    import torch

    main = repo_script("scripts/build_tiny_arith.py").main

    out = tmp_path / "tiny"
    main(["--out", str(out), "--steps", "5", "--threads", "1"])
    model, tokenizer = _load(out)
    _check_tokenizer(tokenizer)
    cfg = model.config
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (
        128, 4, 2, 32)
    assert cfg.tie_word_embeddings and cfg.max_position_embeddings == 256
    assert cfg.vocab_size >= len(tokenizer) and cfg.vocab_size % 64 == 0
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id
    assert model.generation_config.pad_token_id == tokenizer.pad_token_id
    assert json.loads((out / "build_info.json").read_text())["sft_steps"] == 5
    logits = model(torch.tensor([[tokenizer.bos_token_id, 5, 6]])).logits
    assert logits.shape == (1, 3, cfg.vocab_size) and logits.dtype == torch.float32


def test_shipped_model_is_small_and_loads():
    path = Path(BUILTIN_MODELS["tiny-arith"])
    size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    assert 0 < size <= 5 * 1024 * 1024
    model, tokenizer = _load(resolve_model_path("builtin:tiny-arith"))
    _check_tokenizer(tokenizer)
    assert model.config.head_dim == 32


def test_check_script_scores_like_hybridflow_eval(tmp_path, repo_script, capsys):
    """The built-in model's check script is a third caller of the one validation path: its greedy score on rows
    equals ``hybridflow eval``'s mean@1 on the same rows written to parquet, and a one-update RL smoke run goes
    through the same rollout."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from hybridflow.data.builtin_task import make_builtin_rows
    from hybridflow.evaluation import evaluate

    check = repo_script("scripts/check_tiny_arith.py")
    result = check.main(["--num-val", "6", "--samples", "2", "--rl-smoke", "--rl-updates", "1", "--rl-batch", "4"])
    capsys.readouterr()
    rows = make_builtin_rows("val", 6, 0)
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "val.parquet")
    reference = evaluate("builtin:tiny-arith", tmp_path / "val.parquet", n=2, temperature=1.0,
                         max_response_length=check.RESPONSE_LENGTH, batch_size=128, dtype="float32", device="cpu")
    before = result["before"]
    assert before["num_prompts"] == reference["num_prompts"] == 6
    assert before["greedy_score"] == pytest.approx(reference["mean@1"], abs=1e-4)
    assert before["sampled_score"] == pytest.approx(reference["mean@2"], abs=1e-4)  # same seed, same samples
    assert [point["update"] for point in result["rl"]["curve"]] == [1]
    assert result["after"]["num_prompts"] == 6


def test_build_scripts_live_outside_the_package_and_the_asset_ships():
    """The build/check scripts are repository scripts; the installed package keeps only the built model, which the
    package data of pyproject.toml ships."""
    import tomllib

    root = Path(__file__).resolve().parents[1]
    assert not list((root / "hybridflow" / "models" / "builtin").glob("*tiny_arith*.py"))
    assert (root / "scripts" / "build_tiny_arith.py").is_file() and (root / "scripts" / "check_tiny_arith.py").is_file()
    package_data = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert "assets/**/*" in package_data["hybridflow"]
    assert Path(BUILTIN_MODELS["tiny-arith"]).is_relative_to(root / "hybridflow" / "assets")
