"""The built-in tool-use task ``builtin:tool-arith``: word problems that a calculator makes easy.

Each problem hides one arithmetic expression over 2-4 digit numbers in a short word problem, in one of three
kinds; the numbers close the question, in the order the expression uses them (so a call copies them from a fixed
distance, which a tiny model learns quickly):

* ``mul``    ``a * b``      -- a in 100..999, b in 11..99 ("How many pencils are in 347 boxes of 28?")
* ``muladd`` ``c + a * b``  -- c in 100..999, then a in 11..99 packs of b in 101..999 each
* ``add``    ``a + b + c``  -- three numbers in 1000..9999

A small model cannot multiply a 3-digit by a 2-digit number in its head, but it can copy the numbers into a
calculator call and copy the result back. The reference solution with the ``calculator`` tool is one call, one
observation and a GSM8K final line; the Hermes-style strings are those of the multi-turn loop::

    <tool_call>{"name": "calculator", "arguments": {"expression": "347 * 28"}}</tool_call>
    <tool_response>9716</tool_response>
    #### 9716

A problem's content is its key ``(kind, a, b, c)`` (``c`` is 0 for ``mul``); the wording is decoration. The
train/val partition is a salted hash of the key (independent of any seed), so the splits never share a problem.
Rows follow verl's parquet schema and are scored by :mod:`hybridflow.rewards.tool_arith` under ``DATA_SOURCE``
(1.0 for the right number after the last ``####``, else 0.0).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random

DATA_SOURCE = "hybridflow/tool_arith"
SPLITS = ("train", "val")
VAL_PERCENT = 10  # share of problem keys held out for "val", in percent
_SPLIT_SALT = "hybridflow-tool-arith-split-v1"
TOOL_NAME = "calculator"

# kind -> (number ranges for a, b, c; expression format; phrasings). Placeholders: {name} {item} {a} {b} {c}.
_KINDS: dict[str, tuple[tuple[range, range, range], str, tuple[str, ...]]] = {
    "mul": (
        (range(100, 1000), range(11, 100), range(0, 1)),
        "{a} * {b}",
        ("{name} packs {item} in boxes. How many {item} are in {a} boxes of {b}?",
         "A shop stacks {item} on shelves. How many {item} are on {a} shelves of {b}?"),
    ),
    "muladd": (
        (range(11, 100), range(101, 1000), range(100, 1000)),
        "{c} + {a} * {b}",
        ("{name} collects {item}. How many {item} are {c} plus {a} packs of {b}?",
         "A shop orders {item}. How many {item} are {c} plus {a} crates of {b}?"),
    ),
    "add": (
        (range(1000, 10000), range(1000, 10000), range(1000, 10000)),
        "{a} + {b} + {c}",
        ("{name} counts {item}. How many {item} are {a} and {b} and {c} together?",
         "A farm sells {item}. How many {item} are {a} and {b} and {c} together?"),
    ),
}
KINDS = tuple(_KINDS)

_PEOPLE = (("Ann", "she"), ("Ben", "he"), ("Mia", "she"), ("Tom", "he"), ("Zoe", "she"), ("Leo", "he"))
_ITEMS = ("apples", "pencils", "stickers", "marbles", "cookies", "books", "cards", "eggs")


@dataclasses.dataclass(frozen=True)
class ToolProblem:
    """One word problem with its calculator expression and answer.

    Attributes:
        key: the content ``(kind, a, b, c)``; two problems are the same iff keys match (``c`` is 0 for ``mul``).
        question: the word problem text.
        expression: the calculator expression, e.g. ``"347 * 28"`` (numbers in question order).
        answer: the value of ``expression`` (int).
    """

    key: tuple[str, int, int, int]
    question: str
    expression: str
    answer: int


def tool_call_text(expression: str) -> str:
    """The Hermes-style call of the calculator: ``<tool_call>{json}</tool_call>`` (``json.dumps`` spacing)."""
    call = {"name": TOOL_NAME, "arguments": {"expression": expression}}
    return f"<tool_call>{json.dumps(call)}</tool_call>"


def evaluate_key(key: tuple[str, int, int, int]) -> int:
    """The answer of a problem key, computed from the kind's arithmetic (not from the expression text).

    Raises:
        ValueError: unknown kind.
    """
    kind, a, b, c = key
    if kind == "mul":
        return a * b
    if kind == "muladd":
        return c + a * b
    if kind == "add":
        return a + b + c
    raise ValueError(f"unknown tool-arith kind {kind!r}; known: {list(KINDS)}")


def split_of(key: tuple[str, int, int, int]) -> str:
    """Return ``"val"`` or ``"train"`` for a problem key (fixed salted hash, seed-independent)."""
    digest = hashlib.sha256(f"{_SPLIT_SALT}:{key}".encode()).digest()
    return "val" if int.from_bytes(digest[:4], "big") % 100 < VAL_PERCENT else "train"


def _render(key: tuple[str, int, int, int], rng: random.Random) -> ToolProblem:
    kind, a, b, c = key
    _, expression, phrasings = _KINDS[kind]
    name, _ = rng.choice(_PEOPLE)
    question = rng.choice(phrasings).format(name=name, item=rng.choice(_ITEMS), a=a, b=b, c=c)
    return ToolProblem(key=key, question=question, expression=expression.format(a=a, b=b, c=c),
                       answer=evaluate_key(key))


def make_tool_problems(split: str, num: int, seed: int) -> list[ToolProblem]:
    """Draw ``num`` distinct problems of ``split``, deterministically from ``seed`` (kind uniform, then numbers
    uniform in the kind's ranges, keys of the other split rejected).

    Raises:
        ValueError: unknown ``split`` or negative ``num``.
    """
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; known splits: {list(SPLITS)}")
    if num < 0:
        raise ValueError(f"num must be >= 0, got {num}")
    rng = random.Random(f"{DATA_SOURCE}:{split}:{seed}")
    seen: set[tuple[str, int, int, int]] = set()
    problems: list[ToolProblem] = []
    while len(problems) < num:
        kind = rng.choice(KINDS)
        ranges = _KINDS[kind][0]
        key = (kind, *(rng.choice(r) for r in ranges))
        if key in seen or split_of(key) != split:
            continue
        seen.add(key)
        problems.append(_render(key, rng))
    return problems


def make_tool_rows(split: str, num: int, seed: int) -> list[dict]:
    """``num`` rows of the task in verl's parquet schema.

    Each row: ``{"data_source": "hybridflow/tool_arith", "prompt": [{"role": "user", "content": q}],
    "ability": "math", "reward_model": {"style": "rule", "ground_truth": "9716"},
    "extra_info": {"split": split, "index": i, "expression": "347 * 28"}}``.

    Raises:
        ValueError: unknown ``split`` or negative ``num``.
    """
    return [
        {
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": p.question}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(p.answer)},
            "extra_info": {"split": split, "index": i, "expression": p.expression},
        }
        for i, p in enumerate(make_tool_problems(split, num, seed))
    ]
