"""The connector's ``kv_connector_extra_config`` is checked when vLLM starts it."""

from __future__ import annotations

from pathlib import Path

import pytest
from kvtier.client.adapters.vllm.settings import ConnectorSettings, SettingsError


def test_keys_reach_the_client_settings():
    s = ConnectorSettings.from_extra_config(
        {
            "runtime_dir": "/run/kvtier",
            "cache_salt": "x",
            "request_timeout_s": 0.5,
            "min_load_pages": 2,
            "prefetch_policy": "wait_complete",
            "layerwise_loads": False,
        }
    )
    assert s.client.runtime_dir == Path("/run/kvtier") and s.client.cache_salt == "x"
    assert s.client.request_timeout_s == 0.5
    assert (s.min_load_pages, s.prefetch_policy, s.layerwise_loads) == (2, "wait_complete", False)
    default = ConnectorSettings.from_extra_config(None)
    assert default.client.request_timeout_s == 2.0 and default.layerwise_loads


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"runtime_dri": "/run/kvtier"}, "runtime_dri"),
        ({"prefetch_policy": "eager"}, "prefetch_policy"),
        ({"request_timeout_s": -1}, "request_timeout_s"),
        ({"retry_interval_s": 0}, "retry_interval_s"),
        ({"retry_interval_s": "abc"}, "retry_interval_s"),
        ({"retry_interval_s": float("inf")}, "retry_interval_s"),
        ({"request_timeout_s": float("inf")}, "request_timeout_s"),
        ({"endpoint": "bogus"}, "endpoint"),
        ({"min_load_pages": 1.5}, "min_load_pages"),
        ({"layerwise_loads": "yes"}, "layerwise_loads"),
        ({"copy_mode": "kernel"}, "copy_mode"),
        ({"staging_pages": 0}, "staging_pages"),
        ({"staging_pages": 1.5}, "staging_pages"),
        ({"staging_pages": 1 << 40}, "staging_pages"),
        ({"staging_wait_s": -0.1}, "staging_wait_s"),
        ({"staging_wait_s": "1"}, "staging_wait_s"),
    ],
)
def test_a_bad_key_or_value_is_refused_by_name(extra, named):
    with pytest.raises(SettingsError, match=named):
        ConnectorSettings.from_extra_config(extra)


def test_copy_mode_settings_and_what_each_platform_runs():
    from kvtier.client.adapters.vllm.copy_mode import copy_mode_for, layout_for

    s = ConnectorSettings.from_extra_config(
        {"copy_mode": "engine", "staging_pages": 64, "staging_wait_s": 0}
    )
    assert (s.copy_mode, s.staging_pages, s.staging_wait_s) == ("engine", 64, 0.0)
    assert ConnectorSettings.from_extra_config(None).copy_mode == "auto"
    assert [copy_mode_for(m, "cpu") for m in ("auto", "daemon", "engine")] == [
        "daemon",
        "daemon",
        "engine",
    ]
    # CUDA: the engine copies (the daemon's CUDA path is not wired into the connector)
    assert [copy_mode_for(m, "cuda") for m in ("auto", "daemon", "engine")] == [
        "engine",
        None,
        "engine",
    ]
    assert copy_mode_for("auto", "xpu") is None
    assert layout_for("cpu") == "vllm_cpu" and layout_for("cuda") == "vllm_cuda"


def test_engine_tensors_are_staged_in_vllms_logical_block_order():
    import torch
    from kvtier.client.adapters.vllm.copy_mode import engine_parts
    from kvtier.ipc.protocol import Geometry

    g = Geometry(
        num_layers=1, page_size=16, kv_heads=2, head_dim=8, dtype="bfloat16", layout="vllm_cpu"
    )
    lbhnc = torch.zeros(5, 2, 16, 16)
    assert [p.shape for p in engine_parts(lbhnc, g)] == [(5, 2, 16, 16)]
    lbnhc = torch.zeros(5, 16, 2, 16).permute(0, 2, 1, 3)  # CUDA's default: NHD in memory
    (part,) = engine_parts(lbnhc, g)
    assert part.shape == (5, 2, 16, 16) and part.data_ptr() == lbnhc.data_ptr()
    with pytest.raises(ValueError, match=r"shape \(2, 5, 16, 2, 8\)"):
        engine_parts(torch.zeros(2, 5, 16, 2, 8), g)  # an older FlashAttention layout
