/* kvtier.kernels._pagekeys: the SHA-256 chain of page keys (kvtier.client.page_keys), in C.

   chain(seed, tokens, page_bytes, portable=False) -> list[bytes]
       ``tokens`` is a buffer of the full pages' token ids as little-endian uint32 (its
       length a multiple of ``page_bytes``, itself a positive multiple of 4), or a list or
       tuple of ints (each in [0, 2**32), checked, whole pages keyed, a partial last page
       checked and left out) read here, without a numpy array on the way. Returns None when
       an item of the list is not exactly an int (a numpy integer, a bool: the caller
       converts those), so that no Python code runs while the list is read. Key 0 is
       SHA-256(seed || page 0's bytes), key i SHA-256(key i-1 || page i's bytes): the
       32-byte digests, in page order. The hashing runs with the GIL released.
       ``portable``: hash with the portable C even where the CPU has SHA extensions (the
       two are tested against each other and against hashlib).

   Why: an engine keys every prompt before its LOOKUP (vLLM's scheduler does it for each new
   request, on the thread that schedules every other request). In Python each page costs a
   hashlib object, a slice and a digest (about 0.8 µs, 7 ms for a 128K-token prompt at 16
   tokens a page), more than the hashing itself; here a page is two or three SHA-256 blocks,
   with the CPU's SHA extensions where it has them (x86-64 SHA-NI, detected at import) and
   portable C otherwise. The keys are the same bytes either way: hashlib's SHA-256. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>
#include <immintrin.h>
#define HAVE_SHANI_BUILD 1
#endif

static const uint32_t K[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4,
    0xab1c5ed5, 0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe,
    0x9bdc06a7, 0xc19bf174, 0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f,
    0x4a7484aa, 0x5cb0a9dc, 0x76f988da, 0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7,
    0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967, 0x27b70a85, 0x2e1b2138, 0x4d2c6dfc,
    0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85, 0xa2bfe8a1, 0xa81a664b,
    0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070, 0x19a4c116,
    0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7,
    0xc67178f2,
};

static const uint32_t H0[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                               0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};

#define ROR(x, n) (((x) >> (n)) | ((x) << (32 - (n))))

/* FIPS 180-4's compression of ``blocks`` 64-byte blocks into ``s``. */
static void compress_c(uint32_t s[8], const uint8_t *p, size_t blocks) {
    uint32_t w[64];
    for (; blocks--; p += 64) {
        for (int t = 0; t < 16; t++)
            w[t] = (uint32_t)p[4 * t] << 24 | (uint32_t)p[4 * t + 1] << 16 |
                   (uint32_t)p[4 * t + 2] << 8 | (uint32_t)p[4 * t + 3];
        for (int t = 16; t < 64; t++) {
            uint32_t s0 = ROR(w[t - 15], 7) ^ ROR(w[t - 15], 18) ^ (w[t - 15] >> 3);
            uint32_t s1 = ROR(w[t - 2], 17) ^ ROR(w[t - 2], 19) ^ (w[t - 2] >> 10);
            w[t] = w[t - 16] + s0 + w[t - 7] + s1;
        }
        uint32_t a = s[0], b = s[1], c = s[2], d = s[3], e = s[4], f = s[5], g = s[6], h = s[7];
        for (int t = 0; t < 64; t++) {
            uint32_t t1 = h + (ROR(e, 6) ^ ROR(e, 11) ^ ROR(e, 25)) + ((e & f) ^ (~e & g)) + K[t] +
                          w[t];
            uint32_t t2 = (ROR(a, 2) ^ ROR(a, 13) ^ ROR(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
            h = g;
            g = f;
            f = e;
            e = d + t1;
            d = c;
            c = b;
            b = a;
            a = t1 + t2;
        }
        s[0] += a;
        s[1] += b;
        s[2] += c;
        s[3] += d;
        s[4] += e;
        s[5] += f;
        s[6] += g;
        s[7] += h;
    }
}

#ifdef HAVE_SHANI_BUILD
/* The same compression with the SHA extensions: the state kept as ABEF / CDGH, four rounds
   per pair of sha256rnds2, the message schedule by sha256msg1 / sha256msg2. */
__attribute__((target("sha,sse4.1,ssse3"))) static void compress_ni(uint32_t s[8],
                                                                    const uint8_t *p,
                                                                    size_t blocks) {
    const __m128i bswap = _mm_set_epi64x(0x0c0d0e0f08090a0bULL, 0x0405060700010203ULL);
    __m128i tmp = _mm_loadu_si128((const __m128i *)&s[0]);
    __m128i st1 = _mm_loadu_si128((const __m128i *)&s[4]);
    tmp = _mm_shuffle_epi32(tmp, 0xB1);           /* CDAB */
    st1 = _mm_shuffle_epi32(st1, 0x1B);           /* EFGH */
    __m128i st0 = _mm_alignr_epi8(tmp, st1, 8);   /* ABEF */
    st1 = _mm_blend_epi16(st1, tmp, 0xF0);        /* CDGH */
    for (; blocks--; p += 64) {
        __m128i abef = st0, cdgh = st1, x[4];
        for (int i = 0; i < 16; i++) {
            __m128i m;
            if (i < 4) {
                m = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(p + 16 * i)), bswap);
            } else {
                __m128i w4 = x[i & 3], w3 = x[(i + 1) & 3], w2 = x[(i + 2) & 3],
                        w1 = x[(i + 3) & 3];
                m = _mm_add_epi32(_mm_sha256msg1_epu32(w4, w3), _mm_alignr_epi8(w1, w2, 4));
                m = _mm_sha256msg2_epu32(m, w1);
            }
            x[i & 3] = m;
            __m128i r = _mm_add_epi32(m, _mm_loadu_si128((const __m128i *)&K[4 * i]));
            st1 = _mm_sha256rnds2_epu32(st1, st0, r);
            st0 = _mm_sha256rnds2_epu32(st0, st1, _mm_shuffle_epi32(r, 0x0E));
        }
        st0 = _mm_add_epi32(st0, abef);
        st1 = _mm_add_epi32(st1, cdgh);
    }
    tmp = _mm_shuffle_epi32(st0, 0x1B);           /* FEBA */
    st1 = _mm_shuffle_epi32(st1, 0xB1);           /* DCHG */
    st0 = _mm_blend_epi16(tmp, st1, 0xF0);        /* DCBA */
    st1 = _mm_alignr_epi8(st1, tmp, 8);           /* ABEF */
    _mm_storeu_si128((__m128i *)&s[0], st0);
    _mm_storeu_si128((__m128i *)&s[4], st1);
}

static int cpu_has_sha(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return 0;
    if (!(b & (1u << 29))) return 0; /* SHA */
    if (!__get_cpuid(1, &a, &b, &c, &d)) return 0;
    return (c & (1u << 19)) && (c & (1u << 9)); /* SSE4.1, SSSE3 */
}
#endif

typedef void (*compress_fn)(uint32_t s[8], const uint8_t *p, size_t blocks);
static compress_fn fastest = compress_c;
static int native_sha = 0;

/* SHA-256 of ``msg`` (``len`` bytes, ``buf`` holding them and room for the padding: the
   length rounded up past 8 more bytes to 64) into ``out``. */
static void digest(uint8_t *buf, size_t len, uint8_t out[32], compress_fn compress) {
    size_t total = (len + 9 + 63) / 64 * 64;
    uint64_t bits = (uint64_t)len * 8;
    uint32_t s[8];
    buf[len] = 0x80;
    memset(buf + len + 1, 0, total - len - 9);
    for (int i = 0; i < 8; i++) buf[total - 1 - i] = (uint8_t)(bits >> (8 * i));
    memcpy(s, H0, sizeof s);
    compress(s, buf, total / 64);
    for (int i = 0; i < 8; i++) {
        out[4 * i] = (uint8_t)(s[i] >> 24);
        out[4 * i + 1] = (uint8_t)(s[i] >> 16);
        out[4 * i + 2] = (uint8_t)(s[i] >> 8);
        out[4 * i + 3] = (uint8_t)s[i];
    }
}

/* The ints of the list or tuple ``seq`` as little-endian uint32 in a new buffer (its whole
   pages of ``page_bytes``: ``*len`` bytes); NULL with an exception when one is outside
   [0, 2**32); NULL with ``*other`` set and no exception when an item is not exactly an int. */
static uint8_t *ints_as_u32(PyObject *seq, Py_ssize_t page_bytes, Py_ssize_t *len, int *other) {
    Py_ssize_t count = PySequence_Fast_GET_SIZE(seq), per = page_bytes / 4;
    PyObject **items = PySequence_Fast_ITEMS(seq);
    Py_ssize_t whole = count / per * per;
    uint8_t *out = malloc((size_t)(whole > 0 ? whole : 1) * 4);
    if (out == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        if (!PyLong_CheckExact(items[i])) { /* its __index__ could change the list */
            free(out);
            *other = 1;
            return NULL;
        }
        long long v = PyLong_AsLongLong(items[i]);
        if (v == -1 && PyErr_Occurred()) { /* an overflow: out of range, said below */
            PyErr_Clear();
            v = -1;
        }
        if (v < 0 || v > 0xFFFFFFFFLL) {
            free(out);
            PyErr_SetString(PyExc_ValueError, "tokens must be in [0, 2**32)");
            return NULL;
        }
        if (i < whole) {
            uint32_t u = (uint32_t)v;
            uint8_t *d = out + 4 * i;
            d[0] = (uint8_t)u;
            d[1] = (uint8_t)(u >> 8);
            d[2] = (uint8_t)(u >> 16);
            d[3] = (uint8_t)(u >> 24);
        }
    }
    *len = whole * 4;
    return out;
}

static PyObject *chain(PyObject *self, PyObject *args) {
    Py_buffer seed, tokens = {0};
    Py_ssize_t page_bytes, n, i;
    PyObject *out = NULL, *obj;
    uint8_t *keys = NULL, *buf = NULL, *owned = NULL;
    int portable = 0;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*On|p", &seed, &obj, &page_bytes, &portable)) return NULL;
    compress_fn compress = portable ? compress_c : fastest;
    if (page_bytes <= 0 || page_bytes % 4 != 0) {
        PyErr_Format(PyExc_ValueError, "page_bytes = %zd must be a positive multiple of 4",
                     page_bytes);
        PyBuffer_Release(&seed);
        return NULL;
    }
    if (PyList_Check(obj) || PyTuple_Check(obj)) {
        PyObject *seq = PySequence_Fast(obj, "tokens");
        if (seq == NULL) {
            PyBuffer_Release(&seed);
            return NULL;
        }
        int other = 0;
        owned = ints_as_u32(seq, page_bytes, &tokens.len, &other);
        Py_DECREF(seq);
        if (owned == NULL) {
            PyBuffer_Release(&seed);
            if (other) Py_RETURN_NONE;
            return NULL;
        }
        tokens.buf = owned;
    } else if (PyObject_GetBuffer(obj, &tokens, PyBUF_SIMPLE) < 0) {
        PyBuffer_Release(&seed);
        return NULL;
    }
    if (tokens.len % page_bytes != 0) {
        PyErr_Format(PyExc_ValueError, "page_bytes = %zd does not divide the tokens' %zd bytes",
                     page_bytes, tokens.len);
        goto end;
    }
    if (seed.len > (Py_ssize_t)1 << 20 || page_bytes > (Py_ssize_t)1 << 30) {
        PyErr_Format(PyExc_ValueError, "seed (%zd bytes) or page_bytes (%zd) too large",
                     seed.len, page_bytes);
        goto end;
    }
    n = tokens.len / page_bytes;
    size_t room = (size_t)(seed.len > 32 ? seed.len : 32) + (size_t)page_bytes + 72;
    keys = malloc((size_t)(n > 0 ? n : 1) * 32);
    buf = malloc(room);
    if (keys == NULL || buf == NULL) {
        PyErr_NoMemory();
        goto end;
    }
    Py_BEGIN_ALLOW_THREADS
    const uint8_t *page = tokens.buf;
    for (i = 0; i < n; i++, page += page_bytes) {
        size_t head = i ? 32 : (size_t)seed.len;
        memcpy(buf, i ? keys + 32 * (i - 1) : (const uint8_t *)seed.buf, head);
        memcpy(buf + head, page, (size_t)page_bytes);
        digest(buf, head + (size_t)page_bytes, keys + 32 * i, compress);
    }
    Py_END_ALLOW_THREADS
    out = PyList_New(n);
    if (out == NULL) goto end;
    for (i = 0; i < n; i++) {
        PyObject *k = PyBytes_FromStringAndSize((const char *)keys + 32 * i, 32);
        if (k == NULL) {
            Py_CLEAR(out);
            goto end;
        }
        PyList_SET_ITEM(out, i, k);
    }
end:
    free(keys);
    free(buf);
    PyBuffer_Release(&seed);
    if (owned != NULL)
        free(owned);
    else
        PyBuffer_Release(&tokens);
    return out;
}

static PyObject *sha_extensions(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    return PyBool_FromLong(native_sha);
}

static PyMethodDef methods[] = {
    {"chain", chain, METH_VARARGS,
     "chain(seed, tokens, page_bytes, portable=False) -> list[bytes]: the SHA-256 chain of page keys over "
     "``tokens`` (little-endian uint32 token ids, whole pages of ``page_bytes`` bytes)."},
    {"sha_extensions", sha_extensions, METH_NOARGS,
     "sha_extensions() -> bool: whether the CPU's SHA extensions hash (else portable C)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_pagekeys", "The SHA-256 chain of page keys, in C.", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__pagekeys(void) {
#ifdef HAVE_SHANI_BUILD
    if (cpu_has_sha()) {
        fastest = compress_ni;
        native_sha = 1;
    }
#endif
    return PyModule_Create(&module);
}
