"""Extra-config keys of the ``file`` backend."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from kvtier.daemon.storage.file.segments import ALIGN
from pydantic import BaseModel, ByteSize, ConfigDict, Field, field_validator

__all__ = ["FileBackendConfig"]


class FileBackendConfig(BaseModel):
    """Extra-config keys of the ``file`` backend (unknown keys are refused)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    path: Path
    """The store directory (required); created if missing."""
    capacity: ByteSize = Field(default=ByteSize(16 * 2**30), ge=2 * ALIGN)
    """Most bytes of segment files: an int or a string such as ``"16GiB"``. Segments are
    created lazily up to it, then LRU evicts. A store reopened smaller keeps its segments."""
    segment_bytes: ByteSize = Field(default=ByteSize(256 * 2**20), ge=2 * ALIGN)
    """Most bytes of one segment file; a segment always holds at least one slot."""
    fsync: Literal["never", "batch"] = "never"
    """``"never"``: writes stay in the page cache, which survives a crash of the daemon but
    not a power loss. ``"batch"``: ``fdatasync`` the touched segments before a put batch
    reports success; durable, at a fraction of the write bandwidth."""

    @field_validator("path", mode="before")
    @classmethod
    def _names_a_directory(cls, value: object) -> object:
        if isinstance(value, (str, os.PathLike)):
            text = os.fspath(value)
            if not text:
                raise ValueError("must name a directory")
            if "\x00" in str(text):
                raise ValueError("a path cannot contain a NUL byte")
        return value
