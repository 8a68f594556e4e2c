"""services/rollout/sampling.py: the contract's Sampling as vLLM SamplingParams arguments."""

from __future__ import annotations

import pytest

from services.rollout.sampling import finish_reason, sampling_kwargs
from shared.messages.rollout import Sampling


def test_every_field_is_mapped():
    s = Sampling(max_tokens=7, temperature=0.7, top_p=0.9, top_k=5, min_p=0.1, seed=3,
                 presence_penalty=0.5, frequency_penalty=-0.5, stop_token_ids=[9], logit_bias={4: -1.5})
    kw = sampling_kwargs(s, eos_token_ids=[2])
    assert {
        "max_tokens": 7, "temperature": 0.7, "top_p": 0.9, "top_k": 5, "min_p": 0.1, "seed": 3,
        "presence_penalty": 0.5, "frequency_penalty": -0.5, "stop_token_ids": [9, 2], "logit_bias": {4: -1.5},
    }.items() <= kw.items()
    assert kw["logprobs"] == 0 and kw["detokenize"] is False and kw["n"] == 1


def test_defaults_disable_top_k_and_add_eos_once():
    kw = sampling_kwargs(Sampling(stop_token_ids=[2, 5]), eos_token_ids=[2])
    assert kw["top_k"] == 0  # vLLM 0.32: 0 disables top-k, as in the contract
    assert kw["stop_token_ids"] == [2, 5]
    assert kw["logit_bias"] is None and kw["seed"] is None


@pytest.mark.parametrize("vllm, ours", [("stop", "stop"), ("length", "length"), ("abort", "preempted"),
                                        ("error", "error"), ("repetition", "error"), (None, "error")])
def test_finish_reasons(vllm, ours):
    assert finish_reason(vllm) == ours


@pytest.mark.vllm
def test_vllm_accepts_the_mapping():
    from vllm import SamplingParams

    p = SamplingParams(**sampling_kwargs(Sampling(top_k=0, temperature=1.0, logit_bias={1: 2.0}), [2]))
    assert p.top_k == 0 and p.stop_token_ids == [2] and p.logprobs == 0
    greedy = SamplingParams(**sampling_kwargs(Sampling(temperature=0.0, top_k=5, top_p=0.5), [2]))
    assert greedy.top_k == 0 and greedy.top_p == 1.0  # vLLM drops filters under greedy
