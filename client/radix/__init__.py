"""The engine-side L1 index: a radix tree over page-aligned token runs
(:mod:`~kvtier.client.radix.tree`), its nodes, what its operations return, and the full
structural check its tests run."""
