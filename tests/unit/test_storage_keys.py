"""Names of pages in a flat key space: ``<prefix>:<ns hex>:<key hex>``."""

from __future__ import annotations

import fnmatch
import hashlib

import pytest
from kvtier.daemon.storage.keys import ObjectNames

pytestmark = pytest.mark.timeout(10)

NS = hashlib.sha256(b"namespace").digest()
KEY = hashlib.sha256(b"page").digest()


def test_a_name_is_prefix_namespace_key_and_parses_back() -> None:
    names = ObjectNames("kvtier")
    name = names.name(NS, KEY)
    assert name == f"kvtier:{NS.hex()}:{KEY.hex()}"
    assert names.names(NS, [KEY, NS]) == [name, f"kvtier:{NS.hex()}:{NS.hex()}"]
    assert names.encoded(NS, [KEY]) == [name.encode()]
    assert names.parse(name) == (NS, KEY)
    assert names.parse(name.encode()) == (NS, KEY)


def test_a_prefix_with_colons_parses() -> None:
    names = ObjectNames("team:a")
    assert names.parse(names.name(NS, KEY)) == (NS, KEY)
    assert ObjectNames("team").parse(names.name(NS, KEY)) is None


@pytest.mark.parametrize(
    "name",
    [
        "kvtier:health",
        f"other:{NS.hex()}:{KEY.hex()}",
        f"kvtierx:{NS.hex()}:{KEY.hex()}",
        f"kvtier:{NS.hex()}",
        f"kvtier:{NS.hex()}:{KEY.hex()[:-1]}",
        f"kvtier:{NS.hex().upper()}:{KEY.hex()}",
        f"kvtier:{NS.hex()}:{KEY.hex()}:extra",
        f"kvtier::{KEY.hex()}",
        b"kvtier:\xff:00",
    ],
)
def test_names_that_are_not_pages_parse_as_none(name: str | bytes) -> None:
    assert ObjectNames("kvtier").parse(name) is None


def test_the_pattern_matches_its_pages_only_even_with_glob_characters() -> None:
    names = ObjectNames("a*[b]?")
    mine = names.name(NS, KEY)
    other_ns = ObjectNames("a*[b]?").name(KEY, KEY)
    lookalike = ObjectNames("aXbY").name(NS, KEY)
    everything = names.pattern()
    one_ns = names.pattern(NS)

    # fnmatch has no backslash escapes; Redis globs do: translate the escapes to [x] classes
    def redis_glob(pattern: str) -> str:
        out, i = "", 0
        while i < len(pattern):
            if pattern[i] == "\\":
                out += f"[{pattern[i + 1]}]"
                i += 2
            else:
                out += pattern[i]
                i += 1
        return out

    assert fnmatch.fnmatchcase(mine, redis_glob(everything))
    assert fnmatch.fnmatchcase(other_ns, redis_glob(everything))
    assert not fnmatch.fnmatchcase(lookalike, redis_glob(everything))
    assert fnmatch.fnmatchcase(mine, redis_glob(one_ns))
    assert not fnmatch.fnmatchcase(other_ns, redis_glob(one_ns))
