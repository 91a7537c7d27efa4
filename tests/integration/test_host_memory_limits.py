"""Host memory as a node gives it to a real kvtierd: huge pages, sparse and unsealed memfds,
descriptor and address-space limits.

What users are promised (docs/configuration.md ``pool_dir``/``hicache_size``; docs/architecture.md,
"Only the spans the regions use are mapped ... checked against max_mapped_bytes_per_user",
"a hole would be allocated by the populate, charged to the daemon"; daemon/service/quotas.py:
every resource a session makes the daemon hold is bounded, a REGISTER past a bound is BUSY
naming it; daemon/service/strain.py: a shortage fails the one request, never the daemon):

- a pool_dir the node can back starts the daemon, whatever its file system reports for "no
  limit";
- engine memory on huge pages is mapped when the node has the pages, and counted as mapped;
- the descriptors a session makes the daemon keep are bounded like its mappings;
- an address-space shortage refuses the one REGISTER with BUSY and the daemon serves on.

Huge-page tests reserve a few 2 MiB pages (``/proc/sys/vm/nr_hugepages``, root only) and give
them back at teardown; each mount is unmounted at teardown.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import resource
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from kvtier.client.connection.admin import AdminClient
from kvtier.client.connection.connection import Connection
from kvtier.client.kv_pool.regions import RegionMemory
from kvtier.launch.daemon_process import DaemonProcess
from kvtier.ipc import protocol as P

from tests.engines import SMALL, client_config, engine, fill_page, handover, page_bytes, tokens
from tests.servers import RawDealer

WAIT_S = 10.0
HUGE = 2 << 20
NR_HUGEPAGES = Path("/proc/sys/vm/nr_hugepages")


# ------------------------------------------------------------------------------ helpers


def healthy(d) -> None:
    assert d.proc is not None and d.proc.poll() is None, d.log_tail()
    with AdminClient(d.endpoint, timeout_s=5.0) as admin:
        status = admin.health().status
    assert status == "ok" or status.startswith("degraded"), status


@contextlib.contextmanager
def huge_pages(count: int) -> Iterator[None]:
    """Make ``count`` more 2 MiB huge pages free on the node for the block (skips when the
    kernel or the privileges do not allow it); the previous pool size is put back after."""
    try:
        before = int(NR_HUGEPAGES.read_text())
        NR_HUGEPAGES.write_text(str(before + count))
    except OSError as err:
        pytest.skip(f"cannot reserve huge pages here: {err}")
    try:
        free = 0
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("HugePages_Free:"):
                free = int(line.split()[1])
        if free < count:
            pytest.skip(f"the kernel gave only {free} free huge pages of {count} asked")
        yield
    finally:
        NR_HUGEPAGES.write_text(str(before))


@contextlib.contextmanager
def mounted(where: Path, fstype: str, options: str | None = None) -> Iterator[Path]:
    where.mkdir(parents=True, exist_ok=True)
    cmd = ["mount", "-t", fstype, *(["-o", options] if options else []), fstype, str(where)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount {fstype} here: {r.stderr.strip()}")
    try:
        yield where
    finally:
        for p in where.iterdir():
            with contextlib.suppress(OSError):
                p.unlink()
        if subprocess.run(["umount", str(where)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(where)], capture_output=True)


def hugetlb_memfd(size: int, name: str = "hugekv") -> int:
    try:
        fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_HUGETLB | os.MFD_ALLOW_SEALING)
    except OSError as err:
        pytest.skip(f"no MFD_HUGETLB here: {err}")
    os.ftruncate(fd, size)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    return fd


def per_buffer_memory(size: int, num_pages: int, offsets: list[int]) -> P.KVMemory:
    """SMALL's per-buffer export over one segment of ``size`` bytes."""
    n_buf = SMALL.num_layers * SMALL.components
    assert len(offsets) == n_buf
    return P.KVMemory(
        kind="fd",
        num_pages=num_pages,
        segments=[P.MemorySegment(name="kv", size=size)],
        buffer_segments=[0] * n_buf,
        buffer_offsets=offsets,
    )


def mapped_of(pid: int, name: str) -> int:
    """Bytes of the daemon's address space mapping memfd ``name`` now."""
    total = 0
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        if f"memfd:{name}" in line:
            lo, hi = line.split()[0].split("-")
            total += int(hi, 16) - int(lo, 16)
    return total


def daemon_fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


# ---------------------------------------------------------------- pool_dir on huge pages


@pytest.mark.timeout(90)
def test_a_pool_dir_on_a_hugetlbfs_mount_without_a_size_limit_starts(short_tmp):
    """A hugetlbfs mounted without ``size=`` (systemd's /dev/hugepages is such a mount) has no
    limit of its own: ``statvfs`` reports 0 blocks for "unlimited". With enough huge pages free
    for the pool, kvtierd with ``pool_dir`` there is expected to start and serve (or, if huge
    pages were not supported, to say so); it must not claim the file system holds "0 B in all"
    and exit 2 as for a setting no start could ever fit."""
    with (
        huge_pages(16),
        mounted(short_tmp / "huge", "hugetlbfs") as huge,
    ):
        d = DaemonProcess(
            short_tmp / "rd",
            [
                "--hicache-storage-backend", "none", "--hicache-size", "16MiB",
                "--extent-size", "4MiB", "--pool-dir", str(huge),
                "--state-dir", str(short_tmp / "state"),
            ],
        )  # fmt: skip
        try:
            try:
                d.start(timeout=40.0)
            except Exception as err:
                pytest.fail(f"kvtierd refused a pool_dir the node can back: {err}")
            pool, conn = engine(d.runtime_dir)
            try:
                fill_page(pool, 0, seed=4)
                keys = conn.page_keys(tokens(SMALL.page_size, salt=4))
                assert conn.store(keys, [0]).wait(WAIT_S)
                assert conn.load(keys, [1]).wait(WAIT_S)
                assert page_bytes(pool, 1) == page_bytes(pool, 0)
            finally:
                conn.close()
                pool.close()
        finally:
            if d.proc is not None:
                d.stop()
            d.remove_pool(huge)


# ---------------------------------------------------------------- engine memory on huge pages


@pytest.mark.timeout(60)
def test_a_huge_page_memfd_whose_buffers_start_off_a_huge_page_boundary_registers(daemon):
    """An engine keeps its KV in an ``MFD_HUGETLB`` memfd (the node has the huge pages) and
    its buffers start 4 KiB into it (a small header first). Every declared byte lies inside the
    segment, so REGISTER is expected to be served and pages to round-trip. The daemon maps
    only the span the regions use, widened to whole huge pages: a hugetlbfs mapping starts
    on one."""
    n, chunk = 64, SMALL.chunk_bytes
    n_buf = SMALL.num_layers * SMALL.components
    size = 4 * HUGE
    with huge_pages(8):
        fd = hugetlb_memfd(size)
        try:
            memory = per_buffer_memory(size, n, [4096 + i * n * chunk for i in range(n_buf)])
            mem = RegionMemory(SMALL, n, [fd], [size], memory.layout_regions(SMALL))
            conn = Connection(mem, model_id="huge-off", config=client_config(daemon.runtime_dir))
            view = mmap.mmap(fd, size)  # hugetlbfs has no write(): through a mapping
            try:
                payload = os.urandom(SMALL.page_bytes)
                for i, r in enumerate(memory.layout_regions(SMALL)):
                    view[r.offset : r.offset + chunk] = payload[i * chunk : (i + 1) * chunk]
                keys = conn.page_keys(tokens(SMALL.page_size, salt=8))
                assert conn.store(keys, [0]).wait(WAIT_S)
                assert conn.load(keys, [1]).wait(WAIT_S)
                got = b"".join(
                    view[r.offset + r.page_stride : r.offset + r.page_stride + chunk]
                    for r in memory.layout_regions(SMALL)
                )
                assert got == payload
            finally:
                view.close()
                conn.close()
        finally:
            os.close(fd)
    healthy(daemon)


@pytest.mark.timeout(60)
def test_huge_page_mappings_count_whole_huge_pages_against_max_mapped_bytes_per_user(
    daemon_factory,
):
    """``max_mapped_bytes_per_user`` bounds the bytes the daemon maps for one user (its
    address space). An engine's ``MFD_HUGETLB`` memfd holds its 8 buffers of 256 KiB each
    4 MiB apart: every window the daemon maps is a whole 2 MiB huge page, 16 MiB in all. With
    the bound at 4 MiB the REGISTER is expected to be refused BUSY naming the setting, or else
    the daemon to map no more than 4 MiB for it."""
    d = daemon_factory("--max-mapped-bytes-per-user", "4MiB")
    n = 64
    n_buf = SMALL.num_layers * SMALL.components
    spacing = 4 << 20
    size = n_buf * spacing
    with huge_pages(n_buf + 2):
        fd = hugetlb_memfd(size, "hugespread")
        try:
            memory = per_buffer_memory(size, n, [i * spacing for i in range(n_buf)])
            mem = RegionMemory(SMALL, n, [fd], [size], memory.layout_regions(SMALL))
            try:
                conn = Connection(mem, model_id="spread", config=client_config(d.runtime_dir))
            except Exception as err:
                assert "max_mapped_bytes_per_user" in str(err), err
                conn = None
            try:
                mapped = mapped_of(d.pid, "hugespread")
                assert mapped <= 4 << 20, (
                    f"the daemon maps {mapped} bytes of the engine's memory for one user, "
                    f"max_mapped_bytes_per_user = 4 MiB"
                )
            finally:
                if conn is not None:
                    conn.close()
        finally:
            os.close(fd)
    healthy(d)


# ----------------------------------------------------------- descriptors of unmapped memory


G64 = P.Geometry(num_layers=32, page_size=16, kv_heads=1, head_dim=16, dtype="float32")
"""64 K/V buffers of 1 KiB chunks: one memfd each, the most one handover carries."""


@pytest.mark.timeout(60)
def test_unsealed_memfds_copied_by_io_are_bounded_like_mappings(daemon_factory):
    """Without guarded copies (``native_off = ["guarded_copy"]``, or no C compiler at install)
    an unsealed memfd is never mapped: the daemon keeps a duplicate of its descriptor for the
    session's life instead. Those descriptors are expected to be bounded like mappings' (half
    the daemon's RLIMIT_NOFILE in all, quotas.py): a REGISTER past the bound is refused BUSY
    naming RLIMIT_NOFILE and the daemon never runs out of descriptors. They are not counted:
    at a limit of 256 two sessions of 64 memfds each take the daemon to its limit and the next
    REGISTER fails with an INTERNAL ``OSError(24, 'Too many open files')`` (a traceback in
    the log), while HEALTH still says ok."""
    d = daemon_factory(env={"KVTIER_NATIVE_OFF": '["guarded_copy"]'})
    n_buf = G64.num_layers * G64.components
    pages = 4
    size = pages * G64.chunk_bytes
    fds = []
    for _ in range(n_buf):
        fd = os.memfd_create("unsealed", os.MFD_CLOEXEC)
        os.ftruncate(fd, size)
        fds.append(fd)
    hard = resource.prlimit(d.pid, resource.RLIMIT_NOFILE)[1]
    resource.prlimit(d.pid, resource.RLIMIT_NOFILE, (256, hard))
    raw = RawDealer(d.endpoint, wait_s=WAIT_S)
    replies: list[P.Reply] = []
    try:
        for r in range(1, 6):
            memory = P.KVMemory(
                kind="fd",
                num_pages=pages,
                segments=[P.MemorySegment(name=f"s{i}", size=size) for i in range(n_buf)],
                buffer_segments=list(range(n_buf)),
                buffer_offsets=[0] * n_buf,
            )
            try:
                token = handover(d.runtime_dir, fds=fds)
            except Exception:
                break
            rep = raw.ask(
                P.encode(
                    P.Register(
                        req_id=r,
                        protocol_version=P.PROTOCOL_VERSION,
                        namespace=P.NamespaceSpec(f"io-{r}"),
                        geometry=G64,
                        memory=memory,
                        pid=os.getpid(),
                        handover=token,
                    )
                )
            )
            replies.append(rep)
            assert daemon_fd_count(d.pid) <= 256
        refusals = [x for x in replies if isinstance(x, P.ErrorReply)]
        assert refusals, "five sessions of 64 kept descriptors each under a limit of 256"
        for x in refusals:
            assert x.code == P.ErrorCode.BUSY and "RLIMIT_NOFILE" in x.message, x
    finally:
        raw.close()
        for fd in fds:
            os.close(fd)
    assert d.proc.poll() is None, d.log_tail()


# ----------------------------------------------------------------------- holes of a memfd


# ------------------------------------------------------------------ address space (guard)


@pytest.mark.timeout(60)
def test_a_register_past_the_daemons_address_space_is_busy_and_others_are_served(daemon):
    """With the daemon's RLIMIT_AS just above what it maps (as a node with
    ``vm.overcommit_memory = 2`` and little commit left would make mmap fail), an engine
    handing over 1 GiB is refused BUSY naming the shortage; HEALTH says degraded, the open
    session's pages still load byte-exact and a small engine still registers."""
    pool, c0 = engine(daemon.runtime_dir)
    big = -1
    try:
        fill_page(pool, 0, seed=21)
        k0 = c0.page_keys(tokens(SMALL.page_size, salt=21))
        assert c0.store(k0, [0]).wait(WAIT_S)
        vm = 0
        for line in Path(f"/proc/{daemon.pid}/status").read_text().splitlines():
            if line.startswith("VmSize:"):
                vm = int(line.split()[1]) * 1024
        resource.prlimit(daemon.pid, resource.RLIMIT_AS, (vm + (256 << 20), resource.RLIM_INFINITY))
        n_buf = SMALL.num_layers * SMALL.components
        n = (1 << 30) // (n_buf * SMALL.chunk_bytes)
        size = n_buf * n * SMALL.chunk_bytes
        big = os.memfd_create("bigkv", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.ftruncate(big, size)
        fcntl.fcntl(big, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
        memory = per_buffer_memory(size, n, [i * n * SMALL.chunk_bytes for i in range(n_buf)])
        mem = RegionMemory(SMALL, n, [big], [size], memory.layout_regions(SMALL))
        with pytest.raises(Exception) as err:
            Connection(mem, model_id="big", config=client_config(daemon.runtime_dir)).close()
        assert "BUSY" in str(err.value) and "address space" in str(err.value), err.value
        assert daemon.proc.poll() is None, daemon.log_tail()
        h = c0.load(k0, [1])
        assert h.wait(WAIT_S) and page_bytes(pool, 1) == page_bytes(pool, 0)
        p2, c2 = engine(daemon.runtime_dir, model="small")
        c2.close()
        p2.close()
        with AdminClient(daemon.endpoint, timeout_s=5.0) as admin:
            assert admin.health().status.startswith("degraded")
    finally:
        c0.close()
        pool.close()
        if big >= 0:
            os.close(big)
        with contextlib.suppress(OSError):
            resource.prlimit(
                daemon.pid, resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY)
            )


# -------------------------------------------------- closed sessions' memory released (guard)


@pytest.mark.timeout(60)
def test_a_closed_sessions_mapping_and_descriptors_are_released(daemon):
    """64 MiB of engine memory (written by the engine, so prefaulted) is mapped while
    its session is open and gone from the daemon's maps, and its descriptors closed, within
    seconds of the session's end."""
    pool, conn = engine(daemon.runtime_dir, num_pages=256)
    try:
        ino = os.fstat(pool.memory_fds()[0]).st_ino
        name = Path(f"/proc/self/fd/{pool.memory_fds()[0]}").readlink().name
    except OSError:
        conn.close()
        pool.close()
        raise
    try:
        assert f"{name}" in Path(f"/proc/{daemon.pid}/maps").read_text()
    finally:
        conn.close()
        pool.close()
    deadline = time.monotonic() + WAIT_S
    while True:
        held = []
        for f in Path(f"/proc/{daemon.pid}/fd").iterdir():
            with contextlib.suppress(OSError):
                if os.stat(f).st_ino == ino:
                    held.append(f)
        maps = Path(f"/proc/{daemon.pid}/maps").read_text()
        if not held and f" {ino} " not in maps:
            break
        assert time.monotonic() < deadline, (held, [x for x in maps.splitlines() if str(ino) in x])
        time.sleep(0.1)
    healthy(daemon)
