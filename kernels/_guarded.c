/* kvtier.kernels._guarded: page copies over memory that may vanish under them.

   copy_pages(dsts, srcs, length, stream=False, yield_bytes=0) -> int
       For each i, memcpy(dsts[i], srcs[i], length) (addresses as ints), with the GIL
       released. Returns how many pages were copied: len(dsts) when all were, fewer when a
       page faulted with SIGBUS (a shared mapping whose file shrank under it: an engine
       truncated the memfd it handed over). The copy stops there: pages before the count
       are whole; a streamed copy may have written part of the (at most three) pages after
       the one that faulted, which went in the same group of four (see ``stream``).

   Why: an engine's memfd that is not sealed against shrinking (SGLang creates its host
   pool's without MFD_ALLOW_SEALING) can be truncated at any time by its owner. A plain copy
   from a mapping of it would then take SIGBUS and end the daemon. Here a SIGBUS handler
   jumps back out of the copy when, and only when, the faulting thread is inside
   copy_pages (a thread-local flag); any other SIGBUS goes to the handler that was there
   before (faulthandler's, or the default: the process ends as it would have).

   copy_strided(host, host_nbytes, offsets, host_add, engine, engine_pages, page_ids,
                stride, length, to_host, stream=False, yield_bytes=0) -> int
       One region of a transfer in one call: for each i, the ``length`` bytes at
       ``engine + page_ids[i] * stride`` and those at ``host + offsets[i] + host_add`` are
       copied one way (into the host arena when ``to_host``). ``offsets`` and ``page_ids``
       are int64 buffers (numpy arrays) of one length. Every index is checked first (a page
       id in [0, engine_pages), a host range inside [0, host_nbytes)): a bad one raises
       ValueError naming it and nothing is copied. Then the pages are copied as
       copy_pages does (GIL released, stopping at a SIGBUS) and the count is returned.
       Planning a copy in numpy takes longer than moving a 64 KiB page.

   copy_regions(host, host_nbytes, offsets, page_ids, table, to_host, stream=False, yield_bytes=0) -> int
       Several regions of a transfer in one call: ``table`` is an int64 buffer of rows
       (host_add, engine, engine_pages, stride, length), one per region, copied in row
       order as copy_strided copies one. Every row and index is checked first (nothing is
       copied when one is bad). Returns the pages copied over all rows: rows x pages when
       all were, fewer when a page faulted (row = result // pages, page = result % pages).
       One call for all regions: with one call per region, a transfer of a few pages (a
       1-page LOAD) spends as long in the Python around the calls as in the copies.

   All take two optional last arguments. ``yield_bytes`` (default 0: never): after each
   page that brings the bytes copied since the last yield to at least this many, the thread
   calls sched_yield(). A thread that woke up on this CPU (the event loop, another engine
   answering its own request) then runs within microseconds instead of at the next
   scheduler tick (4 ms at HZ=250: the kernel lets the running thread finish its slice, and
   checks that only at the tick); with no other thread waiting, the call returns at once.
   The daemon asks for it only where nobody waits on the copy's end (a long STORE). It is
   checked (not negative) before anything is copied.

   ``stream`` (default false): copy each page with
   non-temporal stores (AVX2 where the CPU has it, else SSE2; plain memcpy off x86-64),
   which write the destination straight to memory instead of first reading every line of
   it into the cache and evicting the cache's contents. For a transfer larger than the
   cache holds, that moves fewer bytes over the memory bus (two passes instead of three),
   which is what glibc's memcpy does for a single copy above its own threshold; data still
   hot in the cache copies slower streamed, so the caller streams only large transfers.
   With AVX2, pages go four at a time (a 128-byte line group of each in turn; within a page
   4 KiB blocks go four at a time the same way): several streams of loads and stores in
   flight at once cost less CPU per byte than one stream, for pages of any
   size. A page that faults inside such a group is found by copying the group again page by
   page, so the count stays exact. The copy
   ends with a store fence, so the bytes are visible to other threads before the caller
   announces them.

   The handler is installed when the module is imported. Addresses are the caller's to
   check: the daemon passes addresses inside the mappings and the arena it owns. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <sched.h>
#include <setjmp.h>
#include <signal.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__)
#include <immintrin.h>

static int have_avx2 = 0;

/* One 128-byte line group of the source at s + off, streamed to d + off. */
#define STREAM128(d, s, off)                                                           \
    do {                                                                               \
        __m256i a_ = _mm256_loadu_si256((const __m256i *)((s) + (off)));               \
        __m256i b_ = _mm256_loadu_si256((const __m256i *)((s) + (off) + 32));          \
        __m256i c_ = _mm256_loadu_si256((const __m256i *)((s) + (off) + 64));          \
        __m256i e_ = _mm256_loadu_si256((const __m256i *)((s) + (off) + 96));          \
        _mm256_stream_si256((__m256i *)((d) + (off)), a_);                             \
        _mm256_stream_si256((__m256i *)((d) + (off) + 32), b_);                        \
        _mm256_stream_si256((__m256i *)((d) + (off) + 64), c_);                        \
        _mm256_stream_si256((__m256i *)((d) + (off) + 96), e_);                        \
    } while (0)

#define BLOCK 4096

/* Non-temporal copy: the destination aligned first, then blocks of 4 x 4 KiB (or 2 x 4 KiB)
   copied together, a line group of each block in turn, so that several streams of loads
   and stores are in flight at once (as glibc's large memcpy does), then the rest line group
   by line group. One stream at a time leaves the memory system waiting: the same copy
   costs more CPU. */
__attribute__((target("avx2"))) static void stream_avx2(char *d, const char *s, size_t n) {
    size_t head = (32 - ((uintptr_t)d & 31)) & 31, i = 0;
    if (head > n) head = n;
    memcpy(d, s, head);
    d += head, s += head, n -= head;
    for (; n >= 4 * BLOCK; d += 4 * BLOCK, s += 4 * BLOCK, n -= 4 * BLOCK)
        for (size_t o = 0; o < BLOCK; o += 128) {
            STREAM128(d, s, o);
            STREAM128(d, s, o + BLOCK);
            STREAM128(d, s, o + 2 * BLOCK);
            STREAM128(d, s, o + 3 * BLOCK);
        }
    for (; n >= 2 * BLOCK; d += 2 * BLOCK, s += 2 * BLOCK, n -= 2 * BLOCK)
        for (size_t o = 0; o < BLOCK; o += 128) {
            STREAM128(d, s, o);
            STREAM128(d, s, o + BLOCK);
        }
    for (; i + 128 <= n; i += 128) STREAM128(d, s, i);
    memcpy(d + i, s + i, n - i);
}

static void stream_sse2(char *d, const char *s, size_t n) {
    size_t head = (16 - ((uintptr_t)d & 15)) & 15, i = 0;
    if (head > n) head = n;
    memcpy(d, s, head);
    d += head, s += head, n -= head;
    for (; i + 64 <= n; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(s + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(s + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(s + i + 32));
        __m128i e = _mm_loadu_si128((const __m128i *)(s + i + 48));
        _mm_stream_si128((__m128i *)(d + i), a);
        _mm_stream_si128((__m128i *)(d + i + 16), b);
        _mm_stream_si128((__m128i *)(d + i + 32), c);
        _mm_stream_si128((__m128i *)(d + i + 48), e);
    }
    memcpy(d + i, s + i, n - i);
}

static void page_copy(void *d, const void *s, size_t n, int stream) {
    if (!stream)
        memcpy(d, s, n);
    else if (have_avx2)
        stream_avx2(d, s, n);
    else
        stream_sse2(d, s, n);
}

/* Four pages of ``n`` bytes streamed together, a 128-byte line group of each in turn (four
   streams of loads and stores in flight, as in stream_avx2, for pages of any size: a page
   of a few KiB copied alone gets no such overlap). Whether it could: it needs AVX2 and
   every destination 32-byte aligned (non-temporal stores fault otherwise); when it returns
   0 nothing was copied. */
__attribute__((target("avx2"))) static int stream4_avx2(char *const d[4], const char *const s[4],
                                                         size_t n) {
    size_t o = 0;
    for (; o + 128 <= n; o += 128) {
        STREAM128(d[0], s[0], o);
        STREAM128(d[1], s[1], o);
        STREAM128(d[2], s[2], o);
        STREAM128(d[3], s[3], o);
    }
    for (int k = 0; k < 4; k++) memcpy(d[k] + o, s[k] + o, n - o);
    return 1;
}

static int group_copy(char *const d[4], const char *const s[4], size_t n) {
    if (!have_avx2 || (((uintptr_t)d[0] | (uintptr_t)d[1] | (uintptr_t)d[2] | (uintptr_t)d[3]) & 31))
        return 0;
    return stream4_avx2(d, s, n);
}

static void fence(void) { _mm_sfence(); }

static void detect_cpu(void) {
    __builtin_cpu_init();
    have_avx2 = __builtin_cpu_supports("avx2");
}
#else
static void page_copy(void *d, const void *s, size_t n, int stream) {
    (void)stream;
    memcpy(d, s, n);
}

static int group_copy(char *const d[4], const char *const s[4], size_t n) {
    (void)d, (void)s, (void)n;
    return 0;
}

static void fence(void) {}

static void detect_cpu(void) {}
#endif

static __thread sigjmp_buf *guard = NULL;

/* No memory access moves across it: ``in_group`` is set before every access of a group
   copy and cleared after the last, even were the copy inlined. */
#define BARRIER() __asm__ volatile("" ::: "memory")

/* Yield the CPU once ``*since`` (bytes copied since the last yield, plus ``n``) reaches
   ``every`` (0: never). */
static inline void pace(size_t *since, size_t n, size_t every) {
    if (every == 0) return;
    *since += n;
    if (*since >= every) {
        *since = 0;
        sched_yield();
    }
}
static struct sigaction previous;

/* After a jump out of the SIGBUS handler. The guards save no signal mask (sigsetjmp(env, 0):
   saving it is a system call per guarded copy); the handler runs with SIGBUS unblocked
   (SA_NODEFER), so nothing is left to restore, unless another handler, installed over ours,
   called ours with SIGBUS blocked. SIGBUS is unblocked here for that case: a later fault
   with it blocked would end the process. */
static void unblock_sigbus(void) {
    sigset_t bus;
    sigemptyset(&bus);
    sigaddset(&bus, SIGBUS);
    pthread_sigmask(SIG_UNBLOCK, &bus, NULL);
}

static void on_sigbus(int sig, siginfo_t *info, void *uctx) {
    sigjmp_buf *g = guard;
    if (g != NULL) {
        guard = NULL;
        siglongjmp(*g, 1);
    }
    /* Not a guarded copy: as if this handler were not there. */
    if ((previous.sa_flags & SA_SIGINFO) && previous.sa_sigaction != NULL) {
        previous.sa_sigaction(sig, info, uctx);
        return;
    }
    if (previous.sa_handler != SIG_DFL && previous.sa_handler != SIG_IGN) {
        previous.sa_handler(sig);
        return;
    }
    /* default: restore it; returning re-runs the faulting access, which then ends us */
    sigaction(SIGBUS, &previous, NULL);
}

static int addresses(PyObject *seq, const char *name, uintptr_t **out, Py_ssize_t *n) {
    PyObject *fast = PySequence_Fast(seq, name);
    if (fast == NULL) return -1;
    *n = PySequence_Fast_GET_SIZE(fast);
    *out = malloc(sizeof(uintptr_t) * (size_t)(*n > 0 ? *n : 1));
    if (*out == NULL) {
        Py_DECREF(fast);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < *n; i++) {
        unsigned long long v = PyLong_AsUnsignedLongLong(PySequence_Fast_GET_ITEM(fast, i));
        if (v == (unsigned long long)-1 && PyErr_Occurred()) {
            free(*out);
            Py_DECREF(fast);
            return -1;
        }
        (*out)[i] = (uintptr_t)v;
    }
    Py_DECREF(fast);
    return 0;
}

/* Streamed copies go four pages at a time (group_copy). A fault inside a group leaves its
   pages partly copied, so the group is copied again page by page from its first page, which
   stops at the page that faults: the count is exact either way. */
static Py_ssize_t guarded_copy(uintptr_t *d, uintptr_t *s, Py_ssize_t n, size_t length,
                               int stream, size_t every) {
    volatile Py_ssize_t done = 0;
    volatile int grouped = stream, in_group = 0;
    size_t since = 0;
    sigjmp_buf env;
    if (sigsetjmp(env, 0) != 0) {
        unblock_sigbus();
        if (!in_group) goto out;
        in_group = 0, grouped = 0; /* again from the group's first page, one by one */
        since = 0;                 /* (not volatile: its value is lost with the jump) */
    }
    guard = &env;
    while (done < n) {
        if (grouped && n - done >= 4) {
            char *dd[4] = {(char *)d[done], (char *)d[done + 1], (char *)d[done + 2],
                           (char *)d[done + 3]};
            const char *ss[4] = {(const char *)s[done], (const char *)s[done + 1],
                                 (const char *)s[done + 2], (const char *)s[done + 3]};
            in_group = 1;
            BARRIER();
            int ok = group_copy(dd, ss, length);
            BARRIER();
            in_group = 0;
            if (ok) {
                done = done + 4;
                pace(&since, 4 * length, every);
                continue;
            }
        }
        page_copy((void *)d[done], (const void *)s[done], length, stream);
        done = done + 1;
        pace(&since, length, every);
    }
out:
    guard = NULL;
    fence();
    return done;
}

static PyObject *copy_pages(PyObject *self, PyObject *args) {
    PyObject *dsts, *srcs;
    Py_ssize_t length, nd, ns, done, every = 0;
    uintptr_t *d = NULL, *s = NULL;
    int stream = 0;
    (void)self;
    if (!PyArg_ParseTuple(args, "OOn|pn", &dsts, &srcs, &length, &stream, &every)) return NULL;
    if (length <= 0) {
        PyErr_Format(PyExc_ValueError, "length = %zd must be > 0", length);
        return NULL;
    }
    if (every < 0) {
        PyErr_Format(PyExc_ValueError, "yield_bytes = %zd must not be negative", every);
        return NULL;
    }
    if (addresses(dsts, "dsts must be a sequence of ints", &d, &nd) < 0) return NULL;
    if (addresses(srcs, "srcs must be a sequence of ints", &s, &ns) < 0) {
        free(d);
        return NULL;
    }
    if (nd != ns) {
        free(d);
        free(s);
        PyErr_Format(PyExc_ValueError, "%zd dsts but %zd srcs", nd, ns);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    done = guarded_copy(d, s, nd, (size_t)length, stream, (size_t)every);
    Py_END_ALLOW_THREADS
    free(d);
    free(s);
    return PyLong_FromSsize_t(done);
}

static int64_t at(const char *base, Py_ssize_t i) {
    int64_t v;
    memcpy(&v, base + i * (Py_ssize_t)sizeof v, sizeof v); /* any alignment */
    return v;
}

enum { ROW_ADD, ROW_ENGINE, ROW_PAGES, ROW_STRIDE, ROW_LENGTH, ROW_WORDS };

static Py_ssize_t regions_copy(char *host, const char *offs, const char *pids, const char *rows,
                               Py_ssize_t nrows, Py_ssize_t n, int to_host, int stream,
                               size_t every) {
    /* rows in order, each row's pages four at a time when streamed (as guarded_copy) */
    volatile Py_ssize_t done = 0;
    volatile int grouped = stream, in_group = 0;
    size_t since = 0;
    sigjmp_buf env;
    if (sigsetjmp(env, 0) != 0) {
        unblock_sigbus();
        if (!in_group) goto out;
        in_group = 0, grouped = 0;
        since = 0;
    }
    guard = &env;
    for (Py_ssize_t r = n > 0 ? done / n : nrows; r < nrows; r++) {
        const char *row = rows + r * ROW_WORDS * (Py_ssize_t)sizeof(int64_t);
        Py_ssize_t add = at(row, ROW_ADD), stride = at(row, ROW_STRIDE);
        size_t length = (size_t)at(row, ROW_LENGTH);
        char *engine = (char *)(uintptr_t)at(row, ROW_ENGINE);
        for (Py_ssize_t i = done - r * n; i < n;) {
            if (grouped && n - i >= 4) {
                char *h[4], *e[4];
                for (int k = 0; k < 4; k++) {
                    h[k] = host + at(offs, i + k) + add;
                    e[k] = engine + at(pids, i + k) * stride;
                }
                in_group = 1;
                BARRIER();
                int ok = to_host ? group_copy(h, (const char *const *)e, length)
                                 : group_copy(e, (const char *const *)h, length);
                BARRIER();
                in_group = 0;
                if (ok) {
                    i += 4, done = done + 4;
                    pace(&since, 4 * length, every);
                    continue;
                }
            }
            char *h = host + at(offs, i) + add;
            char *e = engine + at(pids, i) * stride;
            if (to_host)
                page_copy(h, e, length, stream);
            else
                page_copy(e, h, length, stream);
            i++, done = done + 1;
            pace(&since, length, every);
        }
    }
out:
    guard = NULL;
    fence();
    return done;
}

static PyObject *copy_strided(PyObject *self, PyObject *args) {
    unsigned long long host, engine;
    Py_ssize_t host_nbytes, host_add, engine_pages, stride, length, n, done = 0, every = 0;
    int64_t row[ROW_WORDS];
    Py_buffer offs, pids;
    int to_host, stream = 0;
    PyObject *out = NULL;
    (void)self;
    if (!PyArg_ParseTuple(args, "Kny*nKny*nnp|pn", &host, &host_nbytes, &offs, &host_add, &engine,
                          &engine_pages, &pids, &stride, &length, &to_host, &stream, &every))
        return NULL;
    if (every < 0) {
        PyErr_Format(PyExc_ValueError, "yield_bytes = %zd must not be negative", every);
        goto end;
    }
    n = offs.len / 8;
    if (offs.len % 8 != 0 || pids.len != offs.len) {
        PyErr_Format(PyExc_ValueError, "offsets (%zd bytes) and page_ids (%zd bytes) must be "
                     "int64 arrays of one length", offs.len, pids.len);
        goto end;
    }
    if (length <= 0 || stride < length || host_nbytes < length || engine_pages < 0 ||
        host_add < 0 || host_add > host_nbytes - length) {
        PyErr_Format(PyExc_ValueError, "length = %zd must be > 0 and at most stride = %zd and "
                     "host_nbytes = %zd; engine_pages = %zd and host_add = %zd must not be "
                     "negative, nor host_add + length over host_nbytes", length, stride,
                     host_nbytes, engine_pages, host_add);
        goto end;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t p = at(pids.buf, i), o = at(offs.buf, i);
        if (p < 0 || p >= engine_pages) {
            PyErr_Format(PyExc_ValueError, "page_ids[%zd] = %lld is outside the region's %zd "
                         "pages", i, (long long)p, engine_pages);
            goto end;
        }
        if (o < 0 || o > (int64_t)(host_nbytes - length - host_add)) {
            PyErr_Format(PyExc_ValueError, "offsets[%zd] = %lld + %zd: %zd bytes there are "
                         "outside the arena's %zd", i, (long long)o, host_add, length,
                         host_nbytes);
            goto end;
        }
    }
    row[ROW_ADD] = host_add;
    row[ROW_ENGINE] = (int64_t)engine;
    row[ROW_PAGES] = engine_pages;
    row[ROW_STRIDE] = stride;
    row[ROW_LENGTH] = length;
    Py_BEGIN_ALLOW_THREADS
    done = regions_copy((char *)(uintptr_t)host, offs.buf, pids.buf, (const char *)row, 1, n,
                        to_host, stream, (size_t)every);
    Py_END_ALLOW_THREADS
    out = PyLong_FromSsize_t(done);
end:
    PyBuffer_Release(&offs);
    PyBuffer_Release(&pids);
    return out;
}

/* Check a region copy's table and indexes (nothing is copied when one is bad): 0, or -1
   with ValueError set naming the row or index. */
static int check_regions(Py_ssize_t host_nbytes, const char *offs, const char *pids, Py_ssize_t n,
                         const char *rows, Py_ssize_t nrows) {
    Py_ssize_t min_pages = PY_SSIZE_T_MAX, reach = 0;
    for (Py_ssize_t r = 0; r < nrows; r++) {
        const char *row = rows + r * ROW_WORDS * 8;
        int64_t add = at(row, ROW_ADD), pages = at(row, ROW_PAGES), stride = at(row, ROW_STRIDE),
                length = at(row, ROW_LENGTH);
        if (length <= 0 || stride < length || pages < 0 || add < 0 ||
            length > (int64_t)host_nbytes || add > (int64_t)host_nbytes - length) {
            PyErr_Format(PyExc_ValueError, "table row %zd: length = %lld must be > 0 and at "
                         "most stride = %lld and host_nbytes = %zd; engine_pages = %lld and "
                         "host_add = %lld must not be negative, nor host_add + length over "
                         "host_nbytes", r, (long long)length, (long long)stride, host_nbytes,
                         (long long)pages, (long long)add);
            return -1;
        }
        if (pages < min_pages) min_pages = (Py_ssize_t)pages;
        if (add + length > reach) reach = (Py_ssize_t)(add + length);
    }
    for (Py_ssize_t i = 0; i < n && nrows > 0; i++) {
        int64_t p = at(pids, i), o = at(offs, i);
        if (p < 0 || p >= min_pages) {
            PyErr_Format(PyExc_ValueError, "page_ids[%zd] = %lld is outside the regions' %zd "
                         "pages", i, (long long)p, min_pages);
            return -1;
        }
        if (o < 0 || o > (int64_t)(host_nbytes - reach)) {
            PyErr_Format(PyExc_ValueError, "offsets[%zd] = %lld: the %zd bytes of a page there "
                         "are outside the arena's %zd", i, (long long)o, reach, host_nbytes);
            return -1;
        }
    }
    return 0;
}

static PyObject *copy_regions(PyObject *self, PyObject *args) {
    unsigned long long host;
    Py_ssize_t host_nbytes, n, nrows, done = 0, every = 0;
    Py_buffer offs, pids, rows;
    int to_host, stream = 0;
    PyObject *out = NULL;
    (void)self;
    if (!PyArg_ParseTuple(args, "Kny*y*y*p|pn", &host, &host_nbytes, &offs, &pids, &rows,
                          &to_host, &stream, &every))
        return NULL;
    if (every < 0) {
        PyErr_Format(PyExc_ValueError, "yield_bytes = %zd must not be negative", every);
        goto end;
    }
    n = offs.len / 8;
    nrows = rows.len / (ROW_WORDS * 8);
    if (offs.len % 8 != 0 || pids.len != offs.len || rows.len % (ROW_WORDS * 8) != 0) {
        PyErr_Format(PyExc_ValueError, "offsets (%zd bytes) and page_ids (%zd bytes) must be "
                     "int64 arrays of one length, table (%zd bytes) int64 rows of %d",
                     offs.len, pids.len, rows.len, (int)ROW_WORDS);
        goto end;
    }
    if (check_regions(host_nbytes, offs.buf, pids.buf, n, rows.buf, nrows) < 0) goto end;
    Py_BEGIN_ALLOW_THREADS
    done = regions_copy((char *)(uintptr_t)host, offs.buf, pids.buf, rows.buf, nrows, n,
                        to_host, stream, (size_t)every);
    Py_END_ALLOW_THREADS
    out = PyLong_FromSsize_t(done);
end:
    PyBuffer_Release(&offs);
    PyBuffer_Release(&pids);
    PyBuffer_Release(&rows);
    return out;
}

/* ---- CopyPool: copy threads that take the GIL only for work written in Python ----------

   CopyPool() -> pool: the queue of a fixed set of copy threads. The threads are Python
   threads (started by the caller) that call ``pool.serve()``: it releases the GIL and
   runs region copies submitted with ``submit_copy`` itself, in C, without ever taking the
   GIL back; it returns only to hand the thread a job written in Python (``submit_call``:
   its id) or, once the pool is shut down and its queue empty, None. Users (any int64)
   take turns: the next free thread takes the oldest job of the user whose turn it is,
   then that user goes to the back of the line.

   The end of a region copy is reported through ``fd``, an eventfd that becomes readable
   when the list of ended copies goes from empty to not empty, and ``reap()``, which takes
   that list: (id, status, pages) per copy, status 0 DONE (pages: all pages copied),
   1 SHORT (a page faulted: pages is its index in the request), 2 CANCELLED (``cancel``).
   A region copy announces its layers itself: after each group of rows but the last, the
   group's layer count goes to ``layers_addr`` (an int64) and, when ``wake_addr`` is not 0,
   the 32-bit counter there is bumped and its futex woken; after the last group, every
   layer (``num_layers``). Those addresses are the caller's to keep mapped until the copy
   is reaped. */

#include <errno.h>
#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sys/eventfd.h>
#include <sys/syscall.h>
#include <unistd.h>

enum { JOB_COPY, JOB_CALL };
enum { END_DONE = 0, END_SHORT = 1, END_CANCELLED = 2 };

/* The layers of a copy split in parts: layer l is announced once every part has copied
   it (the smallest of the parts' levels). Freed with its last part. */
typedef struct Gate {
    pthread_mutex_t mu;
    int refs;       /* parts not freed yet (changed with the GIL held) */
    int64_t shown;  /* the level announced */
    Py_ssize_t parts;
    int64_t levels[];
} Gate;

typedef struct Job {
    struct Job *next;               /* in a user's queue, then in the ended list */
    struct Job *rnext, *rprev;      /* among the running copies */
    long long id, user;
    int kind, to_host, stream, status, cancelled;
    char *host;
    int64_t *offs, *pids, *rows, *groups; /* one allocation, in this order */
    Py_ssize_t n, nrows, ngroups, done;
    size_t every;
    int64_t *layers_word;
    uint32_t *wake_word;
    int64_t num_layers;
    Gate *gate;                     /* a part's, or NULL */
    Py_ssize_t part;
} Job;

typedef struct User {
    struct User *next;
    long long uid;
    Job *head, *tail;
    Py_ssize_t count;
} User;

typedef struct {
    PyObject_HEAD
    pthread_mutex_t mu;
    pthread_cond_t cv;
    User *turn_head, *turn_tail; /* users with queued jobs, in turn order */
    Py_ssize_t queued;
    Job *running;
    Job *ended_head, *ended_tail;
    int efd;
    int closed;
} CopyPool;

static void job_free(Job *j) {
    if (j == NULL) return;
    if (j->gate != NULL && --j->gate->refs == 0) {
        pthread_mutex_destroy(&j->gate->mu);
        free(j->gate);
    }
    free(j->offs);
    free(j);
}

/* Queue ``j`` in its user's turn; called with the lock held. 0, or -1 out of memory. */
static int enqueue(CopyPool *p, Job *j) {
    User *u = p->turn_head;
    while (u != NULL && u->uid != j->user) u = u->next;
    if (u == NULL) {
        u = calloc(1, sizeof *u);
        if (u == NULL) return -1;
        u->uid = j->user;
        if (p->turn_tail != NULL)
            p->turn_tail->next = u;
        else
            p->turn_head = u;
        p->turn_tail = u;
    }
    j->next = NULL;
    if (u->tail != NULL)
        u->tail->next = j;
    else
        u->head = j;
    u->tail = j;
    u->count++;
    p->queued++;
    return 0;
}

/* The next job in turn (the lock held, at least one queued): its user goes to the back. */
static Job *dequeue(CopyPool *p) {
    User *u = p->turn_head;
    Job *j = u->head;
    u->head = j->next;
    if (u->head == NULL) u->tail = NULL;
    u->count--;
    p->queued--;
    p->turn_head = u->next;
    if (p->turn_head == NULL) p->turn_tail = NULL;
    u->next = NULL;
    if (u->count > 0) {
        if (p->turn_tail != NULL)
            p->turn_tail->next = u;
        else
            p->turn_head = u;
        p->turn_tail = u;
    } else {
        free(u);
    }
    j->next = NULL;
    return j;
}

/* Add ``j`` to the ended list (the lock held); whether the list was empty (signal fd). */
static int ended(CopyPool *p, Job *j) {
    int was_empty = p->ended_head == NULL;
    j->next = NULL;
    if (p->ended_tail != NULL)
        p->ended_tail->next = j;
    else
        p->ended_head = j;
    p->ended_tail = j;
    return was_empty;
}

static void signal_fd(CopyPool *p) {
    uint64_t one = 1;
    ssize_t r;
    do r = write(p->efd, &one, sizeof one);
    while (r < 0 && errno == EINTR);
    /* EAGAIN: the counter is at its maximum, the fd is readable anyway */
}

static void announce_now(Job *j, int64_t layers) {
    if (j->layers_word != NULL) __atomic_store_n(j->layers_word, layers, __ATOMIC_RELEASE);
    if (j->wake_word != NULL) {
        uint32_t w = __atomic_load_n(j->wake_word, __ATOMIC_RELAXED) + 1u;
        __atomic_store_n(j->wake_word, w, __ATOMIC_RELEASE);
        syscall(SYS_futex, j->wake_word, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
    }
}

/* Announce that ``j`` has copied its first ``layers`` layers: at once, or for a part, once
   every part has (under the gate's lock, so two parts never write the slot at once). */
static void announce(Job *j, int64_t layers) {
    Gate *g = j->gate;
    if (g == NULL) {
        announce_now(j, layers);
        return;
    }
    pthread_mutex_lock(&g->mu);
    if (layers > g->levels[j->part]) g->levels[j->part] = layers;
    int64_t low = g->levels[0];
    for (Py_ssize_t i = 1; i < g->parts; i++)
        if (g->levels[i] < low) low = g->levels[i];
    if (low > g->shown) {
        g->shown = low;
        announce_now(j, low);
    }
    pthread_mutex_unlock(&g->mu);
}

/* Copy every group of rows of ``j`` (no GIL, no lock), announcing layers as it goes. */
static void run_copy(Job *j) {
    int status = END_DONE;
    Py_ssize_t done = 0;
    for (Py_ssize_t g = 0; g < j->ngroups; g++) {
        int64_t a = j->groups[3 * g], b = j->groups[3 * g + 1], layers = j->groups[3 * g + 2];
        if (__atomic_load_n(&j->cancelled, __ATOMIC_ACQUIRE)) {
            status = END_CANCELLED;
            break;
        }
        Py_ssize_t want = (Py_ssize_t)(b - a) * j->n;
        Py_ssize_t got = regions_copy(j->host, (const char *)j->offs, (const char *)j->pids,
                                      (const char *)(j->rows + a * ROW_WORDS), (Py_ssize_t)(b - a),
                                      j->n, j->to_host, j->stream, j->every);
        if (got < want) {
            status = END_SHORT;
            done = j->n > 0 ? got % j->n : 0;
            break;
        }
        if (layers && b < j->nrows) announce(j, layers);
    }
    if (status == END_DONE) {
        announce(j, j->num_layers);
        done = j->n;
    }
    j->status = status;
    j->done = done;
}

static PyObject *pool_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kw[] = {NULL};
    CopyPool *p;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, ":CopyPool", kw)) return NULL;
    p = (CopyPool *)type->tp_alloc(type, 0);
    if (p == NULL) return NULL;
    p->efd = -1;
    if (pthread_mutex_init(&p->mu, NULL) != 0 || pthread_cond_init(&p->cv, NULL) != 0) {
        Py_DECREF(p);
        return PyErr_NoMemory();
    }
    p->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (p->efd < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        Py_DECREF(p);
        return NULL;
    }
    return (PyObject *)p;
}

static void pool_dealloc(CopyPool *p) {
    /* no thread is inside serve(): each holds a reference while it is */
    while (p->turn_head != NULL) {
        User *u = p->turn_head;
        p->turn_head = u->next;
        while (u->head != NULL) {
            Job *j = u->head;
            u->head = j->next;
            job_free(j);
        }
        free(u);
    }
    while (p->ended_head != NULL) {
        Job *j = p->ended_head;
        p->ended_head = j->next;
        job_free(j);
    }
    if (p->efd >= 0) close(p->efd);
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->cv);
    Py_TYPE(p)->tp_free((PyObject *)p);
}

/* A job copying pages [a, b) of a request: its own copy of them, of the table and of the
   groups (the caller's buffers may go once it is queued). NULL when out of memory. */
static Job *make_job(const char *offs, const char *pids, Py_ssize_t a, Py_ssize_t b,
                     const Py_buffer *rows, const Py_buffer *groups) {
    Py_ssize_t n = b - a;
    Job *j = calloc(1, sizeof *j);
    if (j == NULL) return NULL;
    j->offs = malloc((size_t)(16 * n + rows->len + groups->len) + 8);
    if (j->offs == NULL) {
        free(j);
        return NULL;
    }
    memcpy(j->offs, offs + 8 * a, (size_t)(8 * n));
    j->pids = j->offs + n;
    memcpy(j->pids, pids + 8 * a, (size_t)(8 * n));
    j->rows = j->pids + n;
    memcpy(j->rows, rows->buf, (size_t)rows->len);
    j->groups = j->rows + rows->len / 8;
    memcpy(j->groups, groups->buf, (size_t)groups->len);
    j->n = n;
    return j;
}

static PyObject *pool_submit_copy(CopyPool *p, PyObject *args) {
    long long id, user, num_layers;
    unsigned long long host, layers_addr, wake_addr;
    Py_ssize_t host_nbytes, n, nrows, ngroups, nparts = 1, every = 0, made = 0;
    Py_buffer offs, pids, rows, groups, bounds = {0};
    int to_host, stream;
    Job **jobs = NULL;
    Gate *gate = NULL;
    PyObject *out = NULL;
    if (!PyArg_ParseTuple(args, "LLKny*y*y*y*ppnKKL|y*", &id, &user, &host, &host_nbytes, &offs,
                          &pids, &rows, &groups, &to_host, &stream, &every, &layers_addr,
                          &wake_addr, &num_layers, &bounds))
        return NULL;
    n = offs.len / 8;
    nrows = rows.len / (ROW_WORDS * 8);
    ngroups = groups.len / 24;
    if (offs.len % 8 != 0 || pids.len != offs.len || rows.len % (ROW_WORDS * 8) != 0 ||
        groups.len % 24 != 0) {
        PyErr_Format(PyExc_ValueError, "offsets (%zd bytes) and page_ids (%zd bytes) must be "
                     "int64 arrays of one length, table (%zd bytes) int64 rows of %d, groups "
                     "(%zd bytes) int64 rows of 3", offs.len, pids.len, rows.len,
                     (int)ROW_WORDS, groups.len);
        goto end;
    }
    if (every < 0) {
        PyErr_Format(PyExc_ValueError, "yield_bytes = %zd must not be negative", every);
        goto end;
    }
    if (num_layers < 0) {
        PyErr_Format(PyExc_ValueError, "num_layers = %lld must not be negative", num_layers);
        goto end;
    }
    for (Py_ssize_t g = 0, prev = 0; g < ngroups; g++) {
        int64_t a = at(groups.buf, 3 * g), b = at(groups.buf, 3 * g + 1);
        if (a != prev || b <= a || b > nrows) {
            PyErr_Format(PyExc_ValueError, "groups[%zd] = (%lld, %lld): groups must cover the "
                         "table's %zd rows in order", g, (long long)a, (long long)b, nrows);
            goto end;
        }
        prev = (Py_ssize_t)b;
        if (g == ngroups - 1 && b != nrows) {
            PyErr_Format(PyExc_ValueError, "groups end at row %lld of %zd", (long long)b, nrows);
            goto end;
        }
    }
    if (ngroups == 0 && nrows > 0) {
        PyErr_SetString(PyExc_ValueError, "a table with rows needs groups");
        goto end;
    }
    if (bounds.buf != NULL) {
        nparts = bounds.len / 8 - 1;
        if (bounds.len % 8 != 0 || nparts < 1 || at(bounds.buf, 0) != 0 ||
            at(bounds.buf, nparts) != n) {
            PyErr_Format(PyExc_ValueError, "bounds (%zd bytes) must be int64 part starts from 0 "
                         "and the end, %zd", bounds.len, n);
            goto end;
        }
        for (Py_ssize_t i = 0; i < nparts; i++)
            if (at(bounds.buf, i + 1) <= at(bounds.buf, i)) {
                PyErr_Format(PyExc_ValueError, "bounds[%zd] = %lld: each part needs a page",
                             i + 1, (long long)at(bounds.buf, i + 1));
                goto end;
            }
    }
    if (check_regions(host_nbytes, offs.buf, pids.buf, n, rows.buf, nrows) < 0) goto end;
    jobs = calloc((size_t)nparts, sizeof *jobs);
    if (jobs == NULL) {
        PyErr_NoMemory();
        goto end;
    }
    if (bounds.buf != NULL) {
        gate = calloc(1, sizeof *gate + (size_t)nparts * sizeof(int64_t));
        if (gate == NULL || pthread_mutex_init(&gate->mu, NULL) != 0) {
            free(gate);
            gate = NULL;
            PyErr_NoMemory();
            goto end;
        }
        gate->parts = nparts;
    }
    for (; made < nparts; made++) {
        Py_ssize_t a = bounds.buf != NULL ? (Py_ssize_t)at(bounds.buf, made) : 0;
        Py_ssize_t b = bounds.buf != NULL ? (Py_ssize_t)at(bounds.buf, made + 1) : n;
        Job *j = make_job(offs.buf, pids.buf, a, b, &rows, &groups);
        if (j == NULL) {
            PyErr_NoMemory();
            goto end;
        }
        j->id = id + made;
        j->user = user;
        j->kind = JOB_COPY;
        j->host = (char *)(uintptr_t)host;
        j->nrows = nrows;
        j->ngroups = ngroups;
        j->to_host = to_host;
        j->stream = stream;
        j->every = (size_t)every;
        j->layers_word = (int64_t *)(uintptr_t)layers_addr;
        j->wake_word = (uint32_t *)(uintptr_t)wake_addr;
        j->num_layers = num_layers;
        if (gate != NULL) {
            j->gate = gate;
            j->part = made;
            gate->refs++;
        }
        jobs[made] = j;
    }
    pthread_mutex_lock(&p->mu);
    if (p->closed) {
        pthread_mutex_unlock(&p->mu);
        PyErr_SetString(PyExc_RuntimeError, "the copy threads have shut down");
        goto end;
    }
    for (Py_ssize_t i = 0; i < nparts; i++) {
        if (enqueue(p, jobs[i]) < 0) { /* the ones queued run; the rest end CANCELLED */
            int wake = 0;
            for (Py_ssize_t k = i; k < nparts; k++) {
                jobs[k]->status = END_CANCELLED;
                wake |= ended(p, jobs[k]);
            }
            pthread_cond_broadcast(&p->cv);
            pthread_mutex_unlock(&p->mu);
            if (wake) signal_fd(p);
            made = 0; /* every job is the pool's now */
            out = Py_NewRef(Py_None);
            goto end;
        }
    }
    if (nparts > 1)
        pthread_cond_broadcast(&p->cv);
    else
        pthread_cond_signal(&p->cv);
    pthread_mutex_unlock(&p->mu);
    made = 0;
    out = Py_NewRef(Py_None);
end:
    if (made > 0) {
        for (Py_ssize_t i = 0; i < made; i++) job_free(jobs[i]); /* not queued; the last */
    } else if (gate != NULL && gate->refs == 0) {                 /* frees the gate */
        pthread_mutex_destroy(&gate->mu);
        free(gate);
    }
    free(jobs);
    PyBuffer_Release(&offs);
    PyBuffer_Release(&pids);
    PyBuffer_Release(&rows);
    PyBuffer_Release(&groups);
    if (bounds.buf != NULL) PyBuffer_Release(&bounds);
    return out;
}

static PyObject *pool_submit_call(CopyPool *p, PyObject *args) {
    long long id, user;
    Job *j;
    if (!PyArg_ParseTuple(args, "LL", &id, &user)) return NULL;
    j = calloc(1, sizeof *j);
    if (j == NULL) return PyErr_NoMemory();
    j->id = id;
    j->user = user;
    j->kind = JOB_CALL;
    pthread_mutex_lock(&p->mu);
    if (p->closed) {
        pthread_mutex_unlock(&p->mu);
        free(j);
        PyErr_SetString(PyExc_RuntimeError, "the copy threads have shut down");
        return NULL;
    }
    if (enqueue(p, j) < 0) {
        pthread_mutex_unlock(&p->mu);
        free(j);
        return PyErr_NoMemory();
    }
    pthread_cond_signal(&p->cv);
    pthread_mutex_unlock(&p->mu);
    Py_RETURN_NONE;
}

static PyObject *pool_serve(CopyPool *p, PyObject *unused) {
    Job *j;
    long long id = 0;
    int call = 0;
    (void)unused;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&p->mu);
    for (;;) {
        while (!p->closed && p->queued == 0) pthread_cond_wait(&p->cv, &p->mu);
        if (p->queued == 0) break; /* shut down, and nothing left */
        j = dequeue(p);
        if (j->kind == JOB_CALL) {
            call = 1;
            id = j->id;
            free(j);
            break;
        }
        j->rnext = p->running;
        j->rprev = NULL;
        if (p->running != NULL) p->running->rprev = j;
        p->running = j;
        pthread_mutex_unlock(&p->mu);
        run_copy(j);
        pthread_mutex_lock(&p->mu);
        if (j->rprev != NULL)
            j->rprev->rnext = j->rnext;
        else
            p->running = j->rnext;
        if (j->rnext != NULL) j->rnext->rprev = j->rprev;
        if (ended(p, j)) {
            pthread_mutex_unlock(&p->mu);
            signal_fd(p);
            pthread_mutex_lock(&p->mu);
        }
    }
    pthread_mutex_unlock(&p->mu);
    Py_END_ALLOW_THREADS
    if (call) return PyLong_FromLongLong(id);
    Py_RETURN_NONE;
}

static PyObject *pool_reap(CopyPool *p, PyObject *unused) {
    uint64_t count;
    Job *head, *j;
    Py_ssize_t n = 0, i = 0;
    PyObject *out;
    (void)unused;
    /* read first: a copy that ends after this read signals again */
    while (read(p->efd, &count, sizeof count) < 0 && errno == EINTR) {
    }
    pthread_mutex_lock(&p->mu);
    head = p->ended_head;
    p->ended_head = p->ended_tail = NULL;
    pthread_mutex_unlock(&p->mu);
    for (j = head; j != NULL; j = j->next) n++;
    out = PyList_New(n);
    if (out == NULL) { /* put them back: the next reap returns them */
        pthread_mutex_lock(&p->mu);
        if (head != NULL) {
            Job *tail = head;
            while (tail->next != NULL) tail = tail->next;
            tail->next = p->ended_head;
            if (p->ended_head == NULL) p->ended_tail = tail;
            p->ended_head = head;
        }
        pthread_mutex_unlock(&p->mu);
        return NULL;
    }
    for (j = head; j != NULL; i++) {
        Job *next = j->next;
        PyObject *row = Py_BuildValue("(Lin)", j->id, j->status, j->done);
        if (row == NULL) {
            Py_DECREF(out);
            return NULL; /* the rest are lost with the error: out of memory */
        }
        PyList_SET_ITEM(out, i, row);
        job_free(j);
        j = next;
    }
    return out;
}

static PyObject *pool_cancel(CopyPool *p, PyObject *arg) {
    long long id = PyLong_AsLongLong(arg);
    int found = 0;
    if (id == -1 && PyErr_Occurred()) return NULL;
    pthread_mutex_lock(&p->mu);
    for (Job *j = p->running; j != NULL && !found; j = j->rnext)
        if (j->id == id) {
            __atomic_store_n(&j->cancelled, 1, __ATOMIC_RELEASE);
            found = 1;
        }
    for (User *u = p->turn_head; u != NULL && !found; u = u->next)
        for (Job *j = u->head; j != NULL; j = j->next)
            if (j->id == id && j->kind == JOB_COPY) {
                __atomic_store_n(&j->cancelled, 1, __ATOMIC_RELEASE);
                found = 1;
                break;
            }
    pthread_mutex_unlock(&p->mu);
    return PyBool_FromLong(found);
}

static PyObject *pool_queued(CopyPool *p, PyObject *unused) {
    PyObject *out = PyDict_New();
    (void)unused;
    if (out == NULL) return NULL;
    pthread_mutex_lock(&p->mu);
    for (User *u = p->turn_head; u != NULL; u = u->next) {
        PyObject *k = PyLong_FromLongLong(u->uid), *v = PyLong_FromSsize_t(u->count);
        int bad = k == NULL || v == NULL || PyDict_SetItem(out, k, v) < 0;
        Py_XDECREF(k);
        Py_XDECREF(v);
        if (bad) {
            pthread_mutex_unlock(&p->mu);
            Py_DECREF(out);
            return NULL;
        }
    }
    pthread_mutex_unlock(&p->mu);
    return out;
}

static PyObject *pool_shutdown(CopyPool *p, PyObject *args) {
    int cancel = 0, wake = 0;
    PyObject *calls = PyList_New(0);
    if (calls == NULL) return NULL;
    if (!PyArg_ParseTuple(args, "|p", &cancel)) {
        Py_DECREF(calls);
        return NULL;
    }
    pthread_mutex_lock(&p->mu);
    p->closed = 1;
    while (cancel && p->queued > 0) {
        Job *j = dequeue(p);
        if (j->kind == JOB_CALL) {
            PyObject *id = PyLong_FromLongLong(j->id);
            if (id == NULL || PyList_Append(calls, id) < 0) PyErr_Clear();
            Py_XDECREF(id);
            free(j);
        } else {
            j->status = END_CANCELLED;
            wake |= ended(p, j);
        }
    }
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
    if (wake) signal_fd(p);
    return calls;
}

static PyObject *pool_ended(CopyPool *p, PyObject *unused) {
    Py_ssize_t n = 0;
    (void)unused;
    pthread_mutex_lock(&p->mu);
    for (Job *j = p->ended_head; j != NULL; j = j->next) n++;
    pthread_mutex_unlock(&p->mu);
    return PyLong_FromSsize_t(n);
}

static PyObject *pool_fd(CopyPool *p, void *closure) {
    (void)closure;
    return PyLong_FromLong(p->efd);
}

static PyMethodDef pool_methods[] = {
    {"submit_copy", (PyCFunction)pool_submit_copy, METH_VARARGS,
     "submit_copy(id, user, host, host_nbytes, offsets, page_ids, table, groups, to_host, "
     "stream, yield_bytes, layers_addr, wake_addr, num_layers, bounds=None): queue a region "
     "copy, every row and index checked first (ValueError, nothing queued); with bounds "
     "(int64 part starts, then the end), one part per pair, ids id, id + 1, ..., a layer "
     "announced once every part has copied it."},
    {"submit_call", (PyCFunction)pool_submit_call, METH_VARARGS,
     "submit_call(id, user): queue a job written in Python; serve() hands its id to a thread."},
    {"serve", (PyCFunction)pool_serve, METH_NOARGS,
     "serve() -> int | None: run region copies (GIL released) until a Python job's id is "
     "due (returned), or the pool is shut down and empty (None)."},
    {"reap", (PyCFunction)pool_reap, METH_NOARGS,
     "reap() -> list[(id, status, pages)]: the region copies that ended (0 DONE, 1 SHORT: "
     "pages is the faulting page's index, 2 CANCELLED)."},
    {"cancel", (PyCFunction)pool_cancel, METH_O,
     "cancel(id) -> bool: a queued or running region copy stops before its next group."},
    {"queued", (PyCFunction)pool_queued, METH_NOARGS, "queued() -> {user: jobs waiting}."},
    {"ended", (PyCFunction)pool_ended, METH_NOARGS,
     "ended() -> int: region copies that ended and were not reaped yet."},
    {"shutdown", (PyCFunction)pool_shutdown, METH_VARARGS,
     "shutdown(cancel=False) -> list[int]: take no more jobs; with cancel, drop the queued "
     "ones (region copies end CANCELLED) and return the dropped Python jobs' ids."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef pool_getset[] = {
    {"fd", (getter)pool_fd, NULL, "the eventfd readable when region copies have ended", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject CopyPoolType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvtier.kernels._guarded.CopyPool",
    .tp_basicsize = sizeof(CopyPool),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The queue of the copy threads (see the module's source).",
    .tp_new = pool_new,
    .tp_dealloc = (destructor)pool_dealloc,
    .tp_methods = pool_methods,
    .tp_getset = pool_getset,
};

static PyMethodDef methods[] = {
    {"copy_regions", copy_regions, METH_VARARGS,
     "copy_regions(host, host_nbytes, offsets, page_ids, table, to_host, stream=False, yield_bytes=0) -> int: "
     "the pages of every region row (host_add, engine, engine_pages, stride, length), every "
     "index checked first; the number copied before a SIGBUS (rows x pages when none)."},
    {"copy_strided", copy_strided, METH_VARARGS,
     "copy_strided(host, host_nbytes, offsets, host_add, engine, engine_pages, page_ids, "
     "stride, length, to_host, stream=False, yield_bytes=0) -> int: one region's pages, every index checked first; the "
     "number copied before a SIGBUS (all of them when none)."},
    {"copy_pages", copy_pages, METH_VARARGS,
     "copy_pages(dsts, srcs, length, stream=False, yield_bytes=0) -> int: memcpy each page; the number copied before a "
     "SIGBUS (all of them when none)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_guarded",
    "Page copies that survive a shared mapping shrinking under them (SIGBUS).", -1, methods,
};

PyMODINIT_FUNC PyInit__guarded(void) {
    struct sigaction sa;
    PyObject *m;
    detect_cpu();
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_sigbus;
    sa.sa_flags = SA_SIGINFO | SA_NODEFER;
    sigemptyset(&sa.sa_mask);
    if (sigaction(SIGBUS, &sa, &previous) != 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        return NULL;
    }
    if (PyType_Ready(&CopyPoolType) < 0) return NULL;
    m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    if (PyModule_AddType(m, &CopyPoolType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
