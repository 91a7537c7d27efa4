"""The ``kvtier`` commands' argument checking: a parser whose usage errors are one line, and
the argparse value types that refuse a bad value before anything runs or is sent.

Each type raises :class:`argparse.ArgumentTypeError` naming the value and what it must be;
argparse prefixes the flag (``argument --runs: '0' must be at least 1``) and
:class:`OneLineParser` turns that into a :class:`CliError` of code 2, which the command
prints as ``kvtier <command>: <message> (see kvtier <command> --help)``.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable
from typing import NoReturn

from kvtier.config import KvtierError

__all__ = [
    "SEQ_LIMIT",
    "CliError",
    "OneLineParser",
    "bounded_int",
    "directory",
    "non_negative_seconds",
    "positive_int",
    "positive_number",
    "positive_seconds",
    "sequence_number",
    "utf8_text",
]

SEQ_LIMIT = 2**64
"""Sequence numbers (KV event batches) are unsigned 64-bit integers: below this."""


class CliError(KvtierError):
    """A command failed; ``code`` is the exit status (1: daemon side, 2: usage)."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose usage errors are one line (a :class:`CliError`, code 2).

    argparse's own ``error`` prints the whole usage block and exits; a script or an operator
    reading the terminal wants the one line that names the flag. Subparsers made with
    ``add_subparsers().add_parser`` are of this class too (argparse's default).
    """

    def error(self, message: str) -> NoReturn:
        """Raise instead of printing the usage block and exiting."""
        raise CliError(2, f"{message} (see {self.prog} --help)")


def _finite(text: str, what: str, ok: Callable[[float], bool], must: str) -> float:
    """``text`` as a finite number for which ``ok`` holds; else ArgumentTypeError saying
    it is not ``what`` or that it ``must`` be something else."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
    if not (math.isfinite(value) and ok(value)):
        raise argparse.ArgumentTypeError(f"{text!r} must be {must}")
    return value


def positive_seconds(text: str) -> float:
    """argparse type: a finite number of seconds > 0."""
    return _finite(text, "a number of seconds", lambda v: v > 0, "a positive number of seconds")


def positive_number(text: str) -> float:
    """argparse type: a finite number > 0 (a rate, a factor)."""
    return _finite(text, "a number", lambda v: v > 0, "a finite number > 0")


def non_negative_seconds(text: str) -> float:
    """argparse type: a finite number of seconds >= 0 (where 0 has a meaning of its own,
    such as "never stop")."""
    return _finite(text, "a number of seconds", lambda v: v >= 0, "a finite number of seconds >= 0")


def bounded_int(low: int, high: int | None = None) -> Callable[[str], int]:
    """An argparse type: an integer in ``[low, high)`` (no upper bound when ``high`` is None).

    Args:
        low: the smallest value allowed.
        high: the first value refused above, or None.
    """

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{text!r} must be at least {low}")
        if high is not None and value >= high:
            raise argparse.ArgumentTypeError(f"{text!r} must be below {high}")
        return value

    return parse


positive_int = bounded_int(1)
"""argparse type: an integer >= 1."""

sequence_number = bounded_int(0, SEQ_LIMIT)
"""argparse type: a sequence number, 0 <= n < 2**64."""


def utf8_text(text: str) -> str:
    """argparse type: text that can be sent as UTF-8.

    A command line or environment holding bytes that are not UTF-8 reaches Python as lone
    surrogates (``os.fsdecode``), which every later ``encode()`` refuses with a traceback.
    The message shows the bytes as given and where the first bad one is.
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        at = len(text[: err.start].encode("utf-8"))  # the bytes before it are UTF-8
        raise argparse.ArgumentTypeError(
            f"{_as_given(text)!r} is not UTF-8 (undecodable byte at offset {at})"
        ) from None
    return text


def _as_given(text: str) -> bytes | str:
    """``text`` as the bytes it came from (``os.fsencode``), or itself when it has none."""
    try:
        return os.fsencode(text)
    except UnicodeError:
        return text


def directory(text: str) -> str:
    """argparse type: a path that names an existing directory."""
    if not os.path.isdir(text):
        what = "does not exist" if not os.path.exists(text) else "is not a directory"
        raise argparse.ArgumentTypeError(f"{text!r} {what}")
    return text
