"""Verifiable tasks for RL: problems generated on the fly, answers a program checks.

Each task draws problems (a prompt and its reference answer) from a seeded stream and
scores a completion in two parts, *format* (is it an answer of the right shape?) and
*correctness* (is it the right answer?):

| task (`rl.task`) | prompt, e.g. | answer | `rl.size` |
|---|---|---|---|
| addition | `57+312=` | `369` (`963` with `rl.reverse_answer`: least significant digit first) | digits per operand, at most |
| reverse | `R:kqzt=` | `tzqk` | letters, at most |
| sort | `S:5,1,4=` | `1,4,5` | numbers in the list |
| countdown | `C:3,5,7>22=` | an expression using each given number at most once, e.g. `3*5+7` | numbers given |

**Held-out split.** A problem is held out when a hash of its prompt says so (`held_out`,
about 10%): training draws skip those, evaluation draws take only those, so no evaluation
prompt is ever trained on (by SFT or RL), whatever the seed.

**The alphabet.** Every task writes with `ALPHABET` (digits, lower-case letters, a few
symbols), so one character-level tokenizer (`char_tokenizer`: one token per character and
end-of-text) serves them all, the tiny vocabulary the default RL job trains with.
"""

from __future__ import annotations

import ast
import random
import zlib
from dataclasses import dataclass, field

from ndtrain.data.tokenizer import EOT, TextTokenizer

ALPHABET = "0123456789abcdefghijklmnopqrstuvwxyzCRS+-*/=,:>()"
HELD_OUT_PERCENT = 10


@dataclass(frozen=True)
class Problem:
    prompt: str
    answer: str  # a reference answer (for countdown: one of possibly many)
    # rl.data's record (data/chat.Conversation) the chat template renders; None: the prompt
    # is given as it is (the built-in tasks)
    conversation: object = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class Score:
    format: float  # 1: an answer of the right shape
    correct: float  # 1: the right answer (implies format)


def held_out(prompt: str) -> bool:
    return zlib.crc32(prompt.encode()) % 100 < HELD_OUT_PERCENT


class Addition:
    name = "addition"

    def __init__(self, size: int, reverse_answer: bool = False):
        self.size, self.reverse = size, reverse_answer
        self.max_prompt_chars = 2 * size + 2

    def draw(self, rng: random.Random) -> Problem:
        a, b = (rng.randrange(10 ** rng.randint(1, self.size)) for _ in range(2))
        total = str(a + b)
        return Problem(f"{a}+{b}=", total[::-1] if self.reverse else total)

    def score(self, prompt: str, completion: str, answer: str) -> Score:
        text = completion.strip()
        well_formed = text.isdigit() and len(text) <= self.size + 1
        return Score(float(well_formed), float(well_formed and text == answer))


class Reverse:
    name = "reverse"

    def __init__(self, size: int):
        self.size = size
        self.max_prompt_chars = size + 3

    def draw(self, rng: random.Random) -> Problem:
        text = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, max(2, self.size))))
        return Problem(f"R:{text}=", text[::-1])

    def score(self, prompt: str, completion: str, answer: str) -> Score:
        text = completion.strip()
        well_formed = text.isalpha() and text.islower()
        return Score(float(well_formed), float(well_formed and text == answer))


class Sort:
    name = "sort"

    def __init__(self, size: int):
        self.size = size
        self.max_prompt_chars = 2 * size + 2

    def draw(self, rng: random.Random) -> Problem:
        numbers = [rng.randrange(10) for _ in range(self.size)]
        return Problem("S:" + ",".join(map(str, numbers)) + "=", ",".join(map(str, sorted(numbers))))

    def score(self, prompt: str, completion: str, answer: str) -> Score:
        parts = completion.strip().split(",")
        well_formed = all(p.isdigit() for p in parts)
        return Score(float(well_formed), float(well_formed and ",".join(parts) == answer))


class Countdown:
    """Reach the target with the given numbers (each at most once) and + − × ÷."""

    name = "countdown"

    def __init__(self, size: int):
        self.size = size
        self.max_prompt_chars = 2 * size + 6

    def draw(self, rng: random.Random) -> Problem:
        while True:
            numbers = [rng.randint(1, 9) for _ in range(self.size)]
            expr = str(numbers[0])
            for n in numbers[1:]:
                expr += rng.choice("+-*") + str(n)
            target = eval(expr)  # noqa: S307 - our own digits and operators
            if 0 < target <= 100:
                shown = sorted(numbers)
                return Problem("C:" + ",".join(map(str, shown)) + f">{target}=", expr)

    def score(self, prompt: str, completion: str, answer: str) -> Score:
        numbers = [int(n) for n in prompt[2:prompt.index(">")].split(",")]
        target = int(prompt[prompt.index(">") + 1:-1])
        used, value = arithmetic(completion.strip())
        pool = list(numbers)
        well_formed = value is not None
        for n in used or []:
            if n not in pool:
                well_formed = False
                break
            pool.remove(n)
        return Score(float(well_formed), float(well_formed and abs(value - target) < 1e-9))


def arithmetic(text: str) -> tuple[list[int] | None, float | None]:
    """The integer literals of an expression of + − × ÷ and parentheses, and its value;
    (None, None) for anything else (names, calls, division by zero, an empty string)."""
    try:
        tree = ast.parse(text, mode="eval").body
    except (SyntaxError, ValueError):
        return None, None
    numbers: list[int] = []

    def value(node) -> float:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            numbers.append(node.value)
            return node.value
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult, ast.Div)):
            a, b = value(node.left), value(node.right)
            if isinstance(node.op, ast.Div):
                return a / b
            return a + b if isinstance(node.op, ast.Add) else a - b if isinstance(node.op, ast.Sub) else a * b
        raise ValueError("not arithmetic")
    try:
        return numbers, value(tree)
    except (ValueError, ZeroDivisionError):
        return None, None


TASKS = {"addition": Addition, "reverse": Reverse, "sort": Sort, "countdown": Countdown}


def make_task(name: str, size: int, reverse_answer: bool = False):
    return Addition(size, reverse_answer) if name == "addition" else TASKS[name](size)


def draw_problems(task, seed: int, key: str, n: int, split: str) -> list[Problem]:
    """`n` problems of `split` ("train": not held out; "held_out") from the stream named
    (seed, key): a pure function of its arguments."""
    rng = random.Random(f"{seed}/{task.name}/{key}")
    want = split == "held_out"
    out: list[Problem] = []
    while len(out) < n:
        p = task.draw(rng)
        if held_out(p.prompt) == want:
            out.append(p)
    return out


def char_tokenizer() -> TextTokenizer:
    """One token per character of ALPHABET, and end-of-text."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    vocab = {c: i for i, c in enumerate(ALPHABET)}
    vocab[EOT] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token=EOT))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([EOT])
    return TextTokenizer(tok, vocab[EOT])
