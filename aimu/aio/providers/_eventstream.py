"""The AWS event stream (``application/vnd.amazon.eventstream``): binary frames, checked.

Each message is a 12-byte prelude (total length, headers length, the prelude's CRC32),
typed headers, a payload and the CRC32 of everything before it, all big-endian. Both
checksums are checked before a message is read; a length out of bounds, a checksum
that does not match or a header that runs past its block is a :class:`FrameError`.

A small decoder of our own (``zlib.crc32``) rather than botocore's ``EventStreamBuffer``:
the provider reads the stream as bytes arrive, in its own loop and its own errors, and
needs no botocore on its read path (the bare client of ``benchmarks/bench_wire.py``
uses botocore's parser, so both are measured).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

__all__ = ["MAX_MESSAGE", "EventMessage", "FrameError", "decode", "split"]

#: The largest message AWS sends (its limit: 16 MiB of payload, 128 KiB of headers).
MAX_MESSAGE = 16 * 1024 * 1024 + 128 * 1024 + 16
_PRELUDE = 12
_MIN_MESSAGE = _PRELUDE + 4
# header value type -> its fixed size (-1: a 2-byte length, then that many bytes)
_SIZES = {0: 0, 1: 0, 2: 1, 3: 2, 4: 4, 5: 8, 6: -1, 7: -1, 8: 8, 9: 16}


class FrameError(ValueError):
    """The bytes are not a well-formed event stream message (the words say why)."""


@dataclass(frozen=True, slots=True)
class EventMessage:
    """One message: its string headers (``:event-type``, ``:message-type``...) and payload."""

    headers: dict[str, str]
    payload: bytes


def _length(buffer: bytes | memoryview, start: int) -> int:
    """The total length of the message at ``start`` (its prelude checked)."""
    prelude = buffer[start:start + _PRELUDE]
    if zlib.crc32(prelude[:8]) != int.from_bytes(prelude[8:12], "big"):
        raise FrameError("a message's prelude failed its CRC32 check")
    total = int.from_bytes(prelude[:4], "big")
    headers = int.from_bytes(prelude[4:8], "big")
    if not _MIN_MESSAGE <= total <= MAX_MESSAGE or headers > total - _MIN_MESSAGE:
        raise FrameError(f"a message's prelude gives impossible lengths ({total}, {headers})")
    return total


def split(buffer: bytes) -> tuple[list[bytes], bytes]:
    """The whole messages at the head of ``buffer`` (their preludes checked), and the
    bytes of a message still to come."""
    messages: list[bytes] = []
    start = 0
    size = len(buffer)
    while size - start >= _PRELUDE:
        total = _length(buffer, start)
        if size - start < total:
            break
        messages.append(buffer[start:start + total])
        start += total
    return messages, buffer[start:]


def decode(message: bytes) -> EventMessage:
    """One whole message, its checksums checked; string headers kept, others skipped."""
    if len(message) < _MIN_MESSAGE:
        raise FrameError(f"the stream ended in the middle of a message ({len(message)} bytes)")
    total = _length(message, 0)
    if total != len(message):
        raise FrameError(f"the stream ended in the middle of a message ({len(message)} of "
                         f"{total} bytes)")
    if zlib.crc32(memoryview(message)[:-4]) != int.from_bytes(message[-4:], "big"):
        raise FrameError("a message failed its CRC32 check")
    end = _PRELUDE + int.from_bytes(message[4:8], "big")
    headers: dict[str, str] = {}
    at = _PRELUDE
    while at < end:
        width = message[at]
        name = message[at + 1:at + 1 + width]
        at += 1 + width
        if at >= end:
            raise FrameError("a message's header runs past its headers")
        kind = message[at]
        size = _SIZES.get(kind)
        if size is None:
            raise FrameError(f"a message's header has unknown type {kind}")
        at += 1
        if size < 0:
            size = int.from_bytes(message[at:at + 2], "big")
            at += 2
        if at + size > end:
            raise FrameError("a message's header runs past its headers")
        if kind == 7:
            headers[name.decode("utf-8", "replace")] = message[at:at + size].decode(
                "utf-8", "replace"
            )
        at += size
    return EventMessage(headers, message[end:-4])
