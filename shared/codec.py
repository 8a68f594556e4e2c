"""The one codec: msgpack via msgspec, with encoders and decoders built once per type."""

from __future__ import annotations

from functools import lru_cache
from typing import Any, TypeVar

import msgspec

T = TypeVar("T")

_encoder = msgspec.msgpack.Encoder()


def encode(msg: Any) -> bytes:
    return _encoder.encode(msg)


@lru_cache(maxsize=None)
def _decoder(tp: Any) -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(tp)


def decode(data: bytes, tp: type[T]) -> T:
    """Decode `data` as `tp` (a Struct or a tagged union). Raises msgspec.ValidationError."""
    return _decoder(tp).decode(data)
