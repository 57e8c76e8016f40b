"""Arithmetic word problems with gold answers, shared by the plain-openai and AutoGen examples."""

from __future__ import annotations

import random
import re

TEMPLATES = (
    "What is {a}+{b}?",
    "Ann has {a} apples and buys {b} more. How many apples does she have?",
    "A shelf holds {a} books and {b} more arrive. How many books are there now?",
    "A bus carries {a} people and {b} get on. How many people are on the bus?",
)


def problems(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        out.append({"id": i, "question": rng.choice(TEMPLATES).format(a=a, b=b), "answer": a + b})
    return out


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression with + - * / and parentheses."""
    if not re.fullmatch(r"[\d\s+\-*/().]+", expression or ""):
        return f"error: not an arithmetic expression: {expression!r}"
    try:
        return str(eval(expression, {"__builtins__": {}}))  # noqa: S307 (digits and operators only)
    except Exception as exc:
        return f"error: {exc}"


def is_correct(text: str | None, answer: int) -> bool:
    """The last number in ``text`` is the answer."""
    numbers = re.findall(r"-?\d+", text or "")
    return bool(numbers) and int(numbers[-1]) == answer
