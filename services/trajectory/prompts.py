"""Which stored turn a request extends, and the prompt that follows it.

1. Fast: the request resends the messages of the session's last turn byte for byte, then that
   turn's reply and the new messages. The raw digest of the resent part names the turn
   (store.follow: one round trip, with the turn's cached token path); the reply is checked
   against the turn's conversation key by hashing it alone.
2. Otherwise the conversation keys of every prefix that ends on an assistant message are
   computed in one pass (chained keys) and the longest stored one wins (store.find_turn).

Either way the prompt is the turn's token path plus the tokens the chat template adds for
the new messages (Renderer.continuation), spliced as msgpack bytes (tokenpath.py); the work
grows with what the request adds, not with the session. A request that extends nothing, or
that the template does not render as an extension, starts a new root. Redis goes through
store.py; the rest is pure.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from services.trajectory.conversation import (
    candidate_prefixes,
    conversation_key,
    extend_key,
    last_reply,
    prefix_keys,
    raw_digest,
    raw_digests,
)
from services.trajectory.record import Prompt
from services.trajectory.rendering import Renderer, RenderError
from services.trajectory.store import Followed, Store
from services.trajectory.tokenpath import TokenPath
from services.trajectory.turns import path, token_ids
from shared.messages import ChatRequest


class Digests(NamedTuple):
    follow: str  # what step 1 looks up ("" where it does not apply): the part before the last assistant message
    whole: str  # the request's own, which its turn is saved under for the next request to follow


def request_digests(req: ChatRequest) -> Digests:
    """Both raw digests of a chat request, its messages hashed once (conversation.raw_digests)."""
    if req.kind != "chat" or not req.messages:
        return Digests("", "")
    if not (k := last_reply(req.messages)):
        return Digests("", raw_digest(req.tools, req.messages))
    return Digests(*raw_digests(req.tools, req.messages, k - 1))


def follow_digest(req: ChatRequest) -> str:
    """The raw digest step 1 looks up for this request ("" where step 1 does not apply): the part
    before its last assistant message, which the turn that reply came from was saved under."""
    return request_digests(req).follow


class PromptBuilder:
    def __init__(self, store: Store, renderer: Renderer):
        self.store, self.renderer = store, renderer

    async def build(self, sid: str, req: ChatRequest, looked: tuple[str, Followed | None] = ("", None),
                    raw: str = "") -> Prompt:
        """Raises RenderError for messages the template cannot render. `looked`: (follow_digest(req),
        what it found), when the request's lookup asked it already (Store.lookup): step 1 then
        costs no round trip of its own. `raw`: request_digests(req).whole, where already computed."""
        if req.kind == "completion":
            ids = self.renderer.encode(req.prompt)
            return Prompt(ids, ids, -1, [{"role": "user", "content": req.prompt}])
        if not req.messages:
            raise RenderError("messages must not be empty")
        msgs, tools = req.messages, req.tools
        raw = raw or raw_digest(tools, msgs)
        if k := last_reply(msgs):
            if (found := await self._follow(sid, req, k, raw, looked)) is not None:
                return found
            ks = candidate_prefixes(msgs)
            keys = prefix_keys(tools, msgs, ks)
            if hit := await self.store.find_turn(sid, [keys[k] for k in ks]):
                key, tid = hit
                k = next(k for k in ks if keys[k] == key)
                ids = await self.store.path(sid, tid) or await self._walk(sid, tid)
                return self._extend(ids, tid, msgs, k, tools, keys[len(msgs)], raw)
            return self._root(msgs, tools, keys[len(msgs)], raw)
        return self._root(msgs, tools, conversation_key(tools, msgs), raw)

    async def _follow(self, sid: str, req: ChatRequest, k: int, raw: str,
                      looked: tuple[str, Followed | None]) -> Prompt | None:
        """Step 1; None if the fast way does not apply (then step 2 decides)."""
        msgs, tools = req.messages, req.tools
        digest, followed = looked
        if not digest:
            followed = await self.store.follow(sid, follow_digest(req))
        if followed is None:
            return None
        alias = followed.alias
        key = extend_key(alias.request_key, msgs[k - 1:k])  # the resent request + the reply
        if key != alias.turn_key:  # the agent changed the reply: not this turn
            return None
        ids = followed.path or await self._walk(sid, alias.turn_id)
        return self._extend(ids, alias.turn_id, msgs, k, tools, extend_key(key, msgs[k:]), raw)

    async def _walk(self, sid: str, tid: int) -> TokenPath:
        """The token path of a turn whose cached path is gone (a turn that already has a child)."""
        return TokenPath.of(token_ids(path(await self.store.turns(sid), tid)))

    def _extend(self, ids: TokenPath, tid: int, msgs: list[dict[str, Any]], k: int, tools: list[dict[str, Any]],
                request_key: str, raw: str) -> Prompt:
        # the stored path ends with the reply's last generated token: its end-of-turn token unless
        # max_tokens cut it (a turn always generates at least one token)
        cont = self.renderer.continuation(msgs[:k], msgs[k:], tools,
                                          history_ends_with_eos=ids.last == self.renderer.eos_id)
        if cont is None:
            return self._root(msgs, tools, request_key, raw)
        return Prompt(ids + cont, cont, tid, list(msgs[k:]), request_key, raw)

    def _root(self, msgs: list[dict[str, Any]], tools: list[dict[str, Any]], request_key: str, raw: str) -> Prompt:
        ids = self.renderer.prompt(msgs, tools)
        return Prompt(ids, ids, -1, list(msgs), request_key, raw)
