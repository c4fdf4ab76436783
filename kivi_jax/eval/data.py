"""Evaluation inputs: real English prose that ships with the machine, and passkey prompts."""

from __future__ import annotations

import dataclasses
import pathlib

import numpy as np

# Debian's base-files package installs the licence texts; the GPL-3 is ~35k characters of prose.
DEFAULT_PROSE = pathlib.Path("/usr/share/common-licenses/GPL-3")
# The mixed-precision study's check on prose its settings were not chosen on (same package).
HELD_OUT_PROSE = pathlib.Path("/usr/share/common-licenses/GFDL-1.3")


def prose_tokens(tokenizer, *, path=None, max_tokens: int | None = None) -> tuple[list[int], str]:
    """Tokens of a prose file (default: the GPL-3 licence text) and the source's name.

    Raises FileNotFoundError naming the file when it is missing, and ValueError when it holds
    fewer than `max_tokens` tokens (a study never silently runs on less text than asked).
    """
    path = pathlib.Path(path) if path is not None else DEFAULT_PROSE
    if not path.is_file():
        raise FileNotFoundError(f"prose file not found: {path} (pass --text FILE)")
    ids = tokenizer.encode(path.read_text(encoding="utf-8", errors="replace"))
    if max_tokens is not None:
        if len(ids) < max_tokens:
            raise ValueError(f"{path} has {len(ids)} tokens, fewer than the {max_tokens} asked for")
        ids = ids[:max_tokens]
    return ids, str(path)


INTRO = (
    "There is an important piece of information hidden inside a lot of irrelevant text. "
    "Find it and memorize it. I will quiz you about it.\n"
)
FILLER = (
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
)
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key. "
QUESTION = "\nWhat is the pass key? The pass key is"


@dataclasses.dataclass(frozen=True)
class PasskeyPrompt:
    tokens: list[int]
    key: str
    length: int  # target length in tokens
    depth: float  # where the needle sits, as a fraction of the filler


def passkey_prompt(tokenizer, *, length: int, depth: float, rng: np.random.Generator):
    """A prompt of about `length` tokens with a random 5-digit key hidden at `depth` in filler.

    Raises ValueError when `length` cannot hold the instructions, the key, the question and one
    filler sentence, instead of silently making a longer prompt than asked.
    """
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    key = str(rng.integers(10_000, 100_000))
    fixed = len(tokenizer.encode(INTRO + NEEDLE.format(key=key) + QUESTION))
    per_filler = len(tokenizer.encode(FILLER * 10)) / 10
    n = int((length - fixed) / per_filler)
    if n < 1:
        raise ValueError(
            f"passkey length {length} is too short: the instructions, key and question take "
            f"{fixed} tokens and a filler sentence {per_filler:.0f} more"
        )
    before = round(n * depth)
    text = INTRO + FILLER * before + NEEDLE.format(key=key) + FILLER * (n - before) + QUESTION
    return PasskeyPrompt(tokens=tokenizer.encode(text), key=key, length=length, depth=depth)


def passkey_correct(answer: str, key: str) -> bool:
    """The first run of digits in the answer is exactly the key."""
    digits = ""
    for ch in answer:
        if ch.isdigit():
            digits += ch
        elif digits:
            break
    return digits == key
