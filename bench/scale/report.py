"""The table and the plot of ``kvtier bench scale`` (:mod:`kvtier.bench.scale`).

One table, every ratio next to the two figures it divides; the plot (``--plot PNG``,
matplotlib from the ``plot`` extra) draws the N-engine curves: aggregate L2 GB/s and the
memcpy baseline against N, and their ratio.
"""

from __future__ import annotations

from typing import Any

from kvtier.bench.scale.baselines import ScaleBenchError

__all__ = ["RATIOS", "plot", "print_table"]

RATIOS = (
    "transfer_fixed_cost_over_lookup_rtt",
    "transfer_64_over_memcpy",
    "l2_aggregate_over_memcpy_8",
    "l2_aggregate_over_cpu_bound_8",
    "daemon_cpu_s_per_gb_over_memcpy",
    "lookup_throughput_over_echo_8",
    "lookup_8192_over_echo",
    "load_8192_over_memcpy",
    "stall_lookup_p99_over_idle",
    "leave_lookup_max_after_over_p99_before",
    "million_lookup_p50_over_small",
)
"""The scalar ratios (``l2_aggregate_over_memcpy`` is a dict of them, one per N)."""


def _rows(r: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """``(metric, kvtier, baseline, ratio)`` rows."""
    rows = []
    for size, us in r["transfer_load_us_p50"].items():
        rows.append(
            (
                f"load {size} pages: us p50 / GB/s",
                f"{us:.0f} / {r['transfer_load_gbps'][size]:.2f}",
                "",
                "",
            )
        )
    for size, us in r["transfer_store_us_p50"].items():
        rows.append(
            (
                f"store {size} pages: us p50 / GB/s",
                f"{us:.0f} / {r['transfer_store_gbps'][size]:.2f}",
                "",
                "",
            )
        )
    rows += [
        (
            "transfer fixed cost (1-page load) vs 1-key lookup rtt, us",
            f"{r['transfer_fixed_cost_us']:.0f}",
            f"{r['lookup_rtt_us_p50']:.0f}",
            f"{r['transfer_fixed_cost_over_lookup_rtt']:.2f}",
        ),
        (
            "64-page load vs memcpy, GB/s",
            f"{r['transfer_load_gbps']['64']:.2f}",
            f"{r['transfer_memcpy_gbps']:.2f}",
            f"{r['transfer_64_over_memcpy']:.2f}",
        ),
    ]
    for n, g in r["l2_aggregate_gbps"].items():
        rows.append(
            (
                f"{n} engines: L2 aggregate vs memcpy, GB/s",
                f"{g:.2f}",
                f"{r['l2_memcpy_gbps'][n]:.2f}",
                f"{r['l2_aggregate_over_memcpy'][n]:.2f}",
            )
        )
    for n, cpu in r["l2_cpu_s_per_gb"].items():
        rows.append(
            (
                f"{n} engines: CPU s per GB, daemon / engines; all CPUs at that cost, GB/s",
                f"{cpu['daemon']:.2f} / {cpu['engines']:.2f}",
                f"{r['l2_cpu_bound_gbps'][n]:.2f}",
                "",
            )
        )
    n = r["lookup_clients"]
    long = r["long_context_pages"]
    top = str(max(int(n) for n in r["l2_aggregate_gbps"]))
    rows += [
        (
            f"{top} engines: L2 aggregate vs what the CPU per GB allows, GB/s",
            f"{r['l2_aggregate_gbps'][top]:.2f}",
            f"{r['l2_cpu_bound_gbps'][top]:.2f}",
            f"{r['l2_aggregate_over_cpu_bound_8']:.2f}",
        ),
        (
            "daemon CPU s per GB moved vs memcpy shm <-> memfd",
            f"{r['daemon_cpu_s_per_gb']:.3f}",
            f"{r['memcpy_cpu_s_per_gb']:.3f}",
            f"{r['daemon_cpu_s_per_gb_over_memcpy']:.2f}",
        ),
        (
            "  the same, engines' sessions opened and closed included",
            f"{r['daemon_cpu_s_per_gb_with_sessions']:.3f}",
            f"{r['memcpy_cpu_s_per_gb']:.3f}",
            f"{r['daemon_cpu_s_per_gb_with_sessions_over_memcpy']:.2f}",
        ),
        (
            f"{n} engines: lookups/s vs echoes/s",
            f"{r['lookups_per_s']}",
            f"{r['echo_per_s']}",
            f"{r['lookup_throughput_over_echo_8']:.2f}",
        ),
        (
            f"lookup of {long} keys vs echo, us p50",
            f"{r['lookup_long_us_p50']:.0f}",
            f"{r['echo_long_us_p50']:.0f}",
            f"{r['lookup_8192_over_echo']:.2f}",
        ),
        (
            f"load of {long} pages vs memcpy, GB/s",
            f"{r['load_long_gbps']:.2f}",
            f"{r['load_long_memcpy_gbps']:.2f}",
            f"{r['load_8192_over_memcpy']:.2f}",
        ),
        (
            f"64-key lookup p99 while another engine stores {r['stall_store_pages']}-page chains "
            + "into the full pool vs idle, us",
            f"{r['stall_lookup_busy_us_p99']:.0f}",
            f"{r['stall_lookup_idle_us_p99']:.0f}",
            f"{r['stall_lookup_p99_over_idle']:.2f}",
        ),
        (
            f"STORE of {r['stall_store_pages']} pages into the full pool: accepted after, ms p50",
            f"{r['stall_store_accept_ms_p50']:.1f}",
            "",
            "",
        ),
        (
            f"64-key lookup, worst in the second after an engine of "
            f"{r['leave_engine_bytes'] >> 20} MiB leaves vs p99 before, us",
            f"{r['leave_lookup_max_after_us']:.0f}",
            f"{r['leave_lookup_p99_before_us']:.0f}",
            f"{r['leave_lookup_max_after_over_p99_before']:.2f}",
        ),
        ("that engine's UNREGISTER, ms", f"{r['leave_unregister_ms']:.1f}", "", ""),
        (
            f"{r['million_pages']} pages: lookup p50 vs small pool, us",
            f"{r['million_lookup_p50_us']:.0f}",
            f"{r['million_small_lookup_p50_us']:.0f}",
            f"{r['million_lookup_p50_over_small']:.2f}",
        ),
        ("store into empty pool, pages/s", f"{r['million_store_pages_per_s']}", "", ""),
        ("store into full pool, evictions/s", f"{r['million_evict_pages_per_s']}", "", ""),
        (
            "adopt after SIGKILL (health + all found), s",
            f"{r['million_adopt_seconds']:.2f}",
            "",
            "",
        ),
        (
            "daemon RSS beyond shared memory, MiB (per page, B)",
            (
                f"{r['million_rss_beyond_pool_bytes'] / 2**20:.0f} "
                f"({r['million_rss_per_page_bytes']:.0f})"
            ),
            "",
            "",
        ),
    ]
    return rows


def print_table(r: dict[str, Any]) -> None:
    """Print the results as one table: metric, kvtier's figure, the baseline, the ratio."""
    from rich.console import Console
    from rich.table import Table

    t = Table(
        title=f"kvtier bench scale ({r['page_bytes'] >> 10} KiB pages, "
        f"{r['copy_threads']} copy threads, {r['cpu_count']} CPUs)"
    )
    t.add_column("metric")
    t.add_column("kvtier", justify="right")
    t.add_column("baseline", justify="right")
    t.add_column("ratio", justify="right")
    try:
        rows = _rows(r)
    except KeyError:  # some parts did not run (--only): every figure there is, by name
        rows = [(k, str(v), "", "") for k, v in r.items()]
    for row in rows:
        t.add_row(*row)
    Console(width=120).print(t)


def plot(r: dict[str, Any], path: str) -> None:
    """Draw aggregate L2 GB/s, memcpy GB/s and their ratio against N engines to ``path``.

    Raises:
        ScaleBenchError: matplotlib is not installed.
    """
    try:
        import matplotlib
    except ImportError as err:
        raise ScaleBenchError("--plot needs matplotlib: pip install 'kvtier[plot]'") from err

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ns = [int(n) for n in r["l2_aggregate_gbps"]]
    fig, (bw, ratio) = plt.subplots(1, 2, figsize=(10, 4))
    bw.plot(ns, list(r["l2_aggregate_gbps"].values()), "o-", label="kvtier L2 (store + load)")
    bw.plot(
        ns, list(r["l2_memcpy_gbps"].values()), "s--", label=f"memcpy, {r['copy_threads']} threads"
    )
    bw.set(xlabel="engine processes", ylabel="GB/s", title="aggregate bandwidth", xticks=ns)
    bw.legend()
    ratio.plot(ns, list(r["l2_aggregate_over_memcpy"].values()), "o-")
    ratio.axhline(1.0, color="grey", linewidth=0.8)
    ratio.set(xlabel="engine processes", ylabel="L2 / memcpy", title="ratio", xticks=ns)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
