/* kvtier.kernels._keyprobe: the key table's probe of a whole LOOKUP, in one C call.
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

static PyMethodDef methods[] = {
    {"leading_run", leading_run, METH_VARARGS,
     "leading_run(table, keys, ns, state, key_len, words, ns_id, mult0, mult1, shift, start, "
     "max_rounds, ready[, slots]) -> (index, unresolved): the first key from start not READY "
     "in ns_id (with slots, an int64 buffer, the slot of each key of the run is written there)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_keyprobe", "The key table's probe of a whole LOOKUP, in C.", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__keyprobe(void) { return PyModule_Create(&module); }
