/* The Elias-Fano ("gap") index code on the CPU (indexcode.encode_gap, decode_gap), one pass
 * each way.
 *
 * The message holds `count` low parts of `low` bits (low in 0, 1, 2, 4, 8, 16; packed
 * little-endian, code i at bit i * low, 16-bit ones as little-endian words), then the upper
 * bitmap of `upper_bits` bits (bit p at byte p / 8, bit p % 8), whose i-th set bit, at p,
 * holds the i-th position's high part p - i. Position i = ((p - i) << low) | low part i.
 * The numpy decoder unpacked the bitmap to one byte per bit, listed the set ones, subtracted a
 * range and shifted and or-ed the low parts in: five passes and two fresh arrays; the encoder
 * shifted, added a range, scattered into a byte per bit and packed it.
 */
#include <stdint.h>
#include <string.h>

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the bitmap is read in 64-bit little-endian words"
#endif

static uint64_t low_part(const uint8_t *low_codes, int low, int64_t i) {
    if (low == 16) return (uint64_t)low_codes[2 * i] | ((uint64_t)low_codes[2 * i + 1] << 8);
    int64_t bit = i * low;
    return (uint64_t)(low_codes[bit >> 3] >> (bit & 7)) & ((1u << low) - 1u);
}

/* Writes the `count` positions into `out`; returns 0, or -1 when the bitmap holds another
 * number of set bits than `count`, or `low` is not a width of the code. */
int sn_gap_decode(const uint8_t *data, int64_t count, int low, int64_t low_bytes,
                  int64_t upper_bits, int64_t *out) {
    if (!(low == 0 || low == 1 || low == 2 || low == 4 || low == 8 || low == 16)) return -1;
    const uint8_t *upper = data + low_bytes;
    int64_t found = 0;
    int64_t whole = upper_bits / 64;
    for (int64_t w = 0; w <= whole; w++) {
        uint64_t word = 0;
        if (w < whole) {
            memcpy(&word, upper + 8 * w, sizeof word);
        } else {
            int64_t rest = upper_bits - 64 * whole; /* bits in the last, partial word */
            if (rest == 0) break;
            memcpy(&word, upper + 8 * w, (size_t)((rest + 7) / 8));
            if (rest < 64) word &= (UINT64_C(1) << rest) - 1;
        }
        while (word) {
            int64_t p = 64 * w + __builtin_ctzll(word);
            word &= word - 1;
            if (found == count) return -1;
            out[found] = (p - found) << low;
            found++;
        }
    }
    if (found != count) return -1;
    if (low)
        for (int64_t i = 0; i < count; i++) out[i] |= (int64_t)low_part(data, low, i);
    return 0;
}

/* Writes the code of `count` sorted, distinct positions into `out` (`low_bytes` of low parts,
 * then the `upper_bits`-bit bitmap, ceil(upper_bits / 8) bytes; every byte written, padding
 * bits zero). Returns 0, or -1 (out partly written) when a position's bit would fall outside
 * the bitmap or `low` is not a width of the code. */
int sn_gap_encode(const int64_t *positions, int64_t count, int low, int64_t low_bytes,
                  int64_t upper_bits, uint8_t *out) {
    if (!(low == 0 || low == 1 || low == 2 || low == 4 || low == 8 || low == 16)) return -1;
    memset(out, 0, (size_t)(low_bytes + (upper_bits + 7) / 8));
    uint8_t *upper = out + low_bytes;
    uint64_t mask = low ? (UINT64_C(1) << low) - 1 : 0;
    for (int64_t i = 0; i < count; i++) {
        uint64_t position = (uint64_t)positions[i];
        uint64_t bit = (position >> low) + (uint64_t)i;
        if (positions[i] < 0 || bit >= (uint64_t)upper_bits) return -1;
        upper[bit >> 3] |= (uint8_t)(1u << (bit & 7));
        if (low == 16) {
            out[2 * i] = (uint8_t)(position & 0xff);
            out[2 * i + 1] = (uint8_t)((position >> 8) & 0xff);
        } else if (low) {
            int64_t at = i * low;
            out[at >> 3] |= (uint8_t)((position & mask) << (at & 7));
        }
    }
    return 0;
}
