"""Images beside a task: bytes, paths or ``data:`` URLs checked, as ``data:`` URLs.

A user message holds its images inline, as ``data:image/...;base64,...`` URLs in its
``images`` list, so a transcript with images stays plain JSON that any store keeps and
``restore()`` takes back; each provider sends them as its wire takes them (Ollama's
``images``, OpenAI's content parts). Only PNG, JPEG, GIF and WebP are taken, up to
:data:`MAX_IMAGE_BYTES` each.
"""

from __future__ import annotations

import base64
import binascii
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Final, TypeGuard

__all__ = ["MAX_IMAGE_BYTES", "image_urls", "is_data_url", "received_images", "sniff"]

#: The largest image taken (the limit OpenAI's API and Ollama's server set for one image).
MAX_IMAGE_BYTES: Final = 20 * 1024 * 1024

_MAGIC: Final = (
    (b"\x89PNG\r\n\x1a\n", "image/png"),
    (b"\xff\xd8\xff", "image/jpeg"),
    (b"GIF87a", "image/gif"),
    (b"GIF89a", "image/gif"),
)


def is_data_url(image: object) -> TypeGuard[str]:
    return isinstance(image, str) and image.startswith("data:")


def received_images(images: Sequence[object]) -> list[str]:
    """Images that came from a client or another process: each must be a ``data:`` URL
    already, ValueError naming the first that is not (read as a path, it would be a file
    of this host's); their content is checked where they join a message."""
    for index, image in enumerate(images):
        if not is_data_url(image):
            raise ValueError(f"image {index}: send it as a data:image/...;base64,... URL")
    return [image for image in images if is_data_url(image)]  # each one, checked above


def sniff(data: bytes) -> str | None:
    """The MIME type of an image from its first bytes, or None if it is none we take."""
    for magic, mime in _MAGIC:
        if data.startswith(magic):
            return mime
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    return None


def _read(image: object, index: int) -> tuple[bytes, str]:
    """The bytes of one image given as bytes, a ``data:`` URL or a path, and how to name
    it in an error."""
    if isinstance(image, bytes | bytearray | memoryview):
        return bytes(image), f"image {index}"
    if is_data_url(image):
        return _from_data_url(image, index), f"image {index} (a data: URL)"
    if isinstance(image, str | os.PathLike):
        path = Path(image)
        name = f"image {index} ({str(path)[-80:]!r})"
        try:
            size = path.stat().st_size
            if size > MAX_IMAGE_BYTES:
                raise ValueError(_too_large(name, size))
            return path.read_bytes(), name
        except FileNotFoundError:
            raise ValueError(f"{name}: no such file") from None
        except IsADirectoryError:
            raise ValueError(f"{name}: a directory, not an image file") from None
        except PermissionError:
            raise ValueError(f"{name}: not readable (permission denied)") from None
    raise TypeError(
        f"image {index} must be bytes, a path or a data: URL, got {type(image).__name__}"
    )


def _from_data_url(url: str, index: int) -> bytes:
    """The bytes of a ``data:<type>;base64,<data>`` URL (as a transcript keeps them)."""
    head, comma, data = url.partition(",")
    if not comma or not head.endswith(";base64"):
        raise ValueError(f"image {index}: a data: URL must be data:<type>;base64,<data>")
    if len(data) > (MAX_IMAGE_BYTES + 2) // 3 * 4:
        raise ValueError(_too_large(f"image {index}", len(data) * 3 // 4))
    try:
        return base64.b64decode(data, validate=True)
    except binascii.Error:
        raise ValueError(f"image {index}: the data: URL's base64 does not decode") from None


def _too_large(name: str, size: int) -> str:
    return (
        f"{name} is {size / 1_048_576:.1f} MB, more than the "
        f"{MAX_IMAGE_BYTES // 1_048_576} MB an image may be; scale it down"
    )


def image_urls(images: Sequence[object]) -> list[str]:
    """Each image (bytes, or a path to read) as a ``data:`` URL; ValueError or TypeError
    naming the image (its index, its path) that is missing, too large or not an image."""
    urls: list[str] = []
    for index, image in enumerate(images):
        data, name = _read(image, index)
        if len(data) > MAX_IMAGE_BYTES:
            raise ValueError(_too_large(name, len(data)))
        mime = sniff(data)
        if mime is None:
            raise ValueError(f"{name} is not an image aimu can send (PNG, JPEG, GIF or WebP)")
        urls.append(f"data:{mime};base64,{base64.b64encode(data).decode('ascii')}")
    return urls
