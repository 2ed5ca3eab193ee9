"""The demo's task: say whether a short made-up review is positive or negative.

A random-init model cannot do it, yet LoRA learns it within a few dozen steps and it generalises: every review is
composed from word lists, so held-out reviews are new combinations of words the training set has taught. The
answer is one word, which makes "before" (gibberish) and "after" (right) easy to see at a glance.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

SUBJECTS = [
    "soup", "bread", "coffee", "pasta", "salad", "cake", "tea", "pizza",
    "service", "staff", "room", "bed", "film", "music", "hotel", "train",
]
POSITIVE = [
    "warm", "fresh", "tasty", "friendly", "clean", "lovely", "superb", "cozy",
    "bright", "quick", "delicious", "charming", "great", "pleasant", "perfect", "kind",
]
NEGATIVE = [
    "cold", "bland", "rude", "dirty", "slow", "stale", "noisy", "awful",
    "greasy", "dull", "soggy", "bitter", "broken", "cramped", "boring", "sour",
]
QUESTION = "Is this review positive or negative?"


def _review(rng: random.Random, words: list[str]) -> str:
    """One review in one of three shapes, all with two adjectives of the same polarity."""
    first, second = rng.sample(SUBJECTS, 2)
    a, b = rng.sample(words, 2)
    shape = rng.randrange(3)
    if shape == 0:
        return f"the {first} was {a} and {b}."
    if shape == 1:
        return f"the {first} was {a}, and the {second} was {b}."
    return f"{a} {first} and {b} {second}."


def _conversation(prompt: str, answer: str) -> dict:
    return {"messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]}


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8")


def write_task_dataset(
    out_dir: Path, seed: int = 0, n_train: int = 1000, n_heldout: int = 40
) -> tuple[Path, Path]:
    """Write `train.jsonl` and `heldout.jsonl` (OpenAI `messages` format) into `out_dir`.

    Labels alternate so both files are balanced; prompts are unique across both files, so the held-out prompts
    are never seen in training.
    """
    rng = random.Random(seed)
    seen: set[str] = set()
    rows: list[dict] = []
    while len(rows) < n_train + n_heldout:
        answer = "positive" if len(rows) % 2 == 0 else "negative"
        prompt = f"Review: {_review(rng, POSITIVE if answer == 'positive' else NEGATIVE)} {QUESTION}"
        if prompt not in seen:
            seen.add(prompt)
            rows.append(_conversation(prompt, answer))
    out_dir.mkdir(parents=True, exist_ok=True)
    train_path, heldout_path = out_dir / "train.jsonl", out_dir / "heldout.jsonl"
    _write_jsonl(heldout_path, rows[:n_heldout])
    _write_jsonl(train_path, rows[n_heldout:])
    return train_path, heldout_path


def heldout_examples(heldout_path: Path) -> list[tuple[str, str]]:
    """(user prompt, expected answer) pairs, for printing the model's answers before and after fine-tuning."""
    pairs = []
    for line in Path(heldout_path).read_text(encoding="utf-8").splitlines():
        messages = json.loads(line)["messages"]
        pairs.append((messages[0]["content"], messages[-1]["content"]))
    return pairs
