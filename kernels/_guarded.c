/* kvtier.kernels._guarded: page copies over memory that may vanish under them.

   copy_pages(dsts, srcs, length) -> int
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
                stride, length, to_host) -> int
       One region of a transfer in one call: for each i, the ``length`` bytes at
       ``engine + page_ids[i] * stride`` and those at ``host + offsets[i] + host_add`` are
       copied one way (into the host arena when ``to_host``). ``offsets`` and ``page_ids``
       are int64 buffers (numpy arrays) of one length. Every index is checked first (a page
       id in [0, engine_pages), a host range inside [0, host_nbytes)): a bad one raises
       ValueError naming it and nothing is copied. Then the pages are copied as
       copy_pages does (GIL released, stopping at a SIGBUS) and the count is returned.
       Planning a copy in numpy took longer than moving a 64 KiB page.

   The handler is installed when the module is imported. Addresses are the caller's to
   check: the daemon passes addresses inside the mappings and the arena it owns. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <setjmp.h>
#include <signal.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static __thread sigjmp_buf *guard = NULL;
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

static Py_ssize_t guarded_copy(uintptr_t *d, uintptr_t *s, Py_ssize_t n, size_t length) {
    volatile Py_ssize_t done = 0;
    sigjmp_buf env;
    if (sigsetjmp(env, 1) == 0) {
        guard = &env;
        while (done < n) {
            memcpy((void *)d[done], (const void *)s[done], length);
            done = done + 1;
        }
    }
    guard = NULL;
    return done;
}

static PyObject *copy_pages(PyObject *self, PyObject *args) {
    PyObject *dsts, *srcs;
    Py_ssize_t length, nd, ns, done;
    uintptr_t *d = NULL, *s = NULL;
    (void)self;
    if (!PyArg_ParseTuple(args, "OOn", &dsts, &srcs, &length)) return NULL;
    if (length <= 0) {
        PyErr_Format(PyExc_ValueError, "length = %zd must be > 0", length);
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
    done = guarded_copy(d, s, nd, (size_t)length);
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

static Py_ssize_t strided_copy(char *host, const char *offs, Py_ssize_t host_add, char *engine,
                               const char *pids, Py_ssize_t stride, Py_ssize_t n, size_t length,
                               int to_host) {
    volatile Py_ssize_t done = 0;
    sigjmp_buf env;
    if (sigsetjmp(env, 1) == 0) {
        guard = &env;
        while (done < n) {
            char *h = host + at(offs, done) + host_add;
            char *e = engine + at(pids, done) * stride;
            if (to_host)
                memcpy(h, e, length);
            else
                memcpy(e, h, length);
            done = done + 1;
        }
    }
    guard = NULL;
    return done;
}

static PyObject *copy_strided(PyObject *self, PyObject *args) {
    unsigned long long host, engine;
    Py_ssize_t host_nbytes, host_add, engine_pages, stride, length, n, done = 0;
    Py_buffer offs, pids;
    int to_host;
    PyObject *out = NULL;
    (void)self;
    if (!PyArg_ParseTuple(args, "Kny*nKny*nnp", &host, &host_nbytes, &offs, &host_add, &engine,
                          &engine_pages, &pids, &stride, &length, &to_host))
        return NULL;
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
    Py_BEGIN_ALLOW_THREADS
    done = strided_copy((char *)(uintptr_t)host, offs.buf, host_add, (char *)(uintptr_t)engine,
                        pids.buf, stride, n, (size_t)length, to_host);
    Py_END_ALLOW_THREADS
    out = PyLong_FromSsize_t(done);
end:
    PyBuffer_Release(&offs);
    PyBuffer_Release(&pids);
    return out;
}

static PyMethodDef methods[] = {
    {"copy_strided", copy_strided, METH_VARARGS,
     "copy_strided(host, host_nbytes, offsets, host_add, engine, engine_pages, page_ids, "
     "stride, length, to_host) -> int: one region's pages, every index checked first; the "
     "number copied before a SIGBUS (all of them when none)."},
    {"copy_pages", copy_pages, METH_VARARGS,
     "copy_pages(dsts, srcs, length) -> int: memcpy each page; the number copied before a "
     "SIGBUS (all of them when none)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_guarded",
    "Page copies that survive a shared mapping shrinking under them (SIGBUS).", -1, methods,
};

PyMODINIT_FUNC PyInit__guarded(void) {
    struct sigaction sa;
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
