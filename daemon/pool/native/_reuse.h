/* The `reuse` eviction policy's state, in C: included by _alloc.c, whose allocation loop
 * runs the policy inline, and exported by it as `_alloc.Reuse`, which
 * daemon/pool/policies.py's ReuseState wraps for the evictor's Python steps (one
 * implementation for both).
 *
 * Reuse(ghost_factor, shadow, floor): the rules are policies.py's module docstring.
 *
 * State: T1's target `share` of the resident pages, the resident pages at the last
 * eviction (`capacity`), the pages in T2 (`t2`), the evictions from each list, and the
 * ghosts: keys of recent evictions, each with the list it left and that list's eviction
 * count then, oldest first, at most ghost_factor x the resident pages at the last eviction.
 *
 * The ghosts are a FIFO ring of (hash, value) entries (value -1: dropped, a ghost that
 * returned or was remembered again) indexed by an open-addressing table from hash to the
 * entry's sequence number (linear probing, deletion by backward shift, so no tombstones).
 * A key's hash is XXH3-64 of its bytes seeded with its namespace: process-private, like
 * the ghosts themselves; two keys that collide (2^-64) share a ghost, which only moves a
 * target. The ring grows by doubling, or is compacted when at least half of it is dropped,
 * so its memory stays within a small multiple of the live ghosts.
 */
#include <math.h>

#define EMPTY_SEQ UINT64_MAX

typedef struct {
    uint64_t h;
    int64_t val;  /* 2 x (that list's evictions then) + list; -1: dropped */
} GEntry;

typedef struct {
    uint64_t h, seq;  /* a ghost's hash and its ring sequence number: one cache line */
} TEntry;

typedef struct {
    PyObject_HEAD
    double share, shadow, floor_, factor;
    long long capacity, t2, evicted[2];
    GEntry *ring;
    uint64_t rcap, head, tail;  /* entries head..tail-1 live at ring[seq & (rcap - 1)] */
    Py_ssize_t live;
    TEntry *tab;                /* the table (seq EMPTY_SEQ: an empty entry) */
    uint64_t tcap;
    Py_ssize_t tused;
} Reuse;

static PyTypeObject ReuseType;

static uint64_t ghost_hash(int64_t ns, const char *key, Py_ssize_t len) {
    return XXH3_64bits_withSeed(key, (size_t)len, (uint64_t)ns);
}

/* A hint to fetch the table's cache line for `h`, before the work that needs it: each ghost
 * step is a random access into a table larger than the caches. */
static inline void reuse_prefetch(const Reuse *r, uint64_t h) {
    __builtin_prefetch(&r->tab[h & (r->tcap - 1)]);
}

/* The table index holding `h`, or -1. */
static long long table_find(const Reuse *r, uint64_t h) {
    uint64_t mask = r->tcap - 1, i = h & mask;
    while (r->tab[i].seq != EMPTY_SEQ) {
        if (r->tab[i].h == h) return (long long)i;
        i = (i + 1) & mask;
    }
    return -1;
}

/* Remove table entry `i`, shifting later entries of its probe run back into the hole. */
static void table_delete(Reuse *r, uint64_t i) {
    uint64_t mask = r->tcap - 1, j = i, k = i;
    r->tab[j].seq = EMPTY_SEQ;
    for (;;) {
        k = (k + 1) & mask;
        if (r->tab[k].seq == EMPTY_SEQ) break;
        uint64_t ideal = r->tab[k].h & mask;
        /* k stays if its ideal slot lies cyclically in (j, k] */
        int stays = j <= k ? (ideal > j && ideal <= k) : (ideal > j || ideal <= k);
        if (stays) continue;
        r->tab[j] = r->tab[k];
        r->tab[k].seq = EMPTY_SEQ;
        j = k;
    }
    r->tused -= 1;
}

static void table_put(Reuse *r, uint64_t h, uint64_t seq) {
    uint64_t mask = r->tcap - 1, i = h & mask;
    while (r->tab[i].seq != EMPTY_SEQ) i = (i + 1) & mask;
    r->tab[i] = (TEntry){h, seq};
    r->tused += 1;
}

/* A table of `cap` entries (a power of two) holding the ring's live entries. */
static int table_rebuild(Reuse *r, uint64_t cap) {
    TEntry *tab = PyMem_Malloc(cap * sizeof *tab);
    if (tab == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (uint64_t i = 0; i < cap; i++) tab[i].seq = EMPTY_SEQ;
    PyMem_Free(r->tab);
    r->tab = tab;
    r->tcap = cap;
    r->tused = 0;
    for (uint64_t s = r->head; s < r->tail; s++) {
        GEntry *e = &r->ring[s & (r->rcap - 1)];
        if (e->val >= 0) table_put(r, e->h, s);
    }
    return 0;
}

/* Room for one more ring entry: compact when half the ring is dropped, else double. */
static int ring_room(Reuse *r) {
    uint64_t n = r->tail - r->head;
    if (n < r->rcap) return 0;
    uint64_t cap = (uint64_t)r->live * 2 <= n ? r->rcap : r->rcap * 2;
    GEntry *ring = PyMem_Malloc(cap * sizeof *ring);
    if (ring == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    uint64_t out = 0;
    for (uint64_t s = r->head; s < r->tail; s++) {
        GEntry e = r->ring[s & (r->rcap - 1)];
        if (e.val >= 0) ring[out++] = e;
    }
    PyMem_Free(r->ring);
    r->ring = ring;
    r->rcap = cap;
    r->head = 0;
    r->tail = out;
    return table_rebuild(r, r->tcap);
}

/* Drop the oldest live ghost. */
static void ghost_pop_oldest(Reuse *r) {
    while (r->head < r->tail) {
        GEntry *e = &r->ring[r->head & (r->rcap - 1)];
        r->head += 1;
        if (e->val < 0) continue;
        long long i = table_find(r, e->h);
        if (i >= 0) table_delete(r, (uint64_t)i);
        e->val = -1;
        r->live -= 1;
        if (r->head < r->tail) reuse_prefetch(r, r->ring[r->head & (r->rcap - 1)].h);
        return;
    }
}

/* Whether the key (hash `h`) is a ghost: if so it is dropped and, when it left its list
 * within the other list's shadow, that list's target grows (policies.py). */
static int reuse_returning(Reuse *r, uint64_t h) {
    long long i = table_find(r, h);
    if (i < 0) return 0;
    uint64_t seq = r->tab[i].seq;
    GEntry *e = &r->ring[seq & (r->rcap - 1)];
    int64_t got = e->val;
    e->val = -1;
    table_delete(r, (uint64_t)i);
    r->live -= 1;
    int k = (int)(got & 1);
    long long then = got >> 1;
    double mine = k == 0 ? r->share : 1.0 - r->share;
    double region = r->shadow * (double)r->capacity * (1.0 - mine);
    if (region > 0 && (double)(r->evicted[k] - then) <= region) {
        mine = fmin(mine + 1.0 / region, 1.0 - r->floor_);
        r->share = k == 0 ? mine : 1.0 - mine;
    }
    return 1;
}

/* The list the next victim comes from (0: T1, 1: T2), `resident` pages in all. Before the
 * first eviction the targets are set from the split the pool filled with. */
static int reuse_victim_list(Reuse *r, long long resident) {
    if (r->evicted[0] + r->evicted[1] == 0 && resident > 0) {
        double t1 = (double)(resident - r->t2) / (double)resident;
        r->share = fmin(fmax(t1, r->floor_), 1.0 - r->floor_);
    }
    return (double)(resident - r->t2) >= r->share * (double)resident ? 0 : 1;
}

/* Record an eviction from list `k` of the key hashed `h`, `resident` pages resident. */
static int reuse_evicted(Reuse *r, int k, uint64_t h, long long resident) {
    if (ring_room(r) < 0) return -1;  /* may compact: sequence numbers change */
    if ((uint64_t)(r->tused + 1) * 2 > r->tcap && table_rebuild(r, r->tcap * 2) < 0) return -1;
    r->evicted[k] += 1;
    r->capacity = resident;
    uint64_t mask = r->tcap - 1, i = h & mask, seq = r->tail++;
    while (r->tab[i].seq != EMPTY_SEQ && r->tab[i].h != h) i = (i + 1) & mask;
    if (r->tab[i].seq != EMPTY_SEQ) {  /* remembered again: the old entry is dropped */
        r->ring[r->tab[i].seq & (r->rcap - 1)].val = -1;
        r->tab[i].seq = seq;
    } else {
        r->tab[i] = (TEntry){h, seq};
        r->tused += 1;
        r->live += 1;
    }
    r->ring[seq & (r->rcap - 1)] = (GEntry){h, 2 * r->evicted[k] + k};
    double bound = r->factor * (double)resident;
    while ((double)r->live > bound && r->live > 0) ghost_pop_oldest(r);
    return 0;
}

static int reuse_init(PyObject *self, PyObject *args, PyObject *kw) {
    static char *names[] = {"ghost_factor", "shadow", "floor", NULL};
    Reuse *r = (Reuse *)self;
    double factor, shadow, floor_;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "ddd:Reuse", names, &factor, &shadow, &floor_))
        return -1;
    if (!(factor > 0) || !(shadow > 0) || !(floor_ >= 0 && floor_ < 0.5)) {
        PyErr_Format(PyExc_ValueError,
                     "Reuse needs ghost_factor > 0, shadow > 0 and 0 <= floor < 0.5; got %R",
                     args);
        return -1;
    }
    r->factor = factor;
    r->shadow = shadow;
    r->share = 1.0 - floor_;  /* until the first eviction sets it */
    r->floor_ = floor_;
    r->capacity = r->t2 = r->evicted[0] = r->evicted[1] = 0;
    PyMem_Free(r->ring);
    r->rcap = 64;
    r->ring = PyMem_Malloc(r->rcap * sizeof *r->ring);
    r->head = r->tail = 0;
    r->live = 0;
    if (r->ring == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    return table_rebuild(r, 128);
}

static void reuse_dealloc(PyObject *self) {
    Reuse *r = (Reuse *)self;
    PyMem_Free(r->ring);
    PyMem_Free(r->tab);
    Py_TYPE(self)->tp_free(self);
}

/* The hash of a key from Python: a bytes object of at most 32 bytes, in namespace `ns`. */
static int key_hash(PyObject *key, long long ns, uint64_t *h) {
    if (PyBytes_GET_SIZE(key) > KEY_BYTES) {
        PyErr_Format(PyExc_ValueError, "a key has at most %d bytes, got %zd", KEY_BYTES,
                     PyBytes_GET_SIZE(key));
        return -1;
    }
    *h = ghost_hash((int64_t)ns, PyBytes_AS_STRING(key), PyBytes_GET_SIZE(key));
    return 0;
}

static PyObject *reuse_py_returning(PyObject *self, PyObject *args) {
    long long ns;
    PyObject *key;
    uint64_t h;
    if (!PyArg_ParseTuple(args, "LO!:returning", &ns, &PyBytes_Type, &key) ||
        key_hash(key, ns, &h) < 0)
        return NULL;
    return PyBool_FromLong(reuse_returning((Reuse *)self, h));
}

static PyObject *reuse_py_evicted(PyObject *self, PyObject *args) {
    long long ns, resident;
    PyObject *key;
    int k;
    uint64_t h;
    if (!PyArg_ParseTuple(args, "iLO!L:record_eviction", &k, &ns, &PyBytes_Type, &key, &resident) ||
        key_hash(key, ns, &h) < 0)
        return NULL;
    if (k != 0 && k != 1) {
        PyErr_Format(PyExc_ValueError, "list must be 0 or 1, got %d", k);
        return NULL;
    }
    if (reuse_evicted((Reuse *)self, k, h, resident) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *reuse_py_victim_list(PyObject *self, PyObject *arg) {
    long long resident = PyLong_AsLongLong(arg);
    if (resident == -1 && PyErr_Occurred()) return NULL;
    return PyLong_FromLong(reuse_victim_list((Reuse *)self, resident));
}

static PyObject *reuse_get_ghosts(PyObject *self, void *closure) {
    (void)closure;
    return PyLong_FromSsize_t(((Reuse *)self)->live);
}

static PyObject *reuse_get_evicted(PyObject *self, void *closure) {
    (void)closure;
    Reuse *r = (Reuse *)self;
    return Py_BuildValue("[LL]", r->evicted[0], r->evicted[1]);
}

static PyObject *reuse_py_ghost_list(PyObject *self, PyObject *unused) {
    (void)unused;
    Reuse *r = (Reuse *)self;
    PyObject *out = PyList_New(0);
    for (uint64_t s = r->head; out != NULL && s < r->tail; s++) {
        GEntry *e = &r->ring[s & (r->rcap - 1)];
        if (e->val < 0) continue;
        PyObject *t = Py_BuildValue("(KL)", (unsigned long long)e->h, (long long)e->val);
        if (t == NULL || PyList_Append(out, t) < 0) Py_CLEAR(out);
        Py_XDECREF(t);
    }
    return out;
}

static PyMethodDef reuse_methods[] = {
    {"ghost_list", reuse_py_ghost_list, METH_NOARGS,
     "ghost_list() -> [(hash, 2 x evictions then + list)]: the ghosts, oldest first."},
    {"returning", reuse_py_returning, METH_VARARGS,
     "returning(ns, key) -> bool: whether the key is a ghost (dropping it, adapting the "
     "targets)."},
    {"record_eviction", reuse_py_evicted, METH_VARARGS,
     "record_eviction(list, ns, key, resident): record an eviction from T1 (0) or T2 (1)."},
    {"victim_list", reuse_py_victim_list, METH_O,
     "victim_list(resident) -> 0 or 1: the list the next victim comes from (before the first "
     "eviction, setting T1's target to T1's share of the resident pages)."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef reuse_members[] = {
    {"share", T_DOUBLE, offsetof(Reuse, share), READONLY, "T1's target share."},
    {"capacity", T_LONGLONG, offsetof(Reuse, capacity), READONLY,
     "Resident pages at the last eviction."},
    {"t2", T_LONGLONG, offsetof(Reuse, t2), 0, "Resident pages in T2."},
    {NULL, 0, 0, 0, NULL},
};

static PyGetSetDef reuse_getset[] = {
    {"ghosts", reuse_get_ghosts, NULL, "Ghosts remembered.", NULL},
    {"evicted", reuse_get_evicted, NULL, "Evictions from T1 and from T2 (a new list).", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject ReuseType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvtier.daemon.pool.native._alloc.Reuse",
    .tp_basicsize = sizeof(Reuse),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The reuse eviction policy's targets, counts and ghosts (see _reuse.h).",
    .tp_new = PyType_GenericNew,
    .tp_init = reuse_init,
    .tp_dealloc = reuse_dealloc,
    .tp_methods = reuse_methods,
    .tp_members = reuse_members,
    .tp_getset = reuse_getset,
};
