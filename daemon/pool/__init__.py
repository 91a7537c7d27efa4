"""The L2 host pool: index, slots, on-disk layout, adoption (pure; no asyncio)."""
