"""The built-in vision-language task: count the circles in a small synthetic image.

Each problem is one ``IMAGE_SIZE`` x ``IMAGE_SIZE`` RGB image (56 x 56: with Qwen2.5-VL's 14-pixel patches and
2 x 2 spatial merge that is 4 x 4 patches, i.e. 4 image tokens) drawn with PIL: a light background and
``count`` (1 to 5) filled circles of random radius (5 to 8 px), colour and position, at least 2 px apart (so
counting 4-connected blobs of non-background pixels gives the answer). The
question asks how many circles there are; the reference answer is a GSM8K final line (``#### 3``), scored by
the GSM8K strict rule (``hybridflow.rewards.default_compute_score`` under :data:`DATA_SOURCE`).

A problem's content is its ``(split, seed, index)``: the split names its own random stream, so train and val
images are drawn independently (two continuous random layouts essentially never coincide), and the same
``(split, num, seed)`` always gives byte-identical rows (PNG encoding of a PIL image is deterministic).

Rows follow verl's multimodal parquet convention::

    {"data_source": "hybridflow/vlm_count",
     "prompt": [{"role": "user", "content": "<image>How many circles are in the image?"}],
     "images": [{"bytes": b"\\x89PNG..."}],          # the HF datasets Image feature layout
     "ability": "vision",
     "reward_model": {"style": "rule", "ground_truth": "3"},
     "extra_info": {"split": "train", "index": 0, "answer": "#### 3", "count": 3}}

``<image>`` marks where the data layer's processor puts the image tokens (one placeholder per entry of
``images``).
"""

from __future__ import annotations

import dataclasses
import io
import random

from PIL import Image, ImageDraw

DATA_SOURCE = "hybridflow/vlm_count"
SPLITS = ("train", "val")
IMAGE_SIZE = 56  # pixels, square
COUNTS = range(1, 6)  # circles per image
RADIUS_RANGE = (5, 8)  # circle radius in pixels, inclusive
IMAGE_PLACEHOLDER = "<image>"
QUESTION = "How many circles are in the image?"
_MARGIN = 1  # free pixels between a circle's bounding box and the border
_GAP = 3  # the distance of two centres exceeds the sum of their radii by more than this (so >= 2 free pixels)
_COLORS = ((200, 30, 30), (30, 120, 200), (30, 150, 60), (120, 40, 160), (20, 20, 20), (210, 120, 0))
_BACKGROUNDS = ((255, 255, 255), (245, 240, 225), (230, 235, 245))


@dataclasses.dataclass(frozen=True)
class CountProblem:
    """One counting problem.

    Attributes:
        image: the RGB ``PIL.Image`` of size ``IMAGE_SIZE`` x ``IMAGE_SIZE``.
        count: the number of circles drawn (the answer), in ``COUNTS``.
        circles: ``(cx, cy, r)`` of each circle in pixels, in drawing order.
        solution: the reference response, ``"#### {count}"``.
        shortcut_solution: the systematic mistake the SFT warm start mixes in, ``"#### {count + 1}"``
            (never the answer).
    """

    image: Image.Image
    count: int
    circles: tuple[tuple[int, int, int], ...]
    solution: str
    shortcut_solution: str


def _place_circles(count: int, rng: random.Random) -> list[tuple[int, int, int]]:
    """``count`` non-overlapping ``(cx, cy, r)`` inside the image (rejection sampling; restarts on a dead end)."""
    while True:
        circles: list[tuple[int, int, int]] = []
        for _ in range(200):
            r = rng.randint(*RADIUS_RANGE)
            cx = rng.randint(r + _MARGIN, IMAGE_SIZE - 1 - r - _MARGIN)
            cy = rng.randint(r + _MARGIN, IMAGE_SIZE - 1 - r - _MARGIN)
            if all((cx - x) ** 2 + (cy - y) ** 2 > (r + s + _GAP) ** 2 for x, y, s in circles):
                circles.append((cx, cy, r))
                if len(circles) == count:
                    return circles


def draw_circles(circles: list[tuple[int, int, int]], rng: random.Random) -> Image.Image:
    """An RGB image with each ``(cx, cy, r)`` drawn as a filled circle on a random light background."""
    image = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), rng.choice(_BACKGROUNDS))
    draw = ImageDraw.Draw(image)
    for cx, cy, r in circles:
        draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=rng.choice(_COLORS))
    return image


def make_count_problems(split: str, num: int, seed: int) -> list[CountProblem]:
    """Draw ``num`` problems of ``split`` deterministically from ``seed``; counts are uniform over ``COUNTS``.

    Raises:
        ValueError: ``split`` not in ``SPLITS``, or negative ``num``.
    """
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; known splits: {list(SPLITS)}")
    if num < 0:
        raise ValueError(f"num must be >= 0, got {num}")
    rng = random.Random(f"{DATA_SOURCE}:{split}:{seed}")
    problems = []
    for _ in range(num):
        count = rng.choice(COUNTS)
        circles = _place_circles(count, rng)
        problems.append(CountProblem(image=draw_circles(circles, rng), count=count, circles=tuple(circles),
                                     solution=f"#### {count}", shortcut_solution=f"#### {count + 1}"))
    return problems


def png_bytes(image: Image.Image) -> bytes:
    """``image`` encoded as PNG (lossless, deterministic)."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def make_vlm_rows(split: str, num: int, seed: int) -> list[dict]:
    """Build ``num`` rows of the counting task in verl's multimodal parquet convention (module docstring).

    Raises:
        ValueError: unknown ``split`` or negative ``num``.
    """
    return [
        {
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": IMAGE_PLACEHOLDER + QUESTION}],
            "images": [{"bytes": png_bytes(p.image)}],
            "ability": "vision",
            "reward_model": {"style": "rule", "ground_truth": str(p.count)},
            "extra_info": {"split": split, "index": i, "answer": p.solution, "count": p.count},
        }
        for i, p in enumerate(make_count_problems(split, num, seed))
    ]
