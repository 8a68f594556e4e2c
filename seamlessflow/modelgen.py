"""Build a small Llama-architecture checkpoint and a BPE tokenizer with a chat template, offline.

    seamlessflow init-model var/model            # hidden 128, 2 layers: tests and the demo
    seamlessflow init-model var/model --size small   # hidden 256, 4 layers

vLLM and DeepSpeed both load the directory this writes. Nothing is downloaded:
the tokenizer is trained here on a built-in corpus. Real users skip this and pass
`--model /path/to/their/hf/checkpoint`.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

SPECIAL_TOKENS = ["<|pad|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"]
EOS = "<|im_end|>"

# Hermes/Qwen-style template. Tool calls are written as
# <tool_call>{"name": ..., "arguments": {...}}</tool_call> inside the assistant turn;
# shared/toolcalls.py parses that same format back.
CHAT_TEMPLATE = (
    "{%- set sys = messages[0].content if messages and messages[0].role == 'system' else '' -%}"
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' -}}{%- if sys -%}{{- sys + '\\n\\n' -}}{%- endif -%}"
    "{{- '# Tools\\n<tools>\\n' -}}"
    "{%- for tool in tools -%}{{- tool | tojson -}}{{- '\\n' -}}{%- endfor -%}"
    "{{- '</tools>\\nTo call a function reply with <tool_call>{\"name\": NAME, \"arguments\": ARGS}</tool_call><|im_end|>\\n' -}}"
    "{%- elif sys -%}{{- '<|im_start|>system\\n' + sys + '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'system' -%}"
    "{%- elif m.role == 'assistant' -%}"
    "{{- '<|im_start|>assistant\\n' -}}{%- if m.content -%}{{- m.content -}}{%- endif -%}"
    "{%- if m.tool_calls -%}{%- for tc in m.tool_calls -%}"
    "{{- '<tool_call>{\"name\": \"' + tc.function.name + '\", \"arguments\": ' + tc.function.arguments + '}</tool_call>' -}}"
    "{%- endfor -%}{%- endif -%}{{- '<|im_end|>\\n' -}}"
    "{%- else -%}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

SIZES = {
    # name: (hidden, layers, heads, ffn). vLLM's CPU attention needs head_dim 32/64/128...:
    # head_dim 16 fails at the first forward ("Unsupported CPU attention configuration").
    "tiny": (128, 2, 2, 512),
    "small": (256, 4, 4, 1024),
    "medium": (512, 8, 8, 2048),
}

_WORDS = (
    "the a an agent tool call function result weather city temperature search file code "
    "python test error fix patch run return value list dict string number sum reverse sort "
    "hello world please thanks yes no maybe user assistant system reward step policy train "
    "rollout token model version update pause resume query answer question json name arguments"
).split()


def _corpus(n: int, seed: int) -> list[str]:
    """Digit-free on purpose: digits stay one byte-level token each, so the built-in digit
    tasks (seamlessflow/demo/tasks.py) map one character to one token."""
    rng = random.Random(seed)
    lines = []
    for _ in range(n):
        words = rng.choices(_WORDS, k=rng.randint(3, 14))
        lines.append(" ".join(words) + ". " + json.dumps({"name": rng.choice(_WORDS)}))
    return lines


def build_tokenizer(out: Path, vocab_size: int = 512, seed: int = 0):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(4000, seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS,
        pad_token="<|pad|>",
        bos_token=None,
        additional_special_tokens=["<|im_start|>", "<tool_call>", "</tool_call>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return fast


def init_model(out: str | Path, size: str = "tiny", seed: int = 0, vocab_size: int = 512) -> Path:
    """Write config, safetensors weights, generation config and tokenizer into `out`."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose one of {sorted(SIZES)}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(out, vocab_size=vocab_size, seed=seed)
    hidden, layers, heads, ffn = SIZES[size]
    eos = tok.convert_tokens_to_ids(EOS)
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=ffn,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        eos_token_id=eos,
        pad_token_id=tok.pad_token_id,
        bos_token_id=None,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(out, safe_serialization=True)
    GenerationConfig(eos_token_id=eos, pad_token_id=tok.pad_token_id).save_pretrained(out)
    return out


def eos_id(model_dir: Path) -> int:
    """The end-of-sequence token id of a checkpoint directory (its generation_config.json), e.g. to bar
    it with `logit_bias={eos_id(d): -100}` where a test needs replies of their full length."""
    return json.loads((Path(model_dir) / "generation_config.json").read_text())["eos_token_id"]
