"""The contract's `Sampling` as vLLM 0.32 `SamplingParams` keyword arguments, and vLLM's
finish reasons as the contract's (pure: no vLLM import, so it is cheap to test).

Fixed choices, whatever the caller asks:
- token ids in, token ids out: `detokenize=False`, no stop strings;
- `logprobs=0`: vLLM then returns exactly the sampled token's logprob, from the raw
  model distribution (vLLM's default `logprobs_mode="raw_logprobs"`: before
  temperature, top-k/p and penalties);
- `output_kind=DELTA` is set by the engine (it needs the vLLM enum);
- the model's EOS ids are added to `stop_token_ids`, so EOS ends a request even
  though the engine runs with `skip_tokenizer_init=True` and has no tokenizer to ask.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from shared.messages.rollout import FinishReason, Sampling


def eos_token_ids(model_dir: str | Path) -> list[int]:
    """EOS ids from generation_config.json, else config.json (an int or a list in either)."""
    d = Path(model_dir)
    for name in ("generation_config.json", "config.json"):
        try:
            value = json.loads((d / name).read_text()).get("eos_token_id")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(value, int):
            return [value]
        if isinstance(value, list) and value and all(isinstance(v, int) for v in value):
            return list(value)
    return []


def sampling_kwargs(s: Sampling, eos_token_ids: list[int] | tuple[int, ...] = ()) -> dict[str, Any]:
    stop = list(dict.fromkeys([*s.stop_token_ids, *eos_token_ids]))
    return dict(
        n=1,
        max_tokens=s.max_tokens,
        temperature=s.temperature,
        top_p=s.top_p,
        # The contract and vLLM 0.32 agree: 0 disables top-k (vLLM also takes -1).
        top_k=s.top_k,
        min_p=s.min_p,
        seed=s.seed,
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        stop_token_ids=stop,
        logit_bias=dict(s.logit_bias) or None,
        logprobs=0,
        detokenize=False,
        skip_special_tokens=False,
    )


def finish_reason(vllm_reason: str | None) -> FinishReason:
    """vLLM's `CompletionOutput.finish_reason` as the contract's."""
    match vllm_reason:
        case "stop" | "length":
            return vllm_reason
        case "abort":  # only our abort / vacate / shutdown abort requests
            return "preempted"
        case _:  # "error" and anything a later vLLM adds
            return "error"
