"""The connector's ``kv_connector_extra_config`` is checked when vLLM starts it."""

from __future__ import annotations

from pathlib import Path

import pytest
from kvtier.client.adapters.vllm_link import ConnectorSettings, SettingsError


def test_keys_reach_the_client_settings():
    s = ConnectorSettings.from_extra_config({"runtime_dir": "/run/kvtier", "cache_salt": "x",
                                             "request_timeout_s": 0.5, "min_load_pages": 2,
                                             "prefetch_policy": "wait_complete",
                                             "layerwise_loads": False})
    assert s.client.runtime_dir == Path("/run/kvtier") and s.client.cache_salt == "x"
    assert s.client.request_timeout_s == 0.5
    assert (s.min_load_pages, s.prefetch_policy, s.layerwise_loads) == (2, "wait_complete", False)
    default = ConnectorSettings.from_extra_config(None)
    assert default.client.request_timeout_s == 2.0 and default.layerwise_loads


@pytest.mark.parametrize(("extra", "named"), [
    ({"runtime_dri": "/run/kvtier"}, "runtime_dri"),
    ({"prefetch_policy": "eager"}, "prefetch_policy"),
    ({"request_timeout_s": -1}, "request_timeout_s"),
    ({"retry_interval_s": 0}, "retry_interval_s"),
    ({"layerwise_loads": "yes"}, "layerwise_loads"),
])
def test_a_bad_key_or_value_is_refused_by_name(extra, named):
    with pytest.raises(SettingsError, match=named):
        ConnectorSettings.from_extra_config(extra)
