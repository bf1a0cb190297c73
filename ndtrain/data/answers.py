"""Checking a model's answer against a reference: RL's `rl.reward = exact | math`.

- `exact`: the completion equals the reference after `normalise` (Unicode NFKC, case
  folded, runs of whitespace as one space, no space or final full stop at either end).
- `math`: the *final answer* of each, compared as numbers where both are numbers (within
  a relative tolerance of 1e-6, at least 1e-9 absolute), else as normalised text. The final
  answer of a text is the content of its last `\\boxed{...}` (braces balanced), else its last
  number (`-1,234.5`, `3/4`, `2.5%` as 0.025 is *not* done: a percent sign is dropped), else
  the whole text; a reference written `#### 42` (GSM8K) ends in its number too. A number may
  be written with thousands commas, as a fraction `a/b` or `\\frac{a}{b}`, with a leading
  `$` or a trailing unit-free `.`.

Both give a `Score`: format (an answer could be found in the completion) and correctness.
"""

from __future__ import annotations

import math
import re
import unicodedata

from ndtrain.data.verifiable import Score

_NUMBER = re.compile(r"-?\$?\d[\d,]*(?:\.\d+)?(?:/\d+(?:\.\d+)?)?|-?\$?\.\d+")
_FRAC = re.compile(r"\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}")
REL_TOL, ABS_TOL = 1e-6, 1e-9


def normalise(text: str) -> str:
    text = " ".join(unicodedata.normalize("NFKC", text).casefold().split())
    return text.strip().rstrip(".").strip()


def exact(completion: str, reference: str) -> Score:
    got = normalise(completion)
    return Score(float(bool(got)), float(bool(got) and got == normalise(reference)))


def last_boxed(text: str) -> str | None:
    """The content of the last \\boxed{...} (or \\fbox{...}), braces balanced; None if none."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth, j = 1, i
    while j < len(text) and depth:
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        j += 1
    return text[i:j - 1] if depth == 0 else None


def to_number(text: str) -> float | None:
    """The value of a number written as the module's doc says, or None."""
    t = _FRAC.sub(r"(\1)/(\2)", text.strip())
    t = t.replace("$", "").replace(",", "").replace("%", "").replace("(", "").replace(")", "").strip().rstrip(".")
    try:
        if "/" in t:
            a, b = t.split("/", 1)
            return float(a) / float(b)
        return float(t)
    except (ValueError, ZeroDivisionError):
        return None


def final_answer(text: str) -> str | None:
    """The last \\boxed{} content, else the last number, else None."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    numbers = _NUMBER.findall(_FRAC.sub(r"\1/\2", text))
    return numbers[-1] if numbers else None


def same_value(a: str, b: str) -> bool:
    x, y = to_number(a), to_number(b)
    if x is not None and y is not None:
        return math.isfinite(x) and math.isfinite(y) and abs(x - y) <= max(REL_TOL * max(abs(x), abs(y)), ABS_TOL)
    return normalise(_FRAC.sub(r"\1/\2", a)).replace(" ", "") == normalise(_FRAC.sub(r"\1/\2", b)).replace(" ", "")


def math_answer(completion: str, reference: str) -> Score:
    got = final_answer(completion)
    want = final_answer(reference)
    if want is None:
        want = reference
    return Score(float(got is not None), float(got is not None and same_value(got, want)))


CHECKS = {"exact": exact, "math": math_answer}
