"""kvtierd's log lines: control characters escaped, journald priorities, refusals once a
minute (:mod:`kvtier.daemon.log_lines`, :mod:`kvtier.daemon.service.refusal_log`)."""

from __future__ import annotations

import io
import logging
import os

import pytest
from kvtier.daemon.log_lines import (
    LineFormatter,
    escape_controls,
    stderr_is_journal,
    syslog_priority,
)
from kvtier.daemon.service.refusal_log import MAX_KEYS, REPEAT_S, RefusalLog
from kvtier.daemon.storage.options import redact_url, redact_value


def _logger(formatter: logging.Formatter) -> tuple[logging.Logger, io.StringIO]:
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(formatter)
    logger = logging.getLogger(f"kvtier.test.{id(out)}")
    logger.handlers[:] = [handler]
    logger.propagate = False
    logger.setLevel(logging.DEBUG)
    return logger, out


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("m\nERROR forged", "m\\nERROR forged"),
        ("a\rb", "a\\rb"),
        ("\x1b[2Kx", "\\x1b[2Kx"),
        ("nul\x00", "nul\\x00"),
        ("c1\x85", "c1\\x85"),
        ("sep\u2028x", "sep\\x2028x"),
        ("plain – ünïcode", "plain – ünïcode"),
    ],
)
def test_escape_controls(text, want):
    """Every control character becomes a visible escape; other text is left as it is."""
    assert escape_controls(text) == want


def test_a_message_is_one_line_and_a_traceback_keeps_its_lines():
    """A client's string in a message cannot start a line; an exception's traceback does."""
    logger, out = _logger(LineFormatter("%(levelname)s %(message)s"))
    logger.info("model %s registered", "m\nERROR kvtier.daemon: forged")
    try:
        raise ValueError("boom")
    except ValueError:
        logger.exception("failed")
    lines = out.getvalue().splitlines()
    assert lines[0] == "INFO model m\\nERROR kvtier.daemon: forged registered"
    assert lines[1] == "ERROR failed"
    assert lines[2].startswith("Traceback")
    assert lines[-1] == "ValueError: boom"


def test_an_exceptions_message_in_a_traceback_stays_on_its_line():
    """An exception's message may quote a client (a key, a model name): in a traceback it is
    escaped as a message is, so it cannot forge a line; a chained exception's traceback
    keeps its lines."""
    logger, out = _logger(LineFormatter("%(levelname)s %(message)s"))
    try:
        try:
            raise ValueError("bad model 'm\nERROR kvtier.daemon: forged'")
        except ValueError as err:
            raise KeyError("\x1b[2Kgone") from err
    except KeyError:
        logger.exception("failed")
    lines = out.getvalue().splitlines()
    assert "ValueError: bad model 'm\\nERROR kvtier.daemon: forged'" in lines
    assert not any(line.startswith("ERROR kvtier.daemon: forged") for line in lines)
    assert lines[-1] == "KeyError: '\\x1b[2Kgone'"
    assert sum(line.startswith("Traceback") for line in lines) == 2
    assert "The above exception was the direct cause of the following exception:" in lines


def test_the_journal_is_recognised_by_its_stream(tmp_path, monkeypatch):
    """Priorities go to the journal only: ``$JOURNAL_STREAM`` must name stderr's own device
    and inode (a unit whose stderr goes to a file keeps plain lines)."""
    with open(tmp_path / "err", "wb") as f, open(tmp_path / "other", "wb") as g:
        st, other = os.fstat(f.fileno()), os.fstat(g.fileno())
        monkeypatch.setenv("JOURNAL_STREAM", f"{st.st_dev}:{st.st_ino}")
        assert stderr_is_journal(f.fileno())
        assert not stderr_is_journal(g.fileno())
        monkeypatch.setenv("JOURNAL_STREAM", f"{other.st_dev}:{other.st_ino}")
        assert not stderr_is_journal(f.fileno())
        for bad in ("", "x:y", "12", ":"):
            monkeypatch.setenv("JOURNAL_STREAM", bad)
            assert not stderr_is_journal(f.fileno())
        monkeypatch.delenv("JOURNAL_STREAM")
        assert not stderr_is_journal(f.fileno())


def test_under_systemd_every_line_carries_its_priority():
    """With ``priority``, each line (a traceback's too) starts with ``<N>``."""
    logger, out = _logger(LineFormatter("%(message)s", priority=True))
    logger.debug("d")
    logger.info("i")
    logger.warning("w")
    try:
        raise RuntimeError("x")
    except RuntimeError:
        logger.error("e", exc_info=True)
    logger.critical("c")
    lines = out.getvalue().splitlines()
    assert lines[:4] == ["<7>d", "<6>i", "<4>w", "<3>e"]
    assert all(line.startswith("<3>") for line in lines[4:-1])
    assert lines[-1] == "<2>c"
    assert [syslog_priority(n) for n in (5, 15, 25, 35, 45, 55)] == [7, 7, 6, 4, 3, 2]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_refusal_is_logged_once_a_minute_with_the_count_of_those_held():
    """The first refusal of a kind is logged; the next ones within :data:`REPEAT_S` only
    counted; the first after it logged with that count. Another kind has its own turn."""
    logger, out = _logger(logging.Formatter("%(message)s"))
    clock = Clock()
    refusals = RefusalLog(logger, clock)
    assert refusals.log(logging.INFO, ("refused", 1000), "refused %d", 1)
    for i in range(5):
        clock.now += 1
        assert not refusals.log(logging.INFO, ("refused", 1000), "refused %d", i)
    assert refusals.log(logging.INFO, ("refused", 1001), "other uid")
    clock.now += REPEAT_S
    assert refusals.log(logging.INFO, ("refused", 1000), "refused %d", 9)
    clock.now += REPEAT_S
    assert refusals.log(logging.INFO, ("refused", 1000), "refused %d", 10)
    assert out.getvalue().splitlines() == [
        "refused 1",
        "other uid",
        "refused 9 (5 more like it not logged in the last 60s)",
        "refused 10",
    ]


def test_refusal_kinds_remembered_are_bounded():
    """A sender changing its key each time cannot grow the table past :data:`MAX_KEYS`."""
    logger, _ = _logger(logging.Formatter("%(message)s"))
    refusals = RefusalLog(logger, Clock())
    for i in range(MAX_KEYS + 10):
        refusals.log(logging.INFO, i, "x")
    assert len(refusals._seen) == MAX_KEYS


def test_a_level_not_logged_is_not_counted():
    logger, out = _logger(logging.Formatter("%(message)s"))
    logger.setLevel(logging.WARNING)
    refusals = RefusalLog(logger, Clock())
    assert not refusals.log(logging.INFO, "k", "x")
    assert out.getvalue() == "" and not refusals._seen


@pytest.mark.parametrize(
    ("value", "want"),
    [
        ("redis://kv:pw@h:6379/0", "redis://kv:***@h:6379/0"),
        ("redis://h/0?password=pw&db=1", "redis://h/0?password=***&db=1"),
        ({"url": "redis://u:pw@h", "port": 1}, {"url": "redis://u:***@h", "port": 1}),
        ({"password": "pw", "x": ["http://a:b@c"]}, {"password": "***", "x": ["http://a:***@c"]}),
        ({"api_token": 5}, {"api_token": "***"}),
        ("no url", "no url"),
        ("alice:s3cret@redis-host:6379/0", "alice:***@redis-host:6379/0"),  # no scheme
        ({"url": "alice:s3cret@h:1"}, {"url": "alice:***@h:1"}),
        ("ops@example.com", "ops@example.com"),
    ],
)
def test_redact_value(value, want):
    """What an error quotes of a backend's settings never holds a password or a token."""
    assert redact_value(value) == want
    if isinstance(value, str):
        assert redact_url(value) == want


@pytest.mark.parametrize(
    ("text", "secret"),
    [
        ('{"url": "redis://kv:s3cret@h:1/0"', "s3cret"),
        ('{"url": "redis://h/0?password=s3cret&db=1", ', "s3cret"),
        ('{"password": "s3cret", "x": 1', "s3cret"),
        ('{"api_token": 12345', "12345"),
    ],
)
def test_broken_extra_config_text_is_quoted_without_its_secrets(text, secret):
    """A JSON extra config that does not parse is quoted in the error (it names the value),
    its passwords and tokens masked."""
    from kvtier.config.errors import ConfigError
    from kvtier.daemon.storage.options import parse_extra_config

    with pytest.raises(ConfigError) as err:
        parse_extra_config(text)
    assert "***" in str(err.value) and secret not in str(err.value)
