"""The engine-facing cache manager (:mod:`~kvtier.client.cache.manager`): the L1 radix tree
over kvtierd's L2, a request's match and load, HiCache's write policies and the STOREs they
start, and the counters the engine and the benchmarks report."""
