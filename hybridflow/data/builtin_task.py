"""The built-in verifiable task: two-step arithmetic word problems in GSM8K format.

Each problem starts from a count ``a`` and applies two changes ``b`` and ``c`` (one of four
operation pairs: ``+ -``, ``+ +``, ``- +``, ``- -``), e.g. "Ann has 7 apples. She buys 5 more and
then gives 3 away. How many apples does she have now?". The reference solution is two short
equation lines and a GSM8K final line::

    7 + 5 = 12
    12 - 3 = 9
    #### 9

A problem's *content* is its key ``(operation pair, a, b, c)``; the wording (name, item, phrasing)
is decoration. The train/val partition is a fixed function of that key (a salted hash, independent
of any seed), so rows drawn with any seeds from ``"train"`` and ``"val"`` never share a problem:
val holds number triples that the train split never shows for that operation pair.

Rows follow verl's parquet schema (``data_source``, ``prompt`` as chat messages, ``ability``,
``reward_model`` with a rule ground truth, ``extra_info``) and are scored by
``hybridflow.rewards.default_compute_score`` under ``DATA_SOURCE``.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import random

DATA_SOURCE = "hybridflow/arith"
SPLITS = ("train", "val")
VAL_PERCENT = 10  # share of problem keys held out for "val", in percent
_SPLIT_SALT = "hybridflow-arith-split-v1"

A_RANGE = range(2, 21)  # the starting count a
BC_RANGE = range(1, 10)  # the two changes b and c

# (first op, second op) -> phrasings. Placeholders: {name} {Pro} {pro} {obj} {item} {a} {b} {c};
# "scene" phrasings use {animal} and {place} instead of a person.
_PHRASINGS: dict[tuple[str, str], tuple[str, ...]] = {
    ("+", "-"): (
        "{name} has {a} {item}. {Pro} buys {b} more and then gives {c} away. "
        "How many {item} does {pro} have now?",
        "There are {a} {animal} in the {place}. {b} more come and then {c} leave. "
        "How many {animal} are in the {place} now?",
    ),
    ("+", "+"): (
        "{name} has {a} {item}. {Pro} buys {b} more and then a friend gives {obj} {c} more. "
        "How many {item} does {pro} have now?",
        "There are {a} {animal} in the {place}. {b} more come and then {c} more join them. "
        "How many {animal} are in the {place} now?",
    ),
    ("-", "+"): (
        "{name} has {a} {item}. {Pro} gives {b} away and then buys {c} more. "
        "How many {item} does {pro} have now?",
        "There are {a} {animal} in the {place}. {b} leave and then {c} more come. "
        "How many {animal} are in the {place} now?",
    ),
    ("-", "-"): (
        "{name} has {a} {item}. {Pro} gives {b} away and then loses {c}. "
        "How many {item} does {pro} have now?",
        "There are {a} {animal} in the {place}. {b} leave and then {c} more leave. "
        "How many {animal} are in the {place} now?",
    ),
}
OP_PAIRS = tuple(_PHRASINGS)

_PEOPLE = (
    ("Ann", "she"), ("Ben", "he"), ("Mia", "she"), ("Tom", "he"), ("Lily", "she"),
    ("Sam", "he"), ("Emma", "she"), ("Jack", "he"), ("Zoe", "she"), ("Leo", "he"),
)
_ITEMS = ("apples", "pencils", "stickers", "marbles", "cookies", "books", "cards", "shells")
_ANIMALS = ("birds", "ducks", "fish", "cats", "frogs", "sheep")
_PLACES = ("park", "pond", "garden", "yard", "field")
_PRONOUNS = {"she": ("She", "she", "her"), "he": ("He", "he", "him")}


@dataclasses.dataclass(frozen=True)
class ArithProblem:
    """One word problem with its full reference solution and the shortcut mistake.

    Attributes:
        key: the problem content ``(op1, op2, a, b, c)``; two problems are the same iff keys match.
        question: the word problem text.
        answer: the correct final count (int).
        solution: the full GSM8K-format reference solution, ending in ``#### {answer}``.
        shortcut_solution: the systematic mistake -- the first step only, answering the
            intermediate count (``#### {a op1 b}``); never equal to ``answer`` since ``c >= 1``.
    """

    key: tuple[str, str, int, int, int]
    question: str
    answer: int
    solution: str
    shortcut_solution: str


def _apply(x: int, op: str, y: int) -> int:
    return x + y if op == "+" else x - y


def _is_valid(op1: str, op2: str, a: int, b: int, c: int) -> bool:
    mid = _apply(a, op1, b)
    return mid >= 1 and _apply(mid, op2, c) >= 1


def split_of(key: tuple[str, str, int, int, int]) -> str:
    """Return ``"val"`` or ``"train"`` for a problem key (fixed salted hash, seed-independent)."""
    digest = hashlib.sha256(f"{_SPLIT_SALT}:{key}".encode()).digest()
    return "val" if int.from_bytes(digest[:4], "big") % 100 < VAL_PERCENT else "train"


@functools.lru_cache(maxsize=None)
def problem_keys(split: str) -> tuple[tuple[str, str, int, int, int], ...]:
    """All problem keys of ``split`` in a fixed order.

    Raises:
        ValueError: if ``split`` is not one of ``SPLITS``.
    """
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; known splits: {list(SPLITS)}")
    keys = (
        (op1, op2, a, b, c)
        for op1, op2 in OP_PAIRS
        for a in A_RANGE
        for b in BC_RANGE
        for c in BC_RANGE
        if _is_valid(op1, op2, a, b, c)
    )
    return tuple(k for k in keys if split_of(k) == split)


def _render(key: tuple[str, str, int, int, int], rng: random.Random) -> ArithProblem:
    op1, op2, a, b, c = key
    name, pronoun = rng.choice(_PEOPLE)
    pro_cap, pro, obj = _PRONOUNS[pronoun]
    phrasing = rng.choice(_PHRASINGS[(op1, op2)])
    question = phrasing.format(
        name=name, Pro=pro_cap, pro=pro, obj=obj, item=rng.choice(_ITEMS),
        animal=rng.choice(_ANIMALS), place=rng.choice(_PLACES), a=a, b=b, c=c,
    )
    mid = _apply(a, op1, b)
    answer = _apply(mid, op2, c)
    first_line = f"{a} {op1} {b} = {mid}"
    return ArithProblem(
        key=key,
        question=question,
        answer=answer,
        solution=f"{first_line}\n{mid} {op2} {c} = {answer}\n#### {answer}",
        shortcut_solution=f"{first_line}\n#### {mid}",
    )


def make_builtin_problems(split: str, num: int, seed: int) -> list[ArithProblem]:
    """Draw ``num`` problems of ``split``, deterministically from ``seed``.

    Keys are drawn without replacement while the split has enough of them (train: 4479,
    val: 540), then the draw starts over with a fresh shuffle; wording is drawn per problem.

    Raises:
        ValueError: unknown ``split`` or negative ``num``.
    """
    if num < 0:
        raise ValueError(f"num must be >= 0, got {num}")
    keys = problem_keys(split)
    rng = random.Random(f"{DATA_SOURCE}:{split}:{seed}")
    problems: list[ArithProblem] = []
    while len(problems) < num:
        for key in rng.sample(keys, min(len(keys), num - len(problems))):
            problems.append(_render(key, rng))
    return problems


def make_builtin_rows(split: str, num: int, seed: int) -> list[dict]:
    """Build ``num`` rows of the built-in task in verl's parquet schema.

    Each row: ``{"data_source": "hybridflow/arith", "prompt": [{"role": "user", "content": q}],
    "ability": "math", "reward_model": {"style": "rule", "ground_truth": "9"},
    "extra_info": {"split": split, "index": i, "answer": reference_solution}}``.

    Raises:
        ValueError: unknown ``split`` or negative ``num``.
    """
    return [
        {
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": p.question}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(p.answer)},
            "extra_info": {"split": split, "index": i, "answer": p.solution},
        }
        for i, p in enumerate(make_builtin_problems(split, num, seed))
    ]
