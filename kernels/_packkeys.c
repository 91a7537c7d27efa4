/* kvtier.kernels._packkeys: a client's list of 32-byte page keys as one byte string, the
 * packed_keys of a LOOKUP, LOAD or STORE (kvtier.ipc.packed.pack_keys).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

#define KEY_BYTES 32

/* pack_keys(keys) -> bytes | None: the 32-byte keys of the list `keys` back to back, as a
 * packed LOOKUP, LOAD or STORE carries them; None when an item is not a bytes object of
 * exactly 32 bytes (the caller then sends the list, which the daemon refuses naming the
 * key). b"".join does the same in two passes and fills a Py_buffer per item first (80
 * bytes each); one pass over the list's own objects is several times faster.
 */
static PyObject *pack_keys(PyObject *self, PyObject *keys) {
    (void)self;
    if (!PyList_Check(keys)) {
        PyErr_SetString(PyExc_TypeError, "pack_keys takes a list of bytes");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(keys);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *k = PyList_GET_ITEM(keys, i);
        if (!PyBytes_CheckExact(k) || PyBytes_GET_SIZE(k) != KEY_BYTES)
            Py_RETURN_NONE;
    }
    PyObject *out = PyBytes_FromStringAndSize(NULL, n * KEY_BYTES);
    if (out == NULL)
        return NULL;
    char *dst = PyBytes_AS_STRING(out);
    /* the list cannot change meanwhile: nothing here runs Python code or drops the GIL */
    for (Py_ssize_t i = 0; i < n; i++, dst += KEY_BYTES)
        memcpy(dst, PyBytes_AS_STRING(PyList_GET_ITEM(keys, i)), KEY_BYTES);
    return out;
}

static PyMethodDef methods[] = {
    {"pack_keys", pack_keys, METH_O,
     "pack_keys(keys) -> bytes | None: a list of 32-byte bytes objects back to back (None when "
     "an item is anything else)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_packkeys", "A client's page keys packed for the wire, in C.", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__packkeys(void) { return PyModule_Create(&module); }
