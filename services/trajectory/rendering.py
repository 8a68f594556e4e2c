"""Chat templates and tokens: render a request into prompt token ids, decode generated ids.

The one rule: tokens already in a session are never re-tokenized. A new turn
that extends a stored turn only tokenizes the text the template adds after the
stored turn's end-of-turn token (`continuation`). Re-rendering the whole
conversation would re-tokenize the model's replies, and a BPE tokenizer can
split the same text differently than the model sampled it (drift).
"""

from __future__ import annotations

from typing import Any

from services.trajectory.conversation import for_template


class RenderError(ValueError):
    pass


class Renderer:
    def __init__(self, tokenizer: Any):
        if not getattr(tokenizer, "chat_template", None):
            raise RenderError("the model's tokenizer has no chat_template")
        if tokenizer.eos_token is None:
            raise RenderError("the model's tokenizer has no eos_token")
        self.tok = tokenizer
        self.eos_id: int = tokenizer.eos_token_id
        self.eos_text: str = tokenizer.eos_token
        self._strip = {tokenizer.eos_token_id, tokenizer.pad_token_id} - {None}

    @classmethod
    def from_pretrained(cls, path: str) -> "Renderer":
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(path))

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]], gen: bool) -> str:
        try:
            return self.tok.apply_chat_template(
                [for_template(m) for m in messages],
                tools=tools or None,
                add_generation_prompt=gen,
                tokenize=False,
            )
        except Exception as e:  # jinja raises TemplateError, TypeError, KeyError...
            raise RenderError(f"chat template failed: {e}") from None

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def prompt(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[int]:
        """A fresh conversation: the whole template, tokenized once."""
        return self.encode(self.render(messages, tools, gen=True))

    def continuation(
        self,
        history: list[dict[str, Any]],
        new: list[dict[str, Any]],
        tools: list[dict[str, Any]],
        history_ends_with_eos: bool,
    ) -> list[int] | None:
        """Tokens that follow a stored turn whose messages are `history` (ending with the
        assistant reply) when the agent sends `history + new`. None if the template does
        not render `history` as a prefix of `history + new` (then start a new branch)."""
        before = self.render(history, tools, gen=False)
        after = self.render(history + new, tools, gen=True)
        cut = before.rfind(self.eos_text)
        if not after.startswith(before) or cut < 0:
            return None
        tail = before[cut + len(self.eos_text):]
        glue = "" if history_ends_with_eos else self.eos_text
        return self.encode(glue + tail + after[len(before):])

    def token_texts(self, ids: list[int]) -> list[tuple[int, str]]:
        """(position, text) of each generated id that shows in the text (not end-of-turn or
        padding), each decoded alone: what OpenAI's `logprobs` lists as `token`."""
        return [(k, self.tok.decode([i], skip_special_tokens=False)) for k, i in enumerate(ids)
                if i not in self._strip]

    def decode(self, ids: list[int]) -> str:
        """Text of generated ids, without the end-of-turn and padding tokens."""
        return self.tok.decode([i for i in ids if i not in self._strip], skip_special_tokens=False)


class IncrementalText:
    """Decodes a growing list of ids and returns only the new, complete text.

    Holds back up to 3 trailing U+FFFD (a UTF-8 sequence the next token may complete);
    longer runs are bytes that will never form a character, and are streamed as they are.
    """

    def __init__(self, renderer: Renderer):
        self.renderer = renderer
        self.ids: list[int] = []
        self.text = ""

    def add(self, ids: list[int]) -> str:
        self.ids += ids
        text = self.renderer.decode(self.ids)
        held = 0
        while held < 3 and held < len(text) and text[-1 - held] == "\ufffd":
            held += 1
        stable = text[: len(text) - held]
        if len(stable) <= len(self.text) or not stable.startswith(self.text):
            return ""
        new, self.text = stable[len(self.text):], stable
        return new

    def final(self) -> str:
        self.text = self.renderer.decode(self.ids)
        return self.text
