"""GPU identity across processes: device UUIDs, and the ordinal a UUID has in this process.

Ordinals depend on each process's ``CUDA_VISIBLE_DEVICES``, so the engine and kvtierd name a GPU
by its UUID, written as ``nvidia-smi -L`` prints it (``GPU-8-4-4-4-12`` hex digits).
"""

from __future__ import annotations

import os
import re

import torch
from kvtier.ipc.cuda_runtime import CudaIpcError, cupy_module, ordinal_of, require_cuda

__all__ = [
    "UUID_BYTES",
    "device_ordinal",
    "device_uuid",
    "format_device_uuid",
    "parse_device_uuid",
]

UUID_BYTES = 16
"""Bytes of a device UUID."""
_UUID_RE = re.compile(
    r"^(?:gpu-|mig-)?([0-9a-f]{8})-?([0-9a-f]{4})-?([0-9a-f]{4})-?([0-9a-f]{4})"
    r"-?([0-9a-f]{12})$"
)


def format_device_uuid(raw: bytes) -> str:
    """Write a 16-byte device UUID as ``nvidia-smi -L`` does: ``GPU-xxxxxxxx-xxxx-...``.

    Raises:
        CudaIpcError: ``raw`` is not 16 bytes.
    """
    if not isinstance(raw, (bytes, bytearray)) or len(raw) != UUID_BYTES:
        raise CudaIpcError(f"a device UUID has {UUID_BYTES} bytes, got {raw!r}")
    h = bytes(raw).hex()
    return f"GPU-{h[0:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def parse_device_uuid(text: str) -> bytes:
    """The 16 bytes of a device UUID written as :func:`format_device_uuid` (or torch) writes it.

    Accepts an optional ``GPU-`` / ``MIG-`` prefix, any case, with or without dashes.

    Raises:
        CudaIpcError: ``text`` is not a device UUID.
    """
    m = _UUID_RE.match(text.strip().lower()) if isinstance(text, str) else None
    if m is None:
        raise CudaIpcError(
            f"device_uuid = {text!r} is not a GPU UUID (GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx)"
        )
    return bytes.fromhex("".join(m.groups()))


def device_uuid(device: torch.device | int | str) -> str:
    """The UUID of a visible GPU, formatted by :func:`format_device_uuid`.

    Asks torch first (its ``_CudaDeviceProperties.uuid``), then cupy (whose property dictionary
    loses UUIDs with a zero byte, so only a 16-byte answer is used).

    Raises:
        CudaUnavailable: no GPU.
        CudaIpcError: neither torch nor cupy reports the UUID.
    """
    require_cuda("device_uuid")
    ordinal = ordinal_of(device)
    uuid = getattr(torch.cuda.get_device_properties(ordinal), "uuid", None)
    if uuid is not None:
        raw = getattr(uuid, "bytes", None)
        if raw is not None and len(raw) == UUID_BYTES:
            return format_device_uuid(bytes(raw))
        return format_device_uuid(parse_device_uuid(str(uuid)))
    raw = cupy_module().cuda.runtime.getDeviceProperties(ordinal).get("uuid", b"")
    if isinstance(raw, bytes) and len(raw) == UUID_BYTES:
        return format_device_uuid(raw)
    raise CudaIpcError(f"cannot read the UUID of cuda:{ordinal} from torch or cupy")


def device_ordinal(uuid: str) -> int:
    """The ordinal, in this process, of the GPU with ``uuid``.

    Raises:
        CudaIpcError: ``uuid`` is malformed, or no visible GPU has it (the message lists the
            visible ones and ``CUDA_VISIBLE_DEVICES``).
    """
    want = parse_device_uuid(uuid)
    require_cuda("device_ordinal")
    seen = [device_uuid(i) for i in range(torch.cuda.device_count())]
    for i, u in enumerate(seen):
        if parse_device_uuid(u) == want:
            return i
    raise CudaIpcError(
        f"GPU {uuid} is not visible to this process (it sees {seen}; CUDA_VISIBLE_DEVICES="
        f"{os.environ.get('CUDA_VISIBLE_DEVICES', '(unset)')!r}); the engine and kvtierd must "
        "run on the same node and see the same GPU"
    )
