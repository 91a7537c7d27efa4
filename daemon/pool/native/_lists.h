/* The host pool's evictable lists, shared by _alloc.c and _pins.c: intrusive doubly linked
 * lists threaded through slot ids (two int32 link columns each), cold end first, whose ends
 * [cold, hot] live in Python lists of two ints (daemon/pool/links.py's RecencyLists holds
 * them). An evictable page is on one global list (the second, `g2`, when its tier byte is
 * 1: arc's and reuse's T2) and on its owner's list; a FREE slot uses the global link pair
 * for its class's free list instead.
 *
 * Ends and the last owner list used are read once and written back by the caller
 * (ends_write, lists_flush). Every slot id read from the ends or the links is checked
 * against the pool's size before it is used: a corrupt list is a RuntimeError, never a
 * stray write. Included after Python.h, NIL defined. */
#ifndef KVTIER_LISTS_H
#define KVTIER_LISTS_H

#include <stdint.h>

/* The ends [cold, hot] of a list: a Python list of two ints. */
typedef struct {
    PyObject *list;
    long long cold, hot;
} Ends;

/* Whether `x` is NIL or a slot of a pool of `n` slots. */
static inline int in_list_range(long long x, Py_ssize_t n) { return x == NIL || (x >= 0 && x < n); }

/* Read `list`'s ends, each NIL or a slot of a pool of `n` slots. */
static int ends_read(Ends *e, PyObject *list, Py_ssize_t n) {
    if (!PyList_Check(list) || PyList_GET_SIZE(list) != 2) {
        PyErr_SetString(PyExc_TypeError, "list ends must be a list of two ints");
        return -1;
    }
    e->list = list;
    e->cold = PyLong_AsLongLong(PyList_GET_ITEM(list, 0));
    e->hot = PyLong_AsLongLong(PyList_GET_ITEM(list, 1));
    if (PyErr_Occurred()) return -1;
    if (!in_list_range(e->cold, n) || !in_list_range(e->hot, n) ||
        (e->cold == NIL) != (e->hot == NIL)) {
        PyErr_Format(PyExc_RuntimeError, "an evictable list's ends [%lld, %lld] are not slots "
                     "of the pool's %zd", e->cold, e->hot, n);
        return -1;
    }
    return 0;
}

static int ends_write(Ends *e) {
    if (PyList_GET_SIZE(e->list) != 2) {
        PyErr_SetString(PyExc_RuntimeError, "an evictable list's ends changed size");
        return -1;
    }
    PyObject *c = PyLong_FromLongLong(e->cold), *h = PyLong_FromLongLong(e->hot);
    if (c == NULL || h == NULL) {
        Py_XDECREF(c);
        Py_XDECREF(h);
        return -1;
    }
    PyList_SetItem(e->list, 0, c);  /* steals; the list has two items */
    PyList_SetItem(e->list, 1, h);
    return 0;
}

/* Unlink `s` (a slot of a pool of `n`) from the list `e` (its links `prev`, `nxt`). */
static int unlink_(int32_t *prev, int32_t *nxt, Ends *e, int32_t s, Py_ssize_t n_slots) {
    int32_t p = prev[s], n = nxt[s];
    if (!in_list_range(p, n_slots) || !in_list_range(n, n_slots)) {
        PyErr_Format(PyExc_RuntimeError, "an evictable list links slot %d to %d and %d, not "
                     "slots of the pool's %zd", (int)s, (int)p, (int)n, n_slots);
        return -1;
    }
    if (p == NIL) e->cold = n; else nxt[p] = n;
    if (n == NIL) e->hot = p; else prev[n] = p;
    prev[s] = nxt[s] = NIL;
    return 0;
}

/* How many of a list's most recent pages a page entering it may pass over (push_). */
#define RECENCY_WALK 16

/* Link `s` into the list `e` by its last access (`stamp`): at the cold end if it is not more
 * recent than the page there; else after the first page, from the hot end, that is not more
 * recent than it, looking at RECENCY_WALK + 1 pages at most (when all of them are more
 * recent, it goes before the last one looked at). A page stored or loaded now goes to the hot end at once; a parent
 * that becomes evictable when its last child leaves goes where its last access puts it
 * among the most recent pages, or at the cold end when it is older than every page
 * listed. The ends are the pool's slots (read by ends_read); a link the walk would follow
 * outside a pool of `n_slots` slots ends the walk where it is (never a stray read or
 * write: unlink_ reports the corrupt list). */
static void push_(int32_t *prev, int32_t *nxt, Ends *e, const int64_t *stamp, int32_t s,
                  Py_ssize_t n_slots) {
    if (e->cold == NIL) {
        prev[s] = nxt[s] = NIL;
        e->cold = e->hot = s;
        return;
    }
    if (stamp[s] <= stamp[e->cold]) {
        prev[s] = NIL; nxt[s] = (int32_t)e->cold; prev[e->cold] = s;
        e->cold = s;
        return;
    }
    int32_t a = (int32_t)e->hot, b = NIL;  /* s goes between a and b (b: a's successor) */
    for (int w = 0; w < RECENCY_WALK && stamp[a] > stamp[s]; w++) {
        int32_t p = prev[a];
        if (p == NIL || !in_list_range(p, n_slots)) break;
        b = a;
        a = p;
    }
    if (stamp[a] > stamp[s]) {  /* before a (a passed over, or the cold end) */
        b = a;
        a = prev[a];
        if (!in_list_range(a, n_slots)) a = NIL;
    }
    prev[s] = a; nxt[s] = b;
    if (a == NIL) e->cold = s; else nxt[a] = s;
    if (b == NIL) e->hot = s; else prev[b] = s;
}

/* The owner's ends in `own_ends` (created as [NIL, NIL] when `create`), read into `e`. */
static int owner_ends(Ends *e, PyObject *own_ends, int64_t owner, int create, Py_ssize_t n) {
    PyObject *k = PyLong_FromLongLong(owner);
    if (k == NULL) return -1;
    PyObject *list = PyDict_GetItemWithError(own_ends, k);  /* borrowed */
    if (list == NULL && !PyErr_Occurred()) {
        if (!create) {
            PyErr_Format(PyExc_KeyError, "owner %lld has no evictable list", (long long)owner);
        } else if ((list = Py_BuildValue("[ii]", NIL, NIL)) != NULL) {
            int rc = PyDict_SetItem(own_ends, k, list);
            Py_DECREF(list);  /* the dict holds it */
            if (rc < 0) list = NULL;
        }
    }
    Py_DECREF(k);
    return list == NULL ? -1 : ends_read(e, list, n);
}

/* The evictable lists: the global one's ends and the last owner's list used, written back
 * to their Python lists when another owner's is needed and at the end. */
typedef struct {
    Ends g, o;
    int64_t owner;
    int have_owner;
    Py_ssize_t n;         /* the pool's slots */
    PyObject *own_ends;
    Ends g2;              /* the second global list (arc's T2), used where tier[s] is 1 */
    const uint8_t *tier;  /* per slot, which global list; NULL: the first only */
} Lists;

static int lists_flush(Lists *l) {
    if (l->have_owner && ends_write(&l->o) < 0) return -1;
    l->have_owner = 0;
    return 0;
}

static Ends *owner_list(Lists *l, int64_t owner, int create) {
    if (l->have_owner && l->owner == owner) return &l->o;
    if (lists_flush(l) < 0 || owner_ends(&l->o, l->own_ends, owner, create, l->n) < 0)
        return NULL;
    l->owner = owner;
    l->have_owner = 1;
    return &l->o;
}

/* The global list `s` is on (by its tier byte). */
static Ends *global_list(Lists *l, int32_t s) {
    return l->tier != NULL && l->tier[s] ? &l->g2 : &l->g;
}

/* The link columns the lists thread through, and what placing a page reads. */
typedef struct {
    int32_t *prev, *next, *oprev, *onext;
    const int64_t *stamp, *owner;
} Links;

/* Take `s` off its global list and off its owner's. */
static int links_dequeue(const Links *k, Lists *l, int32_t s) {
    if (unlink_(k->prev, k->next, global_list(l, s), s, l->n) < 0) return -1;
    Ends *o = owner_list(l, k->owner[s], 0);
    if (o == NULL) return -1;
    return unlink_(k->oprev, k->onext, o, s, l->n);
}

/* Put `s` on its global list and on its owner's (created on first use). */
static int links_enqueue(const Links *k, Lists *l, int32_t s) {
    push_(k->prev, k->next, global_list(l, s), k->stamp, s, l->n);
    Ends *o = owner_list(l, k->owner[s], 1);
    if (o == NULL) return -1;
    push_(k->oprev, k->onext, o, k->stamp, s, l->n);
    return 0;
}

#endif
