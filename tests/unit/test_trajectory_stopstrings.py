"""services/trajectory/stopstrings.py: OpenAI stop strings over a token stream."""

from __future__ import annotations



def test_stop_strings_find_holdback_and_matcher():
    from services.trajectory.stopstrings import StopMatcher, find_stop, holdback

    assert find_stop("abc END x", ["END"]) == 4 and find_stop("abc", ["END"]) is None
    assert find_stop("xEND yEN", ["EN", "END"]) == 1  # the earliest start wins
    assert find_stop("abcEND", ["END"], start=4) == 3  # a match straddling what was checked before
    assert holdback("hello EN", ["END"]) == 2 and holdback("hello", ["END"]) == 0
    assert holdback("a\n\nObs", ["\nObservation:"]) == 4 and holdback("", ["x"]) == 0

    class Text:  # one character per token id
        def __init__(self):
            self.text = ""

        def add(self, ids):
            self.text += "".join(chr(i) for i in ids)

    m = StopMatcher(Text(), ["END"])
    assert m.add([ord(c) for c in "abcE"]) is None and m.visible(m.text.text) == "abc"
    assert m.add([ord(c) for c in "NDxyz"]) == 2  # "N", "D" kept; "xyz" dropped
    assert m.text.text == "abcEND" and m.at == 3 and m.visible(m.text.text) == "abc"
    plain = StopMatcher(Text(), [])
    assert plain.add([ord("E")]) is None and plain.visible(plain.text.text) == "E"


def test_the_matcher_holds_back_what_holdback_says():
    import random

    from services.trajectory.stopstrings import StopMatcher, holdback

    stops = ["\nObservation:", "</answer>", "aab", "abab"]
    m = StopMatcher(None, stops)
    rng = random.Random(0)
    for _ in range(2000):
        text = "".join(rng.choice("ab</answer>\nObs") for _ in range(rng.randint(0, 12)))
        assert m.visible(text) == text[: len(text) - holdback(text, stops)]
