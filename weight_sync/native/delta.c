/* Delta sync's per-element passes on CPU, each one pass over the data without data-dependent branches
 * per element: numpy's nonzero, boolean indexing and fancy assignment branch on every changed element
 * (20-40 ns each on a busy host), which made them cost several times the compare itself.
 *
 * Built and loaded by weight_sync/native/__init__.py (ctypes, no Python headers); every kernel has a
 * numpy twin there that gives the same bytes, used wherever this library is unavailable.
 */
#include <stdint.h>
#include <string.h>

/* OR of a ^ b over `nwords` 8-byte words: zero exactly when the bytes are equal (vectorizes). */
static inline uint64_t diff_words(const unsigned char *a, const unsigned char *b, int nwords) {
    uint64_t acc = 0;
    for (int w = 0; w < nwords; w++) {
        uint64_t x, y;
        memcpy(&x, a + 8 * w, 8);
        memcpy(&y, b + 8 * w, 8);
        acc |= x ^ y;
    }
    return acc;
}

/* Elements [i, hi) of chunk `lo` one by one: each written, counted only if changed (no branch). */
#define TAIL_LOOP(PVAL)                                                                                  \
    for (; i < hi; i++) {                                                                                \
        pos[k] = PVAL(i, lo);                                                                            \
        vals[k] = a[i];                                                                                  \
        k += a[i] != b[i];                                                                               \
        if (advance) b[i] = a[i];                                                                        \
    }

/* Blocks of 64 elements are skipped whole when equal; inside a changed block, groups of 8 are; a changed
 * group's 8 elements are emitted branch-free (position and value written, the count advanced by the
 * compare). With `advance`, a changed group is also copied over the base (its unchanged elements hold the
 * same bytes already), which moves the base to the new version for the cost of the copy. */
#define SCAN(T, NAME, PT, PVAL)                                                                          \
    static int64_t NAME(const T *restrict a, T *restrict b, int64_t n, int64_t chunk, int64_t c0,       \
                        int advance, PT *restrict pos, T *restrict vals, int64_t cap,                   \
                        int64_t *restrict counts, int64_t *restrict next) {                             \
        enum { G = 64, S = 8, GW = G * sizeof(T) / 8, SW = S * sizeof(T) / 8 }; \
        int64_t k = 0, nchunks = (n + chunk - 1) / chunk, c;                                             \
        for (c = c0; c < nchunks; c++) {                                                                 \
            int64_t lo = c * chunk, hi = lo + chunk < n ? lo + chunk : n, k0 = k, i = lo;                \
            if (k + (hi - lo) > cap) break; /* room for a whole chunk of changes, else the caller grows */ \
            for (; i + G <= hi; i += G) {                                                                \
                if (!diff_words((const unsigned char *)(a + i), (const unsigned char *)(b + i), GW))     \
                    continue;                                                                            \
                for (int s = 0; s < G; s += S) {                                                         \
                    const T *x = a + i + s;                                                              \
                    T *y = b + i + s;                                                                    \
                    if (!diff_words((const unsigned char *)x, (const unsigned char *)y, SW)) continue;   \
                    for (int j = 0; j < S; j++) {                                                        \
                        pos[k] = PVAL(i + s + j, lo);                                                    \
                        vals[k] = x[j];                                                                  \
                        k += x[j] != y[j];                                                               \
                    }                                                                                    \
                    if (advance) memcpy(y, x, S * sizeof(T));                                            \
                }                                                                                        \
            }                                                                                            \
            TAIL_LOOP(PVAL)                                                                              \
            counts[c] = k - k0;                                                                          \
        }                                                                                                \
        *next = c;                                                                                       \
        return k;                                                                                        \
    }
/* What a scan stores per change: the flat position, or (the `_off` scans, chunks of at most 64 Ki) its
 * offset in its chunk as an encoding's 16-bit index offsets are stored, less 32768: the encoder then
 * copies them as they are instead of converting 8-byte positions in another pass. */
#define POS64(at, lo) ((void)(lo), (at))
#define OFF16(at, lo) ((uint16_t)(((at) - (lo)) ^ 0x8000))
SCAN(uint8_t, scan1, int64_t, POS64)
SCAN(uint16_t, scan2, int64_t, POS64)
SCAN(uint32_t, scan4, int64_t, POS64)
SCAN(uint64_t, scan8, int64_t, POS64)
SCAN(uint8_t, scan1_off, uint16_t, OFF16)
SCAN(uint16_t, scan2_off, uint16_t, OFF16)
SCAN(uint32_t, scan4_off, uint16_t, OFF16)
SCAN(uint64_t, scan8_off, uint16_t, OFF16)

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

/* A vector scan's last elements of a chunk [lo.. i, hi), one by one as the portable scan does them. */
#define TAIL2(NAME, PT, PVAL)                                                                            \
    static inline int64_t NAME(const uint16_t *restrict a, uint16_t *restrict b, int64_t lo, int64_t i, \
                               int64_t hi, int advance, PT *restrict pos, uint16_t *restrict vals,       \
                               int64_t k) {                                                              \
        TAIL_LOOP(PVAL)                                                                                  \
        return k;                                                                                        \
    }
TAIL2(tail2, int64_t, POS64)
TAIL2(tail2_off, uint16_t, OFF16)
#define WS_X86_SIMD 1
/* scan2 with AVX-512 (BW for the compare, VBMI2 for the 16-bit compress): 32 elements per step, their
 * changed values and positions compressed in registers and stored whole (the buffers have 64 entries of
 * slack past `cap`), so the cost is the two loads whatever the density. */
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vbmi2,popcnt"))) static int64_t
scan2_avx512(const uint16_t *restrict a, uint16_t *restrict b, int64_t n, int64_t chunk, int64_t c0, int advance,
             int64_t *restrict pos, uint16_t *restrict vals, int64_t cap, int64_t *restrict counts,
             int64_t *restrict next) {
    const __m512i lanes = _mm512_setr_epi64(0, 1, 2, 3, 4, 5, 6, 7), eight = _mm512_set1_epi64(8);
    int64_t k = 0, nchunks = (n + chunk - 1) / chunk, c;
    for (c = c0; c < nchunks; c++) {
        int64_t lo = c * chunk, hi = lo + chunk < n ? lo + chunk : n, k0 = k, i = lo;
        if (k + (hi - lo) > cap) break;
        for (; i + 32 <= hi; i += 32) {
            __m512i x = _mm512_loadu_si512((const void *)(a + i)), y = _mm512_loadu_si512((const void *)(b + i));
            __mmask32 m = _mm512_cmpneq_epi16_mask(x, y);
            if (!m) continue;
            _mm512_storeu_si512((void *)(vals + k), _mm512_maskz_compress_epi16(m, x));
            __m512i at = _mm512_add_epi64(_mm512_set1_epi64(i), lanes);
            for (int q = 0; q < 4; q++) {
                __mmask8 mq = (__mmask8)(m >> (8 * q));
                _mm512_storeu_si512((void *)(pos + k), _mm512_maskz_compress_epi64(mq, at));
                k += __builtin_popcount(mq);
                at = _mm512_add_epi64(at, eight);
            }
            if (advance) _mm512_storeu_si512((void *)(b + i), x);
        }
        k = tail2(a, b, lo, i, hi, advance, pos, vals, k);
        counts[c] = k - k0;
    }
    *next = c;
    return k;
}

/* scan2 with AVX2 (x86-64 hosts without AVX-512, CI's among them): 64 elements per step, skipped whole
 * when equal. A changed step's 64-bit mask (one bit per element, the 16-bit compares packed to bytes)
 * is walked by its lowest set bit: four emissions run unconditionally (one that finds no bit left does
 * not advance the count), a loop takes any further changes. At RL densities (~1.3 changes per 64 at 2%)
 * that is a few stores per change with no branch to mispredict, where emitting whole groups of
 * elements cost a dozen stores per change. */
#define SCAN2_AVX2(NAME, PT, PVAL, TAIL) \
__attribute__((target("avx2,bmi,popcnt"))) static int64_t                                                            \
NAME(const uint16_t *restrict a, uint16_t *restrict b, int64_t n, int64_t chunk, int64_t c0, int advance,            \
     PT *restrict pos, uint16_t *restrict vals, int64_t cap, int64_t *restrict counts, int64_t *restrict next) {     \
    int64_t k = 0, nchunks = (n + chunk - 1) / chunk, c;                                                             \
    for (c = c0; c < nchunks; c++) {                                                                                 \
        int64_t lo = c * chunk, hi = lo + chunk < n ? lo + chunk : n, k0 = k, i = lo;                                \
        if (k + (hi - lo) > cap) break;                                                                              \
        for (; i + 64 <= hi; i += 64) {                                                                              \
            __m256i x[4];                                                                                            \
            uint64_t m = 0;                                                                                          \
            for (int q = 0; q < 4; q++) {                                                                            \
                x[q] = _mm256_loadu_si256((const __m256i *)(a + i + 16 * q));                                        \
                __m256i eq = _mm256_cmpeq_epi16(x[q], _mm256_loadu_si256((const __m256i *)(b + i + 16 * q)));        \
                __m128i bytes = _mm_packs_epi16(_mm256_castsi256_si128(eq), _mm256_extracti128_si256(eq, 1));        \
                m |= (uint64_t)(~(unsigned)_mm_movemask_epi8(bytes) & 0xFFFFu) << (16 * q);                          \
            }                                                                                                        \
            if (!m) continue;                                                                                        \
            /* The whole step is stored, its unchanged quarters included: a branch per quarter (changed              \
             * or not, about even odds at RL densities) mispredicted so often that it cost more than the             \
             * compare (scan of 0.6 G bf16 at 2%: 0.20-0.28 s with it, 0.13-0.16 s without, one core). */            \
            if (advance)                                                                                             \
                for (int q = 0; q < 4; q++) _mm256_storeu_si256((__m256i *)(b + i + 16 * q), x[q]);                  \
            const uint16_t *xs = a + i;                                                                              \
            for (int r = 0; r < 4; r++) {                                                                            \
                uint64_t j = _tzcnt_u64(m); /* 64 when no bit is left: written, not counted */                       \
                pos[k] = PVAL(i + (int64_t)j, lo);                                                                   \
                vals[k] = xs[j & 63];                                                                                \
                k += m != 0;                                                                                         \
                m = _blsr_u64(m);                                                                                    \
            }                                                                                                        \
            while (m) {                                                                                              \
                uint64_t j = _tzcnt_u64(m);                                                                          \
                pos[k] = PVAL(i + (int64_t)j, lo);                                                                   \
                vals[k++] = xs[j];                                                                                   \
                m = _blsr_u64(m);                                                                                    \
            }                                                                                                        \
        }                                                                                                            \
        k = TAIL(a, b, lo, i, hi, advance, pos, vals, k);                                                            \
        counts[c] = k - k0;                                                                                          \
    }                                                                                                                \
    *next = c;                                                                                                       \
    return k;                                                                                                        \
}
SCAN2_AVX2(scan2_avx2, int64_t, POS64, tail2)
SCAN2_AVX2(scan2_avx2_off, uint16_t, OFF16, tail2_off)
#endif

static int use_avx512 = 0, use_avx2 = 0, has_avx2 = 0;
static uint8_t bit_table[256][8], bit_count[256];

/* The scan of `item`-byte elements whose name ends in SUFFIX (positions or offsets into POS); VEC2, if
 * it returns, leaves 16-bit elements to the portable scan. */
#define SCAN_BY_ITEM(SUFFIX, POS, VEC2)                                                                 \
    switch (item) {                                                                                      \
    case 1: return scan1##SUFFIX(a, b, n, chunk, c0, advance, POS, vals, cap, counts, next);             \
    case 2: VEC2 return scan2##SUFFIX(a, b, n, chunk, c0, advance, POS, vals, cap, counts, next);        \
    case 4: return scan4##SUFFIX(a, b, n, chunk, c0, advance, POS, vals, cap, counts, next);             \
    case 8: return scan8##SUFFIX(a, b, n, chunk, c0, advance, POS, vals, cap, counts, next);             \
    }                                                                                                    \
    return -1;

#ifdef WS_X86_SIMD
#define VEC_POS                                                                                          \
    if (use_avx512) return scan2_avx512(a, b, n, chunk, c0, advance, pos, vals, cap, counts, next);      \
    if (use_avx2) return scan2_avx2(a, b, n, chunk, c0, advance, pos, vals, cap, counts, next);
#define VEC_OFF if (has_avx2) return scan2_avx2_off(a, b, n, chunk, c0, advance, off, vals, cap, counts, next);
#else
#define VEC_POS
#define VEC_OFF
#endif

/* The changed elements of `a` against `b` (n elements of `item` bytes) from chunk `c0` on: their
 * positions (ascending) and values, and the changed count of each chunk, until the chunks are done or
 * `cap` could not hold one more whole chunk; `*next` is the first chunk not scanned. `pos` and `vals`
 * must have 64 entries of room past `cap` (vector stores write whole registers). Returns the count
 * written, -1 for an item size other than 1, 2, 4 or 8. */
int64_t ws_delta_scan(const void *a, void *b, int64_t n, int item, int64_t chunk, int64_t c0, int advance,
                      int64_t *pos, void *vals, int64_t cap, int64_t *counts, int64_t *next) {
    SCAN_BY_ITEM(, pos, VEC_POS)
}

/* ws_delta_scan with each change's offset in its chunk written as a 16-bit index offset less 32768 (see
 * OFF16) instead of its flat position: chunks of at most 64 Ki elements. 16-bit tensors take the AVX2
 * scan where the CPU has it (AVX-512 hosts too: its 64-bit position compress has no 16-bit twin here).
 * Returns -1 for an item size other than 1, 2, 4 or 8, -2 for a larger chunk. */
int64_t ws_delta_scan_offsets(const void *a, void *b, int64_t n, int item, int64_t chunk, int64_t c0, int advance,
                              uint16_t *off, void *vals, int64_t cap, int64_t *counts, int64_t *next) {
    if (chunk > 65536) return -2;
    SCAN_BY_ITEM(_off, off, VEC_OFF)
}

/* Write `vals` at `pos` into `dst`, keeping the overwritten values in `old`, and return in sums[0..1] how
 * the write moves the checksum of the tensor `dst` lies in at byte `byte_base` (weight_sync/checksum.py:
 * a plain and a weighted sum of little-endian 32-bit words, weight (word % 65521) + 1), each term taken
 * mod 2**32 and summed in 64 bits: the same numbers as delta_apply's numpy arithmetic. */
#define SCATTER(T, NAME)                                                                                 \
    static void NAME(T *restrict dst, const int64_t *restrict pos, const T *restrict vals, int64_t k,     \
                     int64_t byte_base, T *restrict old, int64_t *sums) {                                \
        uint64_t plain = 0, weighted = 0;                                                                \
        for (int64_t j = 0; j < k; j++) {                                                                \
            int64_t p = pos[j];                                                                          \
            T o = dst[p], v = vals[j];                                                                   \
            old[j] = o;                                                                                  \
            dst[p] = v;                                                                                  \
            uint64_t byte = (uint64_t)(byte_base + p * (int64_t)sizeof(T));                              \
            if (sizeof(T) == 8) {                                                                        \
                uint64_t word = byte >> 2, ov = (uint64_t)o, nv = (uint64_t)v;                           \
                uint64_t lo = (uint32_t)((uint32_t)nv - (uint32_t)ov);                                   \
                uint64_t hi = (uint32_t)((uint32_t)(nv >> 32) - (uint32_t)(ov >> 32));                   \
                plain += lo + hi;                                                                        \
                weighted += ((lo * (word % 65521 + 1)) & 0xFFFFFFFFu) +                                  \
                            ((hi * ((word + 1) % 65521 + 1)) & 0xFFFFFFFFu);                             \
            } else {                                                                                     \
                uint64_t word = byte >> 2;                                                               \
                uint32_t d = ((uint32_t)v - (uint32_t)o) << ((byte & 3) * 8);                            \
                plain += d;                                                                              \
                weighted += ((uint64_t)d * (word % 65521 + 1)) & 0xFFFFFFFFu;                            \
            }                                                                                            \
        }                                                                                                \
        sums[0] = (int64_t)plain;                                                                        \
        sums[1] = (int64_t)weighted;                                                                     \
    }
SCATTER(uint8_t, scatter1)
SCATTER(uint16_t, scatter2)
SCATTER(uint32_t, scatter4)
SCATTER(uint64_t, scatter8)

/* Returns 0, -1 for an unsupported item size, -2 (nothing written) where a position lies outside the
 * `n` elements of `dst`. */
int ws_scatter(void *dst, int64_t n, const int64_t *pos, const void *vals, int64_t k, int item,
               int64_t byte_base, void *old, int64_t *sums) {
    /* One unsigned compare per position (a negative one wraps beyond n): no carried min/max, so it
     * vectorizes. */
    uint64_t outside = 0;
    for (int64_t j = 0; j < k; j++) outside |= (uint64_t)pos[j] >= (uint64_t)n;
    if (outside) return -2;
    switch (item) {
    case 1: scatter1(dst, pos, vals, k, byte_base, old, sums); return 0;
    case 2: scatter2(dst, pos, vals, k, byte_base, old, sums); return 0;
    case 4: scatter4(dst, pos, vals, k, byte_base, old, sums); return 0;
    case 8: scatter8(dst, pos, vals, k, byte_base, old, sums); return 0;
    }
    return -1;
}

/* An encoding's 16-bit index offsets checked (each inside its chunk, positions strictly increasing, the
 * last inside the `n` elements of the tensor) and, where `out` is given, their flat positions written.
 * Per chunk, loops without a carried dependence (each vectorizes); only a chunk's first position is
 * compared with the previous chunk's last (4-5x faster than one loop carrying the last position).
 * Returns 0, -1 (an offset outside its chunk), -2 (positions do not strictly increase), -3 (a position
 * beyond the tensor). */
static int index16(const int64_t *chunks, const int64_t *counts, int64_t nchunks, const int16_t *o16, int64_t chunk,
                   int64_t n, int64_t *out) {
    int64_t j = 0, last = -1, unordered = 0;
    /* In 32 bits (no offset exceeds 65535): the loop then vectorizes, as 64-bit compares did not. */
    int32_t bad = 0, limit = chunk < 65536 ? (int32_t)chunk : 65536;
    for (int64_t c = 0; c < nchunks; c++) {
        int64_t at = chunks[c] * chunk, k = counts[c];
        if (k <= 0) continue;
        const int16_t *o = o16 + j;
        for (int64_t e = 0; e < k; e++) bad |= (int32_t)o[e] + 32768 >= limit;
        for (int64_t e = 1; e < k; e++) unordered |= o[e] <= o[e - 1];
        if (out)
            for (int64_t e = 0; e < k; e++) out[j + e] = at + (int64_t)o[e] + 32768;
        unordered |= at + (int64_t)o[0] + 32768 <= last;
        last = at + (int64_t)o[k - 1] + 32768;
        j += k;
    }
    return bad ? -1 : unordered ? -2 : last >= n ? -3 : 0;
}

/* The checksum move (as SCATTER computes it) of `m` 16-bit writes of one chunk, from their offsets `o`
 * (int16 less 32768), new values `nv` and overwritten values `ov`; the chunk starts at byte `b0` of the
 * checksummed tensor. A chunk spans at most 32 Ki words (64 Ki elements), so an element's word modulo
 * 65521 is the chunk's (m0) plus its word in the chunk, less 65521 once at most: no division per element,
 * and a loop the compiler vectorizes (the per-element divide made the checksum cost more than the write). */
#define SUMS2(NAME, ATTR)                                                                                \
    ATTR static void NAME(const int16_t *restrict o, const uint16_t *restrict nv, const uint16_t *restrict ov, \
                          int64_t m, uint64_t b0, uint64_t *restrict plain, uint64_t *restrict weighted) {  \
        uint32_t r0 = (uint32_t)(b0 & 3), m0 = (uint32_t)((b0 >> 2) % 65521);                            \
        uint64_t p = 0, w = 0;                                                                           \
        for (int64_t e = 0; e < m; e++) {                                                                \
            uint32_t t = r0 + 2u * (uint32_t)((int32_t)o[e] + 32768);                                    \
            uint32_t word = m0 + (t >> 2);                                                               \
            word -= word >= 65521u ? 65521u : 0u;                                                        \
            uint32_t d = ((uint32_t)nv[e] - (uint32_t)ov[e]) << ((t & 3u) << 3);                         \
            p += d;                                                                                      \
            w += (uint32_t)(d * (word + 1u));                                                            \
        }                                                                                                \
        *plain += p;                                                                                     \
        *weighted += w;                                                                                  \
    }
SUMS2(sums2_portable, )
#ifdef WS_X86_SIMD
SUMS2(sums2_avx2, __attribute__((target("avx2"))))
#endif

/* One index-only encoding (16-bit offsets) written into `dst` straight from its offsets, checked first by
 * index16 (nothing written on an error, its code returned), with its checksum move
 * in sums[0..1]; the overwritten values go nowhere (no rollback keeps them). 16-bit elements are written
 * a block at a time from their offsets, the block's checksum move computed after it; other sizes make
 * the block's positions on the stack and scatter as ws_scatter does. Saves the decode's pass writing
 * every position to memory and the scatter's reading it back. -4: an item size other than 1, 2, 4 or 8. */
static int scatter_offsets(void *dst, int64_t n, const int64_t *chunks, const int64_t *counts, int64_t nchunks,
                           const int16_t *offsets, int64_t chunk, const void *vals, int item, int64_t byte_base,
                           int64_t *sums) {
    enum { B = 1024 };
    int64_t pos[B], part[2] = {0, 0};
    uint64_t old[B], plain = 0, weighted = 0;
    if (item != 1 && item != 2 && item != 4 && item != 8) return -4;
    int rc = index16(chunks, counts, nchunks, offsets, chunk, n, NULL);
    if (rc) return rc;
    const char *v = vals;
    int64_t j = 0;
    for (int64_t c = 0; c < nchunks; c++) {
        int64_t at = chunks[c] * chunk, k = counts[c];
        for (int64_t e0 = 0; e0 < k; e0 += B) {
            int64_t m = k - e0 < B ? k - e0 : B;
            const int16_t *o = offsets + j + e0;
            const void *vv = v + (j + e0) * item;
            if (item == 2) {
                uint16_t *d = (uint16_t *)dst, *ov = (uint16_t *)old;
                const uint16_t *nv = vv;
                for (int64_t e = 0; e < m; e++) {
                    int64_t p = at + (int64_t)o[e] + 32768;
                    ov[e] = d[p];
                    d[p] = nv[e];
                }
                uint64_t b0 = (uint64_t)(byte_base + 2 * at);
#ifdef WS_X86_SIMD
                if (has_avx2) {
                    sums2_avx2(o, nv, ov, m, b0, &plain, &weighted);
                    continue;
                }
#endif
                sums2_portable(o, nv, ov, m, b0, &plain, &weighted);
                continue;
            }
            for (int64_t e = 0; e < m; e++) pos[e] = at + (int64_t)o[e] + 32768;
            switch (item) {
            case 1: scatter1(dst, pos, vv, m, byte_base, (uint8_t *)old, part); break;
            case 4: scatter4(dst, pos, vv, m, byte_base, (uint32_t *)old, part); break;
            case 8: scatter8(dst, pos, vv, m, byte_base, (uint64_t *)old, part); break;
            }
            plain += (uint64_t)part[0];
            weighted += (uint64_t)part[1];
        }
        j += k > 0 ? k : 0;
    }
    sums[0] = (int64_t)plain;
    sums[1] = (int64_t)weighted;
    return 0;
}

/* A batch of index-only encodings, one row of JOB_COLS int64 per encoding (weight_sync/native's
 * OffsetBatch): the destination's address and elements, the chunk numbers' and counts' addresses and
 * their length, the offsets' address, the chunk size, the values' address, the item size, the byte base,
 * then the two checksum-move words the scatter writes. One call for a whole bucket: ~300 tensors each
 * cost a Python call and a GIL hand-back per kernel otherwise. */
enum { JOB_COLS = 12 };

/* Check every encoding of the batch (index16: offsets inside their chunks, positions strictly increasing
 * and inside the destination); returns the first refusal's code (0 when
 * all pass) and that encoding's row in *which. */
int ws_check_offsets_many(const int64_t *jobs, int64_t njobs, int64_t *which) {
    for (int64_t i = 0; i < njobs; i++) {
        const int64_t *r = jobs + i * JOB_COLS;
        int rc = index16((const int64_t *)(intptr_t)r[2], (const int64_t *)(intptr_t)r[3], r[4],
                         (const int16_t *)(intptr_t)r[5], r[6], r[1], NULL);
        if (rc) {
            *which = i;
            return rc;
        }
    }
    return 0;
}

/* Write rows [lo, hi) of the batch (scatter_offsets each, its checksum move into the row's last two
 * words); returns the first failure's code and row in *which (the rows before it are written). */
int ws_scatter_offsets_many(int64_t *jobs, int64_t lo, int64_t hi, int64_t *which) {
    for (int64_t i = lo; i < hi; i++) {
        int64_t *r = jobs + i * JOB_COLS;
        int rc = scatter_offsets((void *)(intptr_t)r[0], r[1], (const int64_t *)(intptr_t)r[2],
                                 (const int64_t *)(intptr_t)r[3], r[4], (const int16_t *)(intptr_t)r[5], r[6],
                                 (const void *)(intptr_t)r[7], (int)r[8], r[9], r + 10);
        if (rc) {
            *which = i;
            return rc;
        }
    }
    return 0;
}

/* Positions of an encoding's index chunks: chunks[c] * chunk + offset for each of counts[c] offsets
 * (int16 stored as offset - 32768 when off_bytes is 2, else int32). Returns 0, -1 where an offset lies
 * outside its chunk, -2 where positions do not strictly increase (a repeat would write an element twice). */
int ws_index_positions(const int64_t *chunks, const int64_t *counts, int64_t nchunks, const void *offsets,
                       int off_bytes, int64_t chunk, int64_t *out) {
    if (off_bytes == 2) return index16(chunks, counts, nchunks, offsets, chunk, INT64_MAX, out);
    const int32_t *o32 = offsets;
    int64_t j = 0, last = -1;
    int64_t bad = 0, unordered = 0;
    /* As index16, for 32-bit offsets (chunks beyond 64 Ki elements). */
    for (int64_t c = 0; c < nchunks; c++) {
        int64_t at = chunks[c] * chunk, n = counts[c];
        if (n <= 0) continue;
        int64_t *dst = out + j;
        const int32_t *o = o32 + j;
        for (int64_t e = 0; e < n; e++) {
            int64_t off = (int64_t)o[e];
            bad |= (off < 0) | (off >= chunk);
            dst[e] = at + off;
        }
        for (int64_t e = 1; e < n; e++) unordered |= o[e] <= o[e - 1];
        unordered |= dst[0] <= last;
        last = dst[n - 1];
        j += n;
    }
    return bad ? -1 : unordered ? -2 : 0;
}

/* Fills the table of each byte's set bits and picks the scan for this CPU; the loader calls it before
 * any kernel runs, and simd() again to switch scans. `allow_simd` 0 keeps the portable scans (the tests
 * compare both). */
void ws_init(int allow_simd) {
#ifdef WS_X86_SIMD
    __builtin_cpu_init();
    use_avx512 = allow_simd && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vbmi2");
    has_avx2 = allow_simd && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("bmi");
    use_avx2 = has_avx2 && !use_avx512;
#else
    (void)allow_simd;
#endif
    for (int v = 0; v < 256; v++) {
        int n = 0;
        for (int b = 0; b < 8; b++)
            if (v >> b & 1) bit_table[v][n++] = (uint8_t)b;
        bit_count[v] = (uint8_t)n;
    }
}

/* Positions of an encoding's bitmask chunks (bit b of byte j of the concatenated masks: element 8j + b of
 * its chunk), ascending, branch-free through the table of each byte's set bits (8 entries written per
 * byte, the count advanced by its bits). Returns how many bits are set; positions are written only while
 * 8 entries of `cap` are left, so a mask setting more bits than the caller expects overruns nothing. */
int64_t ws_bitmask_positions(const uint8_t *bits, int64_t nbytes, const int64_t *chunks, int64_t chunk,
                             int64_t *out, int64_t cap) {
    int64_t k = 0, per_chunk = chunk / 8;
    for (int64_t j = 0; j < nbytes; j++) {
        uint8_t v = bits[j];
        if (k + 8 <= cap) {
            int64_t base = chunks[j / per_chunk] * chunk + (j % per_chunk) * 8;
            for (int b = 0; b < 8; b++) out[k + b] = base + bit_table[v][b];
        }
        k += bit_count[v];
    }
    return k;
}

/* Per chunk of one tensor of `numel` elements the cheapest form, as weight_sync/transport/delta_format.py's
 * forms_of_sizes decides it (0 same, 1 bitmask, 2 index, 3 plain; ties go to the simpler): one call
 * where numpy took a dozen small-array operations per tensor. */
void ws_forms(const int64_t *counts, int64_t nchunks, int64_t chunk, int64_t numel, int64_t item, int64_t off_bytes,
              int64_t *form) {
    for (int64_t c = 0; c < nchunks; c++) {
        int64_t k = counts[c], size = c + 1 < nchunks ? chunk : numel - (nchunks - 1) * chunk;
        int64_t bitmask = chunk / 8 + k * item, index = k * (off_bytes + item), plain = size * item;
        int64_t best = index < plain ? index : plain;
        form[c] = k == 0 ? 0 : bitmask < best ? 1 : index < plain ? 2 : 3;
    }
}

/* Which scan the bf16 / 16-bit tensors take: 2 AVX-512, 1 AVX2, 0 the portable loops. */
int ws_simd(void) { return use_avx512 ? 2 : use_avx2; }
