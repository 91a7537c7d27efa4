/* The AVX-512 build of XXH3-64 for kvtier.kernels._fileio, chosen at run time when the CPU
   has AVX-512F (see _xxh3_avx2.c). */

#if defined(__x86_64__) && defined(__GNUC__)
#pragma GCC target("avx512f")
#define XXH_VECTOR XXH_AVX512
#define XXH_INLINE_ALL
#include <xxhash.h>
#include <stddef.h>
#include <stdint.h>

uint64_t kvtier_xxh3_avx512(const void *p, size_t n) { return (uint64_t)XXH3_64bits(p, n); }
#endif
