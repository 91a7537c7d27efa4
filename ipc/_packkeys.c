/* kvtier.ipc._packkeys: a client's 32-byte page keys as one byte string, the packed_keys of
 * a LOOKUP, LOAD or STORE (kvtier.ipc.packed.pack_keys, its one implementation).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
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

static PyMethodDef methods[] = {
    {"pack_keys", pack_keys, METH_O,
     "pack_keys(keys) -> bytes | None: a sequence of 32-byte bytes objects back to back (None "
     "when an item is anything else)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_packkeys", "A client's page keys packed for the wire, in C.", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__packkeys(void) { return PyModule_Create(&module); }
