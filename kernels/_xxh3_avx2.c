/* The AVX2 build of XXH3-64 for kvtier.kernels._fileio, chosen at run time when the CPU has
   AVX2 (about twice the SSE2 build's speed on cached data). Compiled as part of the same
   extension; the target pragma lets this one file use AVX2 whatever the compiler flags. */

#if defined(__x86_64__) && defined(__GNUC__)
#pragma GCC target("avx2")
#define XXH_VECTOR XXH_AVX2
#define XXH_INLINE_ALL
#include <xxhash.h>
#include <stddef.h>
#include <stdint.h>

uint64_t kvtier_xxh3_avx2(const void *p, size_t n) { return (uint64_t)XXH3_64bits(p, n); }
#endif
