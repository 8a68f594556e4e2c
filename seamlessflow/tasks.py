"""Built-in verifiable tasks for demos and learning tests (pure).

reverse: "reverse 4821" -> "1284". Reward = 0.5 * (fraction of positions right) + 0.5 * exact.
"""

from __future__ import annotations

import random


def reverse_prompt(rng: random.Random, min_len: int = 3, max_len: int = 5) -> tuple[str, str]:
    digits = "".join(rng.choices("0123456789", k=rng.randint(min_len, max_len)))
    return f"reverse {digits}", digits[::-1]


def reverse_reward(answer: str, target: str) -> float:
    answer = answer.strip()
    right = sum(a == b for a, b in zip(answer, target)) / len(target)
    if len(answer) > len(target):
        right *= len(target) / len(answer)
    return 0.5 * right + 0.5 * float(answer == target)
