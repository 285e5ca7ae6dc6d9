/* The FFT codec's per-block kernels (sparse/blocks.py): the encoder's candidate pass, and the
 * decoder's scatter of kept bins and its write of each block's signal.
 *
 * Candidates (sn_spectrum_candidates).
 * For each bin of a block of rows of a chunked rFFT (complex64, interleaved re, im), the
 * score is made exactly as blocks._score_rows makes it with numpy (compiled without
 * -ffast-math and with -ffp-contract=off, so the same IEEE single-precision operations in the
 * same order give the same bits):
 *
 *   s = re * re + im * im     (two rounded products, one rounded sum)
 *   s = s * 0.5               for bin 0 and, for an even transform length L, bin L / 2
 *
 * (where both squares are NaN, the sum is the first one, whose sign x86's addition keeps and a
 * compiler free to swap the operands of a + b would not), and every bin whose score is not below `low` (s >= low, or NaN: the caller's finiteness
 * check sees it among the candidates) is appended to the candidates: its position in the whole
 * spectrum, its score and its (re, im). The numpy sequence this replaces swept the block five
 * times (squares, sum, compare, negate, flatnonzero) and gathered twice.
 *
 * Speed: each row's scores go to a buffer of at most SEGMENT floats (in L1) in a loop the
 * compiler vectorises; a second loop appends the few candidates (about 1 - theta of the bins).
 */
#include <stdint.h>
#include <string.h>

#define SEGMENT 2048

static void scores_of(const float *restrict bins, int64_t count, float *restrict out) {
    for (int64_t j = 0; j < count; j++) {
        float a = bins[2 * j] * bins[2 * j];
        float b = bins[2 * j + 1] * bins[2 * j + 1];
        float sum = a + b;
        /* both NaN: the first one's bits, as numpy's add gives them; chosen on the bit
         * patterns, which the compiler vectorises (a float compare it would not) */
        uint32_t bits_a, bits_sum;
        memcpy(&bits_a, &a, sizeof bits_a);
        memcpy(&bits_sum, &sum, sizeof bits_sum);
        uint32_t nan_a = 0u - (uint32_t)((bits_a & 0x7fffffffu) > 0x7f800000u);
        uint32_t chosen = (bits_a & nan_a) | (bits_sum & ~nan_a);
        memcpy(&out[j], &chosen, sizeof chosen);
    }
}

/* flags[j] = 1 where scores[j] is not below low (NaN included), else 0; zeros up to the
 * next multiple of 8 */
static void flags_of(const float *restrict scores, int64_t count, float low,
                     uint8_t *restrict flags) {
    for (int64_t j = 0; j < count; j++) flags[j] = !(scores[j] < low);
    for (int64_t j = count; j % 8; j++) flags[j] = 0;
}

/* The flagged bins, in order: position, score and (re, im) appended; eight flags are read as
 * one word, and only the set ones cost more. Returns how many, or room + 1 past room. */
static int64_t gather(const uint8_t *restrict flags, int64_t count, const float *restrict score,
                      const float *restrict bins, int64_t first, int64_t *restrict positions,
                      float *restrict scores, float *restrict values, int64_t room) {
    int64_t found = 0;
    for (int64_t j = 0; j < count; j += 8) {
        uint64_t word;
        memcpy(&word, flags + j, sizeof word);
        while (word) {
            int64_t k = j + (__builtin_ctzll(word) >> 3); /* each flag is bit 0 of its byte */
            word &= word - 1;
            if (found == room) return room + 1;
            positions[found] = first + k;
            scores[found] = score[k];
            values[2 * found] = bins[2 * k];
            values[2 * found + 1] = bins[2 * k + 1];
            found++;
        }
    }
    return found;
}

/* Returns the number of candidates written, or capacity + 1 once there were more than
 * `capacity` (the caller then takes its exact path); -1 for a bad shape. */
int64_t sn_spectrum_candidates(const float *spectrum, int64_t rows, int64_t bins, int64_t length,
                               float low, int64_t base, int64_t *positions, float *scores,
                               float *values, int64_t capacity) {
    if (rows < 0 || bins <= 0 || length <= 0 || bins != length / 2 + 1 || capacity < 0) return -1;
    int64_t middle = (length % 2 == 0 && length > 1) ? length / 2 : -1;
    float buffer[SEGMENT];
    uint8_t flags[SEGMENT + 8];
    int64_t found = 0;
    for (int64_t r = 0; r < rows; r++) {
        const float *row = spectrum + 2 * r * bins;
        for (int64_t start = 0; start < bins; start += SEGMENT) {
            int64_t count = bins - start < SEGMENT ? bins - start : SEGMENT;
            scores_of(row + 2 * start, count, buffer);
            if (start == 0) buffer[0] = buffer[0] * 0.5f;
            if (middle >= start && middle < start + count)
                buffer[middle - start] = buffer[middle - start] * 0.5f;
            flags_of(buffer, count, low, flags);
            int64_t room = capacity - found;
            int64_t hits = gather(flags, count, buffer, row + 2 * start, base + r * bins + start,
                                  positions + found, scores + found, values + 2 * found, room);
            if (hits > room) return capacity + 1;
            found += hits;
        }
    }
    return found;
}

/* Decode: spectrum[indices[i] - base] += values[i] (complex64 as (re, im) pairs) for i in
 * order, as torch's index_add_ adds them (component-wise IEEE additions). Returns 0, or -1
 * (nothing more added) for an index outside [base, base + bins). */
int sn_add_bins(float *spectrum, int64_t bins, int64_t base, const int64_t *indices,
                const float *values, int64_t count) {
    for (int64_t i = 0; i < count; i++) {
        int64_t j = indices[i] - base;
        if (j < 0 || j >= bins) return -1;
        spectrum[2 * j] = spectrum[2 * j] + values[2 * i];
        spectrum[2 * j + 1] = spectrum[2 * j + 1] + values[2 * i + 1];
    }
    return 0;
}

/* Decode: out[i] = (signal[i] + 0) / divisor, the decoded signal (+ 0 turns -0 into +0, as the
 * dense decode's finite flag does) averaged into a caller's buffer. */
void sn_signal_divide(const float *signal, int64_t count, float divisor, float *out) {
    for (int64_t i = 0; i < count; i++) {
        float v = signal[i] + 0.0f;
        out[i] = v / divisor;
    }
}

/* Decode: target[i] = target[i] - (signal[i] + 0), a residual less the decoded signal. */
void sn_signal_subtract(const float *signal, int64_t count, float *target) {
    for (int64_t i = 0; i < count; i++) {
        float v = signal[i] + 0.0f;
        target[i] = target[i] - v;
    }
}
