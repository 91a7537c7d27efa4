/* kvtier.daemon.pool.native._pins: the host pool's pin and unpin of a run of pages, and a LOAD's
 * move of its pages to T2, each in one C call.
 *
 * pin(pins, stamp, children, slots, clock) -> (clock, newly_pinned, childless)
 * unpin(pins, state, children, slots, ready) -> (unpinned, childless) or None
 * mark_used(tier, flags, slots, bit) -> newly_marked
 *
 * The same per-page steps as daemon/pool/pages.py's PageTable.pin_slots and unpin, in the
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
 * mark_used is the two-list policies' step for a LOAD's pinned pages (policies.py's
 * SplitState.reused): each slot whose `tier` byte is 0 gets 1 and, unless `flags` is None,
 * `bit` set in its flags byte; it returns how many were 0 (the pages entering T2). Every
 * slot is checked against both columns before any change (ValueError).
 *
 * Buffers: pins int32, children int32, stamp int64, state int8, one entry per slot; slots
 * a list of ints (the pool's own: read once, here, with no array made of them first).
 * numpy makes several passes over each column, slow once a copy has flushed the caches;
 * one pass here touches two cache lines a page.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

/* A run's slots and scratch, read from the caller's list before any change. */
typedef struct {
    Py_ssize_t n;       /* slots in the run */
    int64_t *at;        /* the slots (n), then room for the pages that change lists (n) */
} Run;

/* Check that the columns agree in size (pins, children: int32; `other`: `other_item` bytes
 * an entry) and read `slots` (a list of ints) into `run`, each inside the columns; else
 * ValueError (TypeError for an item that is not an int). 0 on success. */
static int prepare(Run *run, PyObject *slots, Py_ssize_t pins, Py_ssize_t children,
                   Py_ssize_t other, Py_ssize_t other_item) {
    Py_ssize_t n_slots = pins / 4, n = PyList_GET_SIZE(slots);
    run->n = n;
    run->at = NULL;
    if (pins % 4 || children != pins || other != n_slots * other_item) {
        PyErr_Format(PyExc_ValueError, "column sizes do not agree: pins %zd, children %zd, "
                     "stamp or state %zd bytes", pins, children, other);
        return -1;
    }
    if ((run->at = PyMem_Malloc((size_t)(n ? 2 * n : 1) * 8)) == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i >= PyList_GET_SIZE(slots)) { /* an item's __index__ shrank the list */
            PyErr_SetString(PyExc_ValueError, "slots changed while being read");
            return -1;
        }
        PyObject *item = PyList_GET_ITEM(slots, i);
        Py_INCREF(item);
        long long s = PyLong_AsLongLong(item);
        if (s == -1 && PyErr_Occurred()) {
            if (!PyErr_ExceptionMatches(PyExc_OverflowError)) {
                Py_DECREF(item);
                return -1;
            }
            PyErr_Clear();
        }
        if (s < 0 || s >= n_slots) {
            PyErr_Format(PyExc_ValueError, "slot %R (index %zd) is outside the %zd slots",
                         item, i, n_slots);
            Py_DECREF(item);
            return -1;
        }
        Py_DECREF(item);
        run->at[i] = s;
    }
    return 0;
}

/* The k pages from `v` as a list of ints (NULL: out of memory). */
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
    Py_buffer pins, stamp, children;
    PyObject *slots, *out = NULL, *list;
    long long clock;
    Run run;
    (void)self;
    if (!PyArg_ParseTuple(args, "w*w*y*O!L", &pins, &stamp, &children, &PyList_Type, &slots,
                          &clock))
        return NULL;
    if (prepare(&run, slots, pins.len, children.len, stamp.len, 8) == 0) {
        int32_t *pin_col = pins.buf;
        const int32_t *kids = children.buf;
        int64_t *stamps = stamp.buf, *childless = run.at + run.n;
        Py_ssize_t newly = 0, k = 0;
        for (Py_ssize_t i = run.n - 1; i >= 0; i--) {
            int64_t s = run.at[i];
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
    }
    PyMem_Free(run.at);
    PyBuffer_Release(&pins);
    PyBuffer_Release(&stamp);
    PyBuffer_Release(&children);
    return out;
}

static PyObject *unpin(PyObject *self, PyObject *args) {
    Py_buffer pins, state, children;
    PyObject *slots, *out = NULL, *list;
    long long ready;
    Run run;
    (void)self;
    if (!PyArg_ParseTuple(args, "w*y*y*O!L", &pins, &state, &children, &PyList_Type, &slots,
                          &ready))
        return NULL;
    if (prepare(&run, slots, pins.len, children.len, state.len, 1) == 0) {
        int32_t *pin_col = pins.buf;
        const int32_t *kids = children.buf;
        const int8_t *states = state.buf;
        const int64_t *at = run.at;
        int64_t *childless = run.at + run.n;
        Py_ssize_t n = run.n, unpinned = 0, k = 0, i;
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
    }
    PyMem_Free(run.at);
    PyBuffer_Release(&pins);
    PyBuffer_Release(&state);
    PyBuffer_Release(&children);
    return out;
}

static PyObject *mark_used(PyObject *self, PyObject *args) {
    Py_buffer tier, flags = {0};
    PyObject *flags_obj, *slots, *out = NULL;
    int bit;
    (void)self;
    if (!PyArg_ParseTuple(args, "w*OO!i", &tier, &flags_obj, &PyList_Type, &slots, &bit))
        return NULL;
    int has_flags = flags_obj != Py_None;
    if (has_flags && PyObject_GetBuffer(flags_obj, &flags, PyBUF_WRITABLE) < 0) {
        PyBuffer_Release(&tier);
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(slots), limit = tier.len;
    if (has_flags && flags.len < limit)
        limit = flags.len;
    int64_t *at = PyMem_Malloc((size_t)(n ? n : 1) * 8);
    if (at == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (tier.itemsize != 1 || (has_flags && flags.itemsize != 1)) {
        PyErr_SetString(PyExc_ValueError, "tier and flags must be columns of bytes");
        goto done;
    }
    if (bit < 0 || bit > 255) {
        PyErr_Format(PyExc_ValueError, "bit %d is not a flags byte's mask", bit);
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i >= PyList_GET_SIZE(slots)) { /* an item's __index__ shrank the list */
            PyErr_SetString(PyExc_ValueError, "slots changed while being read");
            goto done;
        }
        PyObject *item = PyList_GET_ITEM(slots, i);
        Py_INCREF(item);
        long long s = PyLong_AsLongLong(item);
        int bad = s == -1 && PyErr_Occurred();
        if (bad && PyErr_ExceptionMatches(PyExc_OverflowError))
            PyErr_Clear(); /* out of range: named below */
        else if (bad) {
            Py_DECREF(item);
            goto done;
        }
        if (bad || s < 0 || s >= limit) {
            PyErr_Format(PyExc_ValueError, "slot %R is outside the pool [0, %zd)", item, limit);
            Py_DECREF(item);
            goto done;
        }
        Py_DECREF(item);
        at[i] = s;
    }
    uint8_t *t = tier.buf, *f = has_flags ? flags.buf : NULL;
    Py_ssize_t newly = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t s = at[i];
        if (!t[s]) {
            t[s] = 1;
            newly++;
            if (f != NULL)
                f[s] |= (uint8_t)bit;
        }
    }
    out = PyLong_FromSsize_t(newly);
done:
    PyMem_Free(at);
    PyBuffer_Release(&tier);
    if (has_flags)
        PyBuffer_Release(&flags);
    return out;
}

static PyMethodDef methods[] = {
    {"pin", pin, METH_VARARGS,
     "pin(pins, stamp, children, slots, clock) -> (clock, newly_pinned, childless): pin and "
     "touch slots, the last first; childless lists the pages that leave the evictable lists"},
    {"unpin", unpin, METH_VARARGS,
     "unpin(pins, state, children, slots, ready) -> (unpinned, childless) or None: drop one "
     "pin per slot; None, nothing changed, when a slot is not a pinned READY page"},
    {"mark_used", mark_used, METH_VARARGS,
     "mark_used(tier, flags, slots, bit) -> newly_marked: tier 1 (and bit in flags, unless "
     "flags is None) for each slot whose tier was 0; returns how many were"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_pins", "The host pool's pin and unpin of a run of pages, in C.",
    -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__pins(void) { return PyModule_Create(&module); }
