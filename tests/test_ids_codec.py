from __future__ import annotations

import os

import blake3
import pytest
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from chunkstore import ChunkId, TrustDomain
from chunkstore.codec import ChunkCodec, Codec, CodecError
from chunkstore.digests import Digest, digest_key, is_digest
from chunkstore.errors import BadDigest


def test_chunk_id_is_xxh3_128_of_plain_bytes() -> None:
    data = b"hello world"
    cid = ChunkId.of(data)
    assert bytes(cid) == xxhash.xxh3_128_digest(data)
    assert str(cid) == xxhash.xxh3_128_hexdigest(data)
    assert len(str(cid)) == 32
    assert ChunkId.from_hex(str(cid)) == cid


@pytest.mark.parametrize("bad", ["", "xyz", "0" * 31, "0" * 33, "g" * 32])
def test_chunk_id_rejects_malformed_hex(bad: str) -> None:
    with pytest.raises(ValueError, match="chunk id"):
        ChunkId.from_hex(bad)


def test_chunk_id_rejects_wrong_length() -> None:
    with pytest.raises(ValueError, match="16 bytes"):
        ChunkId(b"short")


def test_trust_domain_rejects_bad_names() -> None:
    for bad in ["", "a\0b", "x" * 300]:
        with pytest.raises(ValueError, match="trust domain"):
            TrustDomain(bad)


def test_incompressible_data_is_stored_raw() -> None:
    codec = ChunkCodec(3)
    data = os.urandom(100_000)
    kind, stored = codec.encode(data)
    assert kind == Codec.RAW and stored == data
    assert codec.decode(kind, stored, len(data)) == data


def test_compressible_data_is_zstd() -> None:
    codec = ChunkCodec(3)
    data = b"abc" * 100_000
    kind, stored = codec.encode(data)
    assert kind == Codec.ZSTD and len(stored) < len(data) // 100
    assert codec.decode(kind, stored, len(data)) == data


def test_decode_rejects_wrong_codec_and_garbage() -> None:
    codec = ChunkCodec(3)
    with pytest.raises(CodecError, match="unknown codec byte 7"):
        codec.decode(7, b"xx", 2)
    with pytest.raises(CodecError, match="zstd"):
        codec.decode(Codec.ZSTD, b"not zstd at all", 100)
    _, stored = codec.encode(b"a" * 1000)
    with pytest.raises(CodecError):
        codec.decode(Codec.ZSTD, stored, 999)


@given(st.binary(max_size=5000), st.integers(1, 19))
def test_codec_round_trip(data: bytes, level: int) -> None:
    codec = ChunkCodec(level)
    kind, stored = codec.encode(data)
    assert codec.decode(kind, stored, len(data)) == data


def test_digest_is_blake3_of_bytes_and_round_trips_through_its_key() -> None:
    d = Digest.of(b"hello")
    assert d == "blake3:" + blake3.blake3(b"hello").hexdigest()
    assert d.hex == blake3.blake3(b"hello").hexdigest() and d.matches(b"hello")
    assert not d.matches(b"hello!")
    assert Digest.parse(str(d)) == d and isinstance(Digest.parse(str(d)), Digest)
    assert d.key() == "blake3-" + d.hex and "/" not in d.key() and ":" not in d.key()
    assert Digest.from_key(d.key()) == d and digest_key(str(d)) == d.key()


@pytest.mark.parametrize("bad", ["", "blake3:", "blake3:xyz", "sha256:" + "0" * 64,
                                 "blake3:" + "A" * 64, "blake3:" + "0" * 63,
                                 "blake3:" + "0" * 64 + "/../x", "blake3:" + "0" * 65])
def test_digest_parse_rejects_malformed_with_one_clear_line(bad: str) -> None:
    with pytest.raises(BadDigest) as e:
        Digest.parse(bad)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("not a BLAKE3 digest (blake3:<64 hex digits>)")
    assert isinstance(e.value, ValueError)
    with pytest.raises(BadDigest):
        Digest.from_key(bad.replace(":", "-"))


def test_is_digest_is_the_spelling_only() -> None:
    assert is_digest("blake3:" + "0" * 64) and is_digest("blake3:zz")
    assert not is_digest("app:1") and not is_digest("registry/blake3:1")
