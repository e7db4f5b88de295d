"""The pack file format: append-only files holding many chunk records.

    pack   = file header (16 bytes) + record*
    header = b"LZPACK\\0\\1" + u64 reserved
    record = record header (32 bytes) + stored bytes
    record header = b"LZCK" | chunk id (16) | codec u8 | 3 pad | plain_len u32 | stored_len u32

Records repeat what the index says, so a read can check that the index points
at the record it thinks (id and lengths), and `verify` or a future index
rebuild can walk a pack without the index. Index offsets point at the stored
bytes, i.e. just past the record header.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

PACK_MAGIC = b"LZPACK\x00\x01"
PACK_HEADER = PACK_MAGIC + bytes(8)
PACK_HEADER_SIZE = len(PACK_HEADER)

RECORD_MAGIC = b"LZCK"
_RECORD = struct.Struct(">4s16sB3xII")
RECORD_HEADER_SIZE = _RECORD.size  # 32

MAX_CHUNK_SIZE = 64 << 20


@dataclass(frozen=True, slots=True)
class RecordHeader:
    chunk_id: bytes
    codec: int
    plain_len: int
    stored_len: int


def encode_record_header(chunk_id: bytes, codec: int, plain_len: int, stored_len: int) -> bytes:
    return _RECORD.pack(RECORD_MAGIC, chunk_id, codec, plain_len, stored_len)


def decode_record_header(raw: bytes | memoryview) -> RecordHeader | None:
    """Parse a record header; None when the bytes are not one."""
    if len(raw) < RECORD_HEADER_SIZE:
        return None
    magic, cid, codec, plain_len, stored_len = _RECORD.unpack_from(raw)
    if magic != RECORD_MAGIC:
        return None
    return RecordHeader(bytes(cid), codec, plain_len, stored_len)
