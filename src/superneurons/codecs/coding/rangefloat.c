/* The range-float quantiser's element-wise part (rangefloat.quantize), fused into one loop.
 *
 * For each float32 value v, with the window's base binade `lo`, `mant` mantissa bits and
 * `bits` bits per code (all chosen by the caller from the message's range), the code is made
 * with exactly the operations of the torch sequence it replaces (compiled without
 * -ffast-math and with -ffp-contract=off, so the same IEEE single-precision and two's
 * complement operations in the same order give the same bits):
 *
 *   m    = bits(v) & 0x7fffffff                          |v| as bits (integer order = float order)
 *   sub  = int(rint(float(m) * 2**-(lo + 1) * 2**mant))  the subnormal code (NaN, out of range:
 *          INT32_MIN, as x86's conversion gives), at most 2**mant
 *   code = (m + 2**(shift - 1) - ((lo + 127) << 23)) >> shift, shift = 23 - mant
 *                                                        the normal code (int32 wrap-around,
 *                                                        arithmetic shift)
 *   code = min(max(code, sub), 2**(bits - 1) - 1) | (sign bit of v at bit bits - 1)
 *
 * The powers of two are built from their bit patterns as rangefloat._pow2 builds them.
 * The torch sequence swept the values about twelve times with int32 temporaries.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

static float pow2_bits(int32_t exponent) {
    uint32_t pattern = ((uint32_t)exponent + 127u) << 23;
    float out;
    memcpy(&out, &pattern, sizeof out);
    return out;
}

/* Returns 0, or -1 for parameters no message has. */
int sn_rangefloat_codes(const float *values, int64_t count, int32_t lo, int32_t mant,
                        int32_t bits, int32_t *codes) {
    if (bits < 2 || bits > 31 || mant < 0 || mant > bits - 1 || mant > 22 || count < 0) return -1;
    const float down = pow2_bits(-(lo + 1));
    const float up = pow2_bits(mant);
    const int32_t shift = 23 - mant;
    const uint32_t add = (1u << (shift - 1)) - (((uint32_t)lo + 127u) << 23);
    const int32_t sub_max = (int32_t)1 << mant;
    const int32_t top = ((int32_t)1 << (bits - 1)) - 1;
    const int32_t sign_bit = (int32_t)1 << (bits - 1);
    for (int64_t i = 0; i < count; i++) {
        uint32_t pattern;
        memcpy(&pattern, &values[i], sizeof pattern);
        uint32_t magnitude = pattern & 0x7fffffffu;
        float m;
        memcpy(&m, &magnitude, sizeof m);
        float scaled = m * down;
        scaled = scaled * up;
        scaled = rintf(scaled);
        int32_t sub = scaled < 2147483648.0f ? (int32_t)scaled : INT32_MIN; /* NaN: INT32_MIN */
        sub = sub < sub_max ? sub : sub_max;
        int32_t code = (int32_t)(magnitude + add) >> shift;
        code = code > sub ? code : sub;
        code = code < top ? code : top;
        code |= ((int32_t)pattern >> 31) & sign_bit;
        codes[i] = code;
    }
    return 0;
}

/* max(bits(v) & 0x7fffffff) over the values' int32 bit patterns (0 when there are none): the
 * float32 bits of the largest magnitude, inf and NaN patterns above every finite one. */
int32_t sn_rangefloat_max_bits(const int32_t *patterns, int64_t count) {
    int32_t top = 0;
    for (int64_t i = 0; i < count; i++) {
        int32_t magnitude = patterns[i] & 0x7fffffff;
        top = magnitude > top ? magnitude : top;
    }
    return top;
}
