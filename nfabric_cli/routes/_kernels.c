/* nfabric route kernels: fused, single-threaded encode/decode passes for the low-bit routes.
 *
 * Each function performs the same IEEE-754 operations, in the same order, as the torch
 * reference code in sign.py / intq.py / ternary.py, so results are bit-identical (kernels.py
 * checks the torch side on load; tests/routes/test_kernels.py checks every route). The one
 * reduction whose order matters, the per-chunk sum of |x| for `sign`, is sequential in float32
 * exactly like torch.linalg.vector_norm(ord=1); it runs fast by summing 8 chunks at once, one
 * chunk per SIMD lane (each lane still strictly left to right). Chunks are visited 8 at a time:
 * 8 interleaved memory streams read faster than one on this hardware, and the second pass over
 * them (bits, codes) then reads from cache.
 *
 * Built twice by kernels.py: baseline (-O3, SSE2 on x86-64, scalar elsewhere) and, on CPUs
 * that have it, with -mavx2; both give identical bytes. -ffp-contract=off: no fused
 * multiply-adds, torch rounds every product. Chunk layouts arrive as int64 triples
 * (start, nchunks, length), one per block; see chunks.py.
 */
#ifndef _DEFAULT_SOURCE
#define _DEFAULT_SOURCE /* madvise */
#endif
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__linux__)
#include <sys/mman.h>
#endif

#define NF_ROWS 8 /* chunks visited together */
/* Outputs of at least this many elements go to memory with non-temporal stores (where aligned):
 * codes are read next by the network and a decoded result (tens of MB) by the optimizer, not
 * from our cache, and skipping the read-for-ownership saves a third of a decode's memory
 * traffic and a sixth of a quantise's. */
enum { NF_STREAM_MIN = 1 << 18 };

/* Whether a layout's output (blocks: start, nchunks, length triples) is that large. */
static int stream_out(const int64_t *blocks, int64_t nblocks) {
    if (nblocks <= 0) return 0;
    const int64_t *last = blocks + 3 * (nblocks - 1);
    return last[0] + last[1] * last[2] >= NF_STREAM_MIN;
}

/* ---- vector layer: W floats per register ------------------------------------------------- */
#if defined(__AVX2__)
#include <immintrin.h>
#define NF_W 8
typedef __m256 vf;
#define v_load _mm256_loadu_ps
#define v_store _mm256_storeu_ps
#define v_set1 _mm256_set1_ps
#define v_zero _mm256_setzero_ps
#define v_add _mm256_add_ps
#define v_mul _mm256_mul_ps
#define v_max _mm256_max_ps
#define v_min _mm256_min_ps
#define v_and _mm256_and_ps
#define v_or _mm256_or_ps
#define v_mask _mm256_movemask_ps
#define v_sub _mm256_sub_ps
#define v_div _mm256_div_ps
#define v_stream _mm256_stream_ps
static inline vf v_abs(vf v) { return _mm256_and_ps(v, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff))); }
static inline vf v_nan(vf v) { return _mm256_cmp_ps(v, v, _CMP_UNORD_Q); }
static inline vf v_num(vf v) { return _mm256_cmp_ps(v, v, _CMP_ORD_Q); }
static inline vf v_gt0(vf v) { return _mm256_cmp_ps(v, _mm256_setzero_ps(), _CMP_GT_OQ); }
static inline vf v_eq0(vf v) { return _mm256_cmp_ps(v, _mm256_setzero_ps(), _CMP_EQ_OQ); }
static inline vf v_ones(int64_t on) { return _mm256_castsi256_ps(_mm256_set1_epi32(on ? -1 : 0)); }
#elif defined(__SSE2__)
#include <emmintrin.h>
#define NF_W 4
typedef __m128 vf;
#define v_load _mm_loadu_ps
#define v_store _mm_storeu_ps
#define v_set1 _mm_set1_ps
#define v_zero _mm_setzero_ps
#define v_add _mm_add_ps
#define v_mul _mm_mul_ps
#define v_max _mm_max_ps
#define v_min _mm_min_ps
#define v_and _mm_and_ps
#define v_or _mm_or_ps
#define v_mask _mm_movemask_ps
#define v_sub _mm_sub_ps
#define v_div _mm_div_ps
#define v_stream _mm_stream_ps
static inline vf v_abs(vf v) { return _mm_and_ps(v, _mm_castsi128_ps(_mm_set1_epi32(0x7fffffff))); }
static inline vf v_nan(vf v) { return _mm_cmpunord_ps(v, v); }
static inline vf v_num(vf v) { return _mm_cmpord_ps(v, v); }
static inline vf v_gt0(vf v) { return _mm_cmpgt_ps(v, _mm_setzero_ps()); }
static inline vf v_eq0(vf v) { return _mm_cmpeq_ps(v, _mm_setzero_ps()); }
static inline vf v_ones(int64_t on) { return _mm_castsi128_ps(_mm_set1_epi32(on ? -1 : 0)); }
#endif

/* A sign vote: x > 0, or exact zeros (+0 and -0) too where `up` is set (all-ones lanes: this
 * rank votes zeros up this step, sign.py). NaN never votes up. */
#ifdef NF_W
static inline vf v_vote(vf v, vf up) { return v_or(v_gt0(v), v_and(v_eq0(v), up)); }
#endif
static inline unsigned vote1(float e, int64_t up) { return (unsigned)((e > 0.0f) | (up && e == 0.0f)); }

/* Which build this is (2: AVX2, 1: SSE2, 0: portable C), and whether the CPU could run AVX2. */
int nf_isa(void) {
#if defined(__AVX2__)
    return 2;
#elif defined(__SSE2__)
    return 1;
#else
    return 0;
#endif
}

int nf_cpu_has_avx2(void) {
#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") != 0;
#else
    return 0;
#endif
}

/* Ask for transparent huge pages on a fresh output buffer before the first write: a 64 MiB
 * decode output otherwise spends most of its time in 4 KiB page faults. A hint only. */
void nf_advise_huge(void *p, int64_t nbytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    const uintptr_t huge = (uintptr_t)1 << 21;
    const uintptr_t a = ((uintptr_t)p + huge - 1) & ~(huge - 1);
    const uintptr_t e = ((uintptr_t)p + (uintptr_t)nbytes) & ~(huge - 1);
    if (e > a) madvise((void *)a, e - a, MADV_HUGEPAGE);
#else
    (void)p;
    (void)nbytes;
#endif
}

/* ---- 8 chunks x 8 elements: sequential |x| sums, one chunk per lane, and sign bytes --------- */

#if defined(__AVX2__)
typedef __m256 acc8;
static inline acc8 acc8_zero(void) { return _mm256_setzero_ps(); }
static inline void acc8_store(float *s, acc8 a) { _mm256_storeu_ps(s, a); }
static inline acc8 rows8_step(const float *p, int64_t len, int64_t i, acc8 acc, uint8_t m[8],
                              vf up) {
    __m256 v[8];
    for (int k = 0; k < 8; ++k) {
        const __m256 raw = _mm256_loadu_ps(p + k * len + i);
        m[k] = (uint8_t)_mm256_movemask_ps(v_vote(raw, up));
        v[k] = v_abs(raw);
    }
    const __m256 t0 = _mm256_unpacklo_ps(v[0], v[1]), t1 = _mm256_unpackhi_ps(v[0], v[1]);
    const __m256 t2 = _mm256_unpacklo_ps(v[2], v[3]), t3 = _mm256_unpackhi_ps(v[2], v[3]);
    const __m256 t4 = _mm256_unpacklo_ps(v[4], v[5]), t5 = _mm256_unpackhi_ps(v[4], v[5]);
    const __m256 t6 = _mm256_unpacklo_ps(v[6], v[7]), t7 = _mm256_unpackhi_ps(v[6], v[7]);
    const __m256 s0 = _mm256_shuffle_ps(t0, t2, 0x44), s1 = _mm256_shuffle_ps(t0, t2, 0xEE);
    const __m256 s2 = _mm256_shuffle_ps(t1, t3, 0x44), s3 = _mm256_shuffle_ps(t1, t3, 0xEE);
    const __m256 s4 = _mm256_shuffle_ps(t4, t6, 0x44), s5 = _mm256_shuffle_ps(t4, t6, 0xEE);
    const __m256 s6 = _mm256_shuffle_ps(t5, t7, 0x44), s7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    /* column j (element i + j of every row), added in order j = 0..7 */
    acc = _mm256_add_ps(acc, _mm256_permute2f128_ps(s0, s4, 0x20));
    acc = _mm256_add_ps(acc, _mm256_permute2f128_ps(s1, s5, 0x20));
    acc = _mm256_add_ps(acc, _mm256_permute2f128_ps(s2, s6, 0x20));
    acc = _mm256_add_ps(acc, _mm256_permute2f128_ps(s3, s7, 0x20));
    acc = _mm256_add_ps(acc, _mm256_permute2f128_ps(s0, s4, 0x31));
    acc = _mm256_add_ps(acc, _mm256_permute2f128_ps(s1, s5, 0x31));
    acc = _mm256_add_ps(acc, _mm256_permute2f128_ps(s2, s6, 0x31));
    return _mm256_add_ps(acc, _mm256_permute2f128_ps(s3, s7, 0x31));
}
#elif defined(__SSE2__)
typedef struct { __m128 lo, hi; } acc8; /* rows 0-3, rows 4-7 */
static inline acc8 acc8_zero(void) { acc8 a = {_mm_setzero_ps(), _mm_setzero_ps()}; return a; }
static inline void acc8_store(float *s, acc8 a) { _mm_storeu_ps(s, a.lo); _mm_storeu_ps(s + 4, a.hi); }
/* 4 rows x 4 elements: transpose so lane k is row k, add the 4 columns in order. */
static inline __m128 rows4x4(const float *p, int64_t len, int64_t i, __m128 acc, int m[4],
                             vf up) {
    __m128 v[4];
    for (int k = 0; k < 4; ++k) {
        const __m128 raw = _mm_loadu_ps(p + k * len + i);
        m[k] = _mm_movemask_ps(v_vote(raw, up));
        v[k] = v_abs(raw);
    }
    _MM_TRANSPOSE4_PS(v[0], v[1], v[2], v[3]);
    acc = _mm_add_ps(acc, v[0]);
    acc = _mm_add_ps(acc, v[1]);
    acc = _mm_add_ps(acc, v[2]);
    return _mm_add_ps(acc, v[3]);
}
static inline acc8 rows8_step(const float *p, int64_t len, int64_t i, acc8 acc, uint8_t m[8],
                              vf up) {
    int a[4], b[4], c[4], d[4];
    acc.lo = rows4x4(p, len, i, acc.lo, a, up);
    acc.lo = rows4x4(p, len, i + 4, acc.lo, b, up);
    acc.hi = rows4x4(p + 4 * len, len, i, acc.hi, c, up);
    acc.hi = rows4x4(p + 4 * len, len, i + 4, acc.hi, d, up);
    for (int k = 0; k < 4; ++k) {
        m[k] = (uint8_t)(a[k] | (b[k] << 4));
        m[k + 4] = (uint8_t)(c[k] | (d[k] << 4));
    }
    return acc;
}
#else
typedef struct { float s[8]; } acc8;
static inline acc8 acc8_zero(void) { acc8 a; memset(&a, 0, sizeof a); return a; }
static inline void acc8_store(float *s, acc8 a) { memcpy(s, a.s, sizeof a.s); }
typedef int64_t vf; /* the portable build's `up`: a flag, not a lane mask */
static inline vf v_ones(int64_t on) { return on; }
static inline acc8 rows8_step(const float *p, int64_t len, int64_t i, acc8 acc, uint8_t m[8],
                              vf up) {
    for (int k = 0; k < 8; ++k) {
        unsigned bits = 0;
        for (int j = 0; j < 8; ++j) {
            const float e = p[k * len + i + j];
            bits |= vote1(e, up) << j;
            acc.s[k] += fabsf(e);
        }
        m[k] = (uint8_t)bits;
    }
    return acc;
}
#endif

/* Sums of |x| of 8 rows into out[0..7]; with `bits` (the byte of row 0's first element; only
 * when rows start on byte boundaries and len % 8 == 0) also their sign bytes. */
static void sums8(const float *p, int64_t len, float *out, uint8_t *bits, int64_t up) {
    acc8 acc = acc8_zero();
    const vf upv = v_ones(up);
    int64_t i = 0;
    uint8_t m[8];
    for (; i + 8 <= len; i += 8) {
        acc = rows8_step(p, len, i, acc, m, upv);
        if (bits)
            for (int k = 0; k < 8; ++k) bits[(k * len + i) >> 3] = m[k];
    }
    float s[8];
    acc8_store(s, acc);
    for (; i < len; ++i)
        for (int k = 0; k < 8; ++k) s[k] += fabsf(p[k * len + i]);
    memcpy(out, s, sizeof s);
}

/* Vote bits (x[i] > 0, or >= 0 with `up`) for i in [a, b), little-endian within a byte;
 * partial bytes are OR-ed in (the caller zeroes the output), whole bytes are stored. */
static void sign_bits_range(const float *x, int64_t a, int64_t b, uint8_t *out, int64_t up) {
    int64_t i = a;
    for (; i < b && (i & 7); ++i) out[i >> 3] |= (uint8_t)(vote1(x[i], up) << (i & 7));
#ifdef NF_W
    const vf upv = v_ones(up);
    for (; i + 8 <= b; i += 8) {
        unsigned m = 0;
        for (int k = 0; k < 8; k += NF_W) m |= (unsigned)v_mask(v_vote(v_load(x + i + k), upv)) << k;
        out[i >> 3] = (uint8_t)m;
    }
#endif
    for (; i < b; ++i) out[i >> 3] |= (uint8_t)(vote1(x[i], up) << (i & 7));
}

void nf_sign_bits(const float *x, int64_t n, uint8_t *out, int64_t up) {
    memset(out, 0, (size_t)((n + 7) / 8));
    sign_bits_range(x, 0, n, out, up);
}

/* Per-chunk mean |x| (sum / length, vector_norm(ord=1) / length) and, if `bits` is not NULL,
 * the packed vote bits (x > 0, or x >= 0 with `up`), 8 chunks at a time. */
void nf_sign_encode(const float *x, int64_t n, const int64_t *blocks, int64_t nblocks,
                    float *scales, uint8_t *bits, int64_t up) {
    if (bits) memset(bits, 0, (size_t)((n + 7) / 8));
    for (int64_t b = 0; b < nblocks; ++b) {
        const int64_t start = blocks[3 * b], nch = blocks[3 * b + 1], len = blocks[3 * b + 2];
        const float flen = (float)len;
        int64_t r = 0;
        for (; r + NF_ROWS <= nch; r += NF_ROWS) {
            const int64_t a = start + r * len;
            const int fused = bits && (a & 7) == 0 && (len & 7) == 0;
            sums8(x + a, len, scales + r, fused ? bits + (a >> 3) : 0, up);
            if (bits && !fused) sign_bits_range(x, a, a + NF_ROWS * len, bits, up);
        }
        for (; r < nch; ++r) {
            const float *p = x + start + r * len;
            float s = 0.0f;
            for (int64_t i = 0; i < len; ++i) s += fabsf(p[i]);
            scales[r] = s;
            if (bits) sign_bits_range(x, start + r * len, start + (r + 1) * len, bits, up);
        }
        for (r = 0; r < nch; ++r) scales[r] = scales[r] / flen;
        scales += nch;
    }
}

/* ---- decode by selection: a 1/2/4-bit code picks one of a chunk's 2/4/16 precomputed floats -- */

/* out[i] = t[bit i] for i in [i, stop), bits packed little-endian within a byte. */
static void select_bits1(const uint8_t *bits, int64_t i, int64_t stop, const float *t, float *out) {
    for (; i < stop && (i & 7); ++i) out[i] = t[(bits[i >> 3] >> (i & 7)) & 1];
#if defined(__AVX2__)
    const __m256 vp = _mm256_set1_ps(t[1]), vn = _mm256_set1_ps(t[0]);
    const __m256i sel = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    for (; i + 8 <= stop; i += 8) {
        const __m256i v = _mm256_and_si256(_mm256_set1_epi32(bits[i >> 3]), sel);
        const __m256 m = _mm256_castsi256_ps(_mm256_cmpeq_epi32(v, sel));
        _mm256_storeu_ps(out + i, _mm256_blendv_ps(vn, vp, m));
    }
#elif defined(__SSE2__)
    const __m128 vp = _mm_set1_ps(t[1]), vn = _mm_set1_ps(t[0]);
    const __m128i lo = _mm_setr_epi32(1, 2, 4, 8), hi = _mm_setr_epi32(16, 32, 64, 128);
    for (; i + 8 <= stop; i += 8) {
        const __m128i v = _mm_set1_epi32(bits[i >> 3]);
        const __m128 m0 = _mm_castsi128_ps(_mm_cmpeq_epi32(_mm_and_si128(v, lo), lo));
        const __m128 m1 = _mm_castsi128_ps(_mm_cmpeq_epi32(_mm_and_si128(v, hi), hi));
        _mm_storeu_ps(out + i, _mm_or_ps(_mm_and_ps(m0, vp), _mm_andnot_ps(m0, vn)));
        _mm_storeu_ps(out + i + 4, _mm_or_ps(_mm_and_ps(m1, vp), _mm_andnot_ps(m1, vn)));
    }
#endif
    for (; i + 8 <= stop; i += 8) {
        const unsigned w = bits[i >> 3];
        for (int k = 0; k < 8; ++k) out[i + k] = t[(w >> k) & 1];
    }
    for (; i < stop; ++i) out[i] = t[(bits[i >> 3] >> (i & 7)) & 1];
}

/* out[i] = t[2-bit code i] (four codes per byte, low bits first). */
static void select_bits2(const uint8_t *c, int64_t i, int64_t stop, const float *t, float *out) {
    for (; i < stop && (i & 3); ++i) out[i] = t[(c[i >> 2] >> (2 * (i & 3))) & 3];
#if defined(__AVX2__)
    const __m256 tab = _mm256_setr_ps(t[0], t[1], t[2], t[3], t[0], t[1], t[2], t[3]);
    const __m256i sh = _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14), m3 = _mm256_set1_epi32(3);
    for (; i + 8 <= stop; i += 8) { /* two bytes -> 8 lanes of codes -> table entries */
        const int w = c[i >> 2] | c[(i >> 2) + 1] << 8;
        const __m256i idx = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(w), sh), m3);
        _mm256_storeu_ps(out + i, _mm256_permutevar8x32_ps(tab, idx));
    }
#endif
    for (; i + 4 <= stop; i += 4) {
        const unsigned w = c[i >> 2];
        out[i] = t[w & 3], out[i + 1] = t[(w >> 2) & 3], out[i + 2] = t[(w >> 4) & 3], out[i + 3] = t[w >> 6];
    }
    for (; i < stop; ++i) out[i] = t[(c[i >> 2] >> (2 * (i & 3))) & 3];
}

/* out[i] = t[4-bit code i] (two codes per byte, low nibble first). */
static void select_bits4(const uint8_t *c, int64_t i, int64_t stop, const float *t, float *out) {
    if (i < stop && (i & 1)) out[i] = t[c[i >> 1] >> 4], ++i;
#if defined(__AVX2__)
    const __m256 lo = _mm256_loadu_ps(t), hi = _mm256_loadu_ps(t + 8);
    const __m256i sh = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28), m15 = _mm256_set1_epi32(15);
    for (; i + 8 <= stop; i += 8) { /* four bytes -> 8 codes; bit 3 of a code picks the half */
        uint32_t w;
        memcpy(&w, c + (i >> 1), 4);
        const __m256i idx = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)w), sh), m15);
        const __m256 upper = _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28));
        _mm256_storeu_ps(out + i, _mm256_blendv_ps(_mm256_permutevar8x32_ps(lo, idx),
                                                   _mm256_permutevar8x32_ps(hi, idx), upper));
    }
#endif
    for (; i + 2 <= stop; i += 2) out[i] = t[c[i >> 1] & 15], out[i + 1] = t[c[i >> 1] >> 4];
    if (i < stop) out[i] = t[c[i >> 1] & 15];
}

/* out = (bit ? +1 : -1) * scale of the element's chunk: torch's (2 * bit - 1) * scale. */
void nf_sign_decode(const uint8_t *bits, const int64_t *blocks, int64_t nblocks,
                    const float *scales, float *out) {
    for (int64_t b = 0; b < nblocks; ++b) {
        const int64_t start = blocks[3 * b], nch = blocks[3 * b + 1], len = blocks[3 * b + 2];
        for (int64_t r = 0; r < nch; ++r) {
            const float s = *scales++;
            const int64_t a = start + r * len;
            const float t[2] = {-1.0f * s, 1.0f * s};
            select_bits1(bits, a, a + len, t, out);
        }
    }
}

/* ---- per-chunk max |x| --------------------------------------------------------------------- */

static float abs_max_scalar(const float *p, int64_t len) {
    float m = 0.0f;
    int nan = 0;
    for (int64_t i = 0; i < len; ++i) {
        const float a = fabsf(p[i]);
        nan |= a != a;
        m = a > m ? a : m;
    }
    return nan ? NAN : m;
}

/* max |x| of `g` <= 8 rows (+0 for an all-zero row, NaN if the row holds a NaN), reading the
 * rows as interleaved streams. */
static void abs_max_rows(const float *p, int64_t g, int64_t len, float *out) {
#ifdef NF_W
    if (g == NF_ROWS) {
        int64_t i = 0;
        vf m[NF_ROWS], bad = v_zero();
        for (int k = 0; k < NF_ROWS; ++k) m[k] = v_zero();
        for (; i + NF_W <= len; i += NF_W)
            for (int k = 0; k < NF_ROWS; ++k) {
                const vf a = v_abs(v_load(p + k * len + i));
                bad = v_or(bad, v_nan(a));
                m[k] = v_max(m[k], a);
            }
        if (v_mask(bad)) { /* a NaN somewhere: rare, find its rows the slow way */
            for (int k = 0; k < NF_ROWS; ++k) out[k] = abs_max_scalar(p + k * len, len);
            return;
        }
        for (int k = 0; k < NF_ROWS; ++k) {
            float lanes[NF_W], best = 0.0f;
            v_store(lanes, m[k]);
            for (int j = 0; j < NF_W; ++j) best = lanes[j] > best ? lanes[j] : best;
            const float tail = abs_max_scalar(p + k * len + i, len - i);
            out[k] = tail != tail ? tail : (tail > best ? tail : best);
        }
        return;
    }
#endif
    for (int64_t k = 0; k < g; ++k) out[k] = abs_max_scalar(p + k * len, len);
}

void nf_abs_max(const float *x, const int64_t *blocks, int64_t nblocks, float *out) {
    for (int64_t b = 0; b < nblocks; ++b) {
        const int64_t start = blocks[3 * b], nch = blocks[3 * b + 1], len = blocks[3 * b + 2];
        for (int64_t r = 0; r < nch; r += NF_ROWS) {
            const int64_t g = nch - r < NF_ROWS ? nch - r : NF_ROWS;
            abs_max_rows(x + start + r * len, g, len, out + r);
        }
        out += nch;
    }
}

/* ---- int8 / int4 --------------------------------------------------------------------------- */

/* One code, as torch computes it: v = x * inv (+ u), NaN -> 0 (torch's float->int8 cast of
 * NaN), clamp to +-qmax, then round half to even (or floor with noise). Clamping before
 * rounding equals rounding before clamping since qmax is an integer. */
static inline int8_t code1(float x, float u, int noisy, float inv, float qmax) {
    float v = x * inv;
    if (noisy) v = v + u;
    if (v != v) v = 0.0f;
    v = v < -qmax ? -qmax : (v > qmax ? qmax : v);
    return (int8_t)(noisy ? floorf(v) : rintf(v));
}

/* Codes go straight to memory (non-temporal stores where aligned): they are read next by the
 * network, not by us, and skipping the read-for-ownership saves a sixth of int8's traffic.
 * Callers end with nf_fence(). */
#if defined(__AVX2__)
static inline void store_codes32(int8_t *p, __m256i v, int nt) {
    if (nt && ((uintptr_t)p & 31) == 0) _mm256_stream_si256((__m256i *)p, v);
    else _mm256_storeu_si256((__m256i *)p, v);
}
#elif defined(__SSE2__)
static inline void store_codes16(int8_t *p, __m128i v, int nt) {
    if (nt && ((uintptr_t)p & 15) == 0) _mm_stream_si128((__m128i *)p, v);
    else _mm_storeu_si128((__m128i *)p, v);
}
#endif

#if defined(__AVX2__)
/* 4 x 8 int32 codes as 32 int8, packed with saturation, in element order (the packs work per
 * 128-bit lane, the permute puts the lanes back). */
static inline __m256i pack_codes32(const __m256i q[4]) {
    const __m256i w = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    return _mm256_permutevar8x32_epi32(w, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

/* 32 codes round(x[i] * inv): the whole encode where nothing can need the NaN mask or the
 * clamp (quantize_row_finite, quantize_row's checked path). */
static inline __m256i round_codes32(const float *x, __m256 vinv) {
    __m256i q[4];
    for (int k = 0; k < 4; ++k) q[k] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 8 * k), vinv));
    return pack_codes32(q);
}
#endif

static inline void nf_fence(void) {
#if defined(__SSE2__)
    _mm_sfence();
#endif
}

static void quantize_row(const float *x, const float *u, int64_t len, float inv, float qmax,
                         int8_t *out, int nt) {
    int64_t i = 0;
#if defined(__AVX2__)
    const __m256 vinv = _mm256_set1_ps(inv), vhi = _mm256_set1_ps(qmax), vlo = _mm256_set1_ps(-qmax);
    const __m256i qhi = _mm256_set1_epi8((char)qmax), qlo = _mm256_set1_epi8((char)-qmax);
    for (; i + 32 <= len; i += 32) {
        if (!u) { /* checked fast path: round(x * inv) alone, which every code in [-qmax, qmax]
                   * proves right: a NaN or infinity converts to INT_MIN (-128 after the
                   * saturating packs) and a value past the clamp lands outside too, except
                   * past +127 for int8, where saturation gives the clamp's own 127 */
            const __m256i w = round_codes32(x + i, vinv);
            const __m256i bad = _mm256_or_si256(_mm256_cmpgt_epi8(w, qhi), _mm256_cmpgt_epi8(qlo, w));
            if (!_mm256_movemask_epi8(bad)) {
                store_codes32(out + i, w, nt);
                continue;
            }
        }
        __m256i q[4];
        for (int k = 0; k < 4; ++k) {
            __m256 v = _mm256_mul_ps(_mm256_loadu_ps(x + i + 8 * k), vinv);
            if (u) v = _mm256_add_ps(v, _mm256_loadu_ps(u + i + 8 * k));
            v = _mm256_min_ps(_mm256_max_ps(_mm256_and_ps(v, v_num(v)), vlo), vhi);
            q[k] = u ? _mm256_cvttps_epi32(_mm256_floor_ps(v)) : _mm256_cvtps_epi32(v);
        }
        store_codes32(out + i, pack_codes32(q), nt);
    }
#elif defined(__SSE2__)
    const __m128 vinv = _mm_set1_ps(inv), vhi = _mm_set1_ps(qmax), vlo = _mm_set1_ps(-qmax);
    for (; i + 16 <= len; i += 16) {
        __m128i q[4];
        for (int k = 0; k < 4; ++k) {
            __m128 v = _mm_mul_ps(_mm_loadu_ps(x + i + 4 * k), vinv);
            if (u) v = _mm_add_ps(v, _mm_loadu_ps(u + i + 4 * k));
            v = _mm_min_ps(_mm_max_ps(_mm_and_ps(v, v_num(v)), vlo), vhi);
            if (u) { /* floor = truncate, minus 1 where that rounded up */
                const __m128i t = _mm_cvttps_epi32(v);
                q[k] = _mm_add_epi32(t, _mm_castps_si128(_mm_cmpgt_ps(_mm_cvtepi32_ps(t), v)));
            } else {
                q[k] = _mm_cvtps_epi32(v); /* MXCSR default: round half to even */
            }
        }
        const __m128i w = _mm_packs_epi16(_mm_packs_epi32(q[0], q[1]), _mm_packs_epi32(q[2], q[3]));
        store_codes16(out + i, w, nt);
    }
#else
    (void)nt;
#endif
    for (; i < len; ++i) out[i] = code1(x[i], u ? u[i] : 0.0f, u != 0, inv, qmax);
}

/* quantize_row for a chunk whose absmax m and inv are finite: no NaN can arise, and
 * |x * inv| <= m * (1/m) * qmax * (1 + 3 eps) < qmax + 1/2 rounds inside +-qmax, so neither the
 * NaN mask nor the clamp can change a code; skipping them is what makes int8 memory-bound. */
static void quantize_row_finite(const float *x, int64_t len, float inv, float qmax, int8_t *out,
                                int nt) {
    int64_t i = 0;
    (void)nt;
#if defined(__AVX2__)
    const __m256 vinv = _mm256_set1_ps(inv);
    for (; i + 32 <= len; i += 32) store_codes32(out + i, round_codes32(x + i, vinv), nt);
#elif defined(__SSE2__)
    const __m128 vinv = _mm_set1_ps(inv);
    for (; i + 16 <= len; i += 16) {
        __m128i q[4];
        for (int k = 0; k < 4; ++k) q[k] = _mm_cvtps_epi32(_mm_mul_ps(_mm_loadu_ps(x + i + 4 * k), vinv));
        const __m128i w = _mm_packs_epi16(_mm_packs_epi32(q[0], q[1]), _mm_packs_epi32(q[2], q[3]));
        store_codes16(out + i, w, nt);
    }
#endif
    for (; i < len; ++i) out[i] = code1(x[i], 0.0f, 0, inv, qmax);
}

void nf_quantize(const float *x, const float *u, const int64_t *blocks, int64_t nblocks,
                 const float *inv, float qmax, int8_t *out) {
    const int nt = stream_out(blocks, nblocks);
    for (int64_t b = 0; b < nblocks; ++b) {
        const int64_t start = blocks[3 * b], nch = blocks[3 * b + 1], len = blocks[3 * b + 2];
        for (int64_t r = 0; r < nch; ++r) {
            const int64_t a = start + r * len;
            quantize_row(x + a, u ? u + a : 0, len, *inv++, qmax, out + a, nt);
        }
    }
    if (nt) nf_fence();
}

/* int4 codes c of elements [e, e + m) as nibbles c + 8, in element order: an even element sets
 * its byte (high nibble 0, pack_uint's padding for an odd total), an odd one fills the high
 * nibble of the byte its predecessor set. */
static void put_nibbles(const int8_t *c, int64_t e, int64_t m, uint8_t *out) {
    int64_t t = 0;
    if ((e & 1) && m > 0) {
        out[e >> 1] |= (uint8_t)((c[0] + 8) << 4);
        t = 1;
    }
    uint8_t *o = out + ((e + t) >> 1);
    const int64_t pairs = (m - t) / 2;
    int64_t j = 0;
#if defined(__SSE2__)
    /* 32 codes -> 16 bytes: as 16-bit lanes [even, odd] + 0x0808, keep the low nibble of each
     * byte, move the odd one up, pack the lanes (all <= 255) back to bytes. */
    const __m128i eight = _mm_set1_epi8(8), lo = _mm_set1_epi16(0x000F), hi = _mm_set1_epi16(0x00F0);
    for (; j + 16 <= pairs; j += 16) {
        __m128i w[2];
        for (int k = 0; k < 2; ++k) {
            const __m128i v = _mm_add_epi8(_mm_loadu_si128((const __m128i *)(c + t + 2 * j + 16 * k)), eight);
            w[k] = _mm_or_si128(_mm_and_si128(v, lo), _mm_and_si128(_mm_srli_epi16(v, 4), hi));
        }
        _mm_storeu_si128((__m128i *)(o + j), _mm_packus_epi16(w[0], w[1]));
    }
#endif
    for (; j < pairs; ++j)
        o[j] = (uint8_t)((uint8_t)(c[t + 2 * j] + 8) | (uint8_t)(c[t + 2 * j + 1] + 8) << 4);
    if ((m - t) & 1) o[pairs] = (uint8_t)(c[m - 1] + 8);
}

/* Local int8/int4 encode, 8 chunks at a time: absmax, inv = (1 / absmax) * qmax (torch's
 * `qmax / absmax` is reciprocal-then-multiply), nearest-rounded codes read from cache. int8
 * codes go to `out` directly; with `nibbles` (int4) each piece of codes is packed two per byte
 * into `out` on its way out of cache. */
void nf_int_encode(const float *x, const int64_t *blocks, int64_t nblocks, float qmax,
                   float *absmax, void *out, int nibbles) {
    enum { PIECE = 4096 };
    int8_t piece[PIECE];
    for (int64_t b = 0; b < nblocks; ++b) {
        const int64_t start = blocks[3 * b], nch = blocks[3 * b + 1], len = blocks[3 * b + 2];
        for (int64_t r = 0; r < nch; r += NF_ROWS) {
            const int64_t g = nch - r < NF_ROWS ? nch - r : NF_ROWS;
            abs_max_rows(x + start + r * len, g, len, absmax + r);
            for (int64_t k = 0; k < g; ++k) {
                const float m = absmax[r + k], inv = m > 0.0f ? (1.0f / m) * qmax : 0.0f;
                const int finite = isfinite(m) && isfinite(inv);
                const int64_t a = start + (r + k) * len;
                for (int64_t i = 0; i < len; i += nibbles ? PIECE : len) {
                    const int64_t n = nibbles && len - i > PIECE ? PIECE : len - i;
                    int8_t *dst = nibbles ? piece : (int8_t *)out + a;
                    if (finite)
                        quantize_row_finite(x + a + i, n, inv, qmax, dst, !nibbles);
                    else
                        quantize_row(x + a + i, 0, n, inv, qmax, dst, !nibbles);
                    if (nibbles) put_nibbles(piece, a + i, n, (uint8_t *)out);
                }
            }
        }
        absmax += nch;
    }
    nf_fence();
}

/* int4 codes in [-8, 7] -> two per byte, offset by 8, low nibble first; an odd tail byte has
 * a zero high nibble (pack_uint's padding). */
void nf_pack_nibbles(const int8_t *codes, int64_t n, uint8_t *out) {
    const int64_t pairs = n / 2;
    for (int64_t j = 0; j < pairs; ++j)
        out[j] = (uint8_t)(((uint8_t)(codes[2 * j] + 8)) | ((uint8_t)(codes[2 * j + 1] + 8) << 4));
    if (n & 1) out[pairs] = (uint8_t)(codes[n - 1] + 8);
}

/* out = lut[code] * scale. `bits` 8: one code per byte (lut has 256 entries, by byte value);
 * `bits` 4: two per byte, low nibble first (lut has 16 entries, by nibble; selected from the
 * chunk's 16 products). */
void nf_int_decode(const uint8_t *codes, int bits, const int64_t *blocks, int64_t nblocks,
                   const float *lut, const float *scales, float *out) {
    for (int64_t b = 0; b < nblocks; ++b) {
        const int64_t start = blocks[3 * b], nch = blocks[3 * b + 1], len = blocks[3 * b + 2];
        for (int64_t r = 0; r < nch; ++r) {
            const float s = *scales++;
            const int64_t a = start + r * len, stop = a + len;
            if (bits == 8) {
                for (int64_t i = a; i < stop; ++i) out[i] = lut[codes[i]] * s;
            } else {
                float t[16];
                for (int k = 0; k < 16; ++k) t[k] = lut[k] * s;
                select_bits4(codes, a, stop, t, out);
            }
        }
    }
}

/* ---- ternary ------------------------------------------------------------------------------- */

/* spread[m]: bit j of m -> byte j (0 or 1), for turning lane masks into per-element bytes. */
#define NF_S(m) ((uint64_t)((m) & 1) | (uint64_t)(((m) >> 1) & 1) << 8 | (uint64_t)(((m) >> 2) & 1) << 16 | \
                 (uint64_t)(((m) >> 3) & 1) << 24 | (uint64_t)(((m) >> 4) & 1) << 32 |                      \
                 (uint64_t)(((m) >> 5) & 1) << 40 | (uint64_t)(((m) >> 6) & 1) << 48 | (uint64_t)(((m) >> 7) & 1) << 56)
#define NF_R4(m) NF_S(m), NF_S(m + 1), NF_S(m + 2), NF_S(m + 3)
#define NF_R16(m) NF_R4(m), NF_R4(m + 4), NF_R4(m + 8), NF_R4(m + 12)
#define NF_R64(m) NF_R16(m), NF_R16(m + 16), NF_R16(m + 32), NF_R16(m + 48)
static const uint64_t spread[256] = {NF_R64(0), NF_R64(64), NF_R64(128), NF_R64(192)};

/* trit[b][k]: base-3 digit k of byte b (bytes >= 243 never occur in a valid payload). */
#define NF_T(b) {(b) % 3, (b) / 3 % 3, (b) / 9 % 3, (b) / 27 % 3, (b) / 81 % 3}
#define NF_T4(b) NF_T(b), NF_T(b + 1), NF_T(b + 2), NF_T(b + 3)
#define NF_T16(b) NF_T4(b), NF_T4(b + 4), NF_T4(b + 8), NF_T4(b + 12)
#define NF_T64(b) NF_T16(b), NF_T16(b + 16), NF_T16(b + 32), NF_T16(b + 48)
static const uint8_t trit[256][5] = {NF_T64(0), NF_T64(64), NF_T64(128), NF_T64(192)};

/* Base-3 packer over a digit stream: five digits per byte, digit k weighs 3^k. */
typedef struct { uint8_t *out; int64_t j; unsigned acc; int k; } packer;
static const unsigned pow3[5] = {1, 3, 9, 27, 81};

static void trits_push(packer *pk, const uint8_t *d, int64_t n) {
    int64_t i = 0;
    for (; i < n && pk->k; ++i) { /* finish the byte the previous digits began */
        pk->acc += d[i] * pow3[pk->k];
        if (++pk->k == 5) { pk->out[pk->j++] = (uint8_t)pk->acc; pk->acc = 0; pk->k = 0; }
    }
    /* Five digit bytes in one word times 81 + 27<<8 + 9<<16 + 3<<24 + 1<<32: byte 4 of the
     * product is d0 + 3 d1 + 9 d2 + 27 d3 + 81 d4, and no lower byte can carry (each <= 240).
     * Reads 3 bytes past the group: digit buffers carry 8 spare bytes. */
    const uint64_t mul = 81u | 27u << 8 | 9u << 16 | 3u << 24 | (uint64_t)1 << 32;
    for (; i + 5 <= n; i += 5) {
        uint64_t word;
        memcpy(&word, d + i, 8);
        pk->out[pk->j++] = (uint8_t)(((word & 0xFFFFFFFFFFull) * mul) >> 32);
    }
    for (; i < n; ++i) pk->acc += d[i] * pow3[pk->k++];
}

/* One piece of a chunk: keep = thresh <= |x| and |x| > 0 (NaN never kept); kept |x| (else +0)
 * into q and digits vote + 1 into d, each if not NULL. Returns the kept count. */
static int64_t ternary_piece(const float *p, int64_t len, float t, float *q, uint8_t *d) {
    int64_t count = 0, i = 0;
#ifdef NF_W
    const vf vt = v_set1(t), z = v_zero();
    for (; i + NF_W <= len; i += NF_W) {
        const vf e = v_load(p + i), m = v_abs(e);
#if defined(__AVX2__)
        const vf keep = _mm256_and_ps(_mm256_cmp_ps(vt, m, _CMP_LE_OQ), _mm256_cmp_ps(m, z, _CMP_GT_OQ));
#else
        const vf keep = _mm_and_ps(_mm_cmple_ps(vt, m), _mm_cmpgt_ps(m, z));
#endif
        const unsigned km = (unsigned)v_mask(keep);
        if (q) v_store(q + i, v_and(keep, m));
        count += (int64_t)((spread[km] * 0x0101010101010101ULL) >> 56); /* popcount, no libgcc */
        if (d) { /* 1 + kept-positive - kept-negative, bytewise: no borrows */
            const unsigned pm = km & (unsigned)v_mask(v_gt0(e));
            const uint64_t dg = 0x0101010101010101ULL + spread[pm] - spread[km & ~pm];
            memcpy(d + i, &dg, NF_W);
        }
    }
#endif
    for (; i < len; ++i) {
        const float m = fabsf(p[i]);
        const int keep = (t <= m) & (m > 0.0f);
        if (q) q[i] = keep ? m : 0.0f;
        if (d) d[i] = (uint8_t)(keep ? (p[i] > 0.0f ? 2 : 0) : 1);
        count += keep;
    }
    return count;
}

/* Gate `nrows` chunks of `len` elements, 8 at a time: threshold = absmax * tau (float32, as
 * torch multiplies a float tensor by a Python float), then, from cache, what is asked for (NULL
 * skips): kept |x| (for torch's per-chunk sum; the caller passes a cache-sized scratch), the
 * kept count per chunk (as float), and the votes + 1 packed base 3, five per byte, continuing
 * across calls through state = {bytes written, pending value, pending digits}. */
void nf_ternary_rows(const float *x, int64_t nrows, int64_t len, float tau, float *kept,
                     float *counts, uint8_t *packed, int64_t *state) {
    enum { PIECE = 4096 };
    uint8_t digits[PIECE + 8]; /* + 8: trits_push reads whole words */
    float absmax[NF_ROWS];
    packer pk = {packed, state[0], (unsigned)state[1], (int)state[2]};
    for (int64_t r0 = 0; r0 < nrows; r0 += NF_ROWS) {
        const int64_t g = nrows - r0 < NF_ROWS ? nrows - r0 : NF_ROWS;
        abs_max_rows(x + r0 * len, g, len, absmax);
        for (int64_t r = r0; r < r0 + g; ++r) {
            const float t = 1.0f * (absmax[r - r0] * tau);
            int64_t count = 0;
            for (int64_t i = 0; i < len; i += PIECE) {
                const int64_t m = len - i < PIECE ? len - i : PIECE, a = r * len + i;
                count += ternary_piece(x + a, m, t, kept ? kept + a : 0, packed ? digits : 0);
                if (packed) trits_push(&pk, digits, m);
            }
            if (counts) counts[r] = (float)count;
        }
    }
    state[0] = pk.j;
    state[1] = pk.acc;
    state[2] = pk.k;
}

/* Flush a partly filled last byte, padding with digit 1 (zero votes). */
void nf_ternary_finish(uint8_t *packed, int64_t *state) {
    if (state[2] == 0) return;
    unsigned acc = (unsigned)state[1];
    for (int k = (int)state[2]; k < 5; ++k) acc += pow3[k];
    packed[state[0]++] = (uint8_t)acc;
    state[1] = state[2] = 0;
}

/* out = (digit - 1) * scale of the element's chunk, digits unpacked from base-3 bytes. */
void nf_ternary_decode(const uint8_t *packed, const int64_t *blocks, int64_t nblocks,
                       const float *scales, float *out) {
    for (int64_t b = 0; b < nblocks; ++b) {
        const int64_t start = blocks[3 * b], nch = blocks[3 * b + 1], len = blocks[3 * b + 2];
        for (int64_t r = 0; r < nch; ++r) {
            const float s = *scales++;
            const float v[3] = {-1.0f * s, 0.0f * s, 1.0f * s};
            int64_t i = start + r * len;
            const int64_t stop = i + len;
            for (; i < stop && i % 5; ++i) out[i] = v[trit[packed[i / 5]][i % 5]];
            for (; i + 5 <= stop; i += 5) {
                const uint8_t *t = trit[packed[i / 5]];
                for (int k = 0; k < 5; ++k) out[i + k] = v[t[k]];
            }
            for (; i < stop; ++i) out[i] = v[trit[packed[i / 5]][i % 5]];
        }
    }
}

/* ---- aggregation --------------------------------------------------------------------------- */

enum { NF_SUM_INT8 = 0, NF_SUM_NIBBLE = 1, NF_SUM_TRIT = 2, NF_SUM_BIT = 3 };

enum { NF_SUM_TILE = 1024 }; /* bytes per shard per tile: at most 8192 elements */

static int elems_per_byte(int kind) {
    return kind == NF_SUM_INT8 ? 1 : kind == NF_SUM_NIBBLE ? 2 : kind == NF_SUM_TRIT ? 5 : 8;
}

/* trit5[b]: the five base-3 digits of byte b in bytes 0..4, for bytewise (SWAR) sums. */
#define NF_D(b) ((uint64_t)((b) % 3) | (uint64_t)((b) / 3 % 3) << 8 | (uint64_t)((b) / 9 % 3) << 16 | \
                 (uint64_t)((b) / 27 % 3) << 24 | (uint64_t)((b) / 81 % 3) << 32)
#define NF_D4(b) NF_D(b), NF_D(b + 1), NF_D(b + 2), NF_D(b + 3)
#define NF_D16(b) NF_D4(b), NF_D4(b + 4), NF_D4(b + 8), NF_D4(b + 12)
#define NF_D64(b) NF_D16(b), NF_D16(b + 16), NF_D16(b + 32), NF_D16(b + 48)
static const uint64_t trit5[256] = {NF_D64(0), NF_D64(64), NF_D64(128), NF_D64(192)};

/* acc[i] = sum over the W shards of the raw code of element i of bytes [j0, j0 + nb): int8
 * value, int4 nibble (0..15), base-3 digit (0..2) or bit (0/1). int32 is exact: |sum| <= 255 W.
 * Bits (W <= 255) and digits (W <= 127) are summed 8 or 5 at a time in the bytes of a uint64:
 * no byte can overflow into the next. */
static void sum_tile(const uint8_t *const *shards, int64_t w, int64_t j0, int64_t nb, int kind,
                     int32_t *acc) {
    const int swar = (kind == NF_SUM_BIT && w <= 255) || (kind == NF_SUM_TRIT && w <= 127);
    if (swar) {
        uint64_t lanes[NF_SUM_TILE];
        const uint64_t *table = kind == NF_SUM_BIT ? spread : trit5;
        const int per = elems_per_byte(kind);
        memset(lanes, 0, sizeof(uint64_t) * (size_t)nb);
        for (int64_t r = 0; r < w; ++r) {
            const uint8_t *s = shards[r] + j0;
            for (int64_t j = 0; j < nb; ++j) lanes[j] += table[s[j]];
        }
        for (int64_t j = 0; j < nb; ++j)
            for (int k = 0; k < per; ++k) acc[per * j + k] = (int32_t)((lanes[j] >> (8 * k)) & 255);
        return;
    }
    memset(acc, 0, sizeof(int32_t) * (size_t)(nb * elems_per_byte(kind)));
    for (int64_t r = 0; r < w; ++r) {
        const uint8_t *s = shards[r] + j0;
        if (kind == NF_SUM_INT8) {
            for (int64_t j = 0; j < nb; ++j) acc[j] += (int8_t)s[j];
        } else if (kind == NF_SUM_NIBBLE) {
            for (int64_t j = 0; j < nb; ++j) {
                acc[2 * j] += s[j] & 15;
                acc[2 * j + 1] += s[j] >> 4;
            }
        } else if (kind == NF_SUM_TRIT) {
            for (int64_t j = 0; j < nb; ++j)
                for (int k = 0; k < 5; ++k) acc[5 * j + k] += trit[s[j]][k];
        } else {
            for (int64_t j = 0; j < nb; ++j)
                for (int k = 0; k < 8; ++k) acc[8 * j + k] += (s[j] >> k) & 1;
        }
    }
}

/* out[i] = offset + per-element sum of the W shards' codes (each shard `nbytes` bytes), tile by
 * tile so every shard streams through cache once. */
void nf_sum_codes(const uint8_t *const *shards, int64_t w, int64_t nbytes, int kind, int64_t offset,
                  int64_t *out) {
    int32_t acc[NF_SUM_TILE * 8];
    const int per = elems_per_byte(kind);
    for (int64_t j0 = 0; j0 < nbytes; j0 += NF_SUM_TILE) {
        const int64_t nb = nbytes - j0 < NF_SUM_TILE ? nbytes - j0 : NF_SUM_TILE;
        sum_tile(shards, w, j0, nb, kind, acc);
        int64_t *o = out + j0 * per;
        for (int64_t i = 0; i < nb * per; ++i) o[i] = acc[i] + offset;
    }
}

/* Sign reducer over W shards of packed votes: c = positive votes per element; values =
 * sign(2c - W), or c itself with `keep_count`; agree = |2c - W| / W (float, as torch computes
 * it). One pass, tile by tile. */
void nf_sign_combine(const uint8_t *const *shards, int64_t w, int64_t nbytes, int keep_count,
                     int64_t *values, float *agree) {
    int32_t acc[NF_SUM_TILE * 8];
    /* per count c in [0, W]: the value and the agreement, computed once */
    float agree_of[256];
    int64_t value_of[256];
    if (w > 255) return; /* the route refuses W > 255 before it gets here */
    for (int64_t c = 0; c <= w; ++c) {
        const int64_t margin = 2 * c - w;
        agree_of[c] = (float)(margin < 0 ? -margin : margin) / (float)w;
        value_of[c] = keep_count ? c : (margin > 0) - (margin < 0);
    }
    for (int64_t j0 = 0; j0 < nbytes; j0 += NF_SUM_TILE) {
        const int64_t nb = nbytes - j0 < NF_SUM_TILE ? nbytes - j0 : NF_SUM_TILE;
        sum_tile(shards, w, j0, nb, NF_SUM_BIT, acc);
        int64_t *v = values + 8 * j0;
        float *g = agree + 8 * j0;
        for (int64_t i = 0; i < 8 * nb; ++i) {
            g[i] = agree_of[acc[i]];
            v[i] = value_of[acc[i]];
        }
    }
}

/* Store the codes of `n` elements (n * bits a multiple of 8) at `bits` in {1, 2, 4, 8, 16, 32},
 * little-endian within a byte and as native words for 16/32 bits: what `pack_uint` writes. */
static void pack_codes(const uint32_t *code, int64_t n, int bits, uint8_t *out) {
    if (bits == 8) {
        for (int64_t i = 0; i < n; ++i) out[i] = (uint8_t)code[i];
    } else if (bits == 16) {
        uint16_t *o = (uint16_t *)out;
        for (int64_t i = 0; i < n; ++i) o[i] = (uint16_t)code[i];
    } else if (bits == 32) {
        memcpy(out, code, sizeof(uint32_t) * (size_t)n);
    } else {
        const int per = 8 / bits;
        for (int64_t j = 0; j < n / per; ++j) {
            unsigned byte = 0;
            for (int k = 0; k < per; ++k) byte |= code[per * j + k] << (bits * k);
            out[j] = (uint8_t)byte;
        }
    }
}

/* Vote margins by element range: range k holds elements [ends[k - 1], ends[k]) (ends[-1] = 0),
 * ascending; elements at or past ends[nends - 1] (a shard's padding) are not counted. A reduce
 * that spans several health scopes (regions on one route) keeps each scope's agreement apart.
 * add_margins adds |2 acc[i] - w| of elements e0 .. e0 + ne - 1 to margin[k] of their range,
 * the cursor *k moving along. */
static void add_margins(const int32_t *acc, int64_t e0, int64_t ne, int64_t w,
                        const int64_t *ends, int64_t nends, int64_t *k, int64_t *margin) {
    int64_t i = 0;
    while (i < ne && *k < nends) {
        if (e0 + i >= ends[*k]) {
            ++*k;
            continue;
        }
        const int64_t stop = ends[*k] - e0 < ne ? ends[*k] - e0 : ne;
        int64_t m = 0;
        for (; i < stop; ++i) {
            const int64_t d = 2 * (int64_t)acc[i] - w;
            m += d < 0 ? -d : d;
        }
        margin[*k] += m;
    }
}

/* Bits lo .. hi - 1 of a 64-bit word (0 <= lo, hi <= 64; none when hi <= lo). */
static inline uint64_t bit_span(int64_t lo, int64_t hi) {
    if (hi <= lo) return 0;
    const uint64_t upto = hi >= 64 ? ~0ULL : ((1ULL << hi) - 1);
    return upto & ~((1ULL << lo) - 1);
}

/* The sharded reducer's combine, packed: per element, c = the sum over the W shards of its raw
 * code (`kind`, as nf_sum_codes); its result code is table[c] when `table` is given (sign: a
 * vote count -> code; `table` has W + 1 entries), else c + offset; codes are written packed at
 * `bits` into `out` (nbytes * per * bits / 8 bytes). `margin` (may be NULL; `nends` entries)
 * gets the sum of |2c - W| per range of `ends` (add_margins): the sign vote's agreement,
 * exact in int64. One pass, tile by tile: no int64 values, no float agreement array. */
void nf_combine_pack(const uint8_t *const *shards, int64_t w, int64_t nbytes, int kind,
                     int64_t offset, const int32_t *table, int bits, const int64_t *ends,
                     int64_t nends, uint8_t *out, int64_t *margin) {
    int32_t acc[NF_SUM_TILE * 8];
    uint32_t code[NF_SUM_TILE * 8];
    const int per = elems_per_byte(kind);
    int64_t k = 0;
    for (int64_t j0 = 0; j0 < nbytes; j0 += NF_SUM_TILE) {
        const int64_t nb = nbytes - j0 < NF_SUM_TILE ? nbytes - j0 : NF_SUM_TILE;
        const int64_t e0 = j0 * per, ne = nb * per;
        sum_tile(shards, w, j0, nb, kind, acc);
        if (table) {
            for (int64_t i = 0; i < ne; ++i) code[i] = (uint32_t)table[acc[i]];
        } else {
            for (int64_t i = 0; i < ne; ++i) code[i] = (uint32_t)(acc[i] + offset);
        }
        if (margin) add_margins(acc, e0, ne, w, ends, nends, &k, margin);
        pack_codes(code, ne, bits, out + e0 * bits / 8);
    }
}

/* 32 bits of x spread to the even bits of a uint64 (bit k -> bit 2k): Morton interleave. */
static inline uint64_t spread32(uint64_t x) {
    x &= 0xffffffffULL;
    x = (x | x << 16) & 0x0000ffff0000ffffULL;
    x = (x | x << 8) & 0x00ff00ff00ff00ffULL;
    x = (x | x << 4) & 0x0f0f0f0f0f0f0f0fULL;
    x = (x | x << 2) & 0x3333333333333333ULL;
    return (x | x << 1) & 0x5555555555555555ULL;
}

/* |2c - W| summed over the elements of one 64-element word selected by `vm`: for W = 2 from
 * the tie mask alone (|2c - 2| is 2 unless the vote tied), else from the count planes. */
static inline int64_t word_margin(int64_t w, int nplanes, const uint64_t *planes, uint64_t gt,
                                  uint64_t eq, uint64_t vm) {
    if (w == 2) return 2 * (int64_t)__builtin_popcountll(~eq & vm);
    const uint64_t g = gt & vm, l = ~gt & ~eq & vm;
    int64_t sum_g = 0, sum_l = 0;
    for (int b = 0; b < nplanes; ++b) {
        sum_g += (int64_t)__builtin_popcountll(planes[b] & g) << b;
        sum_l += (int64_t)__builtin_popcountll(planes[b] & l) << b;
    }
    return 2 * sum_g - w * (int64_t)__builtin_popcountll(g) + w * (int64_t)__builtin_popcountll(l)
           - 2 * sum_l;
}

/* The range cursor of nf_sign_majority: words wholly below `hi` lie in range q. */
typedef struct {
    int64_t q, hi;
} nf_cursor;

/* Add word j's margins to the ranges of `ends` its elements fall in: at once when the word
 * lies inside the cursor's range (the common case), else range by range with bit masks, then
 * move the cursor to the range of the next word's first element. */
static inline void add_word_margins(int64_t j, int64_t w, int nplanes, const uint64_t *planes,
                                    uint64_t gt, uint64_t eq, const int64_t *ends, int64_t nends,
                                    nf_cursor *c, int64_t *margin) {
    const int64_t base = 64 * j;
    if (base + 64 <= c->hi) {
        margin[c->q] += word_margin(w, nplanes, planes, gt, eq, ~0ULL);
        return;
    }
    while (c->q < nends && ends[c->q] <= base) ++c->q;
    for (int64_t k = c->q; k < nends; ++k) {
        const int64_t start = k ? ends[k - 1] : 0;
        if (start >= base + 64) break;
        const uint64_t vm = bit_span(start > base ? start - base : 0, ends[k] - base);
        margin[k] += word_margin(w, nplanes, planes, gt, eq, vm);
        if (ends[k] >= base + 64) break;
    }
    while (c->q < nends && ends[c->q] <= base + 64) ++c->q;
    c->hi = c->q < nends ? ends[c->q] : 0;
}

/* The two-rank vote's margins, |2c - 2| summed per range of `ends` into `margin` (nothing
 * without ranges): 2 per element the two votes agree on, 0 for a tie. */
static void vote2_margins(const uint8_t *a, const uint8_t *b, int64_t nbytes, const int64_t *ends,
                          int64_t nends, int64_t *margin) {
    if (!margin || !nends) return;
    nf_cursor c = {0, ends[0]};
    for (int64_t j = 0; 8 * j < nbytes; ++j) { /* a short last word: its bytes, zeros after */
        const int64_t m = nbytes - 8 * j < 8 ? nbytes - 8 * j : 8;
        uint64_t x = 0, y = 0;
        memcpy(&x, a + 8 * j, (size_t)m);
        memcpy(&y, b + 8 * j, (size_t)m);
        add_word_margins(j, 2, 0, NULL, x & y, x ^ y, ends, nends, &c, margin);
    }
}

/* The sign route's majority vote over W shards of packed votes, bit-sliced: 64 elements at a
 * time, each shard's word is added into a vertical counter (bit b of every element's count in
 * planes[b]), then compared with K = W / 2 on the planes. Result codes as `_pack_result`
 * writes them: odd W, 1 bit (c > K); even W, 2 bits (0: c < K, 1: a tie, 2: c > K). `margin`
 * (`nends` entries) gets the sum of |2c - W| per range of `ends` (as add_margins). `nbytes`
 * is a multiple of 8; every shard is read once, 8 bytes at a time. */
void nf_sign_majority(const uint8_t *const *shards, int64_t w, int64_t nbytes,
                      const int64_t *ends, int64_t nends, uint8_t *out, int64_t *margin) {
    uint64_t planes[9];
    int nplanes = 1;
    while ((1LL << nplanes) <= w) ++nplanes;
    const int64_t k = w / 2;
    const int even = (w % 2) == 0;
    nf_cursor c = {0, nends ? ends[0] : 0};
    if (w == 2) { /* the two-rank vote in a few word ops: both +, a tie (one each), both - */
        vote2_margins(shards[0], shards[1], nbytes, ends, nends, margin);
        for (int64_t j = 0; j < nbytes / 8; ++j) {
            uint64_t a, b;
            memcpy(&a, shards[0] + 8 * j, 8);
            memcpy(&b, shards[1] + 8 * j, 8);
            const uint64_t gt = a & b, eq = a ^ b;
            const uint64_t lo = spread32(eq) | spread32(gt) << 1;
            const uint64_t hi = spread32(eq >> 32) | spread32(gt >> 32) << 1;
            memcpy(out + 16 * j, &lo, 8);
            memcpy(out + 16 * j + 8, &hi, 8);
        }
        return;
    }
    for (int64_t j = 0; j < nbytes / 8; ++j) {
        memset(planes, 0, sizeof planes);
        for (int64_t r = 0; r < w; ++r) {
            uint64_t carry;
            memcpy(&carry, shards[r] + 8 * j, 8);
            for (int b = 0; b < nplanes && carry; ++b) {
                const uint64_t t = planes[b] & carry;
                planes[b] ^= carry;
                carry = t;
            }
        }
        uint64_t gt = 0, eq = ~0ULL; /* c > K, c == K: most significant plane first */
        for (int b = nplanes - 1; b >= 0; --b) {
            if ((k >> b) & 1) {
                eq &= planes[b];
            } else {
                gt |= eq & planes[b];
                eq &= ~planes[b];
            }
        }
        if (!even) eq = 0; /* c == K is 2c = W - 1: a lost vote, not a tie */
        if (even) {
            const uint64_t lo = spread32(eq) | spread32(gt) << 1;
            const uint64_t hi = spread32(eq >> 32) | spread32(gt >> 32) << 1;
            memcpy(out + 16 * j, &lo, 8);
            memcpy(out + 16 * j + 8, &hi, 8);
        } else {
            memcpy(out + 8 * j, &gt, 8);
        }
        add_word_margins(j, w, nplanes, planes, gt, eq, ends, nends, &c, margin);
    }
}

/* ---- decode of combined results ---------------------------------------------------------- */

/* A combined value v before its chunk's scale, each step rounded to float32 as torch does:
 * mode 0: v; mode 1: v / d; mode 2: (2 v - d) / d. Callers pass literal modes (inlined). */
static inline float pre_scale(float v, int mode, float d) {
    return mode == 0 ? v : mode == 1 ? v / d : (2.0f * v - d) / d;
}

static inline void scale_int64(const int64_t *v, int64_t a, int64_t stop, int mode, float d,
                               float s, float *out) {
    for (int64_t i = a; i < stop; ++i) out[i] = pre_scale((float)v[i], mode, d) * s;
}

/* Decode combined integers with per-chunk scales s: out = pre_scale(v) * s. */
void nf_decode_values(const int64_t *v, const int64_t *blocks, int64_t nblocks,
                      const float *scales, int mode, float d, float *out) {
    for (int64_t b = 0; b < nblocks; ++b) {
        const int64_t start = blocks[3 * b], nch = blocks[3 * b + 1], len = blocks[3 * b + 2];
        for (int64_t r = 0; r < nch; ++r) {
            const float s = *scales++;
            const int64_t a = start + r * len, stop = a + len;
            if (mode == 0) scale_int64(v, a, stop, 0, d, s, out);
            else if (mode == 1) scale_int64(v, a, stop, 1, d, s, out);
            else scale_int64(v, a, stop, 2, d, s, out);
        }
    }
}

/* The combined value of a packed code: mul * code + lo in int64, wrapping like torch's int64. */
static inline int64_t code_value(uint64_t code, int64_t mul, int64_t lo) {
    return (int64_t)((uint64_t)mul * code + (uint64_t)lo);
}

/* out[i] = pre_scale(v[i], mode, d) * s for i in [0, n), the same float ops element by element
 * in vector lanes (IEEE division and product, no contraction); with `nt`, aligned stores are
 * non-temporal (the caller ends with nf_fence()). */
static void scale_out(const float *v, int64_t n, int mode, float d, float s, float *out, int nt) {
    int64_t i = 0;
#if defined(__SSE2__)
    while (i < n && ((uintptr_t)(out + i) & (sizeof(vf) - 1))) {
        out[i] = pre_scale(v[i], mode, d) * s;
        ++i;
    }
    const vf vd = v_set1(d), vs = v_set1(s), two = v_set1(2.0f);
    for (; i + NF_W <= n; i += NF_W) {
        vf x = v_load(v + i);
        if (mode == 1) x = v_div(x, vd);
        else if (mode == 2) x = v_div(v_sub(v_mul(two, x), vd), vd);
        x = v_mul(x, vs);
        if (nt) v_stream(out + i, x);
        else v_store(out + i, x);
    }
#else
    (void)nt;
#endif
    for (; i < n; ++i) out[i] = pre_scale(v[i], mode, d) * s;
}

/* 8/16-bit codes whose values fit int32 (the caller checks): int32 lanes vectorize, and int32
 * and int64 convert the same integer to the same float; scaled a tile at a time by scale_out. */
#define NF_SCALE_NARROW(name, type)                                                               \
    static void name(const type *c, int32_t mul, int32_t lo, int64_t a, int64_t stop, int mode,   \
                     float d, float s, float *out, int nt) {                                      \
        float v[1024];                                                                            \
        for (int64_t t = a; t < stop; t += 1024) {                                                \
            const int64_t m = stop - t < 1024 ? stop - t : 1024;                                  \
            for (int64_t i = 0; i < m; ++i) v[i] = (float)((int32_t)c[t + i] * mul + lo);         \
            scale_out(v, m, mode, d, s, out + t, nt);                                             \
        }                                                                                         \
    }
NF_SCALE_NARROW(scale_u8, uint8_t)
NF_SCALE_NARROW(scale_u16, uint16_t)

/* Decode the packed combined result straight from its codes: element i's code (little-endian at
 * `bits` in {1, 2, 4, 8, 16, 32}; 16/32-bit codes are native words, `codes` aligned to them)
 * has value v = mul * code + lo, and out = pre_scale(v) * s, the same float ops as unpacking
 * to int64 and calling nf_decode_values. Codes of up to 4 bits select from a per-chunk table of
 * pre_scale(v) * s; wider codes are computed (8 lanes of int32 -> float outrun a table gather). */
void nf_decode_codes(const void *codes, int bits, int64_t mul, int64_t lo, const int64_t *blocks,
                     int64_t nblocks, const float *scales, int mode, float d, float *out) {
    const uint8_t *c8 = (const uint8_t *)codes;
    const uint16_t *c16 = (const uint16_t *)codes;
    const uint32_t *c32 = (const uint32_t *)codes;
    float lut[16], t[16];
    if (bits <= 4)
        for (int k = 0; k < (1 << bits); ++k) lut[k] = pre_scale((float)code_value((uint64_t)k, mul, lo), mode, d);
    /* values as int32 when |mul * code| <= 2^30 and |lo| < 2^30: no overflow */
    const int narrow = (bits == 8 || bits == 16) && mul >= -(1 << 14) && mul <= (1 << 14) &&
                       lo > -(1 << 30) && lo < (1 << 30);
    const int nt = narrow && stream_out(blocks, nblocks);
    for (int64_t b = 0; b < nblocks; ++b) {
        const int64_t start = blocks[3 * b], nch = blocks[3 * b + 1], len = blocks[3 * b + 2];
        for (int64_t r = 0; r < nch; ++r) {
            const float s = *scales++;
            const int64_t a = start + r * len, stop = a + len;
            if (bits <= 4)
                for (int k = 0; k < (1 << bits); ++k) t[k] = lut[k] * s;
            if (bits == 1) {
                select_bits1(c8, a, stop, t, out);
            } else if (bits == 2) {
                select_bits2(c8, a, stop, t, out);
            } else if (bits == 4) {
                select_bits4(c8, a, stop, t, out);
            } else if (narrow && bits == 8) {
                scale_u8(c8, (int32_t)mul, (int32_t)lo, a, stop, mode, d, s, out, nt);
            } else if (narrow) {
                scale_u16(c16, (int32_t)mul, (int32_t)lo, a, stop, mode, d, s, out, nt);
            } else {
                for (int64_t i = a; i < stop; ++i) {
                    const uint64_t code = bits == 8 ? c8[i] : bits == 16 ? c16[i] : c32[i];
                    out[i] = pre_scale((float)code_value(code, mul, lo), mode, d) * s;
                }
            }
        }
    }
    if (nt) nf_fence();
}

/* out[i] = t[c], c = bit i of `a` + bit i of `b` in {0, 1, 2}: two ranks' votes counted and
 * looked up in one step (bits packed little-endian within a byte, as select_bits1 reads them). */
static void select_vote2(const uint8_t *a, const uint8_t *b, int64_t i, int64_t stop,
                         const float *t, float *out) {
#define NF_VOTE2(i) (t[((a[(i) >> 3] >> ((i) & 7)) & 1) + ((b[(i) >> 3] >> ((i) & 7)) & 1)])
    for (; i < stop && (i & 7); ++i) out[i] = NF_VOTE2(i);
#if defined(__AVX2__)
    const __m256 vn = _mm256_set1_ps(t[0]), vz = _mm256_set1_ps(t[1]), vp = _mm256_set1_ps(t[2]);
    const __m256i sel = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    for (; i + 8 <= stop; i += 8) {
        const __m256i va = _mm256_and_si256(_mm256_set1_epi32(a[i >> 3]), sel);
        const __m256i vb = _mm256_and_si256(_mm256_set1_epi32(b[i >> 3]), sel);
        const __m256 ma = _mm256_castsi256_ps(_mm256_cmpeq_epi32(va, sel));
        const __m256 mb = _mm256_castsi256_ps(_mm256_cmpeq_epi32(vb, sel));
        const __m256 one = _mm256_blendv_ps(vn, vz, _mm256_or_ps(ma, mb)); /* c >= 1 */
        _mm256_storeu_ps(out + i, _mm256_blendv_ps(one, vp, _mm256_and_ps(ma, mb)));
    }
#elif defined(__SSE2__)
    const __m128 vn = _mm_set1_ps(t[0]), vz = _mm_set1_ps(t[1]), vp = _mm_set1_ps(t[2]);
    const __m128i lo = _mm_setr_epi32(1, 2, 4, 8), hi = _mm_setr_epi32(16, 32, 64, 128);
    for (; i + 8 <= stop; i += 8) {
        const __m128i va = _mm_set1_epi32(a[i >> 3]), vb = _mm_set1_epi32(b[i >> 3]);
        for (int h = 0; h < 2; ++h) {
            const __m128i m = h ? hi : lo;
            const __m128 ma = _mm_castsi128_ps(_mm_cmpeq_epi32(_mm_and_si128(va, m), m));
            const __m128 mb = _mm_castsi128_ps(_mm_cmpeq_epi32(_mm_and_si128(vb, m), m));
            const __m128 both = _mm_and_ps(ma, mb), either = _mm_or_ps(ma, mb);
            const __m128 one = _mm_or_ps(_mm_and_ps(either, vz), _mm_andnot_ps(either, vn));
            _mm_storeu_ps(out + i + 4 * h, _mm_or_ps(_mm_and_ps(both, vp), _mm_andnot_ps(both, one)));
        }
    }
#endif
    for (; i < stop; ++i) out[i] = NF_VOTE2(i);
#undef NF_VOTE2
}

/* nf_combine_decode of two ranks' bits with a table of values (the sign vote at W = 2): the
 * count c = a + b picks its chunk's pre_scale(values[c]) * s directly, the same float ops as
 * the tiled path, in one pass from the two vote arrays (1.55 against 2.45 ms for 9.4M elements,
 * agreement tallied, one thread, against the packed majority then its table decode). */
static void vote2_decode(const uint8_t *a, const uint8_t *b, int64_t nbytes, const int64_t *values,
                         const int64_t *blocks, int64_t nblocks, const float *scales, int mode,
                         float d, float *out, const int64_t *ends, int64_t nends, int64_t *margin) {
    vote2_margins(a, b, nbytes, ends, nends, margin);
    for (int64_t k = 0; k < nblocks; ++k) {
        const int64_t start = blocks[3 * k], nch = blocks[3 * k + 1], len = blocks[3 * k + 2];
        for (int64_t r = 0; r < nch; ++r) {
            const float s = *scales++;
            const int64_t at = start + r * len;
            float t[3];
            for (int c = 0; c < 3; ++c) t[c] = pre_scale((float)values[c], mode, d) * s;
            select_vote2(a, b, at, at + len, t, out);
        }
    }
}

/* Combine and decode in one pass, for a reduce whose every rank combines every element (the
 * codes were all-gathered): per element, c = the sum over the W shards of its raw `kind` code,
 * its combined value v = values[c] (when `values`, one per possible sum: the sign vote) or
 * c + offset, and out = pre_scale(v) * s with its chunk's scale s: the float ops of
 * nf_combine_pack, then nf_decode_codes of that packed result, without the result. Tile by
 * tile, the chunk cursor moving along; `margin` (may be NULL; `nends` entries) gets the sum
 * of |2c - W| per range of `ends` (add_margins); elements past `numel` (padding) are not
 * written. */
void nf_combine_decode(const uint8_t *const *shards, int64_t w, int64_t nbytes, int kind,
                       int64_t offset, const int64_t *values, const int64_t *blocks,
                       int64_t nblocks, const float *scales, int mode, float d, int64_t numel,
                       float *out, const int64_t *ends, int64_t nends, int64_t *margin) {
    if (kind == NF_SUM_BIT && w == 2 && values) {
        vote2_decode(shards[0], shards[1], nbytes, values, blocks, nblocks, scales, mode, d, out,
                     ends, nends, margin);
        return;
    }
    int32_t acc[NF_SUM_TILE * 8];
    float v[NF_SUM_TILE * 8];
    const int per = elems_per_byte(kind);
    const int nt = numel >= NF_STREAM_MIN;
    int64_t k = 0, b = 0, r = 0; /* the range cursor k; the chunk cursor: block b, its chunk r */
    for (int64_t j0 = 0; j0 < nbytes; j0 += NF_SUM_TILE) {
        const int64_t nb = nbytes - j0 < NF_SUM_TILE ? nbytes - j0 : NF_SUM_TILE;
        const int64_t e0 = j0 * per;
        if (e0 >= numel) break;
        const int64_t ne = numel - e0 < nb * per ? numel - e0 : nb * per;
        sum_tile(shards, w, j0, nb, kind, acc);
        if (values) {
            for (int64_t i = 0; i < ne; ++i) v[i] = (float)values[acc[i]];
        } else {
            const int32_t off = (int32_t)offset; /* |offset| <= 8 W: int32 lanes vectorize */
            for (int64_t i = 0; i < ne; ++i) v[i] = (float)(acc[i] + off);
        }
        if (margin) add_margins(acc, e0, ne, w, ends, nends, &k, margin);
        /* scale the tile's elements [e0, e0 + ne) chunk by chunk */
        for (int64_t e = e0; e < e0 + ne;) {
            while (b < nblocks && e >= blocks[3 * b] + (r + 1) * blocks[3 * b + 2]) {
                ++scales;
                if (++r == blocks[3 * b + 1]) { ++b; r = 0; }
            }
            const int64_t end = blocks[3 * b] + (r + 1) * blocks[3 * b + 2];
            const int64_t stop = end < e0 + ne ? end : e0 + ne;
            scale_out(v + (e - e0), stop - e, mode, d, *scales, out + e, nt);
            e = stop;
        }
    }
    if (nt) nf_fence();
}

/* Combine and decode codes each rank quantised on its own scales (int8 / int4 whose codes every
 * rank gathered): out = (sum over ranks r, in rank order, of ((float)(q_r + offset) * rq) *
 * s_r) / w, q_r rank r's raw `kind` code of the element (int4 nibbles hold code + 8: offset
 * -8), s_r its scale of the element's chunk (`scales`: w rows of `nchunks`), every step
 * rounded to float32 as torch computes it; for a power-of-two w the division is the product
 * with 1 / w (the same bits). Tile by tile; elements past `numel` (padding) are not written. */
void nf_combine_decode_local(const uint8_t *const *shards, int64_t w, int64_t nbytes, int kind,
                             int64_t offset, float rq, const int64_t *blocks, int64_t nblocks,
                             int64_t nchunks, const float *scales, int64_t numel, float *out) {
    int32_t acc[NF_SUM_TILE * 8];
    float v[NF_SUM_TILE * 8];
    const int per = elems_per_byte(kind);
    const int nt = numel >= NF_STREAM_MIN, pow2 = w > 0 && (w & (w - 1)) == 0;
    const int32_t off = (int32_t)offset;
    int64_t b0 = 0, r0 = 0, c0 = 0; /* the chunk cursor at the tile's start: block, its chunk, chunk overall */
    for (int64_t j0 = 0; j0 < nbytes; j0 += NF_SUM_TILE) {
        const int64_t nb = nbytes - j0 < NF_SUM_TILE ? nbytes - j0 : NF_SUM_TILE;
        const int64_t e0 = j0 * per;
        if (e0 >= numel) break;
        const int64_t ne = numel - e0 < nb * per ? numel - e0 : nb * per;
        int64_t b = b0, r = r0, c = c0;
        for (int64_t k = 0; k < w; ++k) {
            /* int8 codes convert to float straight from the shard; others via their raw codes */
            const int8_t *q8 = kind == NF_SUM_INT8 ? (const int8_t *)shards[k] + j0 : NULL;
            if (!q8) sum_tile(shards + k, 1, j0, nb, kind, acc);
            const float *row = scales + k * nchunks;
            b = b0, r = r0, c = c0;
            for (int64_t e = e0; e < e0 + ne;) { /* chunk by chunk */
                while (b < nblocks && e >= blocks[3 * b] + (r + 1) * blocks[3 * b + 2]) {
                    ++c;
                    if (++r == blocks[3 * b + 1]) { ++b; r = 0; }
                }
                const int64_t end = blocks[3 * b] + (r + 1) * blocks[3 * b + 2];
                const int64_t stop = (end < e0 + ne ? end : e0 + ne) - e0;
                const float s = row[c];
                int64_t i = e - e0;
                if (q8 && k == 0)
                    for (; i < stop; ++i) v[i] = ((float)q8[i] * rq) * s;
                else if (q8)
                    for (; i < stop; ++i) v[i] = v[i] + ((float)q8[i] * rq) * s;
                else if (k == 0)
                    for (; i < stop; ++i) v[i] = ((float)(acc[i] + off) * rq) * s;
                else
                    for (; i < stop; ++i) v[i] = v[i] + ((float)(acc[i] + off) * rq) * s;
                e = e0 + stop;
            }
        }
        b0 = b, r0 = r, c0 = c;
        scale_out(v, ne, pow2 ? 0 : 1, (float)w, pow2 ? 1.0f / (float)w : 1.0f, out + e0, nt);
    }
    if (nt) nf_fence();
}
