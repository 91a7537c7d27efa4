"""kvtier benchmarks (`kvtier bench ...`)."""
