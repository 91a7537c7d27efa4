/* kvtier.daemon.pool.native._pins: the host pool's pin and unpin of a run of pages, and a LOAD's
 * move of its pages to T2, each in one C call.
 *
 * pin(pins, stamp, children, slots, clock, lists) -> (clock, newly_pinned)
 * unpin(pins, state, children, slots, ready, lists) -> unpinned or None
 * mark_used(tier, flags, slots, bit) -> newly_marked
 *
 * The same per-page steps as daemon/pool/pages.py's PageTable.pin_slots and unpin, in the
 * same order, so a slot listed twice is pinned (or unpinned) twice, as page by page. The
 * pages that leave the evictable lists (pin: pinned for the first time and without
 * resident children) or enter them (unpin: left unpinned and without children) are moved,
 * in order, after the counts (_lists.h). `lists` is (prev, next, oprev, onext: int32 a
 * slot; stamp, owner: int64 a slot; ends, own_ends, ends2, tier): the lists' link columns,
 * the columns that place a page, the first global list's ends, the owners' ends by owner,
 * and the second global list's ends with each slot's tier byte (both None under lru).
 *
 * pin walks `slots` from the last to the first (a chain's tail is touched first): each
 * page gets one more pin and the next tick of the access clock, `clock` + 1 onwards; the
 * new clock is returned. A negative `clock` pins without a touch: no stamp changes, and
 * `clock` is returned as it came. unpin checks every slot first (inside the columns, state `ready`,
 * pinned) and returns None, having changed nothing, when one is not, or when a slot is
 * listed more often than it is pinned: the caller then names it in its error. Every slot
 * is checked against the columns before any change (ValueError), and the columns' sizes
 * against each other. Only a corrupt evictable list, found while the pages move after the
 * counts changed, leaves a run half done (RuntimeError, KeyError for an owner without a
 * list; the caller counts the pinned pages again).
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
#include <string.h>

#define NIL (-1)
#include "_lists.h"

/* The evictable lists as `lists` gives them (see the module's comment), their ends read. */
typedef struct {
    Links k;
    Lists l;
    Py_buffer v[6], tv;
    int have, have_tv;
} PinLists;

static void lists_release(PinLists *p) {
    for (int i = 0; i < p->have; i++) PyBuffer_Release(&p->v[i]);
    if (p->have_tv) PyBuffer_Release(&p->tv);
    p->have = p->have_tv = 0;
}

/* Read `lists` for a pool of `n_slots` slots; 0, or -1 with an error set (released). */
static int lists_open(PinLists *p, PyObject *lists, Py_ssize_t n_slots) {
    PyObject *cols[6], *ends, *own_ends, *ends2, *tier;
    static const Py_ssize_t width[6] = {4, 4, 4, 4, 8, 8};
    memset(p, 0, sizeof *p);
    if (!PyTuple_Check(lists) ||
        !PyArg_ParseTuple(lists, "OOOOOOO!O!OO:lists", &cols[0], &cols[1], &cols[2], &cols[3],
                          &cols[4], &cols[5], &PyList_Type, &ends, &PyDict_Type, &own_ends,
                          &ends2, &tier)) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "lists must be a tuple");
        return -1;
    }
    for (; p->have < 6; p->have++) {
        if (PyObject_GetBuffer(cols[p->have], &p->v[p->have], PyBUF_WRITABLE) < 0) {
            lists_release(p);
            return -1;
        }
        if (p->v[p->have].len < n_slots * width[p->have]) {
            p->have++;
            lists_release(p);
            PyErr_SetString(PyExc_RuntimeError, "a list column is shorter than the pool");
            return -1;
        }
    }
    p->k = (Links){p->v[0].buf, p->v[1].buf, p->v[2].buf, p->v[3].buf, p->v[4].buf,
                   p->v[5].buf};
    p->l.own_ends = own_ends;
    p->l.n = n_slots;
    if ((ends2 == Py_None) != (tier == Py_None)) {
        lists_release(p);
        PyErr_SetString(PyExc_TypeError, "lists takes ends2 and tier together");
        return -1;
    }
    if (tier != Py_None) {
        if (PyObject_GetBuffer(tier, &p->tv, PyBUF_SIMPLE) < 0) {
            lists_release(p);
            return -1;
        }
        p->have_tv = 1;
        if (p->tv.len < n_slots || p->tv.itemsize != 1 || ends_read(&p->l.g2, ends2, n_slots) < 0) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_RuntimeError, "tier is not a byte a slot of the pool");
            lists_release(p);
            return -1;
        }
        p->l.tier = p->tv.buf;
    }
    if (ends_read(&p->l.g, ends, n_slots) < 0) {
        lists_release(p);
        return -1;
    }
    return 0;
}

/* Write the ends back and let go; -1 when that failed (or `rc` was already -1). */
static int lists_close(PinLists *p, int rc) {
    PyObject *t, *val, *tb;
    PyErr_Fetch(&t, &val, &tb);
    if (ends_write(&p->l.g) < 0 || (p->l.tier != NULL && ends_write(&p->l.g2) < 0) ||
        lists_flush(&p->l) < 0)
        rc = -1;
    lists_release(p);
    if (t != NULL) {
        PyErr_Restore(t, val, tb);
        return -1;
    }
    return rc;
}

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

static PyObject *pin(PyObject *self, PyObject *args) {
    Py_buffer pins, stamp, children;
    PyObject *slots, *lists, *out = NULL;
    long long clock;
    Run run;
    PinLists pl;
    (void)self;
    if (!PyArg_ParseTuple(args, "w*w*y*O!LO", &pins, &stamp, &children, &PyList_Type, &slots,
                          &clock, &lists))
        return NULL;
    if (prepare(&run, slots, pins.len, children.len, stamp.len, 8) == 0 &&
        lists_open(&pl, lists, pins.len / 4) == 0) {
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
            if (clock >= 0)
                stamps[s] = ++clock;
        }
        int rc = 0;
        for (Py_ssize_t j = 0; j < k && rc == 0; j++)  /* off the evictable lists */
            rc = links_dequeue(&pl.k, &pl.l, (int32_t)childless[j]);
        if (lists_close(&pl, rc) == 0)
            out = Py_BuildValue("Ln", clock, newly);
    }
    PyMem_Free(run.at);
    PyBuffer_Release(&pins);
    PyBuffer_Release(&stamp);
    PyBuffer_Release(&children);
    return out;
}

static PyObject *unpin(PyObject *self, PyObject *args) {
    Py_buffer pins, state, children;
    PyObject *slots, *lists, *out = NULL;
    long long ready;
    Run run;
    PinLists pl;
    (void)self;
    if (!PyArg_ParseTuple(args, "w*y*y*O!LO", &pins, &state, &children, &PyList_Type, &slots,
                          &ready, &lists))
        return NULL;
    if (prepare(&run, slots, pins.len, children.len, state.len, 1) == 0 &&
        lists_open(&pl, lists, pins.len / 4) == 0) {
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
        int rc = 0;
        for (Py_ssize_t j = 0; i == n && j < k && rc == 0; j++)  /* onto the evictable lists */
            rc = links_enqueue(&pl.k, &pl.l, (int32_t)childless[j]);
        if (lists_close(&pl, rc) == 0)
            out = i != n ? Py_NewRef(Py_None) : PyLong_FromSsize_t(unpinned);
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
     "pin(pins, stamp, children, slots, clock, lists) -> (clock, newly_pinned): pin and "
     "touch slots, the last first; the pages pinned first and childless leave the lists"},
    {"unpin", unpin, METH_VARARGS,
     "unpin(pins, state, children, slots, ready, lists) -> unpinned or None: drop one pin "
     "per slot (the childless pages left unpinned enter the lists); None, nothing changed, "
     "when a slot is not a pinned READY page"},
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
