"""A chat request's messages, decoded only where they are read.

An agent resends its whole conversation with every turn, so at turn 200 a request carries 400
messages of which the trajectory manager reads a handful: the reply it extends, the new ones,
and what the template's short history needs (rendering.short_history). `ChatRequestIn` keeps
each message as the msgpack bytes it came in (`msgspec.Raw`: a slice of the request, no
copy) and `Messages` turns one into a dict the first time it is read. The raw digest
(conversation.raw_digest) hashes those bytes as they came, the very bytes a re-encoding of
the decoded dicts gives (msgpack is canonical for what JSON can carry), so a digest is the
same whichever way the request was decoded.

A message that is not a JSON object is found when it is read: `InvalidMessage`, a 400 for
the agent (the gateway's own schema check keeps such a request off the bus).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, overload

import msgspec

from shared.messages import ChatRequest

_message = msgspec.msgpack.Decoder(dict[str, Any])


class InvalidMessage(ValueError):
    pass


class ChatRequestIn(ChatRequest, tag="ChatRequest"):
    """ChatRequest as the trajectory manager decodes it (`decode(data, ChatRequestIn)`): the same
    wire form, its `messages` a Messages of the raw bytes. Raises msgspec.DecodeError as
    `decode(data, ChatRequest)` does (ValidationError for another type or a wrong field)."""

    messages: list[msgspec.Raw] = []  # type: ignore[assignment]

    def __post_init__(self) -> None:  # decoded, the raw messages are read through a Messages
        self.messages = Messages(self.messages)  # type: ignore[assignment]


class Messages(Sequence[dict[str, Any]]):
    """The request's messages: raw bytes each, a dict once read (and kept). A slice is a
    Messages too; `+` with a list gives a list of dicts."""

    __slots__ = ("raws", "_dicts", "_base")

    def __init__(self, raws: list[msgspec.Raw], dicts: list[dict[str, Any] | None] | None = None,
                 base: int = 0) -> None:
        self.raws = raws
        self._dicts = dicts if dicts is not None else [None] * len(raws)
        self._base = base  # where this slice starts in the request: for the error message only

    def __len__(self) -> int:
        return len(self.raws)

    @overload
    def __getitem__(self, i: int) -> dict[str, Any]: ...
    @overload
    def __getitem__(self, i: slice) -> Messages: ...

    def __getitem__(self, i):
        if isinstance(i, slice):
            start = i.indices(len(self.raws))[0]
            return Messages(self.raws[i], self._dicts[i], self._base + start)
        m = self._dicts[i]
        if m is None:
            try:
                m = self._dicts[i] = _message.decode(self.raws[i])
            except msgspec.DecodeError as e:
                n = self._base + (i if i >= 0 else len(self.raws) + i)
                raise InvalidMessage(f"messages[{n}] is not a message object: {e}") from None
        return m

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for i in range(len(self.raws)):
            yield self[i]

    def __add__(self, other: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        return list(self) + list(other)

    def __radd__(self, other: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        return list(other) + list(self)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and not isinstance(other, str) and list(self) == list(other)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Messages({len(self.raws)})"

