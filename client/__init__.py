"""kvtier's engine-side library: what an inference engine links to use kvtierd.

- :mod:`~kvtier.client.connection`: the connections to kvtierd (the engine's session, its
  request codec and replies, transfers in flight; the admin client; the KV event subscriber);
- :mod:`~kvtier.client.kv_pool`: the engine's KV memory as kvtierd reaches it (a paged pool in
  shared or GPU memory, or any memory described as regions);
- :mod:`~kvtier.client.staging`: the engine-side copy path through a host staging area;
- :mod:`~kvtier.client.radix`: the L1 radix tree;
- :mod:`~kvtier.client.cache`: the cache manager (L1 over L2, HiCache's write policies);
- :mod:`~kvtier.client.page_keys`: the page key chain every process computes alike;
- :mod:`~kvtier.client.adapters`: the vLLM connector and the SGLang HiCache backend.
"""
