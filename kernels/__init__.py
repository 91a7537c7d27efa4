"""Page copy operations between an engine's KV buffers and the daemon's host arena.

``kvtier.kernels.plan`` checks and coalesces a transfer's page and slot pairs once (both back ends
start from it); ``kvtier.kernels.page_copy`` is the CPU implementation (numpy strided copies and
``memmove``); ``kvtier.kernels.cuda_copy`` has the same signatures for CUDA engine buffers (plan in
``cuda_plan``; DMA by default, ``cuda_segments`` planning its byte segments and ``cuda_dma``
issuing them; the copy kernel in ``cuda_kernel``) and imports cupy only when used.
"""

from kvtier.kernels.page_copy import (
    CopyPlan,
    IndexArray,
    PageCopyError,
    copy_layer_from_host,
    copy_layer_kv_from_host,
    copy_layer_kv_to_host,
    copy_layer_to_host,
    copy_layers_from_host,
    copy_layers_to_host,
)

__all__ = [
    "CopyPlan",
    "IndexArray",
    "PageCopyError",
    "copy_layer_from_host",
    "copy_layer_kv_from_host",
    "copy_layer_kv_to_host",
    "copy_layer_to_host",
    "copy_layers_from_host",
    "copy_layers_to_host",
]
