/* kvtier.ipc._packkeys: a client's 32-byte page keys as one byte string, the packed_keys of
 * a LOOKUP, LOAD or STORE (kvtier.ipc.packed.pack_keys, its one implementation), and the
 * daemon's check of a packed request's engine pages (check_pages).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define KEY_BYTES 32

/* pack_keys(keys) -> bytes | None: the 32-byte keys of the sequence `keys` back to back, as
 * a packed LOOKUP, LOAD or STORE carries them; None when an item is not a bytes object of
 * exactly 32 bytes. A list or a tuple is read as it is; any other sequence is first made a
 * list (PySequence_Fast: its Python code runs then, before any key is read). b"".join does
 * the same in two passes and fills a Py_buffer per item first (80 bytes each); one pass
 * over the sequence's own objects is several times faster.
 */
static PyObject *pack_keys(PyObject *self, PyObject *keys) {
    (void)self;
    PyObject *seq = PySequence_Fast(keys, "pack_keys takes a sequence of bytes");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    PyObject *out = NULL;
    for (Py_ssize_t i = 0; i < n; i++)
        if (!PyBytes_CheckExact(items[i]) || PyBytes_GET_SIZE(items[i]) != KEY_BYTES) {
            out = Py_NewRef(Py_None);
            goto end;
        }
    out = PyBytes_FromStringAndSize(NULL, n * KEY_BYTES);
    if (out == NULL)
        goto end;
    char *dst = PyBytes_AS_STRING(out);
    /* the sequence cannot change meanwhile: nothing here runs Python code or drops the GIL */
    for (Py_ssize_t i = 0; i < n; i++, dst += KEY_BYTES)
        memcpy(dst, PyBytes_AS_STRING(items[i]), KEY_BYTES);
end:
    Py_DECREF(seq);
    return out;
}

/* The page at index i of packed little-endian uint32 pages. */
static inline uint64_t page_at(const unsigned char *b, Py_ssize_t i) {
    const unsigned char *q = b + 4 * i;
    return (uint64_t)q[0] | (uint64_t)q[1] << 8 | (uint64_t)q[2] << 16 | (uint64_t)q[3] << 24;
}

/* check_pages(packed_pages, num_pages) -> None | (reason, index): None when every page of
 * the little-endian uint32 pages is below num_pages and none is there twice; otherwise
 * (1, i) for the first page at or above num_pages, or, when there is none, (2, i) for the
 * first page that an earlier one repeats. Linear: a pass for the range, one with a hash set
 * of twice as many entries as pages (8 bytes each), on the event loop of the daemon, where
 * a sort of a long STORE's pages would hold every other engine's request.
 */
static PyObject *check_pages(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer buf;
    Py_ssize_t num_pages; /* "n": a negative or too large int is refused, never wrapped */
    if (!PyArg_ParseTuple(args, "y*n:check_pages", &buf, &num_pages))
        return NULL;
    PyObject *out = NULL;
    if (num_pages < 0) {
        PyErr_Format(PyExc_ValueError, "num_pages = %zd must not be negative", num_pages);
        goto end;
    }
    if (buf.len % 4) {
        PyErr_Format(PyExc_ValueError, "packed pages of %zd bytes: not whole uint32 pages",
                     buf.len);
        goto end;
    }
    Py_ssize_t n = buf.len / 4;
    const unsigned char *b = (const unsigned char *)buf.buf;
    for (Py_ssize_t i = 0; i < n; i++)
        if (page_at(b, i) >= (uint64_t)num_pages) {
            out = Py_BuildValue("(in)", 1, i);
            goto end;
        }
    if (n < 2) {
        out = Py_NewRef(Py_None);
        goto end;
    }
    size_t cap = 16;
    while (cap < 2 * (size_t)n)
        cap <<= 1;
    uint64_t *set = calloc(cap, sizeof *set); /* page + 1; 0: empty */
    if (set == NULL) {
        PyErr_NoMemory();
        goto end;
    }
    Py_ssize_t twice = -1;
    for (Py_ssize_t i = 0; i < n && twice < 0; i++) {
        uint64_t p = page_at(b, i) + 1;
        size_t h = (size_t)((p * 0x9E3779B97F4A7C15ull) >> 32) & (cap - 1);
        while (set[h] != 0 && set[h] != p)
            h = (h + 1) & (cap - 1);
        if (set[h] == p)
            twice = i;
        set[h] = p;
    }
    free(set);
    out = twice < 0 ? Py_NewRef(Py_None) : Py_BuildValue("(in)", 2, twice);
end:
    PyBuffer_Release(&buf);
    return out;
}

static PyMethodDef methods[] = {
    {"check_pages", check_pages, METH_VARARGS,
     "check_pages(packed_pages, num_pages) -> None | (reason, index): None when every "
     "little-endian uint32 page is below num_pages and none is there twice; else (1, i) for "
     "the first page out of range, or (2, i) for the first page given before"},
    {"pack_keys", pack_keys, METH_O,
     "pack_keys(keys) -> bytes | None: a sequence of 32-byte bytes objects back to back (None "
     "when an item is anything else)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_packkeys", "Packed page keys and pages of requests, in C.", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__packkeys(void) { return PyModule_Create(&module); }
