"""A synthetic reasoning task that over-thinks in a checkable way (SpecExit, issue 13).

Multi-digit addition with ``<think> … </think> answer`` traces: the thinking adds column by column, states the
sum, and then keeps re-checking it (a random number of redundant paragraphs) before it closes. The answer is
settled at the paragraph that states the sum; everything after it is what SpecExit should save. From each trace
come per-character labels for the drafter's signal head: progress (share of the thinking done), remaining
(thinking characters left; tokens once tokenised) and confidence (1 once the sum is stated: cutting there
still gives the right answer). Problems are split into training and held-out sets by a hash of the problem.
"""

from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass

THINK_START, THINK_END = "<think>", "</think>"
PLACES = ("Units", "Tens", "Hundreds", "Thousands", "Ten-thousands", "Hundred-thousands")
HELDOUT_PERCENT = 10


@dataclass(frozen=True)
class Problem:
    a: int
    b: int

    @property
    def prompt(self) -> str:
        return f"What is {self.a} + {self.b}?\n"

    @property
    def answer(self) -> str:
        return str(self.a + self.b)

    def heldout(self) -> bool:
        return int(hashlib.sha256(f"{self.a}+{self.b}".encode()).hexdigest()[:8], 16) % 100 < HELDOUT_PERCENT


@dataclass(frozen=True)
class Trace:
    """A completion (what follows the prompt): ``<think>`` paragraphs ``</think>`` answer."""

    problem: Problem
    text: str
    think_end_at: int  # index of THINK_END in text
    settled_at: int  # end of the paragraph that states the sum: from here a cut still gives the right answer

    def labels(self) -> list[tuple[float, float, float]]:
        """Per character of the thinking (``text[:think_end_at]``): (confidence, progress, remaining)."""
        n = self.think_end_at
        return [(1.0 if i >= self.settled_at else 0.0, i / n, float(n - i)) for i in range(n)]


def make_problem(rng: random.Random, digits: tuple[int, int] = (3, 5)) -> Problem:
    def number() -> int:
        d = rng.randint(*digits)
        return rng.randint(10 ** (d - 1), 10 ** d - 1)
    return Problem(number(), number())


def _columns(p: Problem) -> list[str]:
    xs, ys = str(p.a)[::-1], str(p.b)[::-1]
    carry, out = 0, []
    for i in range(max(len(xs), len(ys))):
        x, y = int(xs[i]) if i < len(xs) else 0, int(ys[i]) if i < len(ys) else 0
        total = x + y + carry
        terms = f"{x} + {y}" + (f" + {carry}" if carry else "")
        carry = total // 10
        out.append(f"{PLACES[i]}: {terms} = {total}" + (f", write {total % 10}, carry 1." if carry else "."))
    if carry:
        out.append("Carry the final 1.")
    return out


def _rechecks(p: Problem, rng: random.Random, n: int) -> list[str]:
    s = p.a + p.b
    pool = [f"Let me check. {s} - {p.b} = {p.a}. Correct.",
            f"Let me check again by adding in the other order. {p.b} + {p.a} = {s}.",
            f"Check with subtraction the other way: {s} - {p.a} = {p.b}. Yes.",
            f"Estimate: about {round(p.a, -2)} + {round(p.b, -2)} = {round(p.a, -2) + round(p.b, -2)}, "
            f"close to {s}. Fine.",
            f"Double-check the units: {p.a % 10} + {p.b % 10} ends in {(p.a + p.b) % 10}. Fine.",
            f"One more look: {p.a} + {p.b} = {s}."]
    return [rng.choice(pool) for _ in range(n)]


def make_trace(p: Problem, rng: random.Random, max_rechecks: int = 6) -> Trace:
    """The column sums, the sum stated, then 0..``max_rechecks`` redundant checks (the over-thinking)."""
    paragraphs = [f"Add {p.a} and {p.b}.", *_columns(p), f"So the sum is {p.answer}."]
    head = THINK_START + "\n" + "\n\n".join(paragraphs) + "\n\n"
    settled_at = len(head)
    checks = _rechecks(p, rng, rng.randint(0, max_rechecks))
    think = head + "".join(c + "\n\n" for c in checks) + f"The answer is {p.answer}.\n"
    return Trace(p, think + THINK_END + "\n" + p.answer, len(think), settled_at)


def answer_of(completion: str) -> str | None:
    """The answer a completion gives: the first number after ``</think>`` (None without one)."""
    _, sep, after = completion.partition(THINK_END)
    match = re.search(r"-?\d+", after) if sep else None
    return match.group(0) if match else None


def problems(n: int, seed: int, heldout: bool) -> list[Problem]:
    """``n`` distinct problems of one split, reproducibly."""
    rng, out, seen = random.Random(seed), [], set()
    while len(out) < n:
        p = make_problem(rng)
        if p.heldout() == heldout and (p.a, p.b) not in seen:
            seen.add((p.a, p.b))
            out.append(p)
    return out
