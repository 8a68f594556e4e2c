"""OpenAI `stop` strings over a token stream (pure).

The rollout workers see token ids only, so stop strings are matched here, on the decoded
text. When one appears, the turn ends "stop": its recorded tokens run up to and including
the token that completed the stop string (what the policy really sampled), and the agent's
content ends just before the stop string (OpenAI's contract). While streaming, text that
could be the start of a stop string is held back until the next tokens decide it.
"""

from __future__ import annotations


def find_stop(text: str, stops: list[str], start: int = 0) -> int | None:
    """Index in `text` of the earliest stop string that ends at or after `start` (None if none).

    `start` lets a caller that checked a shorter prefix before skip the part it has seen:
    a stop string that ends beyond it may begin up to len(stop) - 1 characters earlier."""
    best: int | None = None
    for s in stops:
        i = text.find(s, max(0, start - len(s) + 1))
        if i >= 0 and (best is None or i < best):
            best = i
    return best


def holdback(text: str, stops: list[str]) -> int:
    """How many trailing characters of `text` might begin a stop string (so are not shown yet)."""
    held = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), held, -1):
            if text.endswith(s[:n]):
                held = n
                break
    return held


class StopMatcher:
    """Feeds tokens one at a time into `text` (an IncrementalText-like object with
    `add(ids)` and `.text`) and reports where a stop string completes."""

    def __init__(self, text, stops: list[str]):
        self.text = text
        self.stops = stops
        # holdback() for a text that grows a token at a time: the proper prefixes of the stop strings
        # by their last character, longest first, so most tokens cost one dict lookup
        self._prefixes: dict[str, list[str]] = {}
        for p in sorted({s[:n] for s in stops for n in range(1, len(s))}, key=len, reverse=True):
            self._prefixes.setdefault(p[-1], []).append(p)
        self.checked = 0  # characters of text already searched
        self.at: int | None = None  # content length once a stop string was found

    def add(self, ids: list[int]) -> int | None:
        """Add `ids`; returns how many of them to keep if a stop string completed (the rest
        are dropped, never shown and never recorded), else None."""
        if not self.stops:
            self.text.add(ids)
            return None
        for k, tok in enumerate(ids):
            self.text.add([tok])
            at = find_stop(self.text.text, self.stops, self.checked)
            self.checked = len(self.text.text)
            if at is not None:
                self.at = at
                return k + 1
        return None

    def visible(self, text: str) -> str:
        """The part of `text` the agent may see now."""
        if self.at is not None:
            return text[: self.at]
        if not self.stops or not text:
            return text
        held = next((len(p) for p in self._prefixes.get(text[-1], ()) if text.endswith(p)), 0)
        return text[: len(text) - held]
