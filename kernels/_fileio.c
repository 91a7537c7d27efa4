/* kvtier.kernels._fileio: page I/O between a buffer and a file, checksummed, without the GIL.

   write_pages(fd, buf, offsets, length, positions) -> list[int | None]
       For each i: write buf[offsets[i] : offsets[i] + length] to the file at positions[i]
       (pwrite, restarted on EINTR and on short writes), then the xxh3-64 checksum of those
       bytes (hashed right after the copy, while they are in cache). None for a page whose
       write failed.

   read_pages(fd, buf, offsets, length, positions) -> list[int | None]
       For each i: read `length` bytes at positions[i] into buf[offsets[i] : ...] (pread,
       restarted likewise), then their xxh3-64 checksum. None for a page whose read failed
       or came back short (end of file).

   The whole batch runs with the GIL released: one release per call instead of two per page
   (the syscall and the hash), so that the daemon's event loop and the other I/O threads do
   not take turns with it page by page. Arguments are checked before any I/O: a bad one
   raises ValueError/TypeError/OverflowError and nothing is read or written.

   seal_headers(hbuf, headers, pbuf, payloads, length, ns, keys) -> None
       For each i: the xxh3-64 of pbuf[payloads[i] : payloads[i] + length], then the 96-byte
       object header of kvtier.daemon.storage.objects (magic, format version, namespace, key,
       length, that checksum, the header's own checksum) written at hbuf[headers[i]:].

   write_headers(hbuf, headers, length, ns, keys, checksums) -> None
       The same headers, recording checksums the caller computed (e.g. while copying).

   recorded_checksums(hbuf, headers, length, ns, keys) -> list[int | None]
       The payload checksum each header records; None where the header does not verify.

   check_headers(hbuf, headers, pbuf, payloads, length, ns, keys) -> list[bool]
       For each i: True when the header at hbuf[headers[i]:] verifies (its checksum, magic,
       format version, namespace, key and length) and the payload's xxh3-64 is the one it
       records. hbuf and pbuf may be the same buffer (headers in the slots' headroom).

   The checksum is XXH3_64bits with seed 0, identical to the Python `xxhash.xxh3_64_intdigest`
   (the XXH3 output is frozen since xxHash 0.8.0; a unit test compares the two). */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define XXH_INLINE_ALL
#include <xxhash.h>

/* XXH3-64 of the build's baseline vector unit (SSE2 on x86-64), or the AVX2 build
   (_xxh3_avx2.c) when the CPU has AVX2: the same function, faster. There is no AVX-512
   build: pages hashed from the last-level cache or memory are bound by memory, not by the vector unit, and
   AVX-512 is faster only on cache-resident data. */
typedef uint64_t (*hash_fn)(const void *, size_t);
static uint64_t xxh3_base(const void *p, size_t n) { return (uint64_t)XXH3_64bits(p, n); }
#if defined(__x86_64__) && defined(__GNUC__)
uint64_t kvtier_xxh3_avx2(const void *p, size_t n);
#endif
static hash_fn xxh3 = xxh3_base;
static const char *xxh3_impl = "baseline";

typedef struct {
    Py_ssize_t n;
    Py_ssize_t *offsets;
    long long *positions;
    int *ok;
    uint64_t *sums;
} batch_t;

static void batch_free(batch_t *b) {
    PyMem_Free(b->offsets);
    PyMem_Free(b->positions);
    PyMem_Free(b->ok);
    PyMem_Free(b->sums);
}

/* Parse and check offsets/positions against the buffer; 0 on success, -1 with an exception. */
static int batch_parse(batch_t *b, PyObject *offsets, PyObject *positions, Py_ssize_t length,
                       Py_ssize_t buflen) {
    memset(b, 0, sizeof(*b));
    if (length <= 0) {
        PyErr_Format(PyExc_ValueError, "length = %zd must be > 0", length);
        return -1;
    }
    PyObject *offs = PySequence_Fast(offsets, "offsets must be a sequence of ints");
    if (offs == NULL)
        return -1;
    PyObject *pos = PySequence_Fast(positions, "positions must be a sequence of ints");
    if (pos == NULL) {
        Py_DECREF(offs);
        return -1;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(offs);
    if (PySequence_Fast_GET_SIZE(pos) != n) {
        PyErr_Format(PyExc_ValueError, "%zd offsets but %zd positions", n,
                     PySequence_Fast_GET_SIZE(pos));
        goto fail;
    }
    b->n = n;
    b->offsets = PyMem_Calloc(n ? n : 1, sizeof(Py_ssize_t));
    b->positions = PyMem_Calloc(n ? n : 1, sizeof(long long));
    b->ok = PyMem_Calloc(n ? n : 1, sizeof(int));
    b->sums = PyMem_Calloc(n ? n : 1, sizeof(uint64_t));
    if (!b->offsets || !b->positions || !b->ok || !b->sums) {
        PyErr_NoMemory();
        goto fail;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t off = PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(offs, i));
        if (off == -1 && PyErr_Occurred())
            goto fail;
        long long p = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(pos, i));
        if (p == -1 && PyErr_Occurred())
            goto fail;
        if (off < 0 || off > buflen - length) {
            PyErr_Format(PyExc_ValueError,
                         "offsets[%zd] = %zd: the page does not fit in the buffer of %zd bytes",
                         i, off, buflen);
            goto fail;
        }
        if (p < 0) {
            PyErr_Format(PyExc_ValueError, "positions[%zd] = %lld must be >= 0", i, p);
            goto fail;
        }
        b->offsets[i] = off;
        b->positions[i] = p;
    }
    Py_DECREF(offs);
    Py_DECREF(pos);
    return 0;
fail:
    Py_DECREF(offs);
    Py_DECREF(pos);
    batch_free(b);
    return -1;
}

static PyObject *batch_result(batch_t *b) {
    PyObject *out = PyList_New(b->n);
    if (out == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < b->n; i++) {
        PyObject *item;
        if (b->ok[i]) {
            item = PyLong_FromUnsignedLongLong((unsigned long long)b->sums[i]);
            if (item == NULL) {
                Py_DECREF(out);
                return NULL;
            }
        } else {
            item = Py_None;
            Py_INCREF(item);
        }
        PyList_SET_ITEM(out, i, item);
    }
    return out;
}

/* Write or read `length` bytes at `pos`, restarting on EINTR and short transfers. */
static int full_io(int fd, char *p, size_t length, off_t pos, int writing) {
    size_t done = 0;
    while (done < length) {
        ssize_t r = writing ? pwrite(fd, p + done, length - done, pos + (off_t)done)
                            : pread(fd, p + done, length - done, pos + (off_t)done);
        if (r < 0) {
            if (errno == EINTR)
                continue;
            return 0;
        }
        if (r == 0)
            return 0; /* end of file (read) or nothing written */
        done += (size_t)r;
    }
    return 1;
}

static PyObject *pages_io(PyObject *args, int writing) {
    int fd;
    Py_buffer view;
    PyObject *offsets, *positions;
    Py_ssize_t length;
    if (!PyArg_ParseTuple(args, writing ? "iy*OnO:write_pages" : "iw*OnO:read_pages", &fd, &view,
                          &offsets, &length, &positions))
        return NULL;
    batch_t b;
    if (batch_parse(&b, offsets, positions, length, view.len) < 0) {
        PyBuffer_Release(&view);
        return NULL;
    }
    char *base = (char *)view.buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < b.n; i++) {
        char *p = base + b.offsets[i];
        if (full_io(fd, p, (size_t)length, (off_t)b.positions[i], writing)) {
            b.sums[i] = xxh3(p, (size_t)length);
            b.ok[i] = 1;
        }
    }
    Py_END_ALLOW_THREADS
    PyObject *out = batch_result(&b);
    batch_free(&b);
    PyBuffer_Release(&view);
    return out;
}

static PyObject *write_pages(PyObject *self, PyObject *args) {
    (void)self;
    return pages_io(args, 1);
}

static PyObject *read_pages(PyObject *self, PyObject *args) {
    (void)self;
    return pages_io(args, 0);
}

static PyObject *checksum(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer view;
    if (!PyArg_ParseTuple(args, "y*:checksum", &view))
        return NULL;
    uint64_t h;
    Py_BEGIN_ALLOW_THREADS
    h = xxh3(view.buf, (size_t)view.len);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLongLong((unsigned long long)h);
}

/* ---- object headers (the layout of kvtier.daemon.storage.objects) ------------------------ */

#define HDR_SIZE 96
#define HDR_SUMMED 88 /* bytes covered by the header checksum */
#define HDR_VERSION 1
#define ID_BYTES 32

typedef struct {
    Py_ssize_t n;
    Py_ssize_t *headers, *payloads;
    const char *keys; /* n * 32 bytes, copied so that the GIL can be released */
    char ns[ID_BYTES];
} objects_t;

static void objects_free(objects_t *o) {
    PyMem_Free(o->headers);
    PyMem_Free(o->payloads);
    PyMem_Free((void *)o->keys);
}

/* Offsets of name (a sequence of n ints) into out, each in [0, buflen - span]. */
static int parse_offsets(PyObject *seq, const char *name, Py_ssize_t n, Py_ssize_t span,
                         Py_ssize_t buflen, Py_ssize_t *out) {
    PyObject *fast = PySequence_Fast(seq, "offsets must be a sequence of ints");
    if (fast == NULL)
        return -1;
    if (PySequence_Fast_GET_SIZE(fast) != n) {
        PyErr_Format(PyExc_ValueError, "%zd keys but %zd %s", n, PySequence_Fast_GET_SIZE(fast),
                     name);
        Py_DECREF(fast);
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t off = PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(fast, i));
        if (off == -1 && PyErr_Occurred()) {
            Py_DECREF(fast);
            return -1;
        }
        if (off < 0 || off > buflen - span) {
            PyErr_Format(PyExc_ValueError, "%s[%zd] = %zd: %zd bytes there do not fit in the "
                         "buffer of %zd bytes", name, i, off, span, buflen);
            Py_DECREF(fast);
            return -1;
        }
        out[i] = off;
    }
    Py_DECREF(fast);
    return 0;
}

static int objects_parse(objects_t *o, PyObject *headers, Py_ssize_t hlen, PyObject *payloads,
                         Py_ssize_t plen, Py_ssize_t length, Py_buffer *ns, PyObject *keys) {
    memset(o, 0, sizeof(*o));
    if (length <= 0) {
        PyErr_Format(PyExc_ValueError, "length = %zd must be > 0", length);
        return -1;
    }
    if (ns->len != ID_BYTES) {
        PyErr_Format(PyExc_ValueError, "ns has %zd bytes, not %d", ns->len, ID_BYTES);
        return -1;
    }
    memcpy(o->ns, ns->buf, ID_BYTES);
    PyObject *kf = PySequence_Fast(keys, "keys must be a sequence of bytes");
    if (kf == NULL)
        return -1;
    Py_ssize_t n = o->n = PySequence_Fast_GET_SIZE(kf);
    o->headers = PyMem_Calloc(n ? n : 1, sizeof(Py_ssize_t));
    o->payloads = PyMem_Calloc(n ? n : 1, sizeof(Py_ssize_t));
    char *kb = PyMem_Malloc(n ? (size_t)n * ID_BYTES : 1);
    o->keys = kb;
    if (!o->headers || !o->payloads || !kb) {
        PyErr_NoMemory();
        goto fail;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *k = PySequence_Fast_GET_ITEM(kf, i);
        if (!PyBytes_Check(k) || PyBytes_GET_SIZE(k) != ID_BYTES) {
            PyErr_Format(PyExc_ValueError, "keys[%zd] must be %d bytes", i, ID_BYTES);
            goto fail;
        }
        memcpy(kb + i * ID_BYTES, PyBytes_AS_STRING(k), ID_BYTES);
    }
    if (parse_offsets(headers, "headers", n, HDR_SIZE, hlen, o->headers) < 0 ||
        (payloads != NULL &&
         parse_offsets(payloads, "payloads", n, length, plen, o->payloads) < 0))
        goto fail;
    Py_DECREF(kf);
    return 0;
fail:
    Py_DECREF(kf);
    objects_free(o);
    return -1;
}

/* Little-endian fields, whatever the host's byte order. */
static void put_le64(char *p, uint64_t v) {
    for (int i = 0; i < 8; i++)
        p[i] = (char)(v >> (8 * i));
}

static uint64_t get_le64(const char *p) {
    uint64_t v = 0;
    for (int i = 0; i < 8; i++)
        v |= (uint64_t)(unsigned char)p[i] << (8 * i);
    return v;
}

static void seal_one(char *h, const char *ns, const char *key, uint64_t length, uint64_t sum) {
    memcpy(h, "KVTP", 4);
    h[4] = (char)(HDR_VERSION & 0xff);
    h[5] = (char)(HDR_VERSION >> 8);
    h[6] = h[7] = 0; /* reserved */
    memcpy(h + 8, ns, ID_BYTES);
    memcpy(h + 40, key, ID_BYTES);
    put_le64(h + 72, length);
    put_le64(h + 80, sum);
    put_le64(h + 88, XXH3_64bits(h, HDR_SUMMED));
}

/* The payload checksum a header records, when everything else in it verifies. */
static int check_one(const char *h, const char *ns, const char *key, uint64_t length,
                     uint64_t *sum) {
    unsigned version = (unsigned char)h[4] | (unsigned)(unsigned char)h[5] << 8;
    if (XXH3_64bits(h, HDR_SUMMED) != get_le64(h + 88) || memcmp(h, "KVTP", 4) != 0 ||
        version != HDR_VERSION || memcmp(h + 8, ns, ID_BYTES) != 0 ||
        memcmp(h + 40, key, ID_BYTES) != 0 || get_le64(h + 72) != length)
        return 0;
    *sum = get_le64(h + 80);
    return 1;
}

static PyObject *headers_io(PyObject *args, int sealing) {
    Py_buffer hbuf, pbuf, ns;
    PyObject *headers, *payloads, *keys;
    Py_ssize_t length;
    if (!PyArg_ParseTuple(args, sealing ? "w*Oy*Ony*O:seal_headers" : "y*Oy*Ony*O:check_headers",
                          &hbuf, &headers, &pbuf, &payloads, &length, &ns, &keys))
        return NULL;
    PyObject *out = NULL;
    objects_t o;
    int *ok = NULL;
    if (objects_parse(&o, headers, hbuf.len, payloads, pbuf.len, length, &ns, keys) < 0)
        goto done;
    ok = PyMem_Calloc(o.n ? o.n : 1, sizeof(int));
    if (ok == NULL) {
        PyErr_NoMemory();
        objects_free(&o);
        goto done;
    }
    char *hb = (char *)hbuf.buf;
    const char *pb = (const char *)pbuf.buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < o.n; i++) {
        char *h = hb + o.headers[i];
        const char *key = o.keys + i * ID_BYTES;
        uint64_t recorded;
        if (sealing)
            seal_one(h, o.ns, key, (uint64_t)length, xxh3(pb + o.payloads[i], (size_t)length));
        else
            ok[i] = check_one(h, o.ns, key, (uint64_t)length, &recorded) &&
                    xxh3(pb + o.payloads[i], (size_t)length) == recorded;
    }
    Py_END_ALLOW_THREADS
    if (sealing) {
        out = Py_None;
        Py_INCREF(out);
    } else if ((out = PyList_New(o.n)) != NULL) {
        for (Py_ssize_t i = 0; i < o.n; i++) {
            PyObject *flag = ok[i] ? Py_True : Py_False;
            Py_INCREF(flag);
            PyList_SET_ITEM(out, i, flag);
        }
    }
    PyMem_Free(ok);
    objects_free(&o);
done:
    PyBuffer_Release(&hbuf);
    PyBuffer_Release(&pbuf);
    PyBuffer_Release(&ns);
    return out;
}

static PyObject *seal_headers(PyObject *self, PyObject *args) {
    (void)self;
    return headers_io(args, 1);
}

static PyObject *check_headers(PyObject *self, PyObject *args) {
    (void)self;
    return headers_io(args, 0);
}

/* Write headers recording the given payload checksums (the caller hashed the payloads). */
static PyObject *write_headers(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer hbuf, ns;
    PyObject *headers, *keys, *checksums;
    Py_ssize_t length;
    if (!PyArg_ParseTuple(args, "w*Ony*OO:write_headers", &hbuf, &headers, &length, &ns, &keys,
                          &checksums))
        return NULL;
    PyObject *out = NULL, *sums = NULL;
    uint64_t *values = NULL;
    objects_t o;
    if (objects_parse(&o, headers, hbuf.len, NULL, 0, length, &ns, keys) < 0)
        goto done;
    sums = PySequence_Fast(checksums, "checksums must be a sequence of ints");
    if (sums == NULL)
        goto parsed;
    if (PySequence_Fast_GET_SIZE(sums) != o.n) {
        PyErr_Format(PyExc_ValueError, "%zd keys but %zd checksums", o.n,
                     PySequence_Fast_GET_SIZE(sums));
        goto parsed;
    }
    values = PyMem_Calloc(o.n ? o.n : 1, sizeof(uint64_t));
    if (values == NULL) {
        PyErr_NoMemory();
        goto parsed;
    }
    for (Py_ssize_t i = 0; i < o.n; i++) {
        values[i] = PyLong_AsUnsignedLongLong(PySequence_Fast_GET_ITEM(sums, i));
        if (PyErr_Occurred()) {
            PyErr_Format(PyExc_ValueError, "checksums[%zd] must be an int of 64 bits", i);
            goto parsed;
        }
    }
    for (Py_ssize_t i = 0; i < o.n; i++)
        seal_one((char *)hbuf.buf + o.headers[i], o.ns, o.keys + i * ID_BYTES, (uint64_t)length,
                 values[i]);
    out = Py_None;
    Py_INCREF(out);
parsed:
    PyMem_Free(values);
    Py_XDECREF(sums);
    objects_free(&o);
done:
    PyBuffer_Release(&hbuf);
    PyBuffer_Release(&ns);
    return out;
}

/* The payload checksum each header records, or None where the header does not verify. */
static PyObject *recorded_checksums(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer hbuf, ns;
    PyObject *headers, *keys;
    Py_ssize_t length;
    if (!PyArg_ParseTuple(args, "y*Ony*O:recorded_checksums", &hbuf, &headers, &length, &ns,
                          &keys))
        return NULL;
    PyObject *out = NULL;
    objects_t o;
    if (objects_parse(&o, headers, hbuf.len, NULL, 0, length, &ns, keys) < 0)
        goto done;
    if ((out = PyList_New(o.n)) == NULL)
        goto parsed;
    for (Py_ssize_t i = 0; i < o.n; i++) {
        uint64_t sum;
        PyObject *item;
        if (check_one((const char *)hbuf.buf + o.headers[i], o.ns, o.keys + i * ID_BYTES,
                      (uint64_t)length, &sum)) {
            if ((item = PyLong_FromUnsignedLongLong((unsigned long long)sum)) == NULL) {
                Py_CLEAR(out);
                goto parsed;
            }
        } else {
            item = Py_None;
            Py_INCREF(item);
        }
        PyList_SET_ITEM(out, i, item);
    }
parsed:
    objects_free(&o);
done:
    PyBuffer_Release(&hbuf);
    PyBuffer_Release(&ns);
    return out;
}

static PyMethodDef methods[] = {
    {"write_headers", write_headers, METH_VARARGS,
     "write_headers(hbuf, headers, length, ns, keys, checksums) -> None: write the object "
     "header recording each given payload checksum at its offset in hbuf."},
    {"recorded_checksums", recorded_checksums, METH_VARARGS,
     "recorded_checksums(hbuf, headers, length, ns, keys) -> list[int | None]: the payload "
     "checksum each header records, None where it does not verify."},
    {"seal_headers", seal_headers, METH_VARARGS,
     "seal_headers(hbuf, headers, pbuf, payloads, length, ns, keys) -> None: hash each payload "
     "of pbuf and write its 96-byte object header at its offset in hbuf."},
    {"check_headers", check_headers, METH_VARARGS,
     "check_headers(hbuf, headers, pbuf, payloads, length, ns, keys) -> list[bool]: whether "
     "each header verifies and records its payload's xxh3-64."},
    {"write_pages", write_pages, METH_VARARGS,
     "write_pages(fd, buf, offsets, length, positions) -> list[int | None]: pwrite each page "
     "of buf to its file position, then its xxh3-64 checksum (None: the write failed)."},
    {"read_pages", read_pages, METH_VARARGS,
     "read_pages(fd, buf, offsets, length, positions) -> list[int | None]: pread each page "
     "into buf, then its xxh3-64 checksum (None: the read failed or came back short)."},
    {"checksum", checksum, METH_VARARGS, "checksum(buf) -> int: the xxh3-64 of buf."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_fileio",
    "Checksummed page I/O between a buffer and a file, with the GIL released per batch.", -1,
    methods,
};

PyMODINIT_FUNC PyInit__fileio(void) {
#if defined(__x86_64__) && defined(__GNUC__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2")) {
        xxh3 = kvtier_xxh3_avx2;
        xxh3_impl = "avx2";
    }
#endif
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddStringConstant(m, "HASH_IMPL", xxh3_impl) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
