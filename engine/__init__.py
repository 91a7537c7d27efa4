"""kvtier's reference engine: a small Llama-style model over a paged KV pool, driving kvtier as
an inference engine's scheduler would (:mod:`~kvtier.engine.engine`), also in a process of its
own (:mod:`~kvtier.engine.worker`). Used by the demo, the benchmarks and the tests; no part of
the client library."""
