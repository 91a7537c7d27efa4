"""The engine-side copy path (``copy_mode = "engine"``): a host staging area kvtierd maps
(:mod:`~kvtier.client.staging.area`) and the engine's copies between its KV cache and it
(:mod:`~kvtier.client.staging.copies`)."""
