/* kvtier.kernels._guarded: page copies over memory that may vanish under them.

   copy_pages(dsts, srcs, length, stream=False, yield_bytes=0) -> int
       For each i, memcpy(dsts[i], srcs[i], length) (addresses as ints), with the GIL
       released. Returns how many pages were copied: len(dsts) when all were, fewer when a
       page faulted with SIGBUS (a shared mapping whose file shrank under it: an engine
       truncated the memfd it handed over). The copy stops there; nothing else happens.

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
   hot in the cache copies slower streamed, so the caller streams only large transfers. The copy
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

__attribute__((target("avx2"))) static void stream_avx2(char *d, const char *s, size_t n) {
    size_t head = (32 - ((uintptr_t)d & 31)) & 31, i = 0;
    if (head > n) head = n;
    memcpy(d, s, head);
    d += head, s += head, n -= head;
    for (; i + 128 <= n; i += 128) {
        __m256i a = _mm256_loadu_si256((const __m256i *)(s + i));
        __m256i b = _mm256_loadu_si256((const __m256i *)(s + i + 32));
        __m256i c = _mm256_loadu_si256((const __m256i *)(s + i + 64));
        __m256i e = _mm256_loadu_si256((const __m256i *)(s + i + 96));
        _mm256_stream_si256((__m256i *)(d + i), a);
        _mm256_stream_si256((__m256i *)(d + i + 32), b);
        _mm256_stream_si256((__m256i *)(d + i + 64), c);
        _mm256_stream_si256((__m256i *)(d + i + 96), e);
    }
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

static void fence(void) {}

static void detect_cpu(void) {}
#endif

static __thread sigjmp_buf *guard = NULL;

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

static Py_ssize_t guarded_copy(uintptr_t *d, uintptr_t *s, Py_ssize_t n, size_t length,
                               int stream, size_t every) {
    volatile Py_ssize_t done = 0;
    size_t since = 0;
    sigjmp_buf env;
    if (sigsetjmp(env, 1) == 0) {
        guard = &env;
        while (done < n) {
            page_copy((void *)d[done], (const void *)s[done], length, stream);
            done = done + 1;
            pace(&since, length, every);
        }
    }
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
    volatile Py_ssize_t done = 0;
    size_t since = 0;
    sigjmp_buf env;
    if (sigsetjmp(env, 1) == 0) {
        guard = &env;
        for (Py_ssize_t r = 0; r < nrows; r++) {
            const char *row = rows + r * ROW_WORDS * (Py_ssize_t)sizeof(int64_t);
            Py_ssize_t add = at(row, ROW_ADD), stride = at(row, ROW_STRIDE);
            size_t length = (size_t)at(row, ROW_LENGTH);
            char *engine = (char *)(uintptr_t)at(row, ROW_ENGINE);
            for (Py_ssize_t i = 0; i < n; i++) {
                char *h = host + at(offs, i) + add;
                char *e = engine + at(pids, i) * stride;
                if (to_host)
                    page_copy(h, e, length, stream);
                else
                    page_copy(e, h, length, stream);
                done = done + 1;
                pace(&since, length, every);
            }
        }
    }
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

static PyObject *copy_regions(PyObject *self, PyObject *args) {
    unsigned long long host;
    Py_ssize_t host_nbytes, n, nrows, done = 0, min_pages = PY_SSIZE_T_MAX, reach = 0, every = 0;
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
    for (Py_ssize_t r = 0; r < nrows; r++) {
        const char *row = (const char *)rows.buf + r * ROW_WORDS * 8;
        int64_t add = at(row, ROW_ADD), pages = at(row, ROW_PAGES), stride = at(row, ROW_STRIDE),
                length = at(row, ROW_LENGTH);
        if (length <= 0 || stride < length || pages < 0 || add < 0 ||
            length > (int64_t)host_nbytes || add > (int64_t)host_nbytes - length) {
            PyErr_Format(PyExc_ValueError, "table row %zd: length = %lld must be > 0 and at "
                         "most stride = %lld and host_nbytes = %zd; engine_pages = %lld and "
                         "host_add = %lld must not be negative, nor host_add + length over "
                         "host_nbytes", r, (long long)length, (long long)stride, host_nbytes,
                         (long long)pages, (long long)add);
            goto end;
        }
        if (pages < min_pages) min_pages = (Py_ssize_t)pages;
        if (add + length > reach) reach = (Py_ssize_t)(add + length);
    }
    for (Py_ssize_t i = 0; i < n && nrows > 0; i++) {
        int64_t p = at(pids.buf, i), o = at(offs.buf, i);
        if (p < 0 || p >= min_pages) {
            PyErr_Format(PyExc_ValueError, "page_ids[%zd] = %lld is outside the regions' %zd "
                         "pages", i, (long long)p, min_pages);
            goto end;
        }
        if (o < 0 || o > (int64_t)(host_nbytes - reach)) {
            PyErr_Format(PyExc_ValueError, "offsets[%zd] = %lld: the %zd bytes of a page there "
                         "are outside the arena's %zd", i, (long long)o, reach, host_nbytes);
            goto end;
        }
    }
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
    detect_cpu();
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_sigbus;
    sa.sa_flags = SA_SIGINFO | SA_NODEFER;
    sigemptyset(&sa.sa_mask);
    if (sigaction(SIGBUS, &sa, &previous) != 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        return NULL;
    }
    return PyModule_Create(&module);
}
