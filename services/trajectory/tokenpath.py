"""Token paths kept as the msgpack bytes Redis stores and the worker reads (pure).

A turn's prompt is its parent turn's token path (cached in Redis as a msgpack array of ints) plus
the few tokens the chat template adds for the new messages. Decoding a 5,000-token path into Python
ints and encoding it again for the in-flight state, the Generate and the next cached path cost a
turn at turn 200 ~0.15 ms more than a turn at turn 10 (BENCHMARKS.md). A msgpack array is
a header and its items back to back, so `path + more` is header(n + m), the path's items and the
new items' bytes: copied, never decoded.

    path = TokenPath.from_raw(raw_from_redis, last=alias.last_id)
    prompt = path + continuation_ids        # bytes spliced
    Generate(prompt_ids=prompt.wire(), ...)  # the same bytes on the wire: the worker decodes list[int]

The ids are decoded only where Python needs them (a resume, a walk, a test), once.
"""

from __future__ import annotations

from typing import Any

import msgspec

_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder(list[int])


def _header(n: int) -> bytes:
    if n < 16:
        return bytes((0x90 | n,))
    if n < 1 << 16:
        return b"\xdc" + n.to_bytes(2, "big")
    return b"\xdd" + n.to_bytes(4, "big")


def array_header(raw: bytes | memoryview) -> tuple[int, int]:
    """(items, header bytes) of the msgpack array `raw` starts with."""
    if not raw:
        raise ValueError("empty bytes: not a msgpack array")
    b = raw[0]
    if 0x90 <= b <= 0x9F:
        return b & 0x0F, 1
    if b == 0xDC and len(raw) >= 3:
        return int.from_bytes(raw[1:3], "big"), 3
    if b == 0xDD and len(raw) >= 5:
        return int.from_bytes(raw[1:5], "big"), 5
    raise ValueError(f"not a msgpack array (first byte {b:#04x})")


def count(ids: list[int] | msgspec.Raw | Any) -> int:
    """How many ids a Generate's `prompt_ids` holds: a list, or a Raw msgpack array (TokenPath.wire)."""
    if isinstance(ids, msgspec.Raw):
        return array_header(memoryview(ids))[0]
    return len(ids)


class TokenPath:
    """A sequence of token ids held as its msgpack array, its Python list, or both (each made once,
    when first asked for). `last` is the final id, known without decoding when the caller knows it."""

    __slots__ = ("_raw", "_ids", "_n", "_last")

    def __init__(self, raw: bytes | None, ids: list[int] | None, n: int, last: int | None):
        self._raw, self._ids, self._n, self._last = raw, ids, n, last

    @classmethod
    def of(cls, ids: list[int]) -> "TokenPath":
        return cls(None, ids, len(ids), ids[-1] if ids else None)

    @classmethod
    def from_raw(cls, raw: bytes, last: int | None = None) -> "TokenPath":
        """A msgpack array of ints (raises ValueError if `raw` is not an array); `last`, if known,
        saves decoding it to learn the final id."""
        n, _ = array_header(raw)
        return cls(raw, None, n, last if n else None)

    def __len__(self) -> int:
        return self._n

    def __repr__(self) -> str:
        return f"TokenPath({self._n} ids)"

    def __eq__(self, other: object) -> bool:
        if isinstance(other, TokenPath):
            return self.ids == other.ids
        if isinstance(other, list):
            return self.ids == other
        return NotImplemented

    __hash__ = None  # mutable-looking value: equal to lists, so unhashable like them

    @property
    def ids(self) -> list[int]:
        if self._ids is None:
            self._ids = _dec.decode(self._raw)
        return self._ids

    @property
    def raw(self) -> bytes:
        if self._raw is None:
            self._raw = _enc.encode(self._ids)
        return self._raw

    @property
    def last(self) -> int | None:
        if self._last is None and self._n:
            self._last = self.ids[-1]
        return self._last

    def wire(self) -> msgspec.Raw:
        """For a message field typed list[int]: msgspec copies these bytes as they are."""
        return msgspec.Raw(self.raw)

    def __add__(self, more: list[int]) -> "TokenPath":
        if not more:
            return self
        if not self._n:
            return TokenPath.of(list(more))
        raw, m = memoryview(self.raw), _enc.encode(more)
        _, h = array_header(raw)
        _, mh = array_header(m)
        n = self._n + len(more)
        return TokenPath(b"".join((_header(n), raw[h:], memoryview(m)[mh:])), None, n, more[-1])
