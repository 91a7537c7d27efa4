"""The L2 host pool, pure (no asyncio, no threads, no I/O but the mapped pool file).

One module per concept: ``host_pool`` (HostPool), ``pages`` (the page table and its state
machine), ``eviction``, ``slots``, ``links`` (intrusive lists), ``layout`` (the pool
file's format), ``meta`` (the mapped metadata), ``adopt`` (the restart scan), ``records``.
"""
