"""Misconfigurations stop SGLang at start with a message saying what to change."""

from __future__ import annotations

import pytest
from sglang_harness import extra_config

pytestmark = pytest.mark.timeout(300)


def test_refusals_name_the_fix(instances, module_tmp) -> None:
    extra = extra_config(module_tmp / "nodaemon")
    no_shm = {k: v for k, v in extra.items() if k != "allocator"}
    inst = instances(
        "config",
        "page_first",
        extra,
        only_attempts=True,
        attempts=[
            {"extra": no_shm},
            {"extra": {**extra, "runtim_dir": "/tmp"}},
            {"extra": {**extra, "request_timeout_s": -1}},
        ],
    )
    no_shm_rep, typo_rep, bad_value_rep = (inst.reply(), inst.reply(), inst.reply())
    assert "HostPoolError" in no_shm_rep["refused"]
    assert '"allocator": "shm"' in no_shm_rep["refused"]
    assert "SettingsError" in typo_rep["refused"] and "runtim_dir" in typo_rep["refused"]
    assert "request_timeout_s" in bad_value_rep["refused"]
