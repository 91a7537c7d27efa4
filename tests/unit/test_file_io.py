"""``kvtier.kernels.file_io``: checksummed page I/O, native (C, GIL released per batch) and
pure Python, against each other and against the tests' own XXH3
(``tests/xxh3_reference.py``)."""

from __future__ import annotations

import os
import shutil
import sysconfig
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from kvtier.kernels import file_io

from tests.xxh3_reference import xxh3_64

try:
    from kvtier.kernels import _fileio  # type: ignore[attr-defined]
except ImportError:  # the optional extension was not built
    _fileio = None

needs_native = pytest.mark.skipif(
    _fileio is None,
    reason="kvtier.kernels._fileio was not built (no C compiler or no "
    "xxhash.h when kvtier was installed; `make venv` installs libxxhash-dev)",
)

IMPLS: list[tuple[str, Callable, Callable]] = [
    ("python", file_io.py_write_pages, file_io.py_read_pages)
]
if _fileio is not None:
    IMPLS.append(("native", _fileio.write_pages, _fileio.read_pages))


@pytest.fixture
def fd(tmp_path: Path) -> Iterator[int]:
    f = os.open(tmp_path / "pages.bin", os.O_RDWR | os.O_CREAT, 0o600)
    yield f
    os.close(f)


def noise(n: int, seed: int = 0) -> bytearray:
    return bytearray(np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes())


@pytest.mark.parametrize("length", [1, 7, 4096, 65537, 256 * 1024])
@pytest.mark.parametrize("name,write,read", IMPLS, ids=[i[0] for i in IMPLS])
def test_round_trip_checksums_equal_the_reference_xxh3(
    fd: int, name: str, write: Callable, read: Callable, length: int
) -> None:
    src = noise(3 * length + 100, seed=length)
    offsets = [0, 100, 2 * length + 100]
    positions = [5 * length, 0, 9 * length + 3]
    expected = [xxh3_64(bytes(src[o : o + length])) for o in offsets]
    assert write(fd, src, offsets, length, positions) == expected
    dst = bytearray(len(src))
    assert read(fd, dst, offsets, length, positions) == expected
    assert [dst[o : o + length] for o in offsets] == [src[o : o + length] for o in offsets]


@needs_native
def test_native_and_python_agree_on_the_same_file(fd: int) -> None:
    src, length = noise(1 << 20, seed=7), 1 << 16
    offsets = list(range(0, 1 << 20, length))
    positions = [i * length for i in reversed(range(len(offsets)))]
    assert _fileio.write_pages(fd, src, offsets, length, positions) == file_io.py_write_pages(
        fd, src, offsets, length, positions
    )
    a, b = bytearray(len(src)), bytearray(len(src))
    assert _fileio.read_pages(fd, a, offsets, length, positions) == file_io.py_read_pages(
        fd, b, offsets, length, positions
    )
    assert a == b == src


@pytest.mark.parametrize("name,write,read", IMPLS, ids=[i[0] for i in IMPLS])
def test_a_short_read_past_the_end_is_none(
    fd: int, name: str, write: Callable, read: Callable
) -> None:
    src = noise(8192)
    assert write(fd, src, [0], 4096, [0])[0] is not None
    dst = bytearray(8192)
    assert read(fd, dst, [0, 4096], 4096, [0, 2048]) == [
        xxh3_64(bytes(src[:4096])),
        None,
    ]  # only 2048 bytes left at 2048


@pytest.mark.parametrize("name,write,read", IMPLS, ids=[i[0] for i in IMPLS])
def test_a_closed_descriptor_fails_each_page(
    tmp_path: Path, name: str, write: Callable, read: Callable
) -> None:
    f = os.open(tmp_path / "x", os.O_RDWR | os.O_CREAT, 0o600)
    os.close(f)
    assert write(f, bytearray(8192), [0, 4096], 4096, [0, 4096]) == [None, None]
    assert read(f, bytearray(8192), [0], 4096, [0]) == [None]


@pytest.mark.parametrize("name,write,read", IMPLS, ids=[i[0] for i in IMPLS])
@pytest.mark.parametrize(
    "offsets,length,positions,match",
    [
        ([4097], 4096, [0], "offsets\\[0\\] = 4097"),
        ([-1], 16, [0], "offsets\\[0\\] = -1"),
        ([0], 16, [-5], "positions\\[0\\] = -5"),
        ([0, 16], 16, [0], "2 offsets but 1 positions"),
        ([0], 0, [0], "length = 0"),
    ],
)
def test_bad_arguments_raise_before_any_io(
    fd: int,
    name: str,
    write: Callable,
    read: Callable,
    offsets: list[int],
    length: int,
    positions: list[int],
    match: str,
) -> None:
    buf = bytearray(8192)
    for fn in (write, read):
        with pytest.raises(ValueError, match=match):
            fn(fd, buf, offsets, length, positions)
    assert os.fstat(fd).st_size == 0  # nothing was written


@needs_native
@pytest.mark.timeout(60)
def test_native_batch_runs_without_the_gil(fd: int) -> None:
    # Another thread makes one read_pages call, which fills the destination page by page;
    # this thread keeps looking at the first byte of every page. Seeing the destination part
    # filled (some pages landed, others not yet) means this thread ran Python in the middle
    # of that one C call. A batch that held the GIL would let it look only before the first
    # page lands or after the last, never in between. One such look is enough; the further
    # tries only cover a batch during which this thread was not scheduled at all.
    length, n, tries = 1 << 20, 64, 50
    os.pwrite(fd, b"\xff" * (n * length), 0)
    dst = bytearray(n * length)
    firsts = slice(0, n * length, length)  # the first byte of every page
    places = [i * length for i in range(n)]
    landed: set[int] = set()  # how many pages had landed, at each look

    def read(done: threading.Event) -> None:
        _fileio.read_pages(fd, dst, places, length, places)
        done.set()

    for _ in range(tries):
        dst[firsts] = bytes(n)
        done = threading.Event()
        t = threading.Thread(target=read, args=(done,))
        t.start()
        while not done.is_set():
            landed.add(dst[firsts].count(0xFF))
        t.join()
        assert dst[firsts] == b"\xff" * n
        if any(0 < k < n for k in landed):
            return
    pytest.fail(f"never saw a batch part done in {tries} batches: looked at {sorted(landed)}")


def test_native_io_is_built_where_its_build_dependencies_are() -> None:
    include = Path("/usr/include/xxhash.h")
    if not include.exists() or shutil.which(sysconfig.get_config_var("CC").split()[0]) is None:
        pytest.skip("no xxhash.h or no C compiler here: the pure-Python path is the one in use")
    assert _fileio is not None, "kvtier.kernels._fileio should have been built: reinstall kvtier"
    assert file_io.BUILT and file_io.in_use()


@needs_native
def test_the_file_io_switch_sends_the_calls_to_the_python_path(
    fd: int, native_off, monkeypatch
) -> None:
    """Turned off (kvtier.kernels.native), write_pages and read_pages run in Python; on
    again, in C. The Python functions are wrapped to see which one ran."""
    ran: list[str] = []
    for name in ("py_write_pages", "py_read_pages"):
        real = getattr(file_io, name)
        monkeypatch.setattr(
            file_io, name, lambda *a, _real=real, _name=name: ran.append(_name) or _real(*a)
        )
    src = bytearray(range(256)) * 4
    back = bytearray(len(src))
    native_off("file_io")
    assert not file_io.in_use()
    sums = file_io.write_pages(fd, src, [0, 512], 512, [0, 4096])
    assert file_io.read_pages(fd, back, [0, 512], 512, [0, 4096]) == sums
    assert ran == ["py_write_pages", "py_read_pages"] and back == src
    native_off()
    assert file_io.in_use()
    assert file_io.write_pages(fd, src, [0, 512], 512, [0, 4096]) == sums
    assert file_io.read_pages(fd, back, [0, 512], 512, [0, 4096]) == sums
    assert ran == ["py_write_pages", "py_read_pages"]  # the C calls ran this time
