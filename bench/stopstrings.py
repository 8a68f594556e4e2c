"""CPU per generated token of the trajectory manager's text path with OpenAI `stop` strings.

    .venv/bin/python bench/stopstrings.py                      # this checkout
    .venv/bin/python bench/stopstrings.py --root /tmp/before   # another checkout's services/

A 1,000-token reply (the tiny model's tokenizer) arrives one token per delta, as a stream does,
through services/trajectory/turnstream.py's TurnStream: the decoded text, the stop-string matcher
(4 strings that never match, so the reply runs to its end) and the agent-visible text. Prints the
median over `--repeats` of the process CPU per token, in microseconds, with and without stops.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

STOPS = ["\nObservation:", "</answer>", "STOP!", "###"]
TEXT = ("The quick brown fox jumps over the lazy dog; naïve café owners ship 42 crates of açaí "
        "to Zürich, then reverse 12345 and 67890. ")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", default=str(Path(__file__).resolve().parents[1]), help="checkout whose code runs")
    ap.add_argument("--tokens", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--model", help="a model dir with a tokenizer (default: build the tiny one)")
    a = ap.parse_args()
    sys.path.insert(0, a.root)
    from seamlessflow.modelgen import init_model
    from services.trajectory.rendering import Renderer
    from services.trajectory.turnstream import TurnStream
    from shared.messages import ChatRequest, Sampling, TokenDelta

    model = a.model or str(init_model(Path(tempfile.mkdtemp(prefix="sf-stop-")) / "model"))
    renderer = Renderer.from_pretrained(model)
    ids: list[int] = []
    while len(ids) < a.tokens:
        ids += renderer.encode(TEXT)
    ids = ids[:a.tokens]
    assert not any(s in renderer.decode(ids) for s in STOPS)

    def per_token(stops: list[str]) -> float:
        req = ChatRequest("r", "s", "chat", "m", Sampling(max_tokens=a.tokens), stop=stops, agent_streams=True)
        stream = TurnStream(renderer, req, 0.0)
        t0 = time.process_time()
        for k, tok in enumerate(ids):
            stream.add(TokenDelta("r", [tok], [-1.0], 0), "w0", k == 0)
            stream.to_persist(k == 0)
            stream.progress(float(k))
        stream.final_text()
        return 1e6 * (time.process_time() - t0) / len(ids)

    per_token(STOPS)  # warm up
    row = {"root": a.root, "tokens": len(ids),
           "us_per_token_4_stops": round(statistics.median(per_token(STOPS) for _ in range(a.repeats)), 2),
           "us_per_token_no_stops": round(statistics.median(per_token([]) for _ in range(a.repeats)), 2)}
    print(json.dumps(row))


if __name__ == "__main__":
    main()
