/* kvtier.kernels._pins: the host pool's pin and unpin of a run of pages, in one C call.
 *
 * pin(pins, stamp, children, slots, clock) -> (clock, newly_pinned, childless)
 * unpin(pins, state, children, slots, ready) -> (unpinned, childless) or None
 *
 * The same per-page steps as daemon/pool/pages.py's PageTable._pin_slots and unpin, in the
 * same order, so a slot listed twice is pinned (or unpinned) twice, as page by page. What
 * stays in Python is the evictable lists: `childless` lists, in order, the pages that leave
 * them (pin: pinned for the first time and without resident children) or enter them
 * (unpin: left unpinned and without children), for the caller to move.
 *
 * pin walks `slots` from the last to the first (a chain's tail is touched first): each
 * page gets one more pin and the next tick of the access clock, `clock` + 1 onwards; the
 * new clock is returned. unpin checks every slot first (inside the columns, state `ready`,
 * pinned) and returns None, having changed nothing, when one is not, or when a slot is
 * listed more often than it is pinned: the caller's page-by-page path then names it in its
 * error. Every slot is checked against the columns before any change (ValueError), and the
 * columns' sizes against each other. (Only running out of memory for the returned list,
 * after the pins changed, leaves a run half done: MemoryError.)
 *
 * Buffers: pins int32, children int32, stamp int64, state int8, one entry per slot; slots
 * int64. A 64-page LOAD's pin and unpin took 34 and 60 us in numpy here once its copy had
 * flushed the caches; one pass here touches two cache lines a page.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

/* The columns agree in size and every slot is inside them; else ValueError. */
static int check(Py_ssize_t n_slots, Py_ssize_t pins, Py_ssize_t children, Py_ssize_t other,
                 Py_ssize_t other_item, const Py_buffer *slots) {
    if (pins != n_slots * 4 || children != n_slots * 4 || other != n_slots * other_item ||
        slots->len % 8) {
        PyErr_Format(PyExc_ValueError, "column sizes do not agree: pins %zd, children %zd, "
                     "stamp or state %zd bytes, slots %zd bytes", pins, children, other,
                     slots->len);
        return -1;
    }
    const int64_t *at = slots->buf;
    for (Py_ssize_t i = 0; i < slots->len / 8; i++)
        if (at[i] < 0 || at[i] >= n_slots) {
            PyErr_Format(PyExc_ValueError, "slot %lld (index %zd) is outside the %zd slots",
                         (long long)at[i], i, n_slots);
            return -1;
        }
    return 0;
}

/* The first k entries of a C array as a list of ints (NULL: out of memory). */
static PyObject *as_list(const int64_t *v, Py_ssize_t k) {
    PyObject *list = PyList_New(k);
    for (Py_ssize_t i = 0; list != NULL && i < k; i++) {
        PyObject *x = PyLong_FromLongLong(v[i]);
        if (x == NULL)
            Py_CLEAR(list);
        else
            PyList_SET_ITEM(list, i, x);
    }
    return list;
}

static PyObject *pin(PyObject *self, PyObject *args) {
    Py_buffer pins, stamp, children, slots;
    long long clock;
    PyObject *out = NULL, *list;
    int64_t *childless = NULL;
    (void)self;
    if (!PyArg_ParseTuple(args, "w*w*y*y*L", &pins, &stamp, &children, &slots, &clock))
        return NULL;
    Py_ssize_t n_slots = pins.len / 4, n = slots.len / 8, newly = 0, k = 0;
    if (check(n_slots, pins.len, children.len, stamp.len, 8, &slots) < 0)
        goto end;
    if ((childless = PyMem_Malloc((size_t)(n ? n : 1) * 8)) == NULL) {
        PyErr_NoMemory();
        goto end;
    }
    int32_t *pin_col = pins.buf;
    const int32_t *kids = children.buf;
    int64_t *stamps = stamp.buf;
    const int64_t *at = slots.buf;
    for (Py_ssize_t i = n - 1; i >= 0; i--) {
        int64_t s = at[i];
        if (pin_col[s] == 0) {
            newly++;
            if (kids[s] == 0)
                childless[k++] = s;
        }
        pin_col[s]++;
        stamps[s] = ++clock;
    }
    if ((list = as_list(childless, k)) != NULL)
        out = Py_BuildValue("LnN", clock, newly, list);
end:
    PyMem_Free(childless);
    PyBuffer_Release(&pins);
    PyBuffer_Release(&stamp);
    PyBuffer_Release(&children);
    PyBuffer_Release(&slots);
    return out;
}

static PyObject *unpin(PyObject *self, PyObject *args) {
    Py_buffer pins, state, children, slots;
    long long ready;
    PyObject *out = NULL, *list;
    int64_t *childless = NULL;
    (void)self;
    if (!PyArg_ParseTuple(args, "w*y*y*y*L", &pins, &state, &children, &slots, &ready))
        return NULL;
    Py_ssize_t n_slots = pins.len / 4, n = slots.len / 8, unpinned = 0, k = 0, i;
    if (check(n_slots, pins.len, children.len, state.len, 1, &slots) < 0)
        goto end;
    if ((childless = PyMem_Malloc((size_t)(n ? n : 1) * 8)) == NULL) {
        PyErr_NoMemory();
        goto end;
    }
    int32_t *pin_col = pins.buf;
    const int32_t *kids = children.buf;
    const int8_t *states = state.buf;
    const int64_t *at = slots.buf;
    for (i = 0; i < n; i++)
        if (states[at[i]] != ready || pin_col[at[i]] <= 0)
            break;
    if (i == n)
        for (i = 0; i < n; i++) {
            int64_t s = at[i];
            if (pin_col[s] <= 0) { /* listed more often than pinned */
                while (i-- > 0)    /* give the pins dropped so far back, and refuse */
                    pin_col[at[i]]++;
                break;
            }
            if (--pin_col[s] == 0) {
                unpinned++;
                if (kids[s] == 0)
                    childless[k++] = s;
            }
        }
    if (i != n)
        out = Py_NewRef(Py_None);
    else if ((list = as_list(childless, k)) != NULL)
        out = Py_BuildValue("nN", unpinned, list);
end:
    PyMem_Free(childless);
    PyBuffer_Release(&pins);
    PyBuffer_Release(&state);
    PyBuffer_Release(&children);
    PyBuffer_Release(&slots);
    return out;
}

static PyMethodDef methods[] = {
    {"pin", pin, METH_VARARGS,
     "pin(pins, stamp, children, slots, clock) -> (clock, newly_pinned, childless): pin and "
     "touch slots, the last first; childless lists the pages that leave the evictable lists"},
    {"unpin", unpin, METH_VARARGS,
     "unpin(pins, state, children, slots, ready) -> (unpinned, childless) or None: drop one "
     "pin per slot; None, nothing changed, when a slot is not a pinned READY page"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_pins", "The host pool's pin and unpin of a run of pages, in C.",
    -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__pins(void) { return PyModule_Create(&module); }
