/* kvtier.daemon.pool.native._keyprobe: the host pool's key index in C. Three functions:
 *
 * - leading_run: the key table's probe of a whole LOOKUP, in one call (below);
 * - index_keys: the dict of an adopted pool's pages, built in one pass (further down);
 * - seals: the adoption scan's row seals (xxh3 of keys of 17 to 32 bytes), further still;
 *
 * leading_run(table, keys, ns, state, key_len, words, ns_id, mult0, mult1, shift, start,
 *             max_rounds, ready[, slots]) -> (index, unresolved)
 *
 * The same probe as daemon/pool/keytable.py's KeyTable.find, key after key from `start`,
 * stopping at the first key that is not confirmed READY in namespace `ns_id`: its index is
 * returned (the number of keys when all are), with `unresolved` = 1 when its probe met
 * `max_rounds` taken entries (the caller's exact probe decides it) and 0 for a true miss.
 * With `slots` (a writable int64 buffer of one entry per key), the slot found for each key
 * of the run is written to it: a LOAD pins the pages it found without looking them up again.
 *
 * A table entry only proposes a slot: a slot counts when it is inside the columns, its key
 * bytes equal the key's, its key length is 32, its namespace is `ns_id` and its state
 * `ready`. Every buffer's size is checked against the others before the first probe, so no
 * table entry, however stale, reads outside them (a prefetch reads nothing: it only asks
 * for a line, and only of a slot inside the columns). The GIL is released while probing: only
 * the caller's thread changes these arrays.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define WORDS 4 /* a 32-byte key as four 64-bit words */
#define AHEAD 16 /* keys between a bucket's prefetch and its probe: a long LOOKUP's rows lie
                  * all over the columns, and out of the caches once copies have run, so each
                  * key would wait for its misses one after another; fetched ahead, they overlap */

static PyObject *leading_run(PyObject *self, PyObject *args) {
    Py_buffer table, keys, ns, state, key_len, words, slots = {0};
    long long ns_id, start, max_rounds, ready;
    unsigned long long mult0, mult1, shift;
    PyObject *out = NULL;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*y*y*y*y*y*LKKKLLL|w*", &table, &keys, &ns, &state, &key_len,
                          &words, &ns_id, &mult0, &mult1, &shift, &start, &max_rounds, &ready,
                          &slots))
        return NULL;
    Py_ssize_t n_slots = ns.len / 8, n_entries = table.len / 4, n = words.len / (8 * WORDS);
    if (ns.len % 8 || keys.len != n_slots * 8 * WORDS || state.len != n_slots ||
        key_len.len != n_slots || table.len % 4 || words.len % (8 * WORDS)) {
        PyErr_Format(PyExc_ValueError, "column sizes do not agree: ns %zd, keys %zd, state %zd, "
                     "key_len %zd bytes; table %zd, words %zd bytes", ns.len, keys.len,
                     state.len, key_len.len, table.len, words.len);
        goto end;
    }
    if (n_entries == 0 || (n_entries & (n_entries - 1)) || shift >= 64 || start < 0 ||
        start > n || max_rounds < 1) {
        PyErr_Format(PyExc_ValueError, "table of %zd entries (a power of two), shift %llu, "
                     "start %lld of %zd keys, max_rounds %lld", n_entries, shift, start, n,
                     max_rounds);
        goto end;
    }
    if (slots.buf != NULL && slots.len < n * 8) {
        PyErr_Format(PyExc_ValueError, "slots has %zd bytes, %zd keys need %zd", slots.len, n,
                     n * 8);
        goto end;
    }
    {
        int64_t *found_at = slots.buf;
        const int32_t *tab = table.buf;
        const uint64_t *kcol = keys.buf, *w = words.buf;
        const int64_t *ncol = ns.buf;
        const int8_t *scol = state.buf;
        const uint8_t *lcol = key_len.buf;
        uint64_t mask = (uint64_t)n_entries - 1, nsh = (uint64_t)ns_id * mult1;
        Py_ssize_t i = start;
        int unresolved = 0;
        Py_BEGIN_ALLOW_THREADS
        for (; i < n; i++) {
            const uint64_t *k = w + i * WORDS;
            uint64_t pos = ((nsh ^ k[0]) * mult0) >> shift;
            if (i + AHEAD < n)  /* the bucket of a key AHEAD keys on */
                __builtin_prefetch(tab + ((((nsh ^ w[(i + AHEAD) * WORDS]) * mult0) >> shift) & mask));
            if (i + AHEAD / 2 < n) {  /* the row its bucket proposes, for a key half as far on */
                int32_t c = tab[(((nsh ^ w[(i + AHEAD / 2) * WORDS]) * mult0) >> shift) & mask];
                if (c >= 0 && c < n_slots) {
                    __builtin_prefetch(kcol + (Py_ssize_t)c * WORDS);
                    __builtin_prefetch(ncol + c);
                    __builtin_prefetch(scol + c);
                    __builtin_prefetch(lcol + c);
                }
            }
            int found = 0, open = 1;
            for (long long r = 0; r < max_rounds; r++, pos = (pos + 1) & mask) {
                int32_t c = tab[pos & mask];
                if (c < 0) {  /* an empty entry ends the probe: not here */
                    open = 0;
                    break;
                }
                if (c < n_slots && memcmp(kcol + (Py_ssize_t)c * WORDS, k, 8 * WORDS) == 0 &&
                    ncol[c] == ns_id && scol[c] == ready && lcol[c] == 8 * WORDS) {
                    found = 1;
                    if (found_at != NULL)
                        found_at[i] = c;
                    break;
                }
            }
            if (!found) {
                unresolved = open;
                break;
            }
        }
        Py_END_ALLOW_THREADS
        out = Py_BuildValue("ni", i, unresolved);
    }
end:
    PyBuffer_Release(&table);
    PyBuffer_Release(&keys);
    PyBuffer_Release(&ns);
    PyBuffer_Release(&state);
    PyBuffer_Release(&key_len);
    PyBuffer_Release(&words);
    if (slots.buf != NULL)
        PyBuffer_Release(&slots);
    return out;
}

/* index_keys(rows, slots, by_slot) -> dict: the index of adopted pages of one namespace.
 *
 * `rows` holds n 32-byte keys back to back and `slots` (int64) their n slot ids; each key
 * becomes one bytes object, put into `by_slot` (a list: slot -> key) at its slot and into
 * the returned dict (key -> slot), which is sized for n keys up front. Each key is hashed
 * the moment it is made, while it is in the cache: a dict of a million keys built from a
 * list of them (dict(zip(...))) spends most of its time waiting on memory, each key read
 * back from RAM to be hashed. Every slot is checked
 * against the list before anything is changed; a key that comes twice is a ValueError (the
 * adoption scan keeps one row per key), and so is any slot named twice.
 */
static PyObject *index_keys(PyObject *self, PyObject *args) {
    Py_buffer rows, slots;
    PyObject *by_slot, *index = NULL;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*y*O!", &rows, &slots, &PyList_Type, &by_slot))
        return NULL;
    Py_ssize_t n = slots.len / 8, size = PyList_GET_SIZE(by_slot);
    const int64_t *at = slots.buf;
    const char *key = rows.buf;
    if (slots.len % 8 || rows.len != n * 8 * WORDS) {
        PyErr_Format(PyExc_ValueError, "rows has %zd bytes and slots %zd: not one 32-byte key "
                     "per int64 slot", rows.len, slots.len);
        goto end;
    }
    for (Py_ssize_t i = 0; i < n; i++)
        if (at[i] < 0 || at[i] >= size || PyList_GET_ITEM(by_slot, at[i]) != Py_None) {
            PyErr_Format(PyExc_ValueError, "slot %lld (index %zd) is outside the %zd slots "
                         "or already holds a key", (long long)at[i], i, size);
            goto end;
        }
    index = _PyDict_NewPresized(n);
    Py_ssize_t i = 0;
    for (; index != NULL && i < n; i++, key += 8 * WORDS) {
        PyObject *k = PyBytes_FromStringAndSize(key, 8 * WORDS), *v = NULL;
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
    PyBuffer_Release(&slots);
    return index;
}

/* seals(rows, lengths, seeds, out) -> None: xxh3_64(rows[i][:lengths[i]], seeds[i]) per row.
 *
 * The adoption scan's row seals (daemon/pool/seals.py, whose numpy columns this replaces
 * when built) for keys of 17 to 32 bytes: XXH3 hashes such an input with two 16-byte mixes
 * (of its first and of its last 16 bytes) and an avalanche. `rows` holds n keys of `width`
 * (32) bytes each; `lengths` n uint8, each from 17 to 32 (else ValueError, nothing written);
 * `seeds` and `out` n uint64 each.
 */
static inline uint64_t read64(const uint8_t *p) {
    uint64_t v;
    memcpy(&v, p, 8);
    return v; /* little-endian machines only (x86-64, aarch64), as the key columns are */
}

static inline uint64_t mix16(const uint8_t *in, uint64_t s0, uint64_t s1, uint64_t seed) {
    unsigned __int128 m = (unsigned __int128)(read64(in) ^ (s0 + seed)) *
                          (read64(in + 8) ^ (s1 - seed));
    return (uint64_t)m ^ (uint64_t)(m >> 64);
}

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
        if (len[i] < 17 || len[i] > 8 * WORDS) {
            PyErr_Format(PyExc_ValueError, "key %zd is %d bytes long, not 17 to 32", i, len[i]);
            goto end;
        }
    {
        const uint64_t *seed = seeds.buf;
        uint64_t *digest = out.buf;
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < n; i++, key += 8 * WORDS) {
            uint64_t acc = len[i] * 0x9E3779B185EBCA87ULL; /* PRIME64_1 */
            acc += mix16(key, 0xbe4ba423396cfeb8ULL, 0x1cad21f72c81017cULL, seed[i]);
            acc += mix16(key + len[i] - 16, 0xdb979083e96dd4deULL, 0x1f67b3b7a4a44072ULL,
                         seed[i]);
            acc ^= acc >> 37;
            acc *= 0x165667919E3779F9ULL;
            digest[i] = acc ^ (acc >> 32);
        }
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
    {"leading_run", leading_run, METH_VARARGS,
     "leading_run(table, keys, ns, state, key_len, words, ns_id, mult0, mult1, shift, start, "
     "max_rounds, ready[, slots]) -> (index, unresolved): the first key from start not READY "
     "in ns_id (with slots, an int64 buffer, the slot of each key of the run is written there)"},
    {"index_keys", index_keys, METH_VARARGS,
     "index_keys(rows, slots, by_slot) -> dict: 32-byte keys (rows) as bytes objects, each "
     "put into the list by_slot at its slot (int64 slots) and into a dict key -> slot"},
    {"seals", seals, METH_VARARGS,
     "seals(rows, lengths, seeds, out) -> None: xxh3_64 of each 32-byte row's first "
     "lengths[i] bytes (17 to 32) with seeds[i], written to out (uint64)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_keyprobe",
    "The host pool's key index in C: the key table's probe of a whole LOOKUP, the index of an "
    "adopted pool's keys and their row seals.", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__keyprobe(void) { return PyModule_Create(&module); }
