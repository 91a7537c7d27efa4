/* The `reuse` eviction policy's state, in C: included by _alloc.c, whose allocation loop
 * runs the policy inline, and exported by it as `_alloc.Reuse`, which
 * daemon/pool/policies.py's ReuseState wraps for the evictor's Python steps (one
 * implementation for both).
 *
 * Reuse(ghost_factor, quantile): the rules are policies.py's module docstring.
 *
 * State: the resident pages at the last eviction (`capacity`), the pages in T2 (`t2`), the
 * evictions from each list, the re-use distances (a histogram in powers of two of the
 * access-clock ticks between a page's last use and its next one) and the lifetime drawn
 * from them (`life`: -1 until the first estimate), and the ghosts: keys of recent
 * evictions, each with the list it left and its page's last access tick, oldest first, at
 * most ghost_factor x the resident pages at the last eviction.
 *
 * The ghosts are a FIFO ring of (hash, value) entries (value -1: dropped, a ghost that
 * returned or was remembered again) indexed by an open-addressing table from hash to the
 * entry's sequence number (linear probing, deletion by backward shift, so no tombstones).
 * A key's hash is XXH3-64 of its bytes seeded with its namespace: process-private, like
 * the ghosts themselves; two keys that collide (2^-64) share a ghost, which only moves a
 * page into T2 and adds one distance. The ring grows by doubling, or is compacted when at
 * least half of it is dropped, so its memory stays within a small multiple of the live
 * ghosts.
 */
#include <math.h>

#define EMPTY_SEQ UINT64_MAX
#define STAMP_MAX ((int64_t)1 << 61)  /* the largest stamp a ghost keeps */

/* a - b, or the nearest of INT64_MIN, INT64_MAX when it overflows (stamps come from a file). */
static inline long long sat_sub(long long a, long long b) {
    long long d;
    if (__builtin_sub_overflow(a, b, &d)) return b < 0 ? LLONG_MAX : LLONG_MIN;
    return d;
}

typedef struct {
    uint64_t h;
    int64_t val;  /* 2 x (its page's last access tick) + list; -1: dropped */
} GEntry;

typedef struct {
    uint64_t h, seq;  /* a ghost's hash and its ring sequence number: one cache line */
} TEntry;

typedef struct {
    PyObject_HEAD
    double factor, quantile;
    long long capacity, t2, evicted[2], life;
    uint64_t hist[64], samples;  /* re-use distances: hist[b] counts those in [2^b, 2^(b+1)) */
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

/* A re-use `d` ticks after the page's last use. Once the histogram holds as many
 * distances as the pool held pages at its last eviction, `life` becomes their `quantile`
 * (found in its power of two, linearly between its bounds), and every count is halved
 * (older distances weigh less). */
static void reuse_observe(Reuse *r, long long d) {
    if (d <= 0) return;
    r->hist[63 - __builtin_clzll((unsigned long long)d)] += 1;
    r->samples += 1;
    if (r->capacity <= 0 || r->samples < (uint64_t)r->capacity) return;
    double target = r->quantile * (double)r->samples, acc = 0.0;
    int b = 0;
    for (; b < 63; b++) {  /* the power of two holding the quantile: acc < target there */
        if (acc + (double)r->hist[b] >= target) break;
        acc += (double)r->hist[b];
    }
    double life = ldexp(1.0, b) * (1.0 + (target - acc) / (double)r->hist[b]);
    r->life = life >= 9.0e18 ? (long long)9.0e18 : (long long)life;
    r->samples = 0;
    for (int k = 0; k < 64; k++) r->samples += (r->hist[k] >>= 1);
}

/* Whether the key (hash `h`) is a ghost, stored again at tick `clock`: if so it is dropped
 * and the ticks since its page's last use count as a re-use distance. */
static int reuse_returning(Reuse *r, uint64_t h, long long clock) {
    long long i = table_find(r, h);
    if (i < 0) return 0;
    uint64_t seq = r->tab[i].seq;
    GEntry *e = &r->ring[seq & (r->rcap - 1)];
    int64_t got = e->val;
    e->val = -1;
    table_delete(r, (uint64_t)i);
    r->live -= 1;
    reuse_observe(r, sat_sub(clock, got >> 1));
    return 1;
}

/* The lifetime now: `life`, or before the first estimate 4 x `resident`. */
static long long reuse_life(const Reuse *r, long long resident) {
    return r->life >= 0 ? r->life : 4 * resident;
}

/* The list the next victim comes from (0: T1, 1: T2), given the stamps of the coldest
 * evictable page of each (`have1`, `have2`: whether there is one), the access clock and
 * the resident pages: T2's when T1 has none, or when it has not been used for more than
 * the lifetime and is colder than T1's. */
static int reuse_pick(const Reuse *r, int have1, long long stamp1, int have2, long long stamp2,
                      long long clock, long long resident) {
    if (!have2) return 0;
    if (!have1) return 1;
    return sat_sub(clock, stamp2) > reuse_life(r, resident) && stamp2 < stamp1 ? 1 : 0;
}

/* Record an eviction from list `k` of the key hashed `h`, whose page was last used at tick
 * `stamp`, `resident` pages resident. */
static int reuse_evicted(Reuse *r, int k, uint64_t h, long long stamp, long long resident) {
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
    /* a stamp read from an adopted file may be anything: kept within [0, 2^61] */
    int64_t at = stamp < 0 ? 0 : stamp > STAMP_MAX ? STAMP_MAX : stamp;
    r->ring[seq & (r->rcap - 1)] = (GEntry){h, 2 * at + k};
    double bound = r->factor * (double)resident;
    while ((double)r->live > bound && r->live > 0) ghost_pop_oldest(r);
    return 0;
}

static int reuse_init(PyObject *self, PyObject *args, PyObject *kw) {
    static char *names[] = {"ghost_factor", "quantile", NULL};
    Reuse *r = (Reuse *)self;
    double factor, quantile;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "dd:Reuse", names, &factor, &quantile))
        return -1;
    if (!(factor > 0) || !(quantile > 0 && quantile < 1)) {
        PyErr_Format(PyExc_ValueError,
                     "Reuse needs ghost_factor > 0 and 0 < quantile < 1; got %R", args);
        return -1;
    }
    r->factor = factor;
    r->quantile = quantile;
    r->life = -1;
    memset(r->hist, 0, sizeof r->hist);
    r->samples = 0;
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
    long long ns, clock;
    PyObject *key;
    uint64_t h;
    if (!PyArg_ParseTuple(args, "LO!L:returning", &ns, &PyBytes_Type, &key, &clock) ||
        key_hash(key, ns, &h) < 0)
        return NULL;
    return PyBool_FromLong(reuse_returning((Reuse *)self, h, clock));
}

static PyObject *reuse_py_evicted(PyObject *self, PyObject *args) {
    long long ns, stamp, resident;
    PyObject *key;
    int k;
    uint64_t h;
    if (!PyArg_ParseTuple(args, "iLO!LL:record_eviction", &k, &ns, &PyBytes_Type, &key, &stamp,
                          &resident) ||
        key_hash(key, ns, &h) < 0)
        return NULL;
    if (k != 0 && k != 1) {
        PyErr_Format(PyExc_ValueError, "list must be 0 or 1, got %d", k);
        return NULL;
    }
    if (reuse_evicted((Reuse *)self, k, h, stamp, resident) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *reuse_py_pick(PyObject *self, PyObject *args) {
    PyObject *s1, *s2;
    long long clock, resident, stamp1 = 0, stamp2 = 0;
    if (!PyArg_ParseTuple(args, "OOLL:pick", &s1, &s2, &clock, &resident)) return NULL;
    if (s1 != Py_None && (stamp1 = PyLong_AsLongLong(s1)) == -1 && PyErr_Occurred()) return NULL;
    if (s2 != Py_None && (stamp2 = PyLong_AsLongLong(s2)) == -1 && PyErr_Occurred()) return NULL;
    return PyLong_FromLong(
        reuse_pick((Reuse *)self, s1 != Py_None, stamp1, s2 != Py_None, stamp2, clock, resident));
}

static PyObject *reuse_py_used(PyObject *self, PyObject *args) {
    Py_buffer stamp;
    PyObject *slots;
    long long clock;
    if (!PyArg_ParseTuple(args, "y*O!L:used", &stamp, &PyList_Type, &slots, &clock)) return NULL;
    Py_ssize_t n_slots = stamp.len / (Py_ssize_t)sizeof(int64_t), n = PyList_GET_SIZE(slots);
    const int64_t *st = stamp.buf;
    PyObject *out = NULL;
    long long *at = NULL;
    if (stamp.len % (Py_ssize_t)sizeof(int64_t) != 0) {
        PyErr_SetString(PyExc_ValueError, "stamp must hold int64 values");
        goto done;
    }
    if ((at = PyMem_Malloc((size_t)(n > 0 ? n : 1) * sizeof *at)) == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {  /* every slot read and checked once, before any
                                           * distance counts */
        if (i >= PyList_GET_SIZE(slots)) {
            PyErr_SetString(PyExc_ValueError, "slots changed while they were read");
            goto done;
        }
        long long s = PyLong_AsLongLong(PyList_GET_ITEM(slots, i));
        if (s == -1 && PyErr_Occurred()) goto done;
        if (s < 0 || s >= n_slots) {
            PyErr_Format(PyExc_ValueError, "slot %lld is outside the pool's %zd", s, n_slots);
            goto done;
        }
        at[i] = s;
    }
    for (Py_ssize_t i = 0; i < n; i++) reuse_observe((Reuse *)self, sat_sub(clock, st[at[i]]));
    out = Py_None;
    Py_INCREF(out);
done:
    PyMem_Free(at);
    PyBuffer_Release(&stamp);
    return out;
}

static PyObject *reuse_py_restore(PyObject *self, PyObject *arg) {
    long long life = PyLong_AsLongLong(arg);
    if (life == -1 && PyErr_Occurred()) return NULL;
    if (life < 1 || life > 9000000000000000000LL) {
        PyErr_Format(PyExc_ValueError, "a lifetime is 1 to 9e18 ticks, got %lld", life);
        return NULL;
    }
    ((Reuse *)self)->life = life;
    Py_RETURN_NONE;
}

static PyObject *reuse_py_life(PyObject *self, PyObject *arg) {
    long long resident = PyLong_AsLongLong(arg);
    if (resident == -1 && PyErr_Occurred()) return NULL;
    return PyLong_FromLongLong(reuse_life((Reuse *)self, resident));
}

static PyObject *reuse_py_histogram(PyObject *self, PyObject *unused) {
    (void)unused;
    Reuse *r = (Reuse *)self;
    PyObject *out = PyList_New(64);
    for (int b = 0; out != NULL && b < 64; b++) {
        PyObject *v = PyLong_FromUnsignedLongLong(r->hist[b]);
        if (v == NULL) Py_CLEAR(out);
        else PyList_SET_ITEM(out, b, v);
    }
    return out;
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
     "ghost_list() -> [(hash, 2 x its page's last access tick + list)]: the ghosts, oldest "
     "first."},
    {"returning", reuse_py_returning, METH_VARARGS,
     "returning(ns, key, clock) -> bool: whether the key is a ghost (dropping it, counting "
     "the ticks since its page's last use as a re-use distance)."},
    {"record_eviction", reuse_py_evicted, METH_VARARGS,
     "record_eviction(list, ns, key, stamp, resident): record an eviction from T1 (0) or T2 "
     "(1) of a page last used at tick `stamp`."},
    {"pick", reuse_py_pick, METH_VARARGS,
     "pick(stamp1, stamp2, clock, resident) -> 0 or 1: the list the next victim comes from, "
     "given the stamps of each list's coldest evictable page (None: none)."},
    {"used", reuse_py_used, METH_VARARGS,
     "used(stamp, slots, clock): the pages `slots` (stamps in the int64 buffer `stamp`) are "
     "used again at tick `clock`: count their re-use distances."},
    {"restore", reuse_py_restore, METH_O,
     "restore(life): take a lifetime estimated before a restart (1 to 9e18 ticks)."},
    {"lifetime", reuse_py_life, METH_O,
     "lifetime(resident) -> int: the lifetime now (before the first estimate, 4 x resident)."},
    {"histogram", reuse_py_histogram, METH_NOARGS,
     "histogram() -> [64 ints]: the re-use distances counted in [2^b, 2^(b+1)), by b."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef reuse_members[] = {
    {"life", T_LONGLONG, offsetof(Reuse, life), READONLY,
     "The lifetime estimated from the re-use distances, in ticks (-1: none yet)."},
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
    .tp_doc = "The reuse eviction policy's lifetime, counts and ghosts (see _reuse.h).",
    .tp_new = PyType_GenericNew,
    .tp_init = reuse_init,
    .tp_dealloc = reuse_dealloc,
    .tp_methods = reuse_methods,
    .tp_members = reuse_members,
    .tp_getset = reuse_getset,
};
