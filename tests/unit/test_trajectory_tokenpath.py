"""Token paths spliced as msgpack bytes: the same ids as list concatenation, at every header size."""

from __future__ import annotations

import random

import msgspec
import pytest

from services.trajectory.store import Alias
from services.trajectory.tokenpath import TokenPath, array_header, count
from shared.codec import decode, encode
from shared.messages import Generate, Sampling

_enc = msgspec.msgpack.Encoder()


# the array header changes size at 16 and 65,536 items: either side of both, for the path and the sum
@pytest.mark.parametrize("n", [0, 1, 15, 16, 65_535, 65_536])
@pytest.mark.parametrize("m", [0, 1, 3, 65_536])
def test_splicing_equals_list_concatenation(n, m):
    rng = random.Random(n * 7 + m)
    a = [rng.randrange(300_000) for _ in range(n)]  # fixint, uint8/16/32 encodings all occur
    b = [rng.randrange(300_000) for _ in range(m)]
    path = TokenPath.from_raw(_enc.encode(a)) + b
    assert len(path) == n + m and path.ids == a + b
    assert path.raw == _enc.encode(a + b)  # byte for byte what msgspec itself writes
    assert path.last == (a + b)[-1] if a + b else path.last is None


def test_a_wire_field_decodes_as_the_list_on_the_other_side():
    path = TokenPath.of([5, 6]) + [7, 300, 70_000]
    cmd = Generate("r.0", path.wire(), Sampling(max_tokens=4), session_id="s")
    got = decode(encode(cmd), Generate)
    assert got.prompt_ids == [5, 6, 7, 300, 70_000] and count(cmd.prompt_ids) == 5 == count(got.prompt_ids)


def test_last_is_the_callers_when_given_and_decoded_otherwise():
    raw = _enc.encode([1, 2, 3])
    assert TokenPath.from_raw(raw).last == 3
    assert TokenPath.from_raw(raw, last=3)._ids is None  # known: nothing decoded
    assert TokenPath.from_raw(_enc.encode([]), last=9).last is None


@pytest.mark.parametrize("raw", [b"", b"\x01", _enc.encode({"a": 1}), b"\xdc\x00"])
def test_bytes_that_are_no_array_are_refused(raw):
    with pytest.raises(ValueError):
        array_header(raw)


def test_an_alias_written_before_last_id_still_reads_and_an_older_reader_misses_not_fails():
    assert Alias.decode(b"4 rk tk") == Alias(4, "rk", "tk", None)
    alias = Alias(4, "rk", "tk", 128_001)
    assert Alias.decode(alias.encode().encode()) == alias
    tid, rk, tk = alias.encode().split(" ")  # what a replica from before last_id does with it
    assert (int(tid), rk) == (4, "rk") and tk != "tk"  # its turn-key check fails: the slow way, no error
