/* Fused element-wise kernels of the per-chunk quantisation (chunkquant.py).
 *
 * Every value takes exactly the IEEE single-precision operations of the torch/numpy sequence
 * it replaces, in the same order (compiled without -ffast-math and with -ffp-contract=off: no
 * fused multiply-add, no reassociation), so the bits are those of that sequence:
 *
 *   quantise (2, 4, 8 bits): y = x * factor; q = (uint8) trunc(y + offset)
 *   scaled sign (1 bit):      q = x >= 0
 *   dequantise:               d = (float) q * step - scale
 *   residual:                 e = x - d
 *   magnitude (1 bit):        |x|, whose row sums torch takes for the scales
 *   two ranks' average:       ((d0 + d1) + 0) / 2 + residual
 *
 * factor, step and scale are per row (one chunk of `cols` values), computed by the caller.
 * Codes are packed little-endian inside each byte (code i of a byte at bit i * bits), rows
 * one after another, as bitpack.pack_rows_ writes them; `cols * bits` is a multiple of 8 and
 * cols at most 65536. `decoded`, `error` and `residual` may be NULL. A NaN y gives the code 0
 * (its message is discarded).
 *
 * Speed: each row goes through a few simple loops over segments of at most 4096 values (their
 * code and float buffers stay in L1), each of which the compiler vectorises; packing takes 8
 * codes per 64-bit multiply (1 bit; 4 per 32-bit one at 2 bits: bitpack.py's gather).
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

static int supported(int64_t cols, int bits) {
    return (bits == 1 || bits == 2 || bits == 4 || bits == 8) && cols > 0 && cols <= 65536 &&
           (cols * bits) % 8 == 0;
}

static void codes_of_grid(const float *restrict x, int64_t cols, float factor, float offset,
                          uint8_t *restrict q) {
    for (int64_t j = 0; j < cols; j++) {
        float z = x[j] * factor;
        z = z + offset;
        int32_t t = (int32_t)z;
        q[j] = z >= 0.0f ? (uint8_t)t : 0; /* NaN: 0 */
    }
}

static void codes_of_sign(const float *restrict x, int64_t cols, uint8_t *restrict q) {
    for (int64_t j = 0; j < cols; j++) q[j] = x[j] >= 0.0f;
}

static void dequantise(const uint8_t *restrict q, int64_t cols, float step, float scale,
                       float *restrict out) {
    for (int64_t j = 0; j < cols; j++) {
        float d = (float)q[j] * step;
        out[j] = d - scale;
    }
}

static void residual_of(const float *restrict x, const float *restrict d, int64_t cols,
                        float *restrict error) {
    for (int64_t j = 0; j < cols; j++) error[j] = x[j] - d[j];
}

static void pack(const uint8_t *restrict q, int64_t cols, int bits, uint8_t *restrict out) {
    if (bits == 8) {
        memcpy(out, q, (size_t)cols);
    } else if (bits == 4) {
        for (int64_t b = 0; b < cols / 2; b++) out[b] = (uint8_t)(q[2 * b] | (q[2 * b + 1] << 4));
    } else {
        /* eight codes of 1 bit (four of 2) in a 64-bit (32-bit) word; the multiply puts
         * code i at bit 56 + i (24 + 2i) and nothing else there (bitpack.py's gather) */
        if (bits == 1) {
            for (int64_t b = 0; b < cols / 8; b++) {
                uint64_t w;
                memcpy(&w, q + 8 * b, 8);
                out[b] = (uint8_t)((w * 0x0102040810204080ULL) >> 56);
            }
        } else {
            for (int64_t b = 0; b < cols / 4; b++) {
                uint32_t w;
                memcpy(&w, q + 4 * b, 4);
                out[b] = (uint8_t)((w * ((1u << 6) + (1u << 12) + (1u << 18) + (1u << 24))) >> 24);
            }
        }
    }
}

static void unpack(const uint8_t *restrict in, int64_t cols, int bits, uint8_t *restrict q) {
    if (bits == 8) {
        memcpy(q, in, (size_t)cols);
    } else if (bits == 4) {
        for (int64_t b = 0; b < cols / 2; b++) {
            q[2 * b] = in[b] & 15;
            q[2 * b + 1] = in[b] >> 4;
        }
    } else if (bits == 2) {
        for (int64_t b = 0; b < cols / 4; b++)
            for (int i = 0; i < 4; i++) q[4 * b + i] = (in[b] >> (2 * i)) & 3;
    } else {
        for (int64_t b = 0; b < cols / 8; b++)
            for (int i = 0; i < 8; i++) q[8 * b + i] = (in[b] >> i) & 1;
    }
}

/* Rows are walked in segments of at most SEGMENT values (a multiple of 8, so every segment's
 * codes start on a byte), with their per-row constants: the buffers stay in L1. */
#define SEGMENT 4096

static int64_t segment_of(int64_t cols, int64_t j) { return cols - j < SEGMENT ? cols - j : SEGMENT; }

/* Rows of `cols` values: codes packed into `packed` (rows * cols * bits / 8 bytes), with
 * `decoded` and `error` when given. bits 1 is the scaled sign (factor and offset unused), 2, 4
 * and 8 the rounded grid. Returns 1 (nothing written) for an unsupported shape. */
int sn_quantize_rows(const float *x, int64_t rows, int64_t cols, int bits, const float *factor,
                     float offset, const float *step, const float *scale, uint8_t *packed,
                     float *decoded, float *error) {
    uint8_t q[SEGMENT];
    float d[SEGMENT];
    if (!supported(cols, bits)) return 1;
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t j = 0; j < cols; j += SEGMENT) {
            const int64_t n = segment_of(cols, j), at = r * cols + j;
            if (bits == 1)
                codes_of_sign(x + at, n, q);
            else
                codes_of_grid(x + at, n, factor[r], offset, q);
            if (decoded || error) {
                float *dr = decoded ? decoded + at : d;
                dequantise(q, n, step[r], scale[r], dr);
                if (error) residual_of(x + at, dr, n, error + at);
            }
            pack(q, n, bits, packed + at * bits / 8);
        }
    }
    return 0;
}

/* out = (float) q * step - scale, row by row, from codes packed as sn_quantize_rows packs.
 * Returns 1 (nothing written) for an unsupported shape. */
int sn_dequantize_rows(const uint8_t *packed, int64_t rows, int64_t cols, int bits,
                       const float *step, const float *scale, float *out) {
    uint8_t q[SEGMENT];
    if (!supported(cols, bits)) return 1;
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t j = 0; j < cols; j += SEGMENT) {
            const int64_t n = segment_of(cols, j), at = r * cols + j;
            unpack(packed + at * bits / 8, n, bits, q);
            dequantise(q, n, step[r], scale[r], out + at);
        }
    }
    return 0;
}

static void average_of(const float *restrict d0, const float *restrict d1, int64_t n,
                       const float *residual, float *restrict out) {
    for (int64_t j = 0; j < n; j++) {
        float a = d0[j] + d1[j];
        a = a + 0.0f;
        out[j] = a / 2.0f;
    }
    if (residual)
        for (int64_t j = 0; j < n; j++) out[j] = out[j] + residual[j];
}

/* The owner's average of two ranks' copies of its rows: out = ((d0 + d1) + 0) / 2, plus
 * `residual` when given, each d = q * step - scale dequantised from its packed codes (the
 * operations and order of the torch path: two dequantisations, an add, an add of +0 that
 * turns a -0 sum into +0 as torch's sum does, the division, the residual's add). */
int sn_average_two(const uint8_t *packed0, const uint8_t *packed1, int64_t rows, int64_t cols,
                   int bits, const float *step0, const float *scale0, const float *step1,
                   const float *scale1, const float *residual, float *out) {
    uint8_t q[SEGMENT];
    float d0[SEGMENT], d1[SEGMENT];
    if (!supported(cols, bits)) return 1;
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t j = 0; j < cols; j += SEGMENT) {
            const int64_t n = segment_of(cols, j), at = r * cols + j;
            unpack(packed0 + at * bits / 8, n, bits, q);
            dequantise(q, n, step0[r], scale0[r], d0);
            unpack(packed1 + at * bits / 8, n, bits, q);
            dequantise(q, n, step1[r], scale1[r], d1);
            average_of(d0, d1, n, residual ? residual + at : NULL, out + at);
        }
    }
    return 0;
}

/* One-bit codes x >= 0 packed into `packed`, and |x| into `magnitude` (for the rows' scales,
 * which the codes do not need): the scaled sign's first pass. */
int sn_sign_rows(const float *x, int64_t rows, int64_t cols, uint8_t *packed,
                 float *magnitude) {
    uint8_t q[SEGMENT];
    if (!supported(cols, 1)) return 1;
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t j = 0; j < cols; j += SEGMENT) {
            const int64_t n = segment_of(cols, j), at = r * cols + j;
            codes_of_sign(x + at, n, q);
            for (int64_t k = 0; k < n; k++) magnitude[at + k] = fabsf(x[at + k]);
            pack(q, n, 1, packed + at / 8);
        }
    }
    return 0;
}
