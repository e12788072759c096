/* A sender's host delta encodings in batches: the scans of many tensors (large ones split into ranges of
 * chunks, so that threads share even work) in one call per run of ranges, then every tensor's encoding
 * laid out from its ranges' scans in one call per run of tensors. Python per tensor (a dozen numpy
 * calls, ~120 us) cost more than its scan on every core count measured; here it costs a table row.
 *
 * The encoding is byte for byte the one weight_sync/transport/delta.py describes and
 * weight_sync/transport/delta_cpu.py's encode_cpu writes (16-bit offsets: chunks of at most 64 Ki
 * elements). Built with delta.c into one library (weight_sync/native/__init__.py).
 */
#include <stdint.h>
#include <string.h>

int64_t ws_delta_scan_offsets(const void *a, void *b, int64_t n, int item, int64_t chunk, int64_t c0, int advance,
                              uint16_t *off, void *vals, int64_t cap, int64_t *counts, int64_t *next);
void ws_forms(const int64_t *counts, int64_t nchunks, int64_t chunk, int64_t numel, int64_t item, int64_t off_bytes,
              int64_t *form);

enum { MAGIC = 0x32445357, SAME = 0, BITMASK = 1, INDEX = 2, PLAIN = 3 };

/* One range of a tensor's chunks to scan (weight_sync/native/encode.py's encode_many): new's and the
 * base's address at the range's first element, its elements, item size, chunk size, whether the base
 * moves, the 16-bit offsets' and values' scratch (room for `cap` changes and 64 more), the range's
 * counts, `cap`; the scan writes the changes found and how many chunks it finished. */
enum { R_NEW, R_BASE, R_N, R_ITEM, R_CHUNK, R_ADVANCE, R_OFF, R_VALS, R_COUNTS, R_CAP, R_K, R_DONE, R_COLS };

/* Scan ranges [lo, hi). A range whose changes outgrow its scratch stops at a chunk boundary: its R_DONE
 * says where, and the caller scans the rest as a range of its own. */
void ws_scan_ranges(int64_t *ranges, int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; i++) {
        int64_t *r = ranges + i * R_COLS, next = 0;
        r[R_K] = ws_delta_scan_offsets((const void *)(intptr_t)r[R_NEW], (void *)(intptr_t)r[R_BASE], r[R_N],
                                       (int)r[R_ITEM], r[R_CHUNK], 0, (int)r[R_ADVANCE],
                                       (uint16_t *)(intptr_t)r[R_OFF], (void *)(intptr_t)r[R_VALS], r[R_CAP],
                                       (int64_t *)(intptr_t)r[R_COUNTS], &next);
        r[R_DONE] = next;
    }
}

/* One tensor to lay out: new's address, elements, item size, chunk size, its counts and forms (one per
 * chunk), its first range row and how many, where its encoding goes; ws_encode_sizes writes its size,
 * changed count and region starts (T_VALS_IX: where the index chunks' values start, after the bitmask
 * chunks' in the values region). */
enum { T_NEW, T_N, T_ITEM, T_CHUNK, T_COUNTS, T_FORMS, T_RANGE0, T_NRANGES, T_OUT, T_SIZE, T_K,
       T_BITS, T_OFFS, T_VALS, T_PLAIN, T_VALS_IX, T_COLS };

static int64_t align8(int64_t n) { return (n + 7) / 8 * 8; }

/* Every tensor's chunk forms (as ws_forms decides them), its changed count, and its encoding's region
 * starts and size: the header and table, the bitmask chunks' bits, the index chunks' offsets, the
 * bitmask then index chunks' values, the plain chunks' values, each padded to 8 bytes. */
void ws_encode_sizes(int64_t *tensors, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        int64_t *t = tensors + i * T_COLS;
        int64_t numel = t[T_N], item = t[T_ITEM], chunk = t[T_CHUNK], nchunks = (numel + chunk - 1) / chunk;
        const int64_t *counts = (const int64_t *)(intptr_t)t[T_COUNTS];
        int64_t *form = (int64_t *)(intptr_t)t[T_FORMS];
        ws_forms(counts, nchunks, chunk, numel, item, 2, form);
        int64_t n_bm = 0, k_bm = 0, k_ix = 0, plain = 0, k = 0;
        for (int64_t c = 0; c < nchunks; c++) {
            int64_t f = form[c], kc = counts[c];
            k += kc;
            n_bm += f == BITMASK;
            k_bm += f == BITMASK ? kc : 0;
            k_ix += f == INDEX ? kc : 0;
            if (f == PLAIN) plain += c + 1 < nchunks ? chunk : numel - c * chunk;
        }
        t[T_BITS] = 16 + 8 * nchunks;
        t[T_OFFS] = t[T_BITS] + align8(n_bm * (chunk / 8));
        t[T_VALS] = t[T_OFFS] + align8(2 * k_ix);
        t[T_PLAIN] = t[T_VALS] + align8((k_bm + k_ix) * item);
        t[T_VALS_IX] = t[T_VALS] + k_bm * item;
        t[T_SIZE] = t[T_PLAIN] + align8(plain * item);
        t[T_K] = k;
    }
}

/* Write the encodings of tensors [lo, hi) (ws_encode_sizes ran on them; their ranges are scanned) at
 * their T_OUT: each chunk's changes are taken in order from its range's scratch. */
void ws_encode_write(const int64_t *tensors, const int64_t *ranges, int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; i++) {
        const int64_t *t = tensors + i * T_COLS;
        int64_t numel = t[T_N], item = t[T_ITEM], chunk = t[T_CHUNK], nchunks = (numel + chunk - 1) / chunk;
        const int64_t *counts = (const int64_t *)(intptr_t)t[T_COUNTS], *form = (const int64_t *)(intptr_t)t[T_FORMS];
        const unsigned char *src = (const unsigned char *)(intptr_t)t[T_NEW];
        unsigned char *out = (unsigned char *)(intptr_t)t[T_OUT];
        /* Every byte after the table is a region's or its padding. Zeroed first where a region does not
         * write each of its bytes: the bits, and the last word of every other region that has bytes
         * (its padding, if any, lies there; the region's own bytes are written over it next). */
        const int64_t end[4] = {t[T_OFFS], t[T_VALS], t[T_PLAIN], t[T_SIZE]};
        memset(out + t[T_BITS], 0, (size_t)(end[0] - t[T_BITS]));
        for (int p = 1; p < 4; p++)
            if (end[p] > end[p - 1]) memset(out + end[p] - 8, 0, 8);
        int32_t *head = (int32_t *)out;
        head[0] = MAGIC;
        head[1] = (int32_t)chunk;
        head[2] = (int32_t)nchunks;
        head[3] = (int32_t)item;
        unsigned char *bits = out + t[T_BITS], *offs = out + t[T_OFFS], *plain = out + t[T_PLAIN];
        unsigned char *vals_bm = out + t[T_VALS], *vals_ix = out + t[T_VALS_IX];
        int64_t c = 0;
        for (int64_t r = t[T_RANGE0]; r < t[T_RANGE0] + t[T_NRANGES]; r++) {
            const int64_t *g = ranges + r * R_COLS;
            const uint16_t *off = (const uint16_t *)(intptr_t)g[R_OFF];
            const unsigned char *sv = (const unsigned char *)(intptr_t)g[R_VALS];
            int64_t stop = c + (g[R_N] + chunk - 1) / chunk, j = 0;
            for (; c < stop; c++) {
                int64_t kc = counts[c], f = form[c];
                head[4 + 2 * c] = (int32_t)f;
                head[5 + 2 * c] = (int32_t)kc;
                if (f == BITMASK) {
                    for (int64_t e = 0; e < kc; e++) {
                        unsigned o = off[j + e] ^ 0x8000u;
                        bits[o >> 3] |= (unsigned char)(1u << (o & 7));
                    }
                    memcpy(vals_bm, sv + j * item, (size_t)(kc * item));
                    bits += chunk / 8;
                    vals_bm += kc * item;
                } else if (f == INDEX) {
                    memcpy(offs, off + j, (size_t)(2 * kc));
                    memcpy(vals_ix, sv + j * item, (size_t)(kc * item));
                    offs += 2 * kc;
                    vals_ix += kc * item;
                } else if (f == PLAIN) {
                    int64_t size = c + 1 < nchunks ? chunk : numel - c * chunk;
                    memcpy(plain, src + c * chunk * item, (size_t)(size * item));
                    plain += size * item;
                }
                j += kc;
            }
        }
    }
}
