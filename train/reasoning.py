"""A synthetic reasoning task that over-thinks in a checkable way (SpecExit, issue 13).

Multi-digit addition with ``<think> … </think> answer`` traces: the thinking adds column by column, states the
sum, and then keeps re-checking it (a random number of numbered, redundant paragraphs) before it closes. The
answer is settled at the paragraph that states the sum; everything after it is what SpecExit should save. Labels
for the drafter's signal head come per character from a trace (`Trace.labels`) and per token from any tokenised
completion, the target's own greedy ones included (`think_span`, `ThinkSpan.labels`): progress (share of the
thinking done), remaining (thinking left) and confidence (1 once the sum is stated: cutting there still gives
the answer). Problems are split into training and held-out sets by a hash of the problem.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence
from dataclasses import dataclass

THINK_START, THINK_END = "<think>", "</think>"
PARAGRAPH = "\n\n"  # ends a paragraph: one token, where SpecExit may cut
SETTLED = "So the sum is"  # opens the paragraph after which the answer is settled
PLACES = ("Units", "Tens", "Hundreds", "Thousands", "Ten-thousands", "Hundred-thousands")
HELDOUT_PERCENT = 10
# Digits per addend. With 3-5 the embedded target (3.2M parameters, 21 min on 2 CPU threads) reached 56% greedy
# held-out accuracy, its errors mostly in reading the right digit of a column; with 2-4, 16 min gave 64 / 64.
DIGITS = (2, 4)
# P(n re-checks), n = 0..12. Greedy decoding stops after check k once stopping is likelier than going on, i.e.
# once P(n = k) > P(n > k): only at k = 10 (hazard 4/6; at most 1/7 before it), so the target's own greedy output
# re-checks 10 times while the traces still vary from 3 to 12 (`Trace.labels` has something to learn).
RECHECK_WEIGHTS = (0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 4, 1, 1)
# Share of traces whose thinking is closed early, right after a paragraph break at or past the settled point (what
# SpecExit's forced ``</think>`` looks like): without them the target never sees ``</think>`` there and answers
# wrongly after an exit (measured: 39% accuracy at SpecExit's defaults, 100% without exits). Spread over the
# paragraphs, each break gets ``</think>`` a few percent of the time: greedy decoding still re-checks 10 times.
EARLY_EXIT_SHARE = 0.3


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


def make_problem(rng: random.Random, digits: tuple[int, int] = DIGITS) -> Problem:
    def number() -> int:
        d = rng.randint(*digits)
        return rng.randint(10 ** (d - 1), 10 ** d - 1)
    return Problem(number(), number())


def _columns(p: Problem) -> list[str]:
    """One paragraph per column, always naming the digit written (the sum is then read back from them)."""
    xs, ys = str(p.a)[::-1], str(p.b)[::-1]
    carry, out = 0, []
    for i in range(max(len(xs), len(ys))):
        x, y = int(xs[i]) if i < len(xs) else 0, int(ys[i]) if i < len(ys) else 0
        total = x + y + carry
        terms = f"{x} + {y}" + (f" + {carry}" if carry else "")
        carry = total // 10
        out.append(f"{PLACES[i]}: {terms} = {total}, write {total % 10}" + (", carry 1." if carry else "."))
    if carry:
        out.append("Carry the final 1.")
    return out


def _rechecks(p: Problem, n: int) -> list[str]:
    """``n`` numbered re-checks in a fixed order, each only restating known numbers: nothing new is decided
    after the sum is stated, and the number says how far the over-thinking has gone (the stopping rule is
    learnable, `RECHECK_WEIGHTS`)."""
    s = p.a + p.b
    pool = [f"{s} - {p.b} = {p.a}. Correct.",
            f"{p.b} + {p.a} = {s}. Same.",
            f"{s} - {p.a} = {p.b}. Yes.",
            f"{p.a} + {p.b} = {s}. Fine.",
            f"the units digit of {s} is {s % 10}. Right.",
            f"{s} is the sum of {p.a} and {p.b}. Sure."]
    return [f"Check {k + 1}: {pool[k % len(pool)]}" for k in range(n)]


def make_trace(p: Problem, rng: random.Random) -> Trace:
    """The column sums, the sum stated, then a random number of redundant checks (the over-thinking); a share
    ``EARLY_EXIT_SHARE`` closes the thinking early, at a paragraph break past the settled point."""
    paragraphs = [f"Add {p.a} and {p.b}.", *_columns(p), f"So the sum is {p.answer}."]
    head = THINK_START + "\n" + "\n\n".join(paragraphs) + "\n\n"
    settled_at = len(head)
    n = rng.choices(range(len(RECHECK_WEIGHTS)), weights=RECHECK_WEIGHTS)[0]
    checks = [c + "\n\n" for c in _rechecks(p, n)]
    if rng.random() < EARLY_EXIT_SHARE:  # closed at the break after the sum or after check j
        think = head + "".join(checks[:rng.randint(0, n)])
    else:
        think = head + "".join(checks) + f"The answer is {p.answer}.\n"
    return Trace(p, think + THINK_END + "\n" + p.answer, len(think), settled_at)


def chat_prompt(p: Problem) -> str:
    """The problem as `train.tokenizer.CHAT_TEMPLATE` renders a user turn (the chat route's prompt)."""
    return f"<|im_start|>user\n{p.prompt.strip()}<|im_end|>\n<|im_start|>assistant\n"


@dataclass(frozen=True)
class ThinkSpan:
    """Where a tokenised completion thinks, in token positions of the sequence it was found in."""

    start: int  # first token inside the thinking (after ``<think>``)
    settled: int  # first token after the paragraph that states the sum: cutting before it keeps the answer
    end: int  # the ``</think>`` token

    def labels(self) -> list[tuple[int, float, float, float]]:
        """(position, confidence, progress, remaining tokens) for each position from ``start`` to ``end``:
        progress runs 0 -> 1 and remaining counts down to 0 at ``</think>``."""
        n = self.end - self.start
        return [(p, float(p >= self.settled), (p - self.start) / n, float(self.end - p))
                for p in range(self.start, self.end + 1)]


def _find(ids: Sequence[int], pattern: Sequence[int], start: int, stop: int) -> int | None:
    k = len(pattern)
    return next((i for i in range(start, stop - k + 1) if list(ids[i:i + k]) == list(pattern)), None)


def think_span(ids: Sequence[int], think_start_id: int, think_end_id: int, settled_ids: Sequence[int],
               paragraph_id: int) -> ThinkSpan | None:
    """The first thinking section of ``ids`` with its settled point (the paragraph end after ``SETTLED``), or
    None when a part is missing (a greedy output that never closes its thinking or never states a sum)."""
    s = _find(ids, [think_start_id], 0, len(ids))
    e = None if s is None else _find(ids, [think_end_id], s + 1, len(ids))
    m = None if e is None else _find(ids, settled_ids, s + 1, e)
    q = None if m is None else _find(ids, [paragraph_id], m + len(settled_ids), e)
    return None if q is None else ThinkSpan(s + 1, q + 1, e)


def problems(n: int, seed: int, heldout: bool) -> list[Problem]:
    """``n`` distinct problems of one split, reproducibly."""
    rng, out, seen = random.Random(seed), [], set()
    while len(out) < n:
        p = make_problem(rng)
        if p.heldout() == heldout and (p.a, p.b) not in seen:
            seen.add((p.a, p.b))
            out.append(p)
    return out
