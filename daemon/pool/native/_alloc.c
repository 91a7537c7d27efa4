/* kvtier.daemon.pool.native._alloc: the host pool's slot allocation for a STORE, its commit and
 * the release of pages, page by page in C.
 *
 * run(cols, keys, prev, clock, ns_id, owner, cid, page_bytes, per_extent, ready_ns,
 *     writing_ns, ready, slot_keys, owned, ends, own_ends, out, env[, admit])
 *     -> (stop, prev) or None
 *
 * daemon/pool/pages.py's PageTable.allocate: a key the namespace holds (READY or WRITING)
 * is skipped and parents the next; any other gets a slot from take_slot and its row is
 * written, the state byte last, with the steps and order of the page-by-page model
 * (tests/pool_model.py); `(index into keys, slot)` is appended to `out` for each, and
 * `clock` (a list of one int, the access clock) advances by one a page, written back also
 * when an error stops the call. take_slot
 * answering NIL is a shortfall: the call stops at that key (`stop`). `admit(slot, ns,
 * key, clock)`, when given, is called for each new page (ArcState.admit); under reuse each new
 * page enters T2 when its key is a ghost (ReuseState.admit). None, having changed nothing:
 * a key is not bytes of at most 32 bytes.
 *
 * take_slot (daemon/pool/eviction.py's policy, page by page in tests/pool_model.py): an
 * owner at its quota evicts its own coldest pages first (at most the victim budget); then a
 * free slot of the class (its free list, the extent it is cutting, a free extent cut: the
 * lowest first); then victims from the cold ends of the global lists (the one arc's or
 * reuse's target names first), or the owner's: one of the class gives its slot, one of
 * another class frees its own (and its extent when that was the extent's last page in
 * use), at most the budget of them; then the coldest page of the class itself. Victims
 * must be in L3 when evictions require it; scans stop after the scan limit. Each victim is
 * logged, told to the policy (reuse's state here, `split.core`; arc's Python state:
 * `split.evicted_page`, `split.victim_list`) and freed as release frees a page; reuse
 * picks between the coldest pages of T1 and T2 by their stamps and the clock.
 *
 * Every step works on a Pool (below): the page table's state as read at the start of a
 * call and written back at its end, also after an error, which leaves what happened so far
 * as the page-by-page path would. The evictions are appended to the log (as
 * `evicted(key, ns, slot, in_l3)`) while it holds fewer than `max_log`, else counted in
 * `unlogged`; both counts are added to the evictor's.
 *
 * cols: the 21 buffers (stamp, ns, owner, length: int64; parent: int32; key: 32 bytes a
 * slot; state, in_l3: int8; key_len: uint8; then int32 a slot: pins, children, first,
 * sib_prev, sib_next, prev, next, oprev, onext; then int32 an extent: ext_class, ext_used,
 * ext_bump). Their sizes are checked against each other; every slot read from them is
 * checked against the pool before it is used (a stop, never a stray write).
 *
 * release(cols, slots, per_extent, env, ready, slot_keys, owned, ends, own_ends) -> int
 *
 * PageTable.release for each slot of `slots`: the page becomes FREE and its slot goes back
 * to its class (see release below).
 *
 * offsets(offset_of, slots, out) -> None or the index of the first refused slot
 *
 * The payload offset of each slot of `slots` (a list of ints) from `offset_of` (int64, one
 * per slot, -1 where the slot's extent is not cut for a class) into `out` (int64, as long
 * as `slots`): what daemon/pool/slots.py's SlotAllocator.slot_offsets answers. A slot
 * outside `offset_of`, or whose offset is -1, stops it: its index is returned (the caller
 * names what is wrong); None when every offset was written.
 *
 * Why in C: in Python each page of a STORE into a full pool (an eviction a page) costs
 * microseconds of the event loop, and a long context's STORE has thousands of pages.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>
#include <string.h>
#define XXH_INLINE_ALL
#include <xxhash.h>

#define NIL (-1)
#define KEY_BYTES 32
#define N_COLS 21
#define READY 2
#define FREE 0
#define WRITING 1
#define HAS_CHECKSUM 1
#define USED_AGAIN 2

#include "_reuse.h"

enum { STAMP, NS, OWNER, LENGTH, PARENT, KEY, STATE, IN_L3, KEY_LEN, PINS, CHILDREN, FIRST,
       SIB_PREV, SIB_NEXT, PREV, NEXT, OPREV, ONEXT, EXT_CLASS, EXT_USED, EXT_BUMP };

typedef struct {
    int64_t *stamp, *ns, *owner, *length;
    int32_t *parent;
    uint8_t *key;
    int8_t *state, *in_l3;
    uint8_t *key_len;
    int32_t *pins, *children, *first, *sib_prev, *sib_next, *prev, *next, *oprev, *onext;
    int32_t *ext_class, *ext_used, *ext_bump;
    Py_ssize_t n_slots, n_extents;
} Cols;

#include "_lists.h"

static Links links_of(const Cols *c) {
    return (Links){c->prev, c->next, c->oprev, c->onext, c->stamp, c->owner};
}

/* RecencyLists.dequeue: the global list and the owner's. */
static int dequeue(Cols *c, Lists *l, int32_t s) {
    Links k = links_of(c);
    return links_dequeue(&k, l, s);
}

/* RecencyLists.enqueue */
static int enqueue(Cols *c, Lists *l, int32_t s) {
    Links k = links_of(c);
    return links_enqueue(&k, l, s);
}

/* owned[owner] += delta */
static int add_owned(PyObject *owned, int64_t owner, long long delta) {
    PyObject *k = PyLong_FromLongLong(owner);
    if (k == NULL) return -1;
    PyObject *v = PyDict_GetItemWithError(owned, k);
    long long now = 0;
    if (v != NULL) now = PyLong_AsLongLong(v);
    PyObject *nv = PyErr_Occurred() ? NULL : PyLong_FromLongLong(now + delta);
    int rc = nv == NULL ? -1 : PyDict_SetItem(owned, k, nv);
    Py_XDECREF(nv);
    Py_DECREF(k);
    return rc;
}

/* The resident pages: the sum of owned's values (-1 with an error set). */
static long long sum_owned(PyObject *owned) {
    PyObject *k, *v;
    Py_ssize_t pos = 0;
    long long total = 0;
    while (PyDict_Next(owned, &pos, &k, &v)) {
        long long n = PyLong_AsLongLong(v);
        if (n == -1 && PyErr_Occurred()) return -1;
        total += n;
    }
    return total;
}

static int in_pool(const Cols *c, long long s) { return s >= 0 && s < c->n_slots; }

/* A slot found by the dicts: an int inside the pool, else -2 (with an error set). */
static long long slot_of(const Cols *c, PyObject *v) {
    long long s = PyLong_AsLongLong(v);
    if (s == -1 && PyErr_Occurred()) return -2;
    if (!in_pool(c, s)) {
        PyErr_Format(PyExc_ValueError, "the index names slot %lld, outside the pool", s);
        return -2;
    }
    return s;
}

static int get_cols(Cols *c, Py_buffer *views, PyObject *cols) {
    static const int width[N_COLS] = {8, 8, 8, 8, 4, KEY_BYTES, 1, 1, 1, 4, 4, 4, 4, 4, 4, 4, 4,
                                      4, 4, 4, 4};
    if (!PyTuple_Check(cols) || PyTuple_GET_SIZE(cols) != N_COLS) {
        PyErr_Format(PyExc_TypeError, "cols must be a tuple of %d buffers", N_COLS);
        return -1;
    }
    int got = 0;
    for (; got < N_COLS; got++)
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(cols, got), &views[got], PyBUF_WRITABLE) < 0)
            break;
    if (got < N_COLS) {
        for (int i = 0; i < got; i++) PyBuffer_Release(&views[i]);
        return -1;
    }
    c->n_slots = views[PINS].len / 4;
    c->n_extents = views[EXT_CLASS].len / 4;
    for (int i = 0; i < N_COLS; i++) {
        Py_ssize_t n = i >= EXT_CLASS ? c->n_extents : c->n_slots;
        if (views[i].len < n * width[i]) {
            PyErr_Format(PyExc_ValueError, "column %d has %zd bytes; %zd entries need %zd",
                         i, views[i].len, n, n * width[i]);
            for (int j = 0; j < N_COLS; j++) PyBuffer_Release(&views[j]);
            return -1;
        }
    }
    void **at[N_COLS] = {(void **)&c->stamp, (void **)&c->ns, (void **)&c->owner,
        (void **)&c->length, (void **)&c->parent, (void **)&c->key, (void **)&c->state,
        (void **)&c->in_l3, (void **)&c->key_len, (void **)&c->pins, (void **)&c->children,
        (void **)&c->first, (void **)&c->sib_prev, (void **)&c->sib_next, (void **)&c->prev,
        (void **)&c->next, (void **)&c->oprev, (void **)&c->onext, (void **)&c->ext_class,
        (void **)&c->ext_used, (void **)&c->ext_bump};
    for (int i = 0; i < N_COLS; i++) *at[i] = views[i].buf;
    return 0;
}

typedef struct {
    long long free, bump, n, ready, writing;
} Class;

static int class_io(PyObject *cls, Class *k, int write) {
    static const char *names[] = {"free", "bump", "n", "ready", "writing"};
    long long *f[] = {&k->free, &k->bump, &k->n, &k->ready, &k->writing};
    for (int i = 0; i < 5; i++) {
        if (write) {
            if (i == 2) continue;
            PyObject *v = PyLong_FromLongLong(*f[i]);
            if (v == NULL || PyObject_SetAttrString(cls, names[i], v) < 0) {
                Py_XDECREF(v);
                return -1;
            }
            Py_DECREF(v);
        } else {
            PyObject *v = PyObject_GetAttrString(cls, names[i]);
            if (v == NULL) return -1;
            *f[i] = PyLong_AsLongLong(v);
            Py_DECREF(v);
            if (*f[i] == -1 && PyErr_Occurred()) return -1;
        }
    }
    return 0;
}

/* evicted(key, ns, slot, in_l3), made as the tuple subclass it is (a NamedTuple's __new__
 * is Python code): allocated by its type, its four items set. */
static PyObject *record(PyObject *evicted, PyObject *key, int64_t ns, long long slot, int in_l3) {
    PyTypeObject *type = (PyTypeObject *)evicted;
    PyObject *ns_v = PyLong_FromLongLong((long long)ns), *slot_v = PyLong_FromLongLong(slot);
    PyObject *rec = ns_v == NULL || slot_v == NULL ? NULL : type->tp_alloc(type, 4);
    if (rec == NULL) {
        Py_XDECREF(ns_v);
        Py_XDECREF(slot_v);
        return NULL;
    }
    Py_INCREF(key);
    PyTuple_SET_ITEM(rec, 0, key);
    PyTuple_SET_ITEM(rec, 1, ns_v);
    PyTuple_SET_ITEM(rec, 2, slot_v);
    PyTuple_SET_ITEM(rec, 3, Py_NewRef(in_l3 ? Py_True : Py_False));
    return rec;
}

/* ---- Taking slots, choosing victims and freeing pages ----
 *
 * A Pool is the page table's state as these steps need it, over the Python objects the
 * page table keeps (read at the start of a call, written back at its end): the columns, the
 * index dicts, the evictable lists, the page classes (their counters cached one class at a
 * time), the slot allocator's free extents and offsets, the eviction settings and log. */
typedef struct {
    PyObject *classes;
    long long cid;  /* the class in `k` (-1: none) */
    Class k;
} ClassCache;

static int cache_class(ClassCache *cc, long long cid) {
    if (cc->cid == cid) return 0;
    if (cc->cid >= 0 && class_io(PyList_GET_ITEM(cc->classes, cc->cid), &cc->k, 1) < 0)
        return -1;
    cc->cid = -1;
    if (cid < 0 || cid >= PyList_GET_SIZE(cc->classes)) {
        PyErr_Format(PyExc_ValueError, "page class %lld is not registered", cid);
        return -1;
    }
    if (class_io(PyList_GET_ITEM(cc->classes, cid), &cc->k, 0) < 0) return -1;
    cc->cid = cid;
    return 0;
}

static int add_attr(PyObject *obj, const char *name, long long delta) {
    PyObject *v = PyObject_GetAttrString(obj, name);
    if (v == NULL) return -1;
    long long now = PyLong_AsLongLong(v);
    Py_DECREF(v);
    if (now == -1 && PyErr_Occurred()) return -1;
    PyObject *nv = PyLong_FromLongLong(now + delta);
    int rc = nv == NULL ? -1 : PyObject_SetAttrString(obj, name, nv);
    Py_XDECREF(nv);
    return rc;
}

static long long int_attr(PyObject *obj, const char *name) {
    PyObject *v = PyObject_GetAttrString(obj, name);
    if (v == NULL) return -1;
    long long n = PyLong_AsLongLong(v);
    Py_DECREF(v);
    return n;
}

typedef struct {
    Cols *c;
    long long per_extent, span, headroom, budget, scan_limit;
    int requires_l3;
    PyObject *ready, *writing, *slot_keys, *owned, *ends_list, *own_ends, *ends2;
    PyObject *free_extents, *quota, *split, *log, *evicted, *evictor;
    Py_ssize_t max_log;
    int64_t *offset_of, *ext_bytes;
    uint8_t *tier;  /* arc's and reuse's T1/T2 byte a slot (NULL: lru) */
    Reuse *core;    /* reuse's state, run here (NULL: lru, arc: arc asks `split`) */
    long long hashed;  /* reuse: the last victim chosen (-1: none), its key's ghost hash */
    long long clock;   /* the access clock (reuse's choice of list compares it to stamps) */
    uint64_t hash;
    Lists l;
    ClassCache cc;
    long long evictions, unlogged;
    long long resident;      /* the resident pages (-1: not summed yet) */
    int64_t own_owner;       /* owned[own_owner] += own_delta, not written yet */
    long long own_delta;
    int own_pending;
    PyObject *idx[2];        /* the last namespace index used (borrowed): writing, ready */
    long long idx_ns[2];
    int64_t q_owner;         /* the quota last looked up: q_state 0 none yet, 1 none, 2 q_quota */
    long long q_quota;
    int q_state;
    Py_buffer ov, xv, tv;
    int have_ov, have_xv, have_tv, lists_read;
} Pool;

/* The Pool over `env`, a tuple (writing, classes, offset_of, ext_bytes, free_extents, span,
 * headroom, quota, requires_l3, budget, scan_limit, log, max_log, evicted, ends2, tier,
 * split, evictor) (ends2, tier and split None under lru; a split whose `core` is a Reuse is
 * run here; the evictor's `evictions` and `unlogged` count this Pool's evictions when it
 * closes) and the columns, dicts and lists given. */
static int pool_open(Pool *P, Cols *c, long long per_extent, PyObject *env, PyObject *ready,
                     PyObject *slot_keys, PyObject *owned, PyObject *ends_list,
                     PyObject *own_ends) {
    memset(P, 0, sizeof *P);
    P->c = c;
    P->per_extent = per_extent;
    P->cc.cid = -1;
    P->resident = -1;
    P->hashed = -1;
    P->clock = 0;
    P->idx_ns[0] = P->idx_ns[1] = -1;
    P->l.own_ends = own_ends;
    P->l.n = c->n_slots;
    P->ready = ready, P->slot_keys = slot_keys, P->owned = owned;
    P->ends_list = ends_list, P->own_ends = own_ends;
    PyObject *classes, *offset_obj, *ext_obj, *tier_obj;
    int requires_l3;
    if (!PyTuple_Check(env) ||
        !PyArg_ParseTuple(env, "O!O!OOO!LLO!pLLO!nOOOOO:env", &PyDict_Type, &P->writing,
                          &PyList_Type, &classes, &offset_obj,
                          &ext_obj, &PyList_Type, &P->free_extents, &P->span, &P->headroom,
                          &PyDict_Type, &P->quota, &requires_l3, &P->budget, &P->scan_limit,
                          &PyList_Type, &P->log, &P->max_log, &P->evicted, &P->ends2,
                          &tier_obj, &P->split, &P->evictor)) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "env must be a tuple");
        return -1;
    }
    P->cc.classes = classes;
    P->requires_l3 = requires_l3;
    if ((P->ends2 == Py_None) != (tier_obj == Py_None) ||
        (P->ends2 == Py_None) != (P->split == Py_None) ||
        (P->ends2 != Py_None && !PyList_Check(P->ends2))) {
        PyErr_SetString(PyExc_TypeError, "env takes ends2 (a list), tier and split together");
        return -1;
    }
    if (!PyType_Check(P->evicted) ||
        !PyType_IsSubtype((PyTypeObject *)P->evicted, &PyTuple_Type)) {
        PyErr_SetString(PyExc_TypeError, "evicted must be a tuple subclass (EvictedPage)");
        return -1;
    }
    if (P->split != Py_None) {  /* reuse's state is its `core`; arc's is Python's */
        PyObject *core = PyObject_GetAttrString(P->split, "core");
        if (core != NULL && PyObject_TypeCheck(core, &ReuseType))
            P->core = (Reuse *)core;  /* a reference, dropped by pool_close */
        else if (core != NULL)
            Py_DECREF(core);
        else if (PyErr_ExceptionMatches(PyExc_AttributeError))
            PyErr_Clear();
        else
            return -1;
    }
    if (PyObject_GetBuffer(offset_obj, &P->ov, PyBUF_WRITABLE) < 0) return -1;
    P->have_ov = 1;
    if (PyObject_GetBuffer(ext_obj, &P->xv, PyBUF_WRITABLE) < 0) return -1;
    P->have_xv = 1;
    if (per_extent <= 0 || c->n_slots > c->n_extents * per_extent ||
        P->ov.len < c->n_slots * 8 || P->xv.len < c->n_extents * 8 ||
        PyList_GET_SIZE(slot_keys) < c->n_slots || P->budget < 0 || P->scan_limit < 0) {
        PyErr_SetString(PyExc_ValueError, "the pool's columns and settings do not agree");
        return -1;
    }
    P->offset_of = P->ov.buf;
    P->ext_bytes = P->xv.buf;
    if (tier_obj != Py_None) {
        if (PyObject_GetBuffer(tier_obj, &P->tv, PyBUF_WRITABLE) < 0) return -1;
        P->have_tv = 1;
        if (P->tv.len < c->n_slots || P->tv.itemsize != 1) {
            PyErr_SetString(PyExc_ValueError, "tier is not a byte a slot of the columns");
            return -1;
        }
        if (ends_read(&P->l.g2, P->ends2, c->n_slots) < 0) return -1;
        P->l.tier = P->tier = P->tv.buf;
    }
    if (ends_read(&P->l.g, ends_list, c->n_slots) < 0) return -1;
    P->lists_read = 1;
    return 0;
}

/* owned[own_owner] += own_delta, written now. */
static int own_flush(Pool *P) {
    int rc = 0;
    if (P->own_pending && P->own_delta)
        rc = add_owned(P->owned, P->own_owner, P->own_delta);
    P->own_pending = 0;
    P->own_delta = 0;
    return rc;
}

/* owned[owner] += delta (kept here while the same owner's pages come and go). */
static int own_add(Pool *P, int64_t owner, long long delta) {
    if (P->own_pending && P->own_owner != owner && own_flush(P) < 0) return -1;
    P->own_owner = owner;
    P->own_pending = 1;
    P->own_delta += delta;
    if (P->resident >= 0) P->resident += delta;
    return 0;
}

/* The resident pages (the sum of owned's values), -1 with an error set. */
static long long pool_resident(Pool *P) {
    if (P->resident < 0) {
        if (own_flush(P) < 0) return -1;
        P->resident = sum_owned(P->owned);
    }
    return P->resident;
}

/* After Python code ran (the policy's, a key's): the borrowed indexes are looked up again. */
static void forget(Pool *P) { P->idx[0] = P->idx[1] = NULL; }

/* The index of namespace `ns` (`ready`: the READY one, else the WRITING one), borrowed. */
static PyObject *ns_index(Pool *P, int ready, long long ns, long long s) {
    if (P->idx[ready] != NULL && P->idx_ns[ready] == ns) return P->idx[ready];
    PyObject *nsk = PyLong_FromLongLong(ns);
    if (nsk == NULL) return NULL;
    PyObject *idx = PyDict_GetItemWithError(ready ? P->ready : P->writing, nsk);
    Py_DECREF(nsk);
    if (idx == NULL || !PyDict_Check(idx)) {
        if (!PyErr_Occurred())
            PyErr_Format(PyExc_ValueError, "namespace %lld has no index of slot %lld", ns, s);
        P->idx[ready] = NULL;
        return NULL;
    }
    P->idx[ready] = idx;
    P->idx_ns[ready] = ns;
    return idx;
}

/* Write back what the Pool cached (also after an error, which it keeps) and let go. */
static int pool_close(Pool *P) {
    PyObject *t, *val, *tb;
    PyErr_Fetch(&t, &val, &tb);
    int rc = 0;
    if (P->cc.cid >= 0 && class_io(PyList_GET_ITEM(P->cc.classes, P->cc.cid), &P->cc.k, 1) < 0)
        rc = -1;
    if (own_flush(P) < 0) rc = -1;
    if ((P->evictions && add_attr(P->evictor, "evictions", P->evictions) < 0) ||
        (P->unlogged && add_attr(P->evictor, "unlogged", P->unlogged) < 0))
        rc = -1;
    P->evictions = P->unlogged = 0;
    if (P->lists_read) {
        if (ends_write(&P->l.g) < 0 || (P->l.tier != NULL && ends_write(&P->l.g2) < 0) ||
            lists_flush(&P->l) < 0)
            rc = -1;
    }
    if (P->have_ov) PyBuffer_Release(&P->ov);
    if (P->have_xv) PyBuffer_Release(&P->xv);
    if (P->have_tv) PyBuffer_Release(&P->tv);
    Py_CLEAR(P->core);
    P->have_ov = P->have_xv = P->have_tv = P->lists_read = 0;
    if (t != NULL) {
        PyErr_Restore(t, val, tb);  /* the first error wins */
        return -1;
    }
    return rc;
}

/* free_unlink (tests/pool_model.py's): the free slot `s` off its class's free list. */
static void free_unlink(Cols *c, Class *k, int32_t s) {
    int32_t p = c->prev[s], n = c->next[s];
    if (p == NIL) k->free = n; else c->next[p] = n;
    if (n != NIL) c->prev[n] = p;
    c->prev[s] = c->next[s] = NIL;
}

/* give_back (tests/pool_model.py's): the FREE slot `s` back to its class (cached). */
static int give_back(Pool *P, int32_t s) {
    Cols *c = P->c;
    Class *k = &P->cc.k;
    long long e = s / P->per_extent;
    c->ext_used[e] -= 1;
    if (c->ext_used[e] > 0) {  /* onto the free list */
        c->prev[s] = NIL;
        c->next[s] = (int32_t)k->free;
        if (k->free != NIL) c->prev[k->free] = s;
        k->free = s;
        return 0;
    }
    long long base = e * P->per_extent;  /* the extent is empty: its slots off the free list */
    long long cut = c->ext_bump[e] < P->per_extent ? c->ext_bump[e] : P->per_extent;
    for (long long t = base; t < base + cut && t < c->n_slots; t++)
        if (t != s) free_unlink(c, k, (int32_t)t);
    if (k->bump == e) k->bump = NIL;
    c->ext_class[e] = NIL;
    c->ext_bump[e] = 0;
    for (long long t = base; t < base + P->per_extent && t < c->n_slots; t++)
        P->offset_of[t] = -1;
    P->ext_bytes[e] = 0;  /* after every slot of it is FREE */
    if (add_attr(PyList_GET_ITEM(P->cc.classes, P->cc.cid), "extents", -1) < 0) return -1;
    PyObject *ev = PyLong_FromLongLong(e);
    int rc = ev == NULL ? -1 : PyList_Append(P->free_extents, ev);
    Py_XDECREF(ev);
    return rc;
}

/* slot_take (tests/pool_model.py's): a free slot of `cid` (its free list, the extent it is
 * cutting, a free extent: the lowest), or NIL. */
static long long slot_take(Pool *P, long long cid) {
    Cols *c = P->c;
    if (cache_class(&P->cc, cid) < 0) return -2;
    Class *k = &P->cc.k;
    long long s = k->free;
    if (s != NIL) {
        if (!in_pool(c, s)) {
            PyErr_Format(PyExc_ValueError, "class %lld's free list names slot %lld", cid, s);
            return -2;
        }
        free_unlink(c, k, (int32_t)s);
        c->ext_used[s / P->per_extent] += 1;
        return s;
    }
    long long e = k->bump;
    if (e != NIL && (e < 0 || e >= c->n_extents)) {
        PyErr_Format(PyExc_ValueError, "class %lld cuts extent %lld, outside the pool", cid, e);
        return -2;
    }
    if (e == NIL) {
        Py_ssize_t n_free = PyList_GET_SIZE(P->free_extents);
        if (n_free == 0) return NIL;
        PyObject *cls = PyList_GET_ITEM(P->cc.classes, cid);
        long long page_bytes = int_attr(cls, "page_bytes");
        if (page_bytes == -1 && PyErr_Occurred()) return -2;
        long long stride = int_attr(cls, "stride");
        if (stride == -1 && PyErr_Occurred()) return -2;
        e = PyLong_AsLongLong(PyList_GET_ITEM(P->free_extents, n_free - 1));
        if (e == -1 && PyErr_Occurred()) return -2;
        if (e < 0 || e >= c->n_extents) {
            PyErr_Format(PyExc_ValueError, "free extent %lld is outside the pool", e);
            return -2;
        }
        if (PyList_SetSlice(P->free_extents, n_free - 1, n_free, NULL) < 0) return -2;
        P->ext_bytes[e] = page_bytes;  /* persisted before any slot of it is used */
        c->ext_class[e] = (int32_t)cid;
        c->ext_bump[e] = 0;
        long long base = e * P->per_extent, at = e * P->span + P->headroom;
        for (long long i = 0; i < k->n && base + i < c->n_slots; i++)
            P->offset_of[base + i] = at + i * stride;  /* SlotAllocator.cut */
        if (add_attr(cls, "extents", 1) < 0) return -2;
        k->bump = e;
    }
    long long i = c->ext_bump[e];
    c->ext_bump[e] = (int32_t)(i + 1);
    if (i + 1 == k->n) k->bump = NIL;
    c->ext_used[e] += 1;
    s = e * P->per_extent + i;
    if (!in_pool(c, s)) {
        PyErr_Format(PyExc_ValueError, "extent %lld cuts slot %lld, outside the pool", e, s);
        return -2;
    }
    return s;
}

/* PageTable.release of the page `s` (off the evictable lists): 1, or 0 when `s` is not a
 * page that can be freed (outside the pool, FREE, pinned, without a key), -1 on error. */
static int release_one(Pool *P, long long s, int keep) {
    Cols *c = P->c;
    if (!in_pool(c, s) || (c->state[s] != READY && c->state[s] != WRITING) || c->pins[s] ||
        s >= PyList_GET_SIZE(P->slot_keys))
        return 0;
    PyObject *key = PyList_GET_ITEM(P->slot_keys, s);
    if (!PyBytes_Check(key)) return 0;
    int was_ready = c->state[s] == READY;
    if (cache_class(&P->cc, c->ext_class[s / P->per_extent]) < 0) return -1;
    PyObject *idx = ns_index(P, was_ready, c->ns[s], s);
    if (idx == NULL) return -1;
    c->state[s] = FREE;  /* first: from here on a crash leaves the slot free */
    __atomic_signal_fence(__ATOMIC_SEQ_CST);
    c->in_l3[s] = 0;
    Py_INCREF(key);
    /* the key leaves the index only where it names this page: a WRITING page detached from
     * it (its STORE cancelled) may see its key name another page, or none */
    PyObject *at = PyDict_GetItemWithError(idx, key);  /* borrowed */
    int rc = at == NULL ? (PyErr_Occurred() ? -1 : 0) : 0;
    if (at != NULL) {
        long long named = PyLong_AsLongLong(at);
        if (named == -1 && PyErr_Occurred()) rc = -1;
        else if (named == s) rc = PyDict_DelItem(idx, key);
    }
    Py_DECREF(key);
    if (rc < 0) return -1;
    if (s >= PyList_GET_SIZE(P->slot_keys)) {  /* the key's __eq__ or __del__ shrank it */
        PyErr_SetString(PyExc_ValueError, "slot_keys changed while a page was freed");
        return -1;
    }
    Py_INCREF(Py_None);
    PyList_SetItem(P->slot_keys, s, Py_None);  /* steals; drops the list's reference */
    if (P->tier != NULL && P->tier[s]) {  /* SplitState.released */
        P->tier[s] = 0;
        if (P->core != NULL)
            P->core->t2 -= 1;
        else if (add_attr(P->split, "t2", -1) < 0)
            return -1;
    }
    int32_t p = c->parent[s];
    if (p != NIL) {  /* ChildLists.unlink(p, s), then the child reference */
        int32_t sp = c->sib_prev[s], sn = c->sib_next[s];
        if (sp == NIL) c->first[p] = sn; else c->sib_next[sp] = sn;
        if (sn != NIL) c->sib_prev[sn] = sp;
        c->parent[s] = c->sib_prev[s] = c->sib_next[s] = NIL;
        c->children[p] -= 1;
        if (c->children[p] == 0 && c->state[p] == READY && c->pins[p] == 0 &&
            enqueue(c, &P->l, p) < 0)
            return -1;
    }
    if (c->first[s] != NIL || c->children[s]) {  /* ChildLists.orphan_all(s) */
        for (int32_t ch = c->first[s], steps = 0; ch != NIL && steps < c->n_slots; steps++) {
            int32_t nx = c->sib_next[ch];
            c->parent[ch] = c->sib_prev[ch] = c->sib_next[ch] = NIL;
            ch = nx;
        }
        c->first[s] = NIL;
        c->children[s] = 0;
    }
    if (was_ready) P->cc.k.ready -= 1; else P->cc.k.writing -= 1;
    if (own_add(P, c->owner[s], -1) < 0) return -1;
    if (!keep && give_back(P, (int32_t)s) < 0) return -1;
    return 1;
}

static int evict_held(Pool *P, long long s, int keep, PyObject *key);

/* evict: the page `s` evicted: the eviction logged (or counted), the policy told, the page off
 * the evictable lists and freed. */
static int evict_one(Pool *P, long long s, int keep) {
    Cols *c = P->c;
    if (!in_pool(c, s) || s >= PyList_GET_SIZE(P->slot_keys)) {
        PyErr_Format(PyExc_ValueError, "evictable slot %lld is outside the pool", s);
        return -1;
    }
    PyObject *key = PyList_GET_ITEM(P->slot_keys, s);
    if (!PyBytes_Check(key)) {
        PyErr_Format(PyExc_ValueError, "evictable slot %lld has no key", s);
        return -1;
    }
    Py_INCREF(key);  /* held across the policy's Python calls below */
    int rc = evict_held(P, s, keep, key);
    Py_DECREF(key);
    return rc;
}

static int evict_held(Pool *P, long long s, int keep, PyObject *key) {
    Cols *c = P->c;
    P->evictions += 1;
    if (PyList_GET_SIZE(P->log) < P->max_log) {
        PyObject *rec = record(P->evicted, key, c->ns[s], s, c->in_l3[s]);
        int rc = rec == NULL ? -1 : PyList_Append(P->log, rec);
        Py_XDECREF(rec);
        if (rc < 0) return -1;
    } else {
        P->unlogged += 1;
    }
    if (P->split != Py_None) {  /* SplitState.evicted_page(s, ns, key, stamp, resident) */
        long long resident = pool_resident(P);
        if (resident < 0) return -1;
        if (P->core != NULL) {
            uint64_t h = P->hashed == s ? P->hash
                : ghost_hash(c->ns[s], PyBytes_AS_STRING(key), PyBytes_GET_SIZE(key));
            P->hashed = -1;
            if (reuse_evicted(P->core, P->tier[s] ? 1 : 0, h, c->stamp[s], resident) < 0)
                return -1;
        } else {
            PyObject *r = PyObject_CallMethod(P->split, "evicted_page", "LLOLL", s,
                                              (long long)c->ns[s], key,
                                              (long long)c->stamp[s], resident);
            forget(P);
            if (r == NULL) return -1;
            Py_DECREF(r);
        }
    }
    if (dequeue(c, &P->l, (int32_t)s) < 0) return -1;
    int done = release_one(P, s, keep);
    if (done == 0)
        PyErr_Format(PyExc_ValueError, "evictable slot %lld could not be freed", s);
    return done == 1 ? 0 : -1;
}

/* scan: the first page from `s` on (through `nxt`), within the scan limit, that
 * eviction may take: in L3 when that is required, of class `cid` unless NIL. */
static long long scan(Pool *P, long long s, const int32_t *nxt, long long cid) {
    Cols *c = P->c;
    for (long long steps = P->scan_limit; s != NIL && steps > 0; steps--) {
        if (!in_pool(c, s)) {
            PyErr_Format(PyExc_ValueError, "an evictable list names slot %lld", s);
            return -2;
        }
        if ((!P->requires_l3 || c->in_l3[s]) &&
            (cid == NIL || c->ext_class[s / P->per_extent] == cid))
            return s;
        s = nxt[s];
    }
    return NIL;
}

/* coldest: the coldest page eviction may take from the global lists (the one the
 * policy names first), or from `owner`'s list when `scoped`; of class `cid` unless NIL. */
static long long coldest(Pool *P, int scoped, long long owner, long long cid) {
    Cols *c = P->c;
    if (scoped) {
        PyObject *k = PyLong_FromLongLong(owner);
        if (k == NULL) return -2;
        int has = PyDict_Contains(P->own_ends, k);
        Py_DECREF(k);
        if (has < 0) return -2;
        if (!has) return NIL;
        Ends *o = owner_list(&P->l, owner, 0);
        return o == NULL ? -2 : scan(P, o->cold, c->onext, cid);
    }
    if (P->split == Py_None) return scan(P, P->l.g.cold, c->next, cid);
    long long resident = pool_resident(P), s;
    if (resident < 0) return -2;
    if (P->core != NULL) {  /* each list's coldest page; reuse picks one */
        long long s1 = scan(P, P->l.g.cold, c->next, cid), s2;
        if (s1 == -2 || (s2 = scan(P, P->l.g2.cold, c->next, cid)) == -2) return -2;
        s = reuse_pick(P->core, s1 != NIL, s1 != NIL ? c->stamp[s1] : 0, s2 != NIL,
                       s2 != NIL ? c->stamp[s2] : 0, P->clock, resident) ? s2 : s1;
    } else {
        PyObject *r = PyObject_CallMethod(P->split, "victim_list", "L", resident);
        forget(P);
        if (r == NULL) return -2;
        long long second = PyLong_AsLongLong(r);
        Py_DECREF(r);
        if (second == -1 && PyErr_Occurred()) return -2;
        Ends *first = second == 1 ? &P->l.g2 : &P->l.g, *other = second == 1 ? &P->l.g : &P->l.g2;
        s = scan(P, first->cold, c->next, cid);
        if (s == NIL) s = scan(P, other->cold, c->next, cid);
    }
    if (P->core != NULL && s >= 0 && s < PyList_GET_SIZE(P->slot_keys)) {
        /* the victim's ghost entry fetched while its eviction is prepared */
        PyObject *key = PyList_GET_ITEM(P->slot_keys, s);
        if (PyBytes_Check(key)) {
            P->hash = ghost_hash(c->ns[s], PyBytes_AS_STRING(key), PyBytes_GET_SIZE(key));
            P->hashed = s;
            reuse_prefetch(P->core, P->hash);
        }
    }
    return s;
}

/* owned[owner] (-1 with an error set). */
static long long owned_of(Pool *P, long long owner) {
    if (own_flush(P) < 0) return -1;
    PyObject *k = PyLong_FromLongLong(owner);
    if (k == NULL) return -1;
    PyObject *v = PyDict_GetItemWithError(P->owned, k);
    Py_DECREF(k);
    if (v == NULL) return PyErr_Occurred() ? -1 : 0;
    return PyLong_AsLongLong(v);
}

/* The quota of `owner`: 1 with it in `*quota`, 0 for none, -1 on error. */
static int quota_of(Pool *P, long long owner, long long *quota) {
    if (P->q_state == 0 || P->q_owner != owner) {
        PyObject *ok = PyLong_FromLongLong(owner);
        if (ok == NULL) return -1;
        PyObject *qv = PyDict_GetItemWithError(P->quota, ok);
        Py_DECREF(ok);
        if (qv == NULL && PyErr_Occurred()) return -1;
        long long q = 0;
        if (qv != NULL && (q = PyLong_AsLongLong(qv)) == -1 && PyErr_Occurred()) return -1;
        P->q_owner = owner;
        P->q_state = qv == NULL ? 1 : 2;
        P->q_quota = q;
    }
    *quota = P->q_quota;
    return P->q_state == 2;
}

/* take_slot: a slot of class `cid` for `owner`, evicting as the policy says: an
 * owner at its quota replaces its own pages first (at most `budget` of them); then a free
 * slot (slot_take); then victims from the cold ends (anyone's, or only the owner's
 * when it had reached its quota): one of `cid` gives its slot, one of another class frees
 * its own, after which a slot of `cid` may be free (at most `budget` such victims); then
 * the coldest page of `cid` itself. NIL: a shortfall; -2: an error. */
static long long take_slot(Pool *P, long long cid, long long owner) {
    Cols *c = P->c;
    int scoped = 0;
    long long quota;
    int has_quota = quota_of(P, owner, &quota);
    if (has_quota < 0) return -2;
    if (has_quota) {
        long long have = owned_of(P, owner);
        if (have == -1 && PyErr_Occurred()) return -2;
        if (have >= quota) {
            scoped = 1;
            for (long long budget = P->budget; have >= quota; budget--) {
                long long v = coldest(P, 1, owner, NIL);
                if (v == -2) return -2;
                if (v == NIL || budget == 0) return NIL;
                if (evict_one(P, v, 0) < 0) return -2;
                if ((have = owned_of(P, owner)) == -1 && PyErr_Occurred()) return -2;
            }
        }
    }
    long long s = slot_take(P, cid);
    if (s != NIL) return s;
    for (long long budget = P->budget; budget > 0; budget--) {  /* reclaim */
        long long v = coldest(P, scoped, owner, NIL);
        if (v == -2) return -2;
        if (v == NIL) break;
        if (c->ext_class[v / P->per_extent] == cid) {
            if (evict_one(P, v, 1) < 0) return -2;
            return v;
        }
        if (evict_one(P, v, 0) < 0) return -2;
        if ((s = slot_take(P, cid)) != NIL) return s;
    }
    long long v = coldest(P, scoped, owner, cid);  /* the class's own pages */
    if (v == NIL || v == -2) return v;
    return evict_one(P, v, 1) < 0 ? -2 : v;
}

/* Whether `s` is `p` or one of its ancestors (a walk bounded by the pool's size). */
static int is_ancestor(const Cols *c, long long s, long long p) {
    for (long long x = p, steps = 0; x != NIL && steps <= c->n_slots; x = c->parent[x], steps++)
        if (x == s) return 1;
    return 0;
}

/* adopt (tests/pool_model.py's): the present page `s`, which has no parent, linked under
   `p` (the page of the key before it): a page stored before its prefix, or left when its
   parent was freed, rejoins its chain, so that its prefix is not evicted before it.
   0, or -1 with an error set. */
static int adopt(Cols *c, Lists *l, long long p, long long s) {
    if (p == NIL || p == s || c->parent[s] != NIL || is_ancestor(c, s, p)) return 0;
    if (c->children[p] == 0 && c->state[p] == READY && c->pins[p] == 0 &&
        dequeue(c, l, (int32_t)p) < 0)
        return -1;
    c->children[p] += 1;
    c->parent[s] = (int32_t)p;
    int32_t head = c->first[p]; /* ChildLists.link(p, s) */
    c->sib_prev[s] = NIL;
    c->sib_next[s] = head;
    if (head != NIL) c->sib_prev[head] = (int32_t)s;
    c->first[p] = (int32_t)s;
    return 0;
}

/* run(cols, keys, prev, clock, ns_id, owner, cid, page_bytes, per_extent, ready_ns,
 *     writing_ns, ready, slot_keys, owned, ends, own_ends, out, env[, admit])
 *     -> (stop, prev) or None: see the module's comment. */
static PyObject *run(PyObject *self, PyObject *args) {
    PyObject *cols, *keys, *ready_ns, *writing_ns, *ready, *slot_keys, *owned, *ends_list;
    PyObject *own_ends, *out, *env, *admit = Py_None, *clock_cell;
    long long prev, clock, ns_id, owner, cid, page_bytes, per_extent;
    (void)self;
    if (!PyArg_ParseTuple(args, "OO!LO!LLLLLO!O!O!O!O!O!O!O!O|O:run", &cols, &PyList_Type, &keys,
                          &prev, &PyList_Type, &clock_cell, &ns_id, &owner, &cid, &page_bytes,
                          &per_extent,
                          &PyDict_Type, &ready_ns, &PyDict_Type, &writing_ns, &PyDict_Type,
                          &ready, &PyList_Type, &slot_keys, &PyDict_Type, &owned, &PyList_Type,
                          &ends_list, &PyDict_Type, &own_ends, &PyList_Type, &out, &env,
                          &admit))
        return NULL;
    if (admit != Py_None && !PyCallable_Check(admit)) {
        PyErr_SetString(PyExc_TypeError, "admit must be a callable or None");
        return NULL;
    }
    if (PyList_GET_SIZE(clock_cell) != 1) {
        PyErr_SetString(PyExc_TypeError, "clock must be a list of one int");
        return NULL;
    }
    clock = PyLong_AsLongLong(PyList_GET_ITEM(clock_cell, 0));
    if (clock == -1 && PyErr_Occurred()) return NULL;
    const long long clock0 = clock;
    Py_ssize_t n = PyList_GET_SIZE(keys);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *key = PyList_GET_ITEM(keys, i);
        if (!PyBytes_CheckExact(key) || PyBytes_GET_SIZE(key) > KEY_BYTES)
            Py_RETURN_NONE;
    }
    Py_buffer views[N_COLS];
    Cols c;
    if (get_cols(&c, views, cols) < 0) return NULL;
    Pool P;
    PyObject *result = NULL;
    Py_ssize_t i = 0;
    if (pool_open(&P, &c, per_extent, env, ready, slot_keys, owned, ends_list, own_ends) < 0)
        goto done;
    if (prev != NIL && !in_pool(&c, prev)) {
        PyErr_Format(PyExc_ValueError, "prev %lld is outside the pool", prev);
        goto done;
    }
    for (; i < n; i++) {
        if (i >= PyList_GET_SIZE(keys)) {  /* the policy's Python code shrank it */
            PyErr_SetString(PyExc_ValueError, "keys changed during the allocation");
            goto done;
        }
        PyObject *key = PyList_GET_ITEM(keys, i);
        if (!PyBytes_CheckExact(key) || PyBytes_GET_SIZE(key) > KEY_BYTES) {
            PyErr_SetString(PyExc_ValueError, "keys changed during the allocation");
            goto done;
        }
        PyObject *hit = PyDict_GetItemWithError(ready_ns, key);
        if (hit == NULL && !PyErr_Occurred()) hit = PyDict_GetItemWithError(writing_ns, key);
        if (PyErr_Occurred()) goto done;
        if (hit != NULL) {
            long long s = slot_of(&c, hit);
            if (s == -2 || adopt(&c, &P.l, prev, s) < 0) goto done;
            prev = s;
            continue;
        }
        Py_INCREF(key);  /* held across the policy's Python calls */
        uint64_t h_new = 0;  /* reuse: the key's ghost hash */
        if (P.core != NULL) {
            h_new = ghost_hash(ns_id, PyBytes_AS_STRING(key), PyBytes_GET_SIZE(key));
            reuse_prefetch(P.core, h_new);
        }
        /* a child's reference shields prev from the evictions that take its slot */
        if (prev != NIL) {
            if (c.children[prev] == 0 && c.state[prev] == READY && c.pins[prev] == 0 &&
                dequeue(&c, &P.l, (int32_t)prev) < 0) {
                Py_DECREF(key);
                goto done;
            }
            c.children[prev] += 1;
        }
        P.clock = clock;
        long long s = take_slot(&P, cid, owner);
        if (s < 0 && prev != NIL) {  /* a shortfall or an error: prev's child reference dropped */
            PyObject *t, *v, *tb;
            PyErr_Fetch(&t, &v, &tb);
            c.children[prev] -= 1;
            if (c.children[prev] == 0 && c.state[prev] == READY && c.pins[prev] == 0 &&
                enqueue(&c, &P.l, (int32_t)prev) < 0)
                s = -2;
            if (t != NULL) {  /* the first error wins */
                PyErr_Clear();
                PyErr_Restore(t, v, tb);
            }
        }
        if (s != NIL && s != -2 && (!in_pool(&c, s) || c.state[s] != FREE)) {
            PyErr_Format(PyExc_ValueError, "take gave slot %lld, not a free one", s);
            s = -2;
        }
        if (s >= 0 && cache_class(&P.cc, cid) < 0) s = -2;
        if (s < 0) {
            Py_DECREF(key);
            if (s == -2) goto done;
            break;  /* a shortfall: stop at this key */
        }
        /* the row first, the state byte last */
        Py_ssize_t len = PyBytes_GET_SIZE(key);
        memcpy(c.key + s * KEY_BYTES, PyBytes_AS_STRING(key), (size_t)len);
        memset(c.key + s * KEY_BYTES + len, 0, (size_t)(KEY_BYTES - len));
        c.key_len[s] = (uint8_t)len;
        c.ns[s] = ns_id;
        c.owner[s] = owner;
        c.length[s] = page_bytes;
        c.parent[s] = (int32_t)prev;
        if (s >= PyList_GET_SIZE(slot_keys)) {  /* the policy's Python code shrank it */
            PyErr_SetString(PyExc_ValueError, "slot_keys changed during the allocation");
            Py_DECREF(key);
            goto done;
        }
        clock += 1;
        c.stamp[s] = clock;
        __atomic_signal_fence(__ATOMIC_SEQ_CST);
        c.state[s] = WRITING;
        Py_INCREF(key);
        PyList_SetItem(slot_keys, s, key);  /* steals the reference just taken */
        if (prev != NIL) {  /* ChildLists.link(prev, s) */
            int32_t head = c.first[prev];
            c.sib_prev[s] = NIL;
            c.sib_next[s] = head;
            if (head != NIL) c.sib_prev[head] = (int32_t)s;
            c.first[prev] = (int32_t)s;
        }
        PyObject *sv = PyLong_FromLongLong(s);
        int rc = sv == NULL ? -1 : PyDict_SetItem(writing_ns, key, sv);
        if (rc == 0 && P.core != NULL && reuse_returning(P.core, h_new, clock)) {
            P.tier[s] = 1;  /* ReuseState.admit: a ghost's key returns into T2 */
            P.core->t2 += 1;
        }
        if (rc == 0 && admit != Py_None) {  /* ArcState.admit(s, ns, key, clock): T1 or T2 */
            PyObject *r = PyObject_CallFunction(admit, "LLOL", s, ns_id, key, clock);
            forget(&P);
            if (r == NULL) rc = -1;
            Py_XDECREF(r);
        }
        if (rc == 0) {
            P.cc.k.writing += 1;
            rc = own_add(&P, owner, 1);
        }
        PyObject *pair = rc < 0 ? NULL : PyTuple_New(2), *at = NULL;
        if (pair != NULL && (at = PyLong_FromSsize_t(i)) == NULL) Py_CLEAR(pair);
        if (pair != NULL) {
            PyTuple_SET_ITEM(pair, 0, at);
            PyTuple_SET_ITEM(pair, 1, sv);  /* steals */
        } else {
            Py_XDECREF(sv);
        }
        rc = pair == NULL ? -1 : PyList_Append(out, pair);
        Py_XDECREF(pair);
        Py_DECREF(key);
        if (rc < 0) goto done;
        prev = s;
    }
    result = Py_BuildValue("(nL)", i, prev);
done:
    if (pool_close(&P) < 0) Py_CLEAR(result);
    if (clock != clock0) {  /* the pages written keep their stamps: the clock keeps up */
        PyObject *t, *v, *tb;
        PyErr_Fetch(&t, &v, &tb);
        PyObject *cv = PyLong_FromLongLong(clock);
        if (cv == NULL || PyList_GET_SIZE(clock_cell) != 1) {
            Py_XDECREF(cv);
            Py_CLEAR(result);
            if (t == NULL && !PyErr_Occurred())
                PyErr_SetString(PyExc_RuntimeError, "clock changed size during the allocation");
        } else {
            PyList_SetItem(clock_cell, 0, cv);  /* steals */
        }
        if (t != NULL) {
            PyErr_Clear();
            PyErr_Restore(t, v, tb);
        }
    }
    for (int j = 0; j < N_COLS; j++) PyBuffer_Release(&views[j]);
    return result;
}

/* commit(cols, extra, slots, checksums, clock, per_extent, writing, ready, slot_keys, classes,
 *        ends, own_ends[, ends2, tier]) -> (stop, clock) or None
 *
 * PageTable.commit in C: the slots, last first, become READY (checksum, flags, the row's
 * seal XXH3-64(key, seed checksum ^ ns), the next access stamp, then the state byte), move
 * from the WRITING index to the READY one, count in their class, and enter the evictable
 * lists when childless. None, having changed nothing: a slot is outside the pool or not
 * WRITING, or a checksum is not a 64-bit unsigned int, or the lengths differ (the Python
 * path names it). `stop` is 0 when every slot is committed, else j + 1 where the slot at j
 * was listed twice (no longer WRITING): those after it are committed, as the Python path
 * leaves them before it raises.
 * `extra` is (checksum, seal: uint64; flags: uint8) a slot. With `ends2` and `tier` (one
 * byte a slot: the arc and reuse policies' T1/T2 split), a page whose tier is 1 enters the
 * second global list, as RecencyLists.enqueue puts it, and its flags byte says USED_AGAIN.
 */
static PyObject *commit(PyObject *self, PyObject *args) {
    PyObject *cols, *extra, *slots, *checksums, *writing, *ready, *slot_keys, *classes;
    PyObject *ends_list, *own_ends, *ends2 = NULL, *tier_obj = NULL;
    long long clock, per_extent;
    (void)self;
    if (!PyArg_ParseTuple(args, "OOO!OLLO!O!O!O!O!O!|O!O:commit", &cols, &extra, &PyList_Type,
                          &slots, &checksums, &clock, &per_extent, &PyDict_Type, &writing,
                          &PyDict_Type, &ready, &PyList_Type, &slot_keys, &PyList_Type,
                          &classes, &PyList_Type, &ends_list, &PyDict_Type, &own_ends,
                          &PyList_Type, &ends2, &tier_obj))
        return NULL;
    if ((ends2 == NULL) != (tier_obj == NULL)) {
        PyErr_SetString(PyExc_TypeError, "commit takes ends2 and tier together");
        return NULL;
    }
    Py_buffer views[N_COLS], xv[3], tv;
    int have_tv = 0;
    Cols c;
    if (get_cols(&c, views, cols) < 0) return NULL;
    PyObject *result = NULL;
    int nx = 0;
    Py_ssize_t n = PyList_GET_SIZE(slots);
    int64_t *at = PyMem_Malloc((size_t)(n ? n : 1) * 16);
    uint64_t *sums = (uint64_t *)(at ? at + n : NULL);
    if (at == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (!PyTuple_Check(extra) || PyTuple_GET_SIZE(extra) != 3) {
        PyErr_SetString(PyExc_TypeError, "extra must be (checksum, seal, flags)");
        goto done;
    }
    for (; nx < 3; nx++)
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(extra, nx), &xv[nx], PyBUF_WRITABLE) < 0)
            goto done;
    if (xv[0].len < c.n_slots * 8 || xv[1].len < c.n_slots * 8 || xv[2].len < c.n_slots ||
        per_extent <= 0 || c.n_slots > c.n_extents * per_extent ||
        PyList_GET_SIZE(slot_keys) < c.n_slots) {
        PyErr_SetString(PyExc_ValueError, "column sizes do not agree");
        goto done;
    }
    uint64_t *checksum = xv[0].buf, *seal = xv[1].buf;
    uint8_t *flags = xv[2].buf;
    int with_sums = checksums != Py_None;
    if (with_sums && (!PyList_Check(checksums) || PyList_GET_SIZE(checksums) != n)) {
        result = Py_None;
        goto done;
    }
    for (Py_ssize_t j = 0; j < n; j++) {  /* every check before any change */
        long long s = PyLong_AsLongLong(PyList_GET_ITEM(slots, j));
        if ((s == -1 && PyErr_Occurred()) || !in_pool(&c, s) || c.state[s] != WRITING ||
            !PyBytes_Check(PyList_GET_ITEM(slot_keys, s)) ||
            c.ext_class[s / per_extent] < 0 ||
            c.ext_class[s / per_extent] >= PyList_GET_SIZE(classes)) {
            PyErr_Clear();
            result = Py_None;
            goto done;
        }
        at[j] = s;
        if (with_sums) {
            sums[j] = PyLong_AsUnsignedLongLong(PyList_GET_ITEM(checksums, j));
            if (sums[j] == (uint64_t)-1 && PyErr_Occurred()) {
                PyErr_Clear();
                result = Py_None;
                goto done;
            }
        }
    }
    Lists l = {.have_owner = 0, .own_ends = own_ends, .n = c.n_slots};
    if (tier_obj != NULL) {
        if (PyObject_GetBuffer(tier_obj, &tv, PyBUF_SIMPLE) < 0) goto done;
        have_tv = 1;
        if (tv.len < c.n_slots || tv.itemsize != 1) {
            PyErr_SetString(PyExc_ValueError, "tier is not a byte a slot of the columns");
            goto done;
        }
        if (ends_read(&l.g2, ends2, c.n_slots) < 0) goto done;
        l.tier = tv.buf;
    }
    if (ends_read(&l.g, ends_list, c.n_slots) < 0) goto done;
    PyObject *by_key = NULL, *from = NULL;  /* ready[ns], writing[ns] of the last ns */
    PyObject *cls = NULL;  /* the last slot's class, its counters in k */
    Class k;
    long long ns_of = 0;
    Py_ssize_t j = n - 1;
    for (; j >= 0; j--) {
        int64_t s = at[j];
        if (c.state[s] != WRITING) break;  /* listed twice */
        PyObject *key = PyList_GET_ITEM(slot_keys, s);
        int64_t ns = c.ns[s];
        uint64_t csum = 0;
        uint8_t used = l.tier != NULL && l.tier[s] ? USED_AGAIN : 0;  /* T2: kept */
        if (with_sums) {
            csum = checksum[s] = sums[j];
            flags[s] = HAS_CHECKSUM | used;
        } else {
            flags[s] = used;
        }
        seal[s] = XXH3_64bits_withSeed(PyBytes_AS_STRING(key), (size_t)PyBytes_GET_SIZE(key),
                                       csum ^ (uint64_t)ns);
        clock += 1;
        c.stamp[s] = clock;
        __atomic_signal_fence(__ATOMIC_SEQ_CST);
        c.state[s] = READY;  /* last: the row is complete */
        if (by_key == NULL || ns_of != ns) {
            PyObject *nsk = PyLong_FromLongLong(ns);
            if (nsk == NULL) goto fail;
            from = PyDict_GetItemWithError(writing, nsk);
            by_key = from == NULL ? NULL : PyDict_GetItemWithError(ready, nsk);
            if (from != NULL && by_key == NULL && !PyErr_Occurred()) {
                by_key = PyDict_New();
                if (by_key != NULL && PyDict_SetItem(ready, nsk, by_key) < 0) Py_CLEAR(by_key);
                Py_XDECREF(by_key);  /* ready holds it */
            }
            Py_DECREF(nsk);
            if (from == NULL || by_key == NULL || !PyDict_Check(from) || !PyDict_Check(by_key)) {
                if (!PyErr_Occurred())
                    PyErr_Format(PyExc_KeyError, "namespace %lld has no index", (long long)ns);
                by_key = NULL;
                goto fail;
            }
            ns_of = ns;
        }
        PyObject *sv = PyLong_FromLongLong(s);
        if (sv == NULL) goto fail;
        Py_INCREF(key);
        int rc = PyDict_DelItem(from, key);
        if (rc == 0) rc = PyDict_SetItem(by_key, key, sv);
        Py_DECREF(key);
        Py_DECREF(sv);
        if (rc < 0) goto fail;
        PyObject *now = PyList_GET_ITEM(classes, c.ext_class[s / per_extent]);
        if (now != cls) {
            if (cls != NULL && class_io(cls, &k, 1) < 0) goto fail;
            cls = NULL;
            if (class_io(now, &k, 0) < 0) goto fail;
            cls = now;
        }
        k.writing -= 1;
        k.ready += 1;
        if (c.children[s] == 0 && enqueue(&c, &l, (int32_t)s) < 0) goto fail;
    }
    if (ends_write(&l.g) < 0 || (l.tier != NULL && ends_write(&l.g2) < 0) ||
        lists_flush(&l) < 0 || (cls != NULL && class_io(cls, &k, 1) < 0))
        goto done;
    result = Py_BuildValue("(nL)", j + 1, clock);
    goto done;
fail:
    {
        PyObject *t, *val, *tb;
        PyErr_Fetch(&t, &val, &tb);
        ends_write(&l.g);
        if (l.tier != NULL) ends_write(&l.g2);
        lists_flush(&l);
        if (cls != NULL) class_io(cls, &k, 1);
        PyErr_Restore(t, val, tb);
    }
done:
    if (result == Py_None) Py_INCREF(result);
    if (have_tv) PyBuffer_Release(&tv);
    for (int i = 0; i < nx; i++) PyBuffer_Release(&xv[i]);
    for (int i = 0; i < N_COLS; i++) PyBuffer_Release(&views[i]);
    PyMem_Free(at);
    return result;
}


/* The slot ids of `slots` (a list) into a new array (*n of them; the caller frees it): an
 * int too large for any pool reads as -1 (refused as outside the pool). Each item's
 * __index__ (Python code) runs here, before anything reads the pool; one that shrinks the
 * list ends the ids there. NULL with an error set: an item is not an int, or no memory. */
static long long *read_ids(PyObject *slots, Py_ssize_t *n) {
    *n = PyList_GET_SIZE(slots);
    long long *at = PyMem_Malloc((size_t)(*n ? *n : 1) * sizeof(long long));
    if (at == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    for (Py_ssize_t i = 0; i < *n; i++) {
        if (i >= PyList_GET_SIZE(slots)) {
            *n = i;
            break;
        }
        PyObject *item = PyList_GET_ITEM(slots, i);
        Py_INCREF(item);
        long long v = PyLong_AsLongLong(item);
        Py_DECREF(item);
        if (v == -1 && PyErr_Occurred()) {
            if (!PyErr_ExceptionMatches(PyExc_OverflowError)) {
                PyMem_Free(at);
                return NULL;
            }
            PyErr_Clear();
        }
        at[i] = v;
    }
    return at;
}

/* release(cols, slots, per_extent, env, ready, slot_keys, owned, ends, own_ends) -> int
 *
 * PageTable.release in C: each slot of `slots` (a list of ints, all read before any
 * change), in order, a WRITING page or an evictable one (READY, unpinned, without resident
 * children: it is taken off the evictable lists first), becomes FREE (the state byte
 * first, then its in-L3 flag), leaves the index (`ready` or `writing`, ns -> key -> slot)
 * and `slot_keys`, and leaves T2 (the tier byte, and the policy's `t2`, under arc and
 * reuse); its parent loses a child (and enters the evictable lists when that leaves it
 * READY, unpinned and childless); its own children, which only an aborted page can have,
 * lose their parent link; its class and owner count one page less; its slot goes back to
 * its class: onto the free list, or, when it was the last slot of its extent in use, the
 * extent is freed (its slots off the free list, its class and persistent page bytes
 * cleared, its offsets -1, appended to the free extents).
 *
 * Returns len(slots) when every slot was released, else the index of the first slot that
 * is not a page this frees (outside the pool, FREE, pinned, READY with resident children,
 * or without a key): those before it are released, as page by page. `env` is the tuple
 * run() takes (the slot allocator's and the policy's objects). */
static PyObject *release(PyObject *self, PyObject *args) {
    PyObject *cols, *slots, *env, *ready, *slot_keys, *owned, *ends_list, *own_ends;
    long long per_extent;
    (void)self;
    if (!PyArg_ParseTuple(args, "OO!LOO!O!O!O!O!:release", &cols, &PyList_Type, &slots,
                          &per_extent, &env, &PyDict_Type, &ready, &PyList_Type, &slot_keys,
                          &PyDict_Type, &owned, &PyList_Type, &ends_list, &PyDict_Type,
                          &own_ends))
        return NULL;
    Py_ssize_t n;
    long long *at = read_ids(slots, &n);  /* every id first: no Python code runs after */
    if (at == NULL) return NULL;
    Py_buffer views[N_COLS];
    Cols c;
    if (get_cols(&c, views, cols) < 0) {
        PyMem_Free(at);
        return NULL;
    }
    Pool P;
    PyObject *result = NULL;
    Py_ssize_t j = 0;
    if (pool_open(&P, &c, per_extent, env, ready, slot_keys, owned, ends_list, own_ends) == 0) {
        for (; j < n; j++) {
            long long s = at[j];
            if (!in_pool(&c, s) || s >= PyList_GET_SIZE(slot_keys) || c.pins[s] ||
                !PyBytes_Check(PyList_GET_ITEM(slot_keys, s)) ||
                (c.state[s] != WRITING && (c.state[s] != READY || c.children[s])))
                break;
            if (c.state[s] == READY && dequeue(&c, &P.l, (int32_t)s) < 0) break;
            if (release_one(&P, s, 0) != 1) break;
        }
    }
    if (pool_close(&P) == 0 && !PyErr_Occurred()) result = PyLong_FromSsize_t(j);
    for (int q = 0; q < N_COLS; q++) PyBuffer_Release(&views[q]);
    PyMem_Free(at);
    return result;
}

static PyObject *offsets(PyObject *self, PyObject *args) {
    Py_buffer table, out;
    PyObject *slots, *result = NULL;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*O!w*", &table, &PyList_Type, &slots, &out))
        return NULL;
    Py_ssize_t n_slots = table.len / 8, n;
    long long *at = read_ids(slots, &n);
    const int64_t *tab = table.buf;
    int64_t *o = out.buf;
    if (at == NULL) goto done;
    if (table.len % 8 || out.len != PyList_GET_SIZE(slots) * 8 || n != PyList_GET_SIZE(slots)) {
        PyErr_Format(PyExc_ValueError, "offsets: offset_of has %zd bytes and out %zd, for %zd "
                     "slots", table.len, out.len, PyList_GET_SIZE(slots));
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        long long s = at[i];
        if (s < 0 || s >= n_slots || tab[s] < 0) {
            result = PyLong_FromSsize_t(i);
            goto done;
        }
        o[i] = tab[s];
    }
    result = Py_NewRef(Py_None);
done:
    PyMem_Free(at);
    PyBuffer_Release(&table);
    PyBuffer_Release(&out);
    return result;
}

static PyMethodDef methods[] = {
    {"run", run, METH_VARARGS, "Allocate slots for a STORE's keys (see the module)."},
    {"commit", commit, METH_VARARGS, "Commit a STORE's filled slots (see commit above)."},
    {"offsets", offsets, METH_VARARGS, "Payload offsets of a list of slots (see the module)."},
    {"release", release, METH_VARARGS, "Free READY or WRITING pages (see release above)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_alloc",
    "The host pool's slot allocation for a STORE, page by page in C.", -1, methods,
};

PyMODINIT_FUNC PyInit__alloc(void) {
    if (PyType_Ready(&ReuseType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    if (PyModule_AddObjectRef(m, "Reuse", (PyObject *)&ReuseType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
