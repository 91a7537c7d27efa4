"""The switch of kvtier's C kernels (kvtier.kernels.native): one setting, one place.

``native_off`` is a daemon setting like any other (TOML, ``KVTIER_NATIVE_OFF``, a flag),
checked by the config model; :func:`~kvtier.kernels.native.configure` applies it to the
process, and the kernels' modules ask it at each call.
"""

from __future__ import annotations

import pytest
from kvtier.config import ConfigError, DaemonConfig
from kvtier.config.loader import load_config
from kvtier.kernels import guarded_copy, native


def test_configure_turns_the_named_kernels_off_and_returns_what_was_off(native_off) -> None:
    assert native.turned_off() == frozenset()
    assert native.configure(["file_io", "region_copy"]) == frozenset()
    assert not native.enabled("file_io") and not native.enabled("region_copy")
    assert native.enabled("guarded_copy")
    assert native.configure([]) == {"file_io", "region_copy"}
    assert all(native.enabled(k) for k in native.KERNELS)


def test_an_unknown_kernel_is_refused_by_name_and_changes_nothing(native_off) -> None:
    native_off("file_io")
    with pytest.raises(
        ValueError,
        match=r"native_off: 'fileio' is not a kernel \(known: "
        r"copy_threads, file_io, guarded_copy, region_copy\)",
    ):
        native.configure(["fileio"])  # type: ignore[list-item]
    assert native.turned_off() == {"file_io"}


def test_the_setting_comes_from_the_environment_like_any_other() -> None:
    cfg = load_config(DaemonConfig, env={"KVTIER_NATIVE_OFF": '["guarded_copy", "file_io"]'})
    assert cfg.native_off == ["guarded_copy", "file_io"]
    assert load_config(DaemonConfig, env={}).native_off == []


def test_a_bad_value_names_the_setting_its_source_and_the_value() -> None:
    with pytest.raises(
        ConfigError,
        match=r"native_off\.0 = 'gpu' \(from environment variable "
        r"KVTIER_NATIVE_OFF\)",
    ):
        load_config(DaemonConfig, env={"KVTIER_NATIVE_OFF": '["gpu"]'})


def test_the_retired_variables_are_refused_not_ignored() -> None:
    """KVTIER_PURE_PYTHON_IO and KVTIER_NO_GUARDED_COPY were read at import by the kernels'
    modules; a daemon given one now says it knows no such setting."""
    for var in ("KVTIER_PURE_PYTHON_IO", "KVTIER_NO_GUARDED_COPY"):
        with pytest.raises(ConfigError, match=f"unknown environment variable {var}"):
            load_config(DaemonConfig, env={var: "1"})


@pytest.mark.skipif(not guarded_copy.BUILT, reason="kvtier.kernels._guarded was not built")
def test_guarded_and_region_copies_follow_their_switches(native_off) -> None:
    assert guarded_copy.available() and guarded_copy.strided()
    native_off("guarded_copy")
    assert not guarded_copy.available() and guarded_copy.strided()
    with pytest.raises(RuntimeError, match="turned off"):
        guarded_copy.copy_pages([1], [2], 8)
    native_off("region_copy")
    assert guarded_copy.available() and not guarded_copy.strided()
    native_off()
    assert guarded_copy.available() and guarded_copy.strided()
