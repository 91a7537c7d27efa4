"""kvtierd's log lines: one event, one line, whatever a client sent.

A message may quote what a client chose (a model name, a tenant, an error text echoed
back): a newline in it would start a line of the client's making (a forged ``ERROR``), an
escape sequence would drive the operator's terminal. :class:`LineFormatter` writes every
control character of a message as an escape (``\\n``, ``\\r``, ``\\x1b``); a traceback
keeps its lines, its exception's message escaped as a message is. When stderr is the
journal's stream each line starts with its syslog priority (``<3>`` for an error,
sd-daemon(3)), so that ``journalctl -p warning`` shows the daemon's warnings.
"""

from __future__ import annotations

import logging
import os
import traceback
from types import TracebackType

__all__ = ["LineFormatter", "escape_controls", "stderr_is_journal", "syslog_priority"]

_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}
_ESCAPES = {
    c: _NAMED.get(chr(c), f"\\x{c:02x}")
    for c in (*range(0x20), 0x7F, *range(0x80, 0xA0), 0x2028, 0x2029)
}


def escape_controls(text: str) -> str:
    """``text`` with every C0/C1 control character (and the Unicode line and paragraph
    separators) written as a visible escape."""
    return text.translate(_ESCAPES)


def stderr_is_journal(fd: int = 2) -> bool:
    """Whether ``fd`` is the stream systemd connected to the journal: ``$JOURNAL_STREAM``
    names its device and inode (systemd.exec(5)). A unit whose stderr goes to a file or a
    terminal has no such match, and keeps its timestamps and no priority prefixes."""
    dev, _, ino = os.environ.get("JOURNAL_STREAM", "").partition(":")
    try:
        st = os.fstat(fd)
        return (int(dev), int(ino)) == (st.st_dev, st.st_ino)
    except (ValueError, OSError):
        return False


def syslog_priority(levelno: int) -> int:
    """The syslog priority of a logging level: 7 debug, 6 info, 4 warning, 3 error, 2
    critical (a level between two takes the lower one's)."""
    if levelno >= logging.CRITICAL:
        return 2
    if levelno >= logging.ERROR:
        return 3
    if levelno >= logging.WARNING:
        return 4
    if levelno >= logging.INFO:
        return 6
    return 7


class LineFormatter(logging.Formatter):
    """A formatter whose message part is one line (control characters escaped).

    Args:
        fmt: the line's format (``%(message)s`` and the usual fields).
        priority: start each line with ``<N>``, its syslog priority (for journald); a
            traceback's lines too.
    """

    def __init__(self, fmt: str, priority: bool = False) -> None:
        super().__init__(fmt)
        self._priority = priority

    def formatMessage(self, record: logging.LogRecord) -> str:
        """The line, its message escaped."""
        record.message = escape_controls(record.message)
        return super().formatMessage(record)

    def formatException(
        self,
        ei: tuple[type[BaseException], BaseException, TracebackType | None]
        | tuple[None, None, None],
    ) -> str:
        """The traceback, its frames as Python writes them and each exception's own line
        (type and message, which may quote a client) escaped: one line each."""
        if ei[0] is None:
            return ""
        lines: list[str] = []
        for chunk in traceback.TracebackException(*ei).format():
            # the header and the line that chains two exceptions are Python's own; an
            # indented chunk (a frame, an exception group's margin-led lines) keeps its lines,
            # each escaped; the rest ("Type: message") may quote a client: one line
            text = chunk[:-1] if chunk.endswith("\n") else chunk
            if chunk.startswith(("Traceback ", "\n")):
                lines.append(text)
            elif chunk.startswith(" "):
                lines.extend(escape_controls(line) for line in text.split("\n"))
            else:
                lines.append(escape_controls(text))
        return "\n".join(lines)

    def format(self, record: logging.LogRecord) -> str:
        """The line and its traceback, if any; each with its priority under systemd."""
        text = super().format(record)
        if not self._priority:
            return text
        tag = f"<{syslog_priority(record.levelno)}>"
        return "\n".join(tag + line for line in text.split("\n"))
