/* kvtier.daemon.pool.native._keyprobe: the host pool's key index in C. Three parts:
 *
 * - Probe: the key table's insertions and its probe of a LOOKUP, over the table and the
 *   pool's columns (below);
 * - index_keys: the dict of an adopted pool's pages, built in one pass (further down);
 * - seals: the adoption scan's row seals (xxh3 of keys of 0 to 32 bytes), further still.
 *
 * Probe(table, keys, ns, state, key_len, mult0, mult1, shift, max_rounds, ready)
 *
 * holds the buffers of the key table (an int32 array of slot ids, -1: empty; a power of
 * two entries) and of the pool's key, ns, state and key_len columns, checked against each
 * other once, here, so that a call is one hash and a few loads per key. The key table's
 * owner (daemon/pool/keytable.py) makes a new Probe whenever it replaces the table.
 *
 * A key's bucket is ((ns * mult1) ^ first 8 bytes of its key) * mult0 >> shift; both
 * insertion and probe run at most `max_rounds` entries on from it (linear probing).
 *
 * add(slots) -> left_out: enters each slot (an int64 buffer, or a sequence of ints) at the
 * first empty entry of its run, reading its key and namespace from the columns; ids out
 * of range, and items that are not ints (a commit the pool refused may list them), are
 * skipped; returns how many found no empty entry there (left out).
 *
 * leading_run(words, ns_id, start[, slots[, lengths]]) -> (index, unresolved): key after
 * key of `words` (32-byte keys back to back, each zero-padded past its length) from
 * `start`, the first that is not confirmed READY in namespace `ns_id`: its index is
 * returned (the number of keys when all are), with `unresolved` = 1 when its probe met
 * `max_rounds` taken entries (the caller's exact probe decides it) and 0 for a true miss.
 * With `slots` (a list; None: none), the slot found for each key of the run from `start`
 * is appended to it: a LOAD pins the pages it found without looking them up again. With
 * `lengths` (one byte per key; None: none), key i is lengths[i] bytes long; else 32.
 *
 * A table entry only proposes a slot: a slot counts when it is inside the columns, its key
 * bytes equal the key's, its key length is the key's, its namespace is `ns_id` and its
 * state `ready`. So no table entry, however stale, reads outside the columns (a prefetch
 * reads nothing: it only asks for a line, and only of a slot inside the columns). Long
 * probes from the first key of a request release the GIL (only the caller's thread changes
 * these arrays); short ones, and the probe that resumes after a key the caller decided, keep
 * it, since taking it back can wait for another thread's switch interval. While a probe runs
 * without the GIL the Probe is busy: close() and a new __init__ refuse, so its buffers stay.
 * No Python code runs inside a call once its arguments are parsed.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#define XXH_INLINE_ALL
#include <xxhash.h>

#define WORDS 4 /* a 32-byte key as four 64-bit words */
#define AHEAD 16 /* keys between a bucket's prefetch and its probe: a long LOOKUP's rows lie
                  * all over the columns, and out of the caches once copies have run, so each
                  * key would wait for its misses one after another; fetched ahead, they overlap */
#define NOGIL_KEYS 1024 /* probes of this many keys or more run without the GIL */

typedef struct {
    PyObject_HEAD
    Py_buffer table, keys, ns, state, key_len;
    int held; /* the buffers are held (0 after close or a failed init) */
    int busy; /* a probe runs without the GIL: close and __init__ refuse */
    Py_ssize_t n_slots, n_entries;
    uint64_t mult0, mult1, shift, mask;
    long long max_rounds, ready;
} Probe;

static void probe_release(Probe *p) {
    if (p->held) {
        PyBuffer_Release(&p->table);
        PyBuffer_Release(&p->keys);
        PyBuffer_Release(&p->ns);
        PyBuffer_Release(&p->state);
        PyBuffer_Release(&p->key_len);
        p->held = 0;
    }
}

static void probe_dealloc(Probe *p) {
    probe_release(p);
    Py_TYPE(p)->tp_free((PyObject *)p);
}

static int probe_busy(Probe *p) {
    if (p->busy) {
        PyErr_SetString(PyExc_RuntimeError, "the probe is in use by another thread");
        return 1;
    }
    return 0;
}

static int probe_init(Probe *p, PyObject *args, PyObject *kwds) {
    (void)kwds;
    if (probe_busy(p))
        return -1;
    probe_release(p);
    if (!PyArg_ParseTuple(args, "w*y*y*y*y*KKKLL", &p->table, &p->keys, &p->ns, &p->state,
                          &p->key_len, &p->mult0, &p->mult1, &p->shift, &p->max_rounds,
                          &p->ready))
        return -1;  /* PyArg_ParseTuple released what it had taken */
    p->held = 1;
    p->n_slots = p->ns.len / 8;
    p->n_entries = p->table.len / 4;
    if (p->ns.len % 8 || p->keys.len != p->n_slots * 8 * WORDS || p->state.len != p->n_slots ||
        p->key_len.len != p->n_slots || p->table.len % 4) {
        PyErr_Format(PyExc_ValueError, "column sizes do not agree: ns %zd, keys %zd, state %zd, "
                     "key_len %zd bytes; table %zd bytes", p->ns.len, p->keys.len, p->state.len,
                     p->key_len.len, p->table.len);
        probe_release(p);
        return -1;
    }
    if (p->n_entries == 0 || (p->n_entries & (p->n_entries - 1)) || p->shift >= 64 ||
        p->n_slots > INT32_MAX || p->max_rounds < 1) {
        PyErr_Format(PyExc_ValueError, "table of %zd entries (a power of two), shift %llu, "
                     "%zd slots, max_rounds %lld", p->n_entries,
                     (unsigned long long)p->shift, p->n_slots, p->max_rounds);
        probe_release(p);
        return -1;
    }
    p->mask = (uint64_t)p->n_entries - 1;
    return 0;
}

static int probe_open(Probe *p) {
    if (!p->held) {
        PyErr_SetString(PyExc_ValueError, "the probe is closed");
        return 0;
    }
    return 1;
}

static inline uint64_t bucket_of(uint64_t mult0, uint64_t shift, uint64_t mask, uint64_t nsh,
                                 uint64_t word0) {
    return (((nsh ^ word0) * mult0) >> shift) & mask;
}

static inline uint64_t bucket(const Probe *p, uint64_t nsh, uint64_t word0) {
    return bucket_of(p->mult0, p->shift, p->mask, nsh, word0);
}

/* Enter slot s at the first empty entry of its run; 0 when there is none. */
static inline int place(Probe *p, int64_t s) {
    const uint64_t *kcol = p->keys.buf;
    const int64_t *ncol = p->ns.buf;
    int32_t *tab = p->table.buf;
    uint64_t pos = bucket(p, (uint64_t)ncol[s] * p->mult1, kcol[s * WORDS]);
    for (long long r = 0; r < p->max_rounds; r++, pos = (pos + 1) & p->mask)
        if (tab[pos] < 0) {
            tab[pos] = (int32_t)s;
            return 1;
        }
    return 0;
}

static PyObject *probe_add(Probe *p, PyObject *arg) {
    if (!probe_open(p))
        return NULL;
    Py_ssize_t left = 0;
    if (PyObject_CheckBuffer(arg)) {
        Py_buffer b;
        if (PyObject_GetBuffer(arg, &b, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0)
            return NULL;
        const char *f = b.format;
        if (b.itemsize != 8 || f == NULL ||
            (strcmp(f, "q") && strcmp(f, "l") && strcmp(f, "<q") && strcmp(f, "=q"))) {
            PyErr_Format(PyExc_TypeError, "slots: an int64 buffer, not format %s",
                         b.format == NULL ? "?" : b.format);
            PyBuffer_Release(&b);
            return NULL;
        }
        const int64_t *s = b.buf;
        for (Py_ssize_t i = 0; i < b.len / 8; i++)
            if (s[i] >= 0 && s[i] < p->n_slots)
                left += !place(p, s[i]);
        PyBuffer_Release(&b);
        return PyLong_FromSsize_t(left);
    }
    PyObject *seq = PySequence_Fast(arg, "slots: an int64 buffer or a sequence of ints");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < n; i++) {
        /* only ints: converting anything else could run Python code that changes the list */
        if (!PyLong_Check(items[i]))
            continue;  /* not a slot id: skipped, as one out of range */
        long long s = PyLong_AsLongLong(items[i]);
        if (s == -1 && PyErr_Occurred()) {  /* beyond 64 bits: out of range */
            PyErr_Clear();
            continue;
        }
        if (s >= 0 && s < p->n_slots)
            left += !place(p, s);
    }
    Py_DECREF(seq);
    return PyLong_FromSsize_t(left);
}

static PyObject *probe_leading_run(Probe *p, PyObject *args) {
    Py_buffer words, lengths = {0};
    long long ns_id, start;
    PyObject *out = NULL, *slots = Py_None, *lengths_obj = Py_None;
    int64_t *found_at = NULL;
    if (!PyArg_ParseTuple(args, "y*LL|OO", &words, &ns_id, &start, &slots, &lengths_obj))
        return NULL;
    if (!probe_open(p)) {  /* after the parse: converting an argument may run Python code */
        PyBuffer_Release(&words);
        return NULL;
    }
    if (lengths_obj != Py_None && PyObject_GetBuffer(lengths_obj, &lengths, PyBUF_SIMPLE) < 0) {
        lengths.buf = NULL;
        goto end;
    }
    Py_ssize_t n = words.len / (8 * WORDS);
    if (words.len % (8 * WORDS) || start < 0 || start > n) {
        PyErr_Format(PyExc_ValueError, "words of %zd bytes (whole 32-byte keys), start %lld",
                     words.len, start);
        goto end;
    }
    if (slots != Py_None && !PyList_Check(slots)) {
        PyErr_Format(PyExc_TypeError, "slots: a list or None, not %.100s", Py_TYPE(slots)->tp_name);
        goto end;
    }
    if (lengths.buf != NULL && lengths.len != n) {
        PyErr_Format(PyExc_ValueError, "lengths has %zd bytes, not one per key (%zd)",
                     lengths.len, n);
        goto end;
    }
    if (slots != Py_None && n > start &&
        (found_at = PyMem_Malloc((size_t)(n - start) * sizeof(int64_t))) == NULL) {
        PyErr_NoMemory();
        goto end;
    }
    {
        const uint8_t *want_len = lengths.buf;
        const int32_t *tab = p->table.buf;
        const uint64_t *kcol = p->keys.buf, *w = words.buf;
        const int64_t *ncol = p->ns.buf;
        const int8_t *scol = p->state.buf;
        const uint8_t *lcol = p->key_len.buf;
        const Py_ssize_t n_slots = p->n_slots;
        const uint64_t mask = p->mask, nsh = (uint64_t)ns_id * p->mult1;
        const uint64_t mult0 = p->mult0, shift = p->shift;
        const long long max_rounds = p->max_rounds, ready = p->ready;
        Py_ssize_t i = start;
        int unresolved = 0;
        PyThreadState *ts = NULL;
        if (start == 0 && n >= NOGIL_KEYS) {
            p->busy++;
            ts = PyEval_SaveThread();
        }
        for (; i < n; i++) {
            const uint64_t *k = w + i * WORDS;
            uint64_t pos = bucket_of(mult0, shift, mask, nsh, k[0]);
            if (i + AHEAD < n)  /* the bucket of a key AHEAD keys on */
                __builtin_prefetch(tab + bucket_of(mult0, shift, mask, nsh,
                                                   w[(i + AHEAD) * WORDS]));
            if (i + AHEAD / 2 < n) {  /* the row its bucket proposes, for a key half as far on */
                int32_t c = tab[bucket_of(mult0, shift, mask, nsh, w[(i + AHEAD / 2) * WORDS])];
                if (c >= 0 && c < n_slots) {
                    __builtin_prefetch(kcol + (Py_ssize_t)c * WORDS);
                    __builtin_prefetch(ncol + c);
                    __builtin_prefetch(scol + c);
                    __builtin_prefetch(lcol + c);
                }
            }
            const unsigned klen = want_len == NULL ? 8 * WORDS : want_len[i];
            int found = 0, open = 1;
            for (long long r = 0; r < max_rounds; r++, pos = (pos + 1) & mask) {
                int32_t c = tab[pos];
                if (c < 0) {  /* an empty entry ends the probe: not here */
                    open = 0;
                    break;
                }
                if (c < n_slots && memcmp(kcol + (Py_ssize_t)c * WORDS, k, 8 * WORDS) == 0 &&
                    ncol[c] == ns_id && scol[c] == ready && lcol[c] == klen) {
                    found = 1;
                    if (found_at != NULL)
                        found_at[i - start] = c;
                    break;
                }
            }
            if (!found) {
                unresolved = open;
                break;
            }
        }
        if (ts != NULL) {
            PyEval_RestoreThread(ts);
            p->busy--;
        }
        for (Py_ssize_t j = 0; found_at != NULL && j < i - start; j++) {
            PyObject *v = PyLong_FromLongLong(found_at[j]);
            int rc = v == NULL ? -1 : PyList_Append(slots, v);
            Py_XDECREF(v);
            if (rc < 0)
                goto end;
        }
        out = Py_BuildValue("ni", i, unresolved);
    }
end:
    PyMem_Free(found_at);
    PyBuffer_Release(&words);
    if (lengths.buf != NULL)
        PyBuffer_Release(&lengths);
    return out;
}

static PyObject *probe_close(Probe *p, PyObject *unused) {
    (void)unused;
    if (probe_busy(p))
        return NULL;
    probe_release(p);
    Py_RETURN_NONE;
}

static PyMethodDef probe_methods[] = {
    {"add", (PyCFunction)probe_add, METH_O,
     "add(slots) -> left_out: enter the slots (int64 buffer or ints; ids out of range or "
     "not ints skipped); returns how many found no empty entry within max_rounds of their bucket"},
    {"leading_run", (PyCFunction)probe_leading_run, METH_VARARGS,
     "leading_run(words, ns_id, start[, slots[, lengths]]) -> (index, unresolved): the first "
     "key from start not READY in ns_id (with slots, a list, the slot of each key of the run "
     "is appended to it; with lengths, one byte per key, each key's length)"},
    {"close", (PyCFunction)probe_close, METH_NOARGS,
     "close(): release the buffers (the probe refuses every call afterwards)"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject ProbeType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvtier.daemon.pool.native._keyprobe.Probe",
    .tp_basicsize = sizeof(Probe),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Probe(table, keys, ns, state, key_len, mult0, mult1, shift, max_rounds, ready): "
              "the key table's insertions and probes over its buffers (see the module source)",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)probe_init,
    .tp_dealloc = (destructor)probe_dealloc,
    .tp_methods = probe_methods,
};

/* index_keys(rows, lengths, slots, by_slot) -> dict: the index of adopted pages of one
 * namespace.
 *
 * `rows` holds n 32-byte key rows back to back, `lengths` (uint8) each key's length (0 to
 * 32: the key is its row's first lengths[i] bytes) and `slots` (int64) their n slot ids;
 * each key becomes one bytes object, put into `by_slot` (a list: slot -> key) at its slot
 * and into the returned dict (key -> slot), which is sized for n keys up front. Each key is
 * hashed the moment it is made, while it is in the cache: a dict of a million keys built
 * from a list of them (dict(zip(...))) spends most of its time waiting on memory, each key
 * read back from RAM to be hashed. Every slot and length is checked against the list
 * before anything is changed; a key that comes twice is a ValueError (the adoption scan
 * keeps one row per key), and so is any slot named twice.
 */
static PyObject *index_keys(PyObject *self, PyObject *args) {
    Py_buffer rows, lengths, slots;
    PyObject *by_slot, *index = NULL;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*y*y*O!", &rows, &lengths, &slots, &PyList_Type, &by_slot))
        return NULL;
    Py_ssize_t n = slots.len / 8, size = PyList_GET_SIZE(by_slot);
    const int64_t *at = slots.buf;
    const uint8_t *len = lengths.buf;
    const char *key = rows.buf;
    if (slots.len % 8 || rows.len != n * 8 * WORDS || lengths.len != n) {
        PyErr_Format(PyExc_ValueError, "rows has %zd bytes, lengths %zd and slots %zd: not one "
                     "32-byte key row and length per int64 slot", rows.len, lengths.len,
                     slots.len);
        goto end;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (at[i] < 0 || at[i] >= size || PyList_GET_ITEM(by_slot, at[i]) != Py_None) {
            PyErr_Format(PyExc_ValueError, "slot %lld (index %zd) is outside the %zd slots "
                         "or already holds a key", (long long)at[i], i, size);
            goto end;
        }
        if (len[i] > 8 * WORDS) {
            PyErr_Format(PyExc_ValueError, "key %zd is %d bytes long, not 0 to 32", i, len[i]);
            goto end;
        }
    }
    index = _PyDict_NewPresized(n);
    Py_ssize_t i = 0;
    for (; index != NULL && i < n; i++, key += 8 * WORDS) {
        PyObject *k = PyBytes_FromStringAndSize(key, len[i]), *v = NULL;
        if (k == NULL || PyObject_Hash(k) == -1 || (v = PyLong_FromLongLong(at[i])) == NULL ||
            PyList_GET_ITEM(by_slot, at[i]) != Py_None || PyDict_SetItem(index, k, v) < 0 ||
            PyDict_GET_SIZE(index) != i + 1) {
            if (!PyErr_Occurred())
                PyErr_Format(PyExc_ValueError, "slot %lld (index %zd): its key or the slot "
                             "comes twice", (long long)at[i], i);
            Py_XDECREF(k);
            Py_XDECREF(v);
            Py_CLEAR(index);
            break;
        }
        Py_DECREF(v);
        PyList_SET_ITEM(by_slot, at[i], k); /* the list takes the reference made above */
        Py_DECREF(Py_None);                 /* and drops the one it held */
    }
    if (index == NULL)  /* a failure part-way: the list gets back the None of each slot set */
        for (Py_ssize_t j = 0; j < i; j++) {
            PyObject *k = PyList_GET_ITEM(by_slot, at[j]);
            Py_INCREF(Py_None);
            PyList_SET_ITEM(by_slot, at[j], Py_None);
            Py_DECREF(k);
        }
end:
    PyBuffer_Release(&rows);
    PyBuffer_Release(&lengths);
    PyBuffer_Release(&slots);
    return index;
}

/* seals(rows, lengths, seeds, out) -> None: xxh3_64(rows[i][:lengths[i]], seeds[i]) per row.
 *
 * The adoption scan's row seals (daemon/pool/seals.py) for keys of every length a row can
 * hold, 0 to 32 bytes: XXH3-64 with a seed (xxHash's XXH3_64bits_withSeed, inlined; its
 * output is frozen since xxHash 0.8.0). Only a row's first lengths[i] bytes are read.
 * `rows` holds n keys of 32 bytes each; `lengths` n uint8, each at most 32 (else
 * ValueError, nothing written); `seeds` and `out` n uint64 each. The unit tests hold every
 * length to the xxhash package and to their own XXH3.
 */
static PyObject *seals(PyObject *self, PyObject *args) {
    Py_buffer rows, lengths, seeds, out;
    PyObject *ret = NULL;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*y*y*w*", &rows, &lengths, &seeds, &out))
        return NULL;
    Py_ssize_t n = lengths.len;
    if (rows.len != n * 8 * WORDS || seeds.len != n * 8 || out.len != n * 8) {
        PyErr_Format(PyExc_ValueError, "rows %zd, lengths %zd, seeds %zd, out %zd bytes: not "
                     "one 32-byte row, length, seed and digest per key", rows.len, lengths.len,
                     seeds.len, out.len);
        goto end;
    }
    const uint8_t *key = rows.buf, *len = lengths.buf;
    for (Py_ssize_t i = 0; i < n; i++)
        if (len[i] > 8 * WORDS) {
            PyErr_Format(PyExc_ValueError, "key %zd is %d bytes long, not 0 to 32", i, len[i]);
            goto end;
        }
    {
        const uint64_t *seed = seeds.buf;
        uint64_t *digest = out.buf;
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < n; i++, key += 8 * WORDS)
            digest[i] = XXH3_64bits_withSeed(key, len[i], seed[i]);
        Py_END_ALLOW_THREADS
    }
    ret = Py_NewRef(Py_None);
end:
    PyBuffer_Release(&rows);
    PyBuffer_Release(&lengths);
    PyBuffer_Release(&seeds);
    PyBuffer_Release(&out);
    return ret;
}

static PyMethodDef methods[] = {
    {"index_keys", index_keys, METH_VARARGS,
     "index_keys(rows, lengths, slots, by_slot) -> dict: each 32-byte row's first lengths[i] "
     "bytes (0 to 32) as a bytes object, put into the list by_slot at its slot (int64 slots) "
     "and into a dict key -> slot"},
    {"seals", seals, METH_VARARGS,
     "seals(rows, lengths, seeds, out) -> None: xxh3_64 of each 32-byte row's first "
     "lengths[i] bytes (0 to 32) with seeds[i], written to out (uint64)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_keyprobe",
    "The host pool's key index in C: the key table's insertions and its probe of a LOOKUP, "
    "the index of an adopted pool's keys and their row seals.", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__keyprobe(void) {
    if (PyType_Ready(&ProbeType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddObjectRef(m, "Probe", (PyObject *)&ProbeType) < 0)
        Py_CLEAR(m);
    return m;
}
