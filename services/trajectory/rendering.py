"""Chat templates and tokens: render a request into prompt token ids, decode generated ids.

The one rule: tokens already in a session are never re-tokenized. A new turn
that extends a stored turn only tokenizes the text the template adds after the
stored turn's end-of-turn token (`continuation`). Re-rendering the whole
conversation would re-tokenize the model's replies, and a BPE tokenizer can
split the same text differently than the model sampled it (drift).

What the template adds is found by rendering a short stand-in for the history: its leading
system messages, its last user message and its last two messages (the reply and what came
before it). A template that renders each message from its neighbours alone adds the same text
after the short history as after the whole one, so a turn costs the template the new messages,
not the session. Whether a template does is checked, not assumed: the first time a shape of
conversation (the roles of the short history and of the new messages, the tools) is seen, the
full history is rendered too, and a shape whose two renders differ is rendered in full from
then on (`always_check` renders both every time).
"""

from __future__ import annotations

import json
import logging
from typing import Any

from services.trajectory.conversation import for_template

log = logging.getLogger(__name__)
MAX_SHAPES = 4096  # conversation shapes remembered as checked


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
        self.always_check = False  # render the full history too at every turn, and use it
        # the Rust tokenizer behind a fast HF tokenizer, called directly: transformers' encode/decode
        # wrappers cost 5-10x the work itself on short texts (None: a slow tokenizer, or a decode
        # that HF post-processes)
        backend = getattr(tokenizer, "_tokenizer", None)
        self._backend = backend if type(backend).__module__.startswith("tokenizers") else None
        self._backend_decode = self._backend if not getattr(tokenizer, "clean_up_tokenization_spaces", False) else None
        self._shapes: dict[tuple, bool] = {}  # conversation shape -> the short render agrees with the full one

    @classmethod
    def from_pretrained(cls, path: str, always_check: bool = False) -> "Renderer":
        from transformers import AutoTokenizer

        r = cls(AutoTokenizer.from_pretrained(path))
        r.always_check = always_check
        return r

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
        if self._backend is not None:
            return self._backend.encode(text, add_special_tokens=False).ids
        return self.tok.encode(text, add_special_tokens=False)

    def decode_all(self, ids: list[int]) -> str:
        """Text of `ids` as they are (end-of-turn and padding included)."""
        if self._backend_decode is not None:
            return self._backend_decode.decode(ids, skip_special_tokens=False)
        return self.tok.decode(ids, skip_special_tokens=False)

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
        text = self._added_text(history, new, tools)
        if text is None:
            return None
        glue = "" if history_ends_with_eos else self.eos_text
        return self.encode(glue + text)

    def _added_text(self, history: list[dict[str, Any]], new: list[dict[str, Any]],
                    tools: list[dict[str, Any]]) -> str | None:
        """The template's text after the reply's end-of-turn token, through the generation prompt."""
        short = short_history(history)
        if len(short) == len(history):
            return self._added_by_full(history, new, tools)
        shape = (json.dumps(tools, sort_keys=True), _roles(short), _roles(new))
        agrees = self._shapes.get(shape)
        if agrees is False:
            return self._added_by_full(history, new, tools)
        try:
            text = self._added_by_full(short, new, tools)
        except RenderError:  # e.g. a template that insists on strict user/assistant alternation
            text = None
        if agrees is None or self.always_check:
            full = self._added_by_full(history, new, tools)
            if len(self._shapes) >= MAX_SHAPES:  # agents that send ever new tools: check those again
                self._shapes.clear()
            self._shapes[shape] = full == text
            if full != text:
                log.warning("the chat template renders a short history differently than the whole one for "
                            "roles %s + %s: rendering the whole history for this shape", shape[1], shape[2])
            return full
        return text

    def _added_by_full(self, history: list[dict[str, Any]], new: list[dict[str, Any]],
                       tools: list[dict[str, Any]]) -> str | None:
        before = self.render(history, tools, gen=False)
        after = self.render(history + new, tools, gen=True)
        cut = before.rfind(self.eos_text)
        if not after.startswith(before) or cut < 0:
            return None
        return before[cut + len(self.eos_text):] + after[len(before):]

    def token_texts(self, ids: list[int]) -> list[tuple[int, str]]:
        """(position, text) of each generated id that shows in the text (not end-of-turn or
        padding), each decoded alone: what OpenAI's `logprobs` lists as `token`."""
        return [(k, self.decode_all([i])) for k, i in enumerate(ids) if i not in self._strip]

    def decode(self, ids: list[int]) -> str:
        """Text of generated ids, without the end-of-turn and padding tokens."""
        return self.decode_all([i for i in ids if i not in self._strip])


def short_history(history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A stand-in for `history` that ends the same way: its leading system messages, its last user
    message, and its last two messages (a list as long as `history` when nothing can be left out)."""
    head = 0
    while head < len(history) and history[head].get("role") in ("system", "developer"):
        head += 1
    tail = max(head, len(history) - 2)
    user = next((i for i in range(tail - 1, head - 1, -1) if history[i].get("role") == "user"), None)
    middle = [history[user]] if user is not None else []
    return history[:head] + middle + history[tail:]


def _roles(messages: list[dict[str, Any]]) -> tuple:
    return tuple((m.get("role"), bool(m.get("tool_calls"))) for m in messages)


class IncrementalText:
    """Decodes a growing list of ids and returns only the new, complete text.

    Holds back up to 3 trailing U+FFFD (a UTF-8 sequence the next token may complete);
    longer runs are bytes that will never form a character, and are streamed as they are.

    Each call decodes a short window, not the whole reply (vLLM's incremental detokenizer):
    the window starts at the tokens before the last ones whose text was settled, so a
    tokenizer that decodes a token differently at the start of a text (a SentencePiece
    leading space) still gets its context, and the window moves on whenever its text ends
    on a whole character.
    """

    def __init__(self, renderer: Renderer):
        self.renderer = renderer
        self.ids: list[int] = []
        self.text = ""
        self._shown: list[int] = []  # ids without end-of-turn and padding: what decodes to text
        self._start = 0  # the window: _shown[_start:] is decoded ...
        self._settled = 0  # ... and the text of _shown[_start:_settled] was already returned
        self._settled_text = ""  # decode(_shown[_start:_settled])
        self._sent = 0  # characters of the window beyond _settled_text already returned

    def add(self, ids: list[int]) -> str:
        self.ids += ids
        strip = self.renderer._strip
        self._shown += [i for i in ids if i not in strip]
        window = self.renderer.decode_all(self._shown[self._start:])
        held = 0
        while held < 3 and held < len(window) and window[-1 - held] == "\ufffd":
            held += 1
        begin = len(self._settled_text) + self._sent
        stable = window[: len(window) - held]
        if len(stable) <= begin:
            return ""
        new = stable[begin:]
        self.text += new
        if held:  # an unfinished character: keep the window where it is
            self._sent += len(new)
        else:
            self._start, self._settled, self._sent = self._settled, len(self._shown), 0
            self._settled_text = self.renderer.decode_all(self._shown[self._start:self._settled])
        return new

    def final(self) -> str:
        self.text = self.renderer.decode(self.ids)
        return self.text
