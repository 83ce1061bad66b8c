/* dd_sglang CPU kernels: the spec_host selector's whole pipeline, one (layer, row) per task
 * (dd_spec_host_select, dd_spec_host_select_par), the sampled hit-rate measurement
 * (dd_measure) and the ring row copies (dd_gather_rows, dd_gather_sets, dd_copy_rows).
 * Compiled at first use by dd_sglang/kernels/native.py (cc -O3 -march=native -fopenmp) and
 * called through ctypes; the parallel entry points run on the OpenMP threads of the libgomp
 * PyTorch loaded.
 *
 * Per task, the same arithmetic as SpecHostSelector.score_layers + Selector.select_layers
 * (dd_sglang/prefetch/selectors.py), in float32:
 *   1. quantise each of the G query vectors to int8 (absmax / 127, round half to even);
 *   2. approximate logit of every candidate c: (q8_j . k8_c) * kscale_c * (qscale_j * scale);
 *   3. per query j the log-sum-exp z_j over the candidates; score_c = max_j (a_jc - z_j);
 *   4. the m best candidates by score (m = ceil(rerank x k));
 *   5. their exact logits scale * (q_j . k_c) from the host tier's keys (bf16 or float32);
 *   6. per query j the normaliser Z_j = logaddexp(lse_i e_ji, z_j + log1p(-taken_j)), taken_j
 *      the approximate softmax mass of the m re-ranked candidates;
 *   7. the k best of the m by max_j (e_ji - Z_j), best first: positions and host slots.
 * Written for this project; no code copied from elsewhere.
 */
#include <math.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAXG 64
#define MAXD 256

/* The calling OpenMP thread's number and its team's size (0 and 1 in a build without OpenMP). */
static inline int thread_id(void) {
#ifdef _OPENMP
    return omp_get_thread_num();
#else
    return 0;
#endif
}

static inline int thread_count(void) {
#ifdef _OPENMP
    return omp_get_num_threads();
#else
    return 1;
#endif
}

static inline float bf16_to_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Dot products of one key with the G query vectors of its KV head. x86 SIMD where the
 * compiler targets it (-march=native: AVX-512BW or AVX2), else plain loops. D is a multiple
 * of 32 on the SIMD paths (checked by the caller; SmolLM2 and Llama use 64 and 128). */
#if defined(__AVX512BW__)
#include <immintrin.h>
static inline void dots_i8(const int8_t *k, const int16_t (*q)[MAXD], int G, int D, int32_t *out) {
    __m512i acc[MAXG];
    for (int j = 0; j < G; j++) acc[j] = _mm512_setzero_si512();
    for (int d = 0; d < D; d += 32) {
        __m512i kv = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(k + d)));
        for (int j = 0; j < G; j++)
            acc[j] = _mm512_add_epi32(acc[j], _mm512_madd_epi16(kv, _mm512_loadu_si512(q[j] + d)));
    }
    for (int j = 0; j < G; j++) out[j] = _mm512_reduce_add_epi32(acc[j]);
}
static inline void dots_bf16(const uint16_t *k, const float (*q)[MAXD], int G, int D, float *out) {
    __m512 acc[MAXG];
    for (int j = 0; j < G; j++) acc[j] = _mm512_setzero_ps();
    for (int d = 0; d < D; d += 16) {
        __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(k + d)));
        __m512 kv = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
        for (int j = 0; j < G; j++) acc[j] = _mm512_fmadd_ps(kv, _mm512_loadu_ps(q[j] + d), acc[j]);
    }
    for (int j = 0; j < G; j++) out[j] = _mm512_reduce_add_ps(acc[j]);
}
static inline void dots_f32(const float *k, const float (*q)[MAXD], int G, int D, float *out) {
    __m512 acc[MAXG];
    for (int j = 0; j < G; j++) acc[j] = _mm512_setzero_ps();
    for (int d = 0; d < D; d += 16) {
        __m512 kv = _mm512_loadu_ps(k + d);
        for (int j = 0; j < G; j++) acc[j] = _mm512_fmadd_ps(kv, _mm512_loadu_ps(q[j] + d), acc[j]);
    }
    for (int j = 0; j < G; j++) out[j] = _mm512_reduce_add_ps(acc[j]);
}
#define SIMD_D 32
/* The approximate logits of 16 candidates at once, for every KV head and query: the key rows'
 * partial sums (one 16-lane vector per candidate and query) are added lane-wise by a transpose
 * tree, so the 16 sums come out as one vector, stored contiguously into a[(h G + j) n + c0..].
 * rows[i]: candidate c0 + i's int8 index row (H x D bytes); ks[h][i]: its scales; cnt <= 16
 * candidates (the rest padded with row 0, not stored). */
static inline __m512i tree16(__m512i *v) {
    __m512i w[8], x[4];
    for (int i = 0; i < 8; i++)
        w[i] = _mm512_add_epi32(_mm512_unpacklo_epi32(v[2 * i], v[2 * i + 1]),
                                _mm512_unpackhi_epi32(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++)
        x[i] = _mm512_add_epi32(_mm512_unpacklo_epi64(w[2 * i], w[2 * i + 1]),
                                _mm512_unpackhi_epi64(w[2 * i], w[2 * i + 1]));
    __m512i z0 = _mm512_add_epi32(_mm512_shuffle_i32x4(x[0], x[1], 0x88), _mm512_shuffle_i32x4(x[0], x[1], 0xdd));
    __m512i z1 = _mm512_add_epi32(_mm512_shuffle_i32x4(x[2], x[3], 0x88), _mm512_shuffle_i32x4(x[2], x[3], 0xdd));
    return _mm512_add_epi32(_mm512_shuffle_i32x4(z0, z1, 0x88), _mm512_shuffle_i32x4(z0, z1, 0xdd));
}

static void logits16(const int8_t *const *rows, const float (*ks)[16], int cnt, int H, int G, int D,
                     const int16_t (*q)[MAXD], const float *qsc, float *a, int64_t n, int c0) {
    __mmask16 keep = (__mmask16)((1u << cnt) - 1u);
    for (int h = 0; h < H; h++) {
        for (int j = 0; j < G; j++) {
            const int16_t *qj = q[h * G + j];
            __m512i acc[16];
            for (int i = 0; i < 16; i++) {
                const int8_t *kr = rows[i] + h * D;
                __m512i sum = _mm512_setzero_si512();
                for (int d = 0; d < D; d += 32)
                    sum = _mm512_add_epi32(sum, _mm512_madd_epi16(_mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(kr + d))),
                                                                  _mm512_loadu_si512(qj + d)));
                acc[i] = sum;
            }
            __m512 f = _mm512_cvtepi32_ps(tree16(acc));
            f = _mm512_mul_ps(_mm512_mul_ps(f, _mm512_loadu_ps(ks[h])), _mm512_set1_ps(qsc[h * G + j]));
            _mm512_mask_storeu_ps(a + (int64_t)(h * G + j) * n + c0, keep, f);
        }
    }
}
#define HAVE_LOGITS16 1

#if defined(__AVX512VNNI__)
/* logits16 with AVX-512 VNNI (vpdpbusd: 64 byte products a instruction, no int8 -> int16
 * widening), for D a multiple of 64. vpdpbusd multiplies unsigned by signed bytes, so the keys
 * are read biased, k ^ 0x80 = k + 128 in [1, 255] as unsigned, against the signed queries:
 * q . k = (k + 128) . q - 128 sum(q), and sum(q) is one integer per query (the query-biased form
 * needed sum(k): one more vpdpbusd and transpose tree per key row). Every product and sum is an
 * exact integer, as in logits16. Inlined where D is a constant (64, 128): the dot loop unrolls and
 * the 16 partial sums stay in registers. */
static inline __attribute__((always_inline)) void
logits16_vnni(const int8_t *const *rows, const float (*ks)[16], int cnt, int H, int G, int D, const int8_t (*qs)[MAXD],
              const int32_t *qsum, const float *qsc, float *a, int64_t n, int c0) {
    __mmask16 keep = (__mmask16)((1u << cnt) - 1u);
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    for (int h = 0; h < H; h++) {
        for (int j = 0; j < G; j++) {
            const int8_t *qj = qs[h * G + j];
            __m512i acc[16];
            for (int i = 0; i < 16; i++) {
                const int8_t *kr = rows[i] + h * D;
                __m512i sum = _mm512_setzero_si512();
                for (int d = 0; d < D; d += 64)
                    sum = _mm512_dpbusd_epi32(sum, _mm512_xor_si512(_mm512_loadu_si512(kr + d), flip),
                                              _mm512_load_si512(qj + d));
                acc[i] = sum;
            }
            __m512i bias = _mm512_set1_epi32(128 * qsum[h * G + j]); /* (k + 128) . q = k . q + 128 sum(q) */
            __m512 f = _mm512_cvtepi32_ps(_mm512_sub_epi32(tree16(acc), bias));
            f = _mm512_mul_ps(_mm512_mul_ps(f, _mm512_loadu_ps(ks[h])), _mm512_set1_ps(qsc[h * G + j]));
            _mm512_mask_storeu_ps(a + (int64_t)(h * G + j) * n + c0, keep, f);
        }
    }
}
#define HAVE_LOGITS16_VNNI 1
#endif
#elif defined(__AVX2__)
#include <immintrin.h>
static inline int32_t hsum_i32(__m256i v) {
    __m128i x = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    x = _mm_add_epi32(x, _mm_shuffle_epi32(x, 0x4e));
    x = _mm_add_epi32(x, _mm_shuffle_epi32(x, 0xb1));
    return _mm_cvtsi128_si32(x);
}
static inline float hsum_ps(__m256 v) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    x = _mm_add_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
}
static inline void dots_i8(const int8_t *k, const int16_t (*q)[MAXD], int G, int D, int32_t *out) {
    __m256i acc[MAXG];
    for (int j = 0; j < G; j++) acc[j] = _mm256_setzero_si256();
    for (int d = 0; d < D; d += 16) {
        __m256i kv = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(k + d)));
        for (int j = 0; j < G; j++)
            acc[j] = _mm256_add_epi32(acc[j], _mm256_madd_epi16(kv, _mm256_loadu_si256((const __m256i *)(q[j] + d))));
    }
    for (int j = 0; j < G; j++) out[j] = hsum_i32(acc[j]);
}
static inline void dots_bf16(const uint16_t *k, const float (*q)[MAXD], int G, int D, float *out) {
    __m256 acc[MAXG];
    for (int j = 0; j < G; j++) acc[j] = _mm256_setzero_ps();
    for (int d = 0; d < D; d += 8) {
        __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(k + d)));
        __m256 kv = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
        for (int j = 0; j < G; j++) acc[j] = _mm256_fmadd_ps(kv, _mm256_loadu_ps(q[j] + d), acc[j]);
    }
    for (int j = 0; j < G; j++) out[j] = hsum_ps(acc[j]);
}
static inline void dots_f32(const float *k, const float (*q)[MAXD], int G, int D, float *out) {
    __m256 acc[MAXG];
    for (int j = 0; j < G; j++) acc[j] = _mm256_setzero_ps();
    for (int d = 0; d < D; d += 8) {
        __m256 kv = _mm256_loadu_ps(k + d);
        for (int j = 0; j < G; j++) acc[j] = _mm256_fmadd_ps(kv, _mm256_loadu_ps(q[j] + d), acc[j]);
    }
    for (int j = 0; j < G; j++) out[j] = hsum_ps(acc[j]);
}
#define SIMD_D 16
#else
#define SIMD_D 1
#endif

static inline void dots_i8_ref(const int8_t *k, const int16_t (*q)[MAXD], int G, int D, int32_t *out) {
    for (int j = 0; j < G; j++) {
        int32_t acc = 0;
        for (int d = 0; d < D; d++) acc += (int32_t)k[d] * (int32_t)q[j][d];
        out[j] = acc;
    }
}
static inline void dots_float_ref(const void *k, int bf16, const float (*q)[MAXD], int G, int D, float *out) {
    for (int j = 0; j < G; j++) {
        float acc = 0.0f;
        for (int d = 0; d < D; d++)
            acc += q[j][d] * (bf16 ? bf16_to_f32(((const uint16_t *)k)[d]) : ((const float *)k)[d]);
        out[j] = acc;
    }
}

/* exp(x) for x <= 0 (arguments here are logits less their max): Cody-Waite range
 * reduction (ln 2 split as 0.693359375 - 2.12194440e-4) and the degree-6 minimax polynomial
 * of Cephes' expf (S. L. Moshier, Cephes Math Library), ~2 ulp, branch-free so loops over it
 * vectorise.
 * Below -87 it returns 0. */
static inline float exp_neg(float x) {
    x = x < -87.0f ? -87.0f : x;
    float n = nearbyintf(x * 1.44269504088896341f);
    float r = x - n * 0.693359375f;
    r = r + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t e = ((int32_t)n + 127) << 23;
    float s;
    memcpy(&s, &e, 4);
    return p * s;
}

typedef struct {
    float v;
    int32_t i;
} scored;

/* Reorder a[0..n) so that a[0..m) hold the m largest values (any order); 0 < m < n. */
static void select_top(scored *a, int n, int m) {
    int lo = 0, hi = n - 1;
    while (lo < hi) {
        float pivot = a[lo + (hi - lo) / 2].v;
        int i = lo, j = hi;
        while (i <= j) {
            while (a[i].v > pivot) i++;
            while (a[j].v < pivot) j--;
            if (i <= j) {
                scored t = a[i];
                a[i] = a[j];
                a[j] = t;
                i++;
                j--;
            }
        }
        if (m - 1 <= j)
            hi = j;
        else if (m - 1 >= i)
            lo = i;
        else
            return;
    }
}

/* Order-preserving map of a float to an unsigned key (larger float, larger key; -0 < +0). */
static inline uint32_t float_key(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

/* The bin of the want-th largest in count[0..bins) (counting from the top); want becomes its
 * rank within that bin. */
static int top_bin(const int32_t *count, int bins, int *want) {
    int b = bins - 1;
    for (; b > 0 && count[b] < *want; b--) *want -= count[b];
    return b;
}

/* dst[0..w) = the keys of src[0..n) whose bits (key >> shift) & mask equal want, in order; returns
 * w. Branch-free: with AVX-512, 16 keys a compare and a compress into a register, then a masked
 * store of the kept lanes (the scalar loop's store address waited on the previous key's compare:
 * a quarter of kth_largest in `perf annotate`). Writes only within dst[0..n). */
static int compact_bits(const uint32_t *src, int n, uint32_t *dst, int shift, uint32_t mask, uint32_t want) {
    int w = 0, i = 0;
#if defined(__AVX512F__)
    const __m512i vm = _mm512_set1_epi32((int)mask), vw = _mm512_set1_epi32((int)want);
    for (; i + 16 <= n; i += 16) {
        __m512i x = _mm512_loadu_si512(src + i);
        __mmask16 k = _mm512_cmpeq_epi32_mask(_mm512_and_si512(_mm512_srli_epi32(x, (unsigned)shift), vm), vw);
        int t = __builtin_popcount(k);
        _mm512_mask_storeu_epi32(dst + w, (__mmask16)((1u << t) - 1u), _mm512_maskz_compress_epi32(k, x));
        w += t;
    }
#endif
    for (; i < n; i++) {
        dst[w] = src[i];
        w += ((src[i] >> shift) & mask) == want;
    }
    return w;
}

/* The m-th largest of v[0..n) (1 <= m <= n), by a radix select on order-preserving keys, 11 +
 * 11 + 10 bits a pass. Pass 1 counts every key's top bits; passes 2 and 3 first copy out the keys
 * that share the bits found so far (a branch-free compaction), then count those. Nothing
 * data-dependent branches (a quickselect's partitions mispredict about half their compares on
 * scores). scratch: 2 n words. Leaves v unchanged. */
static float kth_largest(const float *v, int n, int m, uint32_t *scratch) {
    uint32_t *ka = scratch, *kb = scratch + n;
    int32_t count[2048], c4[4][2048];
    int want = m;
    /* Most keys of one row share a few top-bit bins (its scores are close): four histograms, so
     * consecutive increments of one bin do not wait on each other. */
    memset(c4, 0, sizeof(c4));
    for (int i = 0; i < n; i++) {
        uint32_t key = float_key(v[i]);
        ka[i] = key;
        c4[i & 3][key >> 21]++;
    }
    for (int b = 0; b < 2048; b++) count[b] = c4[0][b] + c4[1][b] + c4[2][b] + c4[3][b];
    uint32_t b1 = (uint32_t)top_bin(count, 2048, &want);
    int n2 = compact_bits(ka, n, kb, 21, 2047u, b1);
    memset(count, 0, sizeof(int32_t) * 2048);
    for (int i = 0; i < n2; i++) count[(kb[i] >> 10) & 2047u]++;
    uint32_t b2 = (uint32_t)top_bin(count, 2048, &want);
    int n3 = compact_bits(kb, n2, ka, 10, 2047u, b2);
    memset(count, 0, sizeof(int32_t) * 1024);
    for (int i = 0; i < n3; i++) count[ka[i] & 1023u]++;
    uint32_t b3 = (uint32_t)top_bin(count, 1024, &want);
    uint32_t key = (b1 << 21) | (b2 << 10) | b3;
    uint32_t u = (key & 0x80000000u) ? (key & 0x7fffffffu) : ~key;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* take_top's scalar pass over candidates [c, n): as its contract below, with `*ties` equal-to-thr
 * candidates still to take and w entries written so far; returns the new count. Branch-free: which
 * candidates pass is unpredictable. */
static inline int take_scalar(const float *sv, int c, int n, float thr, int *ties, scored *sc, int w) {
    int t = *ties;
    for (; c < n; c++) {
        float x = sv[c];
        int eq = x == thr, take = (x > thr) | (eq & (t > 0));
        t -= eq & take;
        sc[w].i = c;
        w += take;
    }
    *ties = t;
    return w;
}
/* The largest of x[c..n) and mx. */
static inline float max_scalar(const float *x, int c, int n, float mx) {
    for (; c < n; c++) mx = x[c] > mx ? x[c] : mx;
    return mx;
}

/* Log-sum-exp of a[0..n) (n >= 1), and out[c] = max_j (a[j n + c] - z[j]) over G rows. */
#if defined(__AVX512F__)
static inline __m512 exp_neg16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
    __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}
/* The largest of x[0..n) (n >= 1; -inf for none larger); the same value as a scalar loop for any
 * order of the compares (a max of numbers; a NaN, which no logit is, could differ). */
static float max_of(const float *x, int n) {
    __m512 vm = _mm512_set1_ps(-INFINITY);
    int i = 0;
    for (; i + 16 <= n; i += 16) vm = _mm512_max_ps(vm, _mm512_loadu_ps(x + i));
    return max_scalar(x, i, n, _mm512_reduce_max_ps(vm));
}
static float lse(const float *a, int n) {
    float mx = max_of(a, n);
    int c;
    __m512 vs = _mm512_setzero_ps(), vmx = _mm512_set1_ps(mx);
    for (c = 0; c + 16 <= n; c += 16) vs = _mm512_add_ps(vs, exp_neg16(_mm512_sub_ps(_mm512_loadu_ps(a + c), vmx)));
    float sum = _mm512_reduce_add_ps(vs);
    for (; c < n; c++) sum += exp_neg(a[c] - mx);
    return mx + logf(sum);
}
/* Step 4's pass: sc[0..mm).i = the candidates whose score sv[c] is above thr, and the first
 * (in candidate order) mm - #above of those equal to it, in ascending c; returns how many were
 * written (mm when thr is sv's mm-th largest). Per 16 candidates: two compares and one compress
 * store, where the scalar loop below carried the tie count from one candidate to the next. */
static int take_top(const float *sv, int n, float thr, int mm, scored *sc) {
    const __m512 vt = _mm512_set1_ps(thr);
    int above = 0, c = 0;
    for (; c + 16 <= n; c += 16) above += __builtin_popcount(_mm512_cmp_ps_mask(_mm512_loadu_ps(sv + c), vt, _CMP_GT_OQ));
    for (; c < n; c++) above += sv[c] > thr;
    int ties = mm - above, w = 0;
    int32_t idx[16];
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (c = 0; c + 16 <= n; c += 16) {
        __m512 x = _mm512_loadu_ps(sv + c);
        __mmask16 take = _mm512_cmp_ps_mask(x, vt, _CMP_GT_OQ);
        unsigned eq = ties > 0 ? (unsigned)_mm512_cmp_ps_mask(x, vt, _CMP_EQ_OQ) : 0u;
        while (__builtin_popcount(eq) > ties) eq &= ~(1u << (31 - __builtin_clz(eq))); /* keep the first `ties` */
        ties -= __builtin_popcount(eq);
        take |= (__mmask16)eq;
        if (!take) continue;
        /* compress into a register, then a plain store: the memory form of vpcompressd is
         * microcoded on AMD Zen 4 (13% of the selection's time in `perf annotate` there) */
        _mm512_storeu_si512(idx, _mm512_maskz_compress_epi32(take, _mm512_add_epi32(lane, _mm512_set1_epi32(c))));
        int t = __builtin_popcount(take);
        for (int i = 0; i < t; i++) sc[w + i].i = idx[i];
        w += t;
    }
    return take_scalar(sv, c, n, thr, &ties, sc, w);
}
static void group_scores(const float *a, int64_t n, int G, const float *z, float *out) {
    int64_t c = 0;
    for (; c + 16 <= n; c += 16) {
        __m512 best = _mm512_sub_ps(_mm512_loadu_ps(a + c), _mm512_set1_ps(z[0]));
        for (int j = 1; j < G; j++)
            best = _mm512_max_ps(best, _mm512_sub_ps(_mm512_loadu_ps(a + j * n + c), _mm512_set1_ps(z[j])));
        _mm512_storeu_ps(out + c, best);
    }
    for (; c < n; c++) {
        float best = a[c] - z[0];
        for (int j = 1; j < G; j++) best = a[j * n + c] - z[j] > best ? a[j * n + c] - z[j] : best;
        out[c] = best;
    }
}
#else
static int take_top(const float *sv, int n, float thr, int mm, scored *sc) {
    int above = 0;
    for (int c = 0; c < n; c++) above += sv[c] > thr;
    int ties = mm - above;
    return take_scalar(sv, 0, n, thr, &ties, sc, 0);
}
static float max_of(const float *x, int n) { return max_scalar(x, 0, n, -INFINITY); }
static float lse(const float *a, int n) {
    float mx = max_of(a, n);
    float sum = 0.0f;
    for (int c = 0; c < n; c++) sum += exp_neg(a[c] - mx);
    return mx + logf(sum);
}
static void group_scores(const float *a, int64_t n, int G, const float *z, float *out) {
    for (int64_t c = 0; c < n; c++) {
        float best = a[c] - z[0];
        for (int j = 1; j < G; j++) best = a[j * n + c] - z[j] > best ? a[j * n + c] - z[j] : best;
        out[c] = best;
    }
}
#endif

#if defined(__AVX512F__)
/* tree16 on float lanes: lane i of the result is the sum of v[i]'s 16 lanes. */
static inline __m512 tree16_ps(const __m512 *v) {
    __m512 t[8], x[4];
    for (int u = 0; u < 8; u++)
        t[u] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * u], v[2 * u + 1]), _mm512_unpackhi_ps(v[2 * u], v[2 * u + 1]));
    for (int u = 0; u < 4; u++)
        x[u] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[2 * u]), _mm512_castps_pd(t[2 * u + 1]))),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[2 * u]), _mm512_castps_pd(t[2 * u + 1]))));
    __m512 z0 = _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], 0x88), _mm512_shuffle_f32x4(x[0], x[1], 0xdd));
    __m512 z1 = _mm512_add_ps(_mm512_shuffle_f32x4(x[2], x[3], 0x88), _mm512_shuffle_f32x4(x[2], x[3], 0xdd));
    return _mm512_add_ps(_mm512_shuffle_f32x4(z0, z1, 0x88), _mm512_shuffle_f32x4(z0, z1, 0xdd));
}

/* Step 5 for candidates [i0, i0 + cnt) of sc (cnt <= 16): their exact logits against the G
 * queries, e[j mm + i] = scale (q_j . k_i). The 16 keys are widened to float32 once (kf), each
 * query's 16 dot products are accumulated in 16 lanes apiece and summed by tree16_ps into one
 * vector (the one-key-at-a-time loop kept G accumulators in memory and reduced each alone: its
 * stores and reductions were most of select_head in `perf annotate`). */
static void exact16(const char *keys_l, int64_t key_row, int64_t head_off, int key_bf16, const int64_t *srow,
                    const scored *sc, int i0, int cnt, const float (*qf)[MAXD], int G, int D, float scale, float *e,
                    int mm) {
    float kf[16][MAXD] __attribute__((aligned(64)));
    const int esz = key_bf16 ? 2 : 4;
    for (int i = 0; i < 16; i++) {
        const char *kr = keys_l + (srow[sc[i0 + (i < cnt ? i : 0)].i] * key_row + head_off) * esz;
        for (int d = 0; d < D; d += 16) {
            __m512 x = key_bf16 ? _mm512_castsi512_ps(_mm512_slli_epi32(
                                      _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(kr + 2 * d))), 16))
                                : _mm512_loadu_ps((const float *)kr + d);
            _mm512_store_ps(kf[i] + d, x);
        }
    }
    const __mmask16 keep = (__mmask16)((1u << cnt) - 1u);
    for (int j = 0; j < G; j++) {
        __m512 acc[16];
        for (int i = 0; i < 16; i++) {
            __m512 sum = _mm512_mul_ps(_mm512_load_ps(kf[i]), _mm512_loadu_ps(qf[j]));
            for (int d = 16; d < D; d += 16)
                sum = _mm512_fmadd_ps(_mm512_load_ps(kf[i] + d), _mm512_loadu_ps(qf[j] + d), sum);
            acc[i] = sum;
        }
        _mm512_mask_storeu_ps(e + (int64_t)j * mm + i0, keep, _mm512_mul_ps(tree16_ps(acc), _mm512_set1_ps(scale)));
    }
}
#endif

/* Sort u[0..n) ascending: a quicksort (median of three, smaller side first) down to runs of 16,
 * then one insertion sort. Inline compares of plain integers, where qsort calls a comparator
 * per compare (by perf, ~10% of the selection at 8 rows x 4k tokens). */
static void sort_u64(uint64_t *u, int n) {
    int lo_st[64], hi_st[64], sp = 0, lo = 0, hi = n - 1;
    for (;;) {
        while (hi - lo > 16) {
            int mid = lo + (hi - lo) / 2;
            uint64_t t;
            if (u[mid] < u[lo]) { t = u[mid]; u[mid] = u[lo]; u[lo] = t; }
            if (u[hi] < u[lo]) { t = u[hi]; u[hi] = u[lo]; u[lo] = t; }
            if (u[hi] < u[mid]) { t = u[hi]; u[hi] = u[mid]; u[mid] = t; }
            uint64_t pivot = u[mid];
            int i = lo, j = hi;
            while (i <= j) {
                while (u[i] < pivot) i++;
                while (u[j] > pivot) j--;
                if (i <= j) { t = u[i]; u[i] = u[j]; u[j] = t; i++; j--; }
            }
            if (j - lo < hi - i) { lo_st[sp] = i; hi_st[sp++] = hi; hi = j; }
            else { lo_st[sp] = lo; hi_st[sp++] = j; lo = i; }
        }
        if (!sp) break;
        sp--;
        lo = lo_st[sp];
        hi = hi_st[sp];
    }
    for (int i = 1; i < n; i++) {
        uint64_t x = u[i];
        int j = i - 1;
        for (; j >= 0 && u[j] > x; j--) u[j + 1] = u[j];
        u[j + 1] = x;
    }
}

/* a[0..n) best first: score descending, ties by ascending index (the order of PyTorch's sorted
 * topk over positions, which the tests compare with). Each entry becomes one 64-bit key, the
 * score's order-reversed bits over the index; scratch: n words. */
static void sort_best_first(scored *a, int n, uint64_t *scratch) {
    for (int c = 0; c < n; c++) scratch[c] = ((uint64_t)~float_key(a[c].v) << 32) | (uint32_t)a[c].i;
    sort_u64(scratch, n);
    for (int c = 0; c < n; c++) {
        uint32_t key = ~(uint32_t)(scratch[c] >> 32);
        uint32_t u = (key & 0x80000000u) ? (key & 0x7fffffffu) : ~key;
        memcpy(&a[c].v, &u, 4);
        a[c].i = (int32_t)(uint32_t)scratch[c];
    }
}

static float logaddexp(float a, float b) {
    if (a == -INFINITY) return b;
    if (b == -INFINITY) return a;
    float mx = a > b ? a : b;
    return mx + log1pf(expf(-fabsf(a - b)));
}

/* One KV head's selection from its approximate logits a[G][n] (compact candidates, cpos[c] the
 * position of candidate c): steps 3-7 of the header. Writes k positions and slots, best first. */
static void select_head(const float *a, int n, const int32_t *cpos, int G, int D, int k, int m,
                        float scale, const float (*qf)[MAXD], const char *keys_l, int64_t key_row,
                        int64_t head_off, int key_bf16, int simd, const int64_t *srow, scored *sc, float *e,
                        float *sv, int64_t *op, int64_t *os) {
    float z[MAXG], taken[MAXG];
    if (n <= k) { /* not expected (rows have more than k candidates); keep what there is */
        for (int c = 0; c < k; c++) {
            op[c] = c < n ? cpos[c] : (n ? cpos[0] : 0);
            os[c] = srow[op[c]];
        }
        return;
    }
    /* 3. log-sum-exp per query; score = max over the group of the log-probability */
    for (int j = 0; j < G; j++) z[j] = lse(a + (int64_t)j * n, n);
    group_scores(a, n, G, z, sv);
    /* 4. the mm best candidates, in candidate order (ascending host slots within a run, which
     * the exact re-ranking then reads in address order), their approximate mass, positions */
    int mm = m < n ? m : n;
    if (mm < n) {
        take_top(sv, n, kth_largest(sv, n, mm, (uint32_t *)(sv + n)), mm, sc);
    } else {
        for (int c = 0; c < n; c++) sc[c].i = c;
    }
    for (int j = 0; j < G; j++) {
        const float *aj = a + (int64_t)j * n;
        float sum = 0.0f;
        for (int i = 0; i < mm; i++) sum += exp_neg(aj[sc[i].i] - z[j]);
        taken[j] = sum;
    }
    for (int i = 0; i < mm; i++) sc[i].i = cpos[sc[i].i];
    /* 5. exact logits of the mm from the host tier's keys */
    const int esz = key_bf16 ? 2 : 4;
    int i0 = 0;
#if defined(__AVX512F__)
    if (simd && D % 16 == 0)
        for (; i0 < mm; i0 += 16) {
            for (int i = i0 + 16; i < i0 + 32 && i < mm; i++) { /* the next 16 keys, every line */
                const char *nx = keys_l + (srow[sc[i].i] * key_row + head_off) * esz;
                for (int b = 0; b < D * esz; b += 64) __builtin_prefetch(nx + b);
            }
            exact16(keys_l, key_row, head_off, key_bf16, srow, sc, i0, mm - i0 < 16 ? mm - i0 : 16, qf, G, D, scale, e,
                    mm);
        }
#endif
    for (int i = i0; i < mm; i++) {
        if (i + 16 < mm) { /* both 64-byte lines of a 64 x bf16 key (more for wider keys) */
            const char *nx = keys_l + (srow[sc[i + 16].i] * key_row + head_off) * esz;
            for (int b = 0; b < D * esz; b += 64) __builtin_prefetch(nx + b);
        }
        const char *kr = keys_l + (srow[sc[i].i] * key_row + head_off) * esz;
        float dot[MAXG];
#if SIMD_D > 1
        if (simd && key_bf16)
            dots_bf16((const uint16_t *)kr, qf, G, D, dot);
        else if (simd)
            dots_f32((const float *)kr, qf, G, D, dot);
        else
#endif
            dots_float_ref(kr, key_bf16, qf, G, D, dot);
        for (int j = 0; j < G; j++) e[(int64_t)j * mm + i] = dot[j] * scale;
    }
    /* 6. normalisers: exact over the mm, approximate over the rest */
    for (int j = 0; j < G; j++) {
        const float *ej = e + (int64_t)j * mm;
        float mx = max_of(ej, mm);
        float sum = 0.0f;
        for (int i = 0; i < mm; i++) sum += exp_neg(ej[i] - mx);
        float tk = taken[j] > 1.0f ? 1.0f : taken[j];
        float rest = tk >= 1.0f ? -INFINITY : z[j] + log1pf(-tk);
        z[j] = logaddexp(mx + logf(sum), rest);
    }
    /* 7. the k best of the mm, best first */
    for (int i = 0; i < mm; i++) {
        float best = e[i] - z[0];
        for (int j = 1; j < G; j++) {
            float v = e[(int64_t)j * mm + i] - z[j];
            best = v > best ? v : best;
        }
        sc[i].v = best;
    }
    if (k < mm) select_top(sc, mm, k);
    sort_best_first(sc, k, (uint64_t *)sv); /* sv (3 P floats) is free after step 4 */
    for (int i = 0; i < k; i++) {
        op[i] = sc[i].i;
        os[i] = srow[sc[i].i];
    }
}

/* A row's H x G selection queries: float32 copies, their int8 versions (absmax / 127, round half
 * to even; as int16 for logits16, as int8 with each query's sum for logits16_vnni), and each
 * query's combined scale. */
typedef struct {
    int16_t qi[MAXG][MAXD] __attribute__((aligned(64)));
#ifdef HAVE_LOGITS16_VNNI
    int8_t qs[MAXG][MAXD] __attribute__((aligned(64)));
    int32_t qsum[MAXG];
#endif
    float qf[MAXG][MAXD] __attribute__((aligned(64)));
    float qsc[MAXG];
} row_queries;

/* step 1 of the header for one row: qrow [HG, D] float32 */
static void quantize_queries(const float *qrow, int HG, int D, float scale, row_queries *Q) {
    for (int j = 0; j < HG; j++) {
        float mx = 0.0f;
        for (int d = 0; d < D; d++) {
            float v = qrow[j * D + d];
            Q->qf[j][d] = v;
            mx = fabsf(v) > mx ? fabsf(v) : mx;
        }
        float qs = (mx < 1e-12f ? 1e-12f : mx) / 127.0f;
#ifdef HAVE_LOGITS16_VNNI
        Q->qsum[j] = 0;
#endif
        for (int d = 0; d < D; d++) {
            Q->qi[j][d] = (int16_t)nearbyintf(Q->qf[j][d] / qs);
#ifdef HAVE_LOGITS16_VNNI
            Q->qs[j][d] = (int8_t)Q->qi[j][d];
            Q->qsum[j] += Q->qi[j][d];
#endif
        }
        Q->qsc[j] = qs * scale;
    }
}

/* step 2 for the compact candidates [c0, c1) of n (c0 a multiple of 16; c1 one too, or n):
 * a[(h G + j) n + c]. Each candidate's logit is computed alone, so any split into such ranges
 * gives the same values as one pass over [0, n). */
static void approx_logits(const row_queries *Q, const int64_t *srow, const int32_t *cpos, int n, int c0, int c1,
                          const int8_t *q8l, const float *ksl, int H, int G, int D, int simd, float *a) {
    int c = c0;
#ifdef HAVE_LOGITS16
    if (simd && H <= 16) {
        const int8_t *rws[16];
        float ksb[16][16];
        for (; c < c1; c += 16) {
            int cnt = n - c < 16 ? n - c : 16;
            for (int i = 0; i < 16; i++) {
                int64_t s = srow[cpos[i < cnt ? c + i : c]];
                rws[i] = q8l + s * H * D;
                for (int h = 0; h < H; h++) ksb[h][i] = ksl[s * H + h];
            }
            /* every line (H D bytes a key: 3 lines for SmolLM2) of the keys two blocks ahead, so
             * the loads above do not wait on memory: with every other key's first line alone,
             * they were the kernel's main stall (perf annotate) */
            if (c + 48 <= n)
                for (int i = 32; i < 48; i++) {
                    const int8_t *nx = q8l + srow[cpos[c + i]] * H * D;
                    for (int b = 0; b < H * D; b += 64) __builtin_prefetch(nx + b);
                }
#ifdef HAVE_LOGITS16_VNNI
            if (D == 64) /* a constant head_dim: the dot loop unrolled, the 16 sums kept in registers */
                logits16_vnni(rws, (const float(*)[16])ksb, cnt, H, G, 64, (const int8_t(*)[MAXD])Q->qs, Q->qsum,
                              Q->qsc, a, n, c);
            else if (D == 128)
                logits16_vnni(rws, (const float(*)[16])ksb, cnt, H, G, 128, (const int8_t(*)[MAXD])Q->qs, Q->qsum,
                              Q->qsc, a, n, c);
            else if (D % 64 == 0)
                logits16_vnni(rws, (const float(*)[16])ksb, cnt, H, G, D, (const int8_t(*)[MAXD])Q->qs, Q->qsum,
                              Q->qsc, a, n, c);
            else
#endif
                logits16(rws, (const float(*)[16])ksb, cnt, H, G, D, (const int16_t(*)[MAXD])Q->qi, Q->qsc, a, n,
                         c);
        }
    }
#endif
    for (; c < c1; c++) {
        int64_t s = srow[cpos[c]];
        if (c + 8 < n) __builtin_prefetch(q8l + srow[cpos[c + 8]] * H * D);
        for (int h = 0; h < H; h++) {
            const int8_t *kr = q8l + (s * H + h) * D;
            float ks = ksl[s * H + h];
            int32_t dot[MAXG];
#if SIMD_D > 1
            if (simd)
                dots_i8(kr, (const int16_t(*)[MAXD])Q->qi[h * G], G, D, dot);
            else
#endif
                dots_i8_ref(kr, (const int16_t(*)[MAXD])Q->qi[h * G], G, D, dot);
            for (int j = 0; j < G; j++) a[(int64_t)(h * G + j) * n + c] = (float)dot[j] * ks * Q->qsc[h * G + j];
        }
    }
}

/* The first level of the two-level selection (pages > 0): keep only the candidates of the best
 * `pages` 16-slot blocks of each KV head, the union over the row's KV heads.
 *
 * A block is 16 consecutive positions in 16 aligned host slots (the host tier allocates whole
 * pages of a multiple of 16 slots), so block b of the tier is slots [16 b, 16 b + 16) and its
 * summary is one row of c8 / csl: the int8 mean of its keys with its own absmax scale
 * (QuantKeyIndex.update). Each block is scored like a candidate token (steps 1-3 of the header,
 * on the block means: approximate logit, per query the log-sum-exp over the row's blocks, the
 * max over the GQA group), and per KV head the `pages` best blocks are kept (ties: the first in
 * position order). cpos[0..n) is compacted in place to the kept candidates, in the same order;
 * returns their count, or n itself (nothing cut) when the row has at most `pages` blocks or the
 * kept blocks hold fewer than `need` candidates (the m the exact re-rank takes). Bytes read: the
 * blocks' summaries (1/16 of the index's) and then the kept candidates' index rows.
 * Returns -1 when out of memory. */
static int first_level(const row_queries *Q, const int64_t *srow, int32_t *cpos, int n, const int8_t *c8l,
                       const float *csl, int H, int G, int D, int simd, int pages, int need) {
    if (n == 0) return 0;
    /* blocks the candidates can lie in (cpos ascends): an upper bound on the row's block count */
    const int span = (cpos[n - 1] >> 4) - (cpos[0] >> 4) + 1;
    int64_t *bslot = malloc(sizeof(int64_t) * (size_t)span);
    int32_t *iota = malloc(sizeof(int32_t) * (size_t)span), *count = malloc(sizeof(int32_t) * (size_t)span);
    float *ab = malloc(sizeof(float) * (size_t)H * G * span);
    float *ps = malloc(sizeof(float) * 3 * (size_t)span); /* scores, then kth_largest's scratch */
    scored *top = malloc(sizeof(scored) * (size_t)span);
    uint8_t *keep = calloc((size_t)span, 1);
    int rc = bslot && iota && count && ab && ps && top && keep ? n : -1;
    int nb = 0;
    for (int c = 0, last = -1; rc >= 0 && c < n; c++) { /* the row's blocks and their candidates */
        if ((cpos[c] >> 4) != last) {
            last = cpos[c] >> 4;
            bslot[nb] = srow[cpos[c]] >> 4;
            iota[nb] = nb;
            count[nb++] = 0;
        }
        count[nb - 1]++;
    }
    if (rc >= 0 && nb > pages) {
        approx_logits(Q, bslot, iota, nb, 0, nb, c8l, csl, H, G, D, simd, ab);
        int kept = 0;
        for (int h = 0; h < H; h++) {
            const float *ah = ab + (int64_t)h * G * nb;
            float z[MAXG];
            for (int j = 0; j < G; j++) z[j] = lse(ah + (int64_t)j * nb, nb);
            group_scores(ah, nb, G, z, ps);
            int got = take_top(ps, nb, kth_largest(ps, nb, pages, (uint32_t *)(ps + nb)), pages, top);
            for (int i = 0; i < got; i++) {
                kept += keep[top[i].i] ? 0 : count[top[i].i];
                keep[top[i].i] = 1;
            }
        }
        if (kept >= need) { /* else too few to re-rank m: keep every candidate (the full scan) */
            int w = 0;
            for (int c = 0, b = -1, last = -1; c < n; c++) {
                if ((cpos[c] >> 4) != last) last = cpos[c] >> 4, b++;
                if (keep[b]) cpos[w++] = cpos[c];
            }
            rc = w;
        }
    }
    free(bslot);
    free(iota);
    free(count);
    free(ab);
    free(ps);
    free(top);
    free(keep);
    return rc;
}

/* Per-thread scratch of select_head for rows of P positions. */
typedef struct {
    scored *sc;
    float *e, *sv;
} head_scratch;

static int scratch_alloc(head_scratch *w, int P, int G, int m) {
    w->sc = malloc(sizeof(scored) * (size_t)P);
    w->e = malloc(sizeof(float) * (size_t)G * m);
    w->sv = malloc(sizeof(float) * 3 * (size_t)P); /* scores, then kth_largest's scratch */
    return w->sc && w->e && w->sv ? 0 : -1;
}

static void scratch_free(head_scratch *w) {
    free(w->sc);
    free(w->e);
    free(w->sv);
}

/* steps 3-7 for KV head h of task (l, r), from its approximate logits a (the task's [H G, n]). */
static void select_task_head(int l, int r, int h, int R, int H, int G, int D, int64_t S, int n,
                             const int32_t *cpos, const float *a, const row_queries *Q, const int64_t *srow,
                             const void *keys, int key_bf16, int k, int m, float scale, int simd,
                             int64_t *out_pos, int64_t *out_slots, head_scratch *w) {
    const char *keys_l = (const char *)keys + (int64_t)l * S * H * D * (key_bf16 ? 2 : 4);
    int64_t o = (((int64_t)l * R + r) * H + h) * k;
    select_head(a + (int64_t)h * G * n, n, cpos, G, D, k, m, scale, (const float(*)[MAXD])Q->qf[h * G], keys_l,
                (int64_t)H * D, (int64_t)h * D, key_bf16, simd, srow, w->sc, w->e, w->sv, out_pos + o,
                out_slots + o);
}

/* Tasks [t0, t1) of the L x R grid (task = l * R + r; every KV head of the row: a host slot's
 * KV heads are one contiguous row of the index, read once for all of them).
 *
 * q        [L, R, H * G, D] float32      the selection queries (KV head h owns columns [h G, h G + G))
 * slots    [R, P] int64, ok [R, P] uint8 each position's host slot, and whether it is a candidate
 * q8       [L, S, H, D] int8, kscale [L, S, H] float32   the int8 key index of the chunk's layers
 * keys     [L, S, H, D] bfloat16 (key_bf16 = 1) or float32   the host tier's keys
 * out_pos, out_slots [L, R, H, k] int64
 * c8       [L, S / 16, H, D] int8, cscale [L, S / 16, H] float32, or NULL: the 16-slot blocks' mean keys
 *          (first_level); with pages > 0 each row's candidates are first cut to its KV heads' best
 *          `pages` blocks (pages 0: every candidate, the full scan)
 * Returns 0, or -1 for a shape this kernel does not take (H * G > MAXG, D > MAXD, k > m, no memory). */
int dd_spec_host_select(int L, int R, int H, int G, int D, int P, int64_t S, const float *q,
                        const int64_t *slots, const uint8_t *ok, const int8_t *q8, const float *kscale,
                        const void *keys, int key_bf16, int k, int m, float scale, int64_t *out_pos,
                        int64_t *out_slots, const int8_t *c8, const float *cscale, int pages, int t0, int t1) {
    if (L < 1 || H * G > MAXG || D > MAXD || k > m || k < 1 || t0 < 0 || t1 > L * R) return -1;
    const int HG = H * G;
    float *a = malloc(sizeof(float) * (size_t)HG * P);
    int32_t *cpos = malloc(sizeof(int32_t) * (size_t)P);
    row_queries Q;
    head_scratch w;
    int bad = scratch_alloc(&w, P, G, m);
    if (!a || !cpos || bad) {
        free(a);
        free(cpos);
        scratch_free(&w);
        return -1;
    }
    const int simd = SIMD_D > 1 && D % SIMD_D == 0;
    for (int t = t0; t < t1; t++) {
        int r = t % R, l = t / R;
        quantize_queries(q + ((int64_t)l * R + r) * HG * D, HG, D, scale, &Q);
        const int64_t *srow = slots + (int64_t)r * P;
        const uint8_t *okrow = ok + (int64_t)r * P;
        int n = 0;
        for (int p = 0; p < P; p++)
            if (okrow[p]) cpos[n++] = p;
        if (pages > 0 && c8 && (n = first_level(&Q, srow, cpos, n, c8 + (int64_t)l * (S >> 4) * H * D,
                                                cscale + (int64_t)l * (S >> 4) * H, H, G, D, simd, pages, m)) < 0) {
            bad = 1;
            break;
        }
        approx_logits(&Q, srow, cpos, n, 0, n, q8 + (int64_t)l * S * H * D, kscale + (int64_t)l * S * H, H, G, D,
                      simd, a);
        for (int h = 0; h < H; h++)
            select_task_head(l, r, h, R, H, G, D, S, n, cpos, a, &Q, srow, keys, key_bf16, k, m, scale, simd,
                             out_pos, out_slots, &w);
    }
    free(a);
    free(cpos);
    scratch_free(&w);
    return bad ? -1 : 0;
}

/* Task t of the grid on `threads` threads (for fewer tasks than threads, e.g. one row's selection
 * of one layer at attention time): the candidates' approximate logits split into ranges of whole
 * 16-candidate blocks, then the KV heads split. Every logit and every head's selection is the same
 * arithmetic as dd_spec_host_select's, so the same sets. Returns 0 or -1 (as it). */
static int select_task_wide(int t, int L, int R, int H, int G, int D, int P, int64_t S, const float *q,
                            const int64_t *slots, const uint8_t *ok, const int8_t *q8, const float *kscale,
                            const void *keys, int key_bf16, int k, int m, float scale, int64_t *out_pos,
                            int64_t *out_slots, const int8_t *c8, const float *cscale, int pages, int threads) {
    const int HG = H * G, r = t % R, l = t / R;
    const int simd = SIMD_D > 1 && D % SIMD_D == 0;
    float *a = malloc(sizeof(float) * (size_t)HG * P);
    int32_t *cpos = malloc(sizeof(int32_t) * (size_t)P);
    row_queries *Q = NULL;
    if (posix_memalign((void **)&Q, 64, sizeof(row_queries))) Q = NULL;
    if (!a || !cpos || !Q) {
        free(a);
        free(cpos);
        free(Q);
        return -1;
    }
    quantize_queries(q + ((int64_t)l * R + r) * HG * D, HG, D, scale, Q);
    const int64_t *srow = slots + (int64_t)r * P;
    const uint8_t *okrow = ok + (int64_t)r * P;
    int n = 0, rc = 0;
    for (int p = 0; p < P; p++)
        if (okrow[p]) cpos[n++] = p;
    if (pages > 0 && c8 && (n = first_level(Q, srow, cpos, n, c8 + (int64_t)l * (S >> 4) * H * D,
                                            cscale + (int64_t)l * (S >> 4) * H, H, G, D, simd, pages, m)) < 0) {
        free(a);
        free(cpos);
        free(Q);
        return -1;
    }
    const int8_t *q8l = q8 + (int64_t)l * S * H * D;
    const float *ksl = kscale + (int64_t)l * S * H;
#pragma omp parallel num_threads(threads) reduction(| : rc)
    {
        int id = thread_id(), nt = thread_count();
        int blocks = (n + 15) / 16;
        int c0 = 16 * (int)((int64_t)blocks * id / nt), c1 = 16 * (int)((int64_t)blocks * (id + 1) / nt);
        approx_logits(Q, srow, cpos, n, c0, c1 < n ? c1 : n, q8l, ksl, H, G, D, simd, a);
        head_scratch w;
        int bad = scratch_alloc(&w, P, G, m);
#pragma omp barrier
        if (bad)
            rc |= 1;
        else
            for (int h = id; h < H; h += nt)
                select_task_head(l, r, h, R, H, G, D, S, n, cpos, a, Q, srow, keys, key_bf16, k, m, scale, simd,
                                 out_pos, out_slots, &w);
        scratch_free(&w);
    }
    free(a);
    free(cpos);
    free(Q);
    return rc ? -1 : 0;
}

/* dd_spec_host_select over every task, split into contiguous ranges over `threads` OpenMP
 * threads. Built with -fopenmp, this library binds to the libgomp already loaded in the process
 * (PyTorch's), so these are the threads PyTorch's own operations use: no second pool competes
 * for the cores with them. With fewer tasks than threads, each task runs on every thread
 * (select_task_wide). Returns 0, or -1 if any range was refused. */
int dd_spec_host_select_par(int L, int R, int H, int G, int D, int P, int64_t S, const float *q,
                            const int64_t *slots, const uint8_t *ok, const int8_t *q8, const float *kscale,
                            const void *keys, int key_bf16, int k, int m, float scale, int64_t *out_pos,
                            int64_t *out_slots, const int8_t *c8, const float *cscale, int pages, int threads) {
    int tasks = L * R, rc = 0;
    if (threads < 1) threads = 1;
    if (L < 1 || H * G > MAXG || D > MAXD || k > m || k < 1) return -1;
    if (tasks < threads) {
        for (int t = 0; t < tasks; t++)
            rc |= select_task_wide(t, L, R, H, G, D, P, S, q, slots, ok, q8, kscale, keys, key_bf16, k, m, scale,
                                   out_pos, out_slots, c8, cscale, pages, threads);
        return rc ? -1 : 0;
    }
#pragma omp parallel num_threads(threads) reduction(| : rc)
    {
        int id = thread_id(), nt = thread_count();
        int t0 = (int)((int64_t)tasks * id / nt), t1 = (int)((int64_t)tasks * (id + 1) / nt);
        if (t1 > t0)
            rc |= dd_spec_host_select(L, R, H, G, D, P, S, q, slots, ok, q8, kscale, keys, key_bf16, k, m, scale,
                                      out_pos, out_slots, c8, cscale, pages, t0, t1);
    }
    return rc ? -1 : 0;
}

/* The int8 key index of n host slots (QuantKeyIndex.update): for every layer l < L, slot
 * slots[i] and KV head h, scale = max(max_d |k|, 1e-12) / 127 and q8 = round(k / scale) to nearest
 * even, clamped to [-127, 127]: PyTorch's float32 arithmetic step for step (true division,
 * nearbyintf), so both give the same bytes. One pass over the keys (PyTorch's version makes ~10
 * passes over a float32 copy; a request's whole prompt is indexed in its first sparse step).
 *
 * keys  [L, S, H, D] bfloat16 (key_bf16 = 1) or float32 (layer stride S H D)
 * q8    [L, S, H, D] int8, scale [L, S, H] float32 (written at the given slots)
 * Split over `threads` OpenMP threads by layer. Returns 0, or -1 for D > MAXD. */
int dd_quantize_keys(int L, int64_t S, int H, int D, const void *keys, int key_bf16, const int64_t *slots, int64_t n,
                     int8_t *q8, float *scale, int threads) {
    if (L < 1 || D < 1 || D > MAXD) return -1;
    if (threads < 1) threads = 1;
    if (threads > L) threads = L;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int l = 0; l < L; l++) {
        float row[MAXD] __attribute__((aligned(64)));
        for (int64_t i = 0; i < n; i++) {
            for (int h = 0; h < H; h++) {
                const int64_t at = ((int64_t)l * S + slots[i]) * H + h;
#if defined(__AVX512F__)
                if (key_bf16 && D % 16 == 0) { /* the same arithmetic, 16 lanes at a time */
                    const uint16_t *kr = (const uint16_t *)keys + at * D;
                    __m512 vm = _mm512_setzero_ps();
                    for (int d = 0; d < D; d += 16) {
                        __m512 x = _mm512_castsi512_ps(
                            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(kr + d))), 16));
                        _mm512_store_ps(row + d, x);
                        vm = _mm512_max_ps(vm, _mm512_abs_ps(x));
                    }
                    const float mx = _mm512_reduce_max_ps(vm);
                    const float s = (mx < 1e-12f ? 1e-12f : mx) / 127.0f;
                    const __m512 vs = _mm512_set1_ps(s), lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
                    for (int d = 0; d < D; d += 16) {
                        __m512 r = _mm512_roundscale_ps(_mm512_div_ps(_mm512_load_ps(row + d), vs),
                                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                        r = _mm512_min_ps(_mm512_max_ps(r, lo), hi);
                        _mm_storeu_si128((__m128i *)(q8 + at * D + d), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(r)));
                    }
                    scale[at] = s;
                    continue;
                }
#endif
                float mx = 0.0f;
                for (int d = 0; d < D; d++) {
                    float x = key_bf16 ? bf16_to_f32(((const uint16_t *)keys)[at * D + d]) : ((const float *)keys)[at * D + d];
                    row[d] = x;
                    x = fabsf(x);
                    mx = x > mx ? x : mx;
                }
                const float s = (mx < 1e-12f ? 1e-12f : mx) / 127.0f;
                int8_t *out = q8 + at * D;
                for (int d = 0; d < D; d++) {
                    float r = nearbyintf(row[d] / s);
                    r = r < -127.0f ? -127.0f : (r > 127.0f ? 127.0f : r);
                    out[d] = (int8_t)r;
                }
                scale[at] = s;
            }
        }
    }
    return 0;
}

/* Row gather for the CPU ring: for i in [0, m), copy row src_rows[i] of src_k / src_v (rows of
 * `row_bytes`) to row dst_rows[i] of dst_k / dst_v, over `threads` OpenMP threads. One pass, no
 * temporary (PyTorch's index_select then a strided assignment copies every row twice). */
void dd_gather_rows(const char *src_k, const char *src_v, char *dst_k, char *dst_v, const int64_t *src_rows,
                    const int64_t *dst_rows, int64_t m, int64_t row_bytes, int threads) {
    if (threads < 1) threads = 1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t i = 0; i < m; i++) {
        if (i + 16 < m) { /* the rows are scattered over the host tier: fetch ahead, K and V */
            const char *nk = src_k + src_rows[i + 16] * row_bytes, *nv = src_v + src_rows[i + 16] * row_bytes;
            for (int64_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(nk + b), __builtin_prefetch(nv + b);
        }
        memcpy(dst_k + dst_rows[i] * row_bytes, src_k + src_rows[i] * row_bytes, (size_t)row_bytes);
        memcpy(dst_v + dst_rows[i] * row_bytes, src_v + src_rows[i] * row_bytes, (size_t)row_bytes);
    }
}

/* A step's sets chosen at attention time into a CPU ring slot, the row indices computed here (no
 * index tensors): for set i < n (plan row rows[i]), KV head h < hkv and column c < w, the K and V
 * rows of host slot slots[i, h, c] (row slots[i, h, c] hkv + h of a layer's [S hkv, row] view) go
 * to row (rows[i] hkv + h) columns + c0 + c of the slot's [R hkv columns, row] view.
 * slots [n, hkv, w] int64, rows [n] int64, contiguous and in range (not checked). Split over
 * `threads` OpenMP threads (the caller passes 1 below GATHER_SERIAL_BYTES). */
void dd_gather_sets(const char *src_k, const char *src_v, char *dst_k, char *dst_v, const int64_t *slots,
                    const int64_t *rows, int64_t n, int64_t hkv, int64_t w, int64_t columns, int64_t c0,
                    int64_t row_bytes, int threads) {
    const int64_t m = n * hkv * w, hw = hkv * w;
    if (threads < 1) threads = 1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t i = 0; i < m; i++) {
        if (i + 16 < m) { /* scattered host rows: fetch ahead, K and V */
            const int64_t j = i + 16, s = slots[j] * hkv + (j / w) % hkv;
            for (int64_t b = 0; b < row_bytes; b += 64)
                __builtin_prefetch(src_k + s * row_bytes + b), __builtin_prefetch(src_v + s * row_bytes + b);
        }
        const int64_t h = (i / w) % hkv, s = slots[i] * hkv + h;
        const int64_t d = (rows[i / hw] * hkv + h) * columns + c0 + i % w;
        memcpy(dst_k + d * row_bytes, src_k + s * row_bytes, (size_t)row_bytes);
        memcpy(dst_v + d * row_bytes, src_v + s * row_bytes, (size_t)row_bytes);
    }
}

/* Serial row copy within one buffer pair: row src_rows[i] of src (rows of `row_bytes` from `src`) to
 * row dst_rows[i] of dst, for i in [0, m). For sources whose rows are not evenly packed K/V
 * pairs (a layer's new K or V, a strided view of the fused QKV projection): the caller gives
 * row indices in units of row_bytes from the base pointer. */
void dd_copy_rows(const char *src, char *dst, const int64_t *src_rows, const int64_t *dst_rows, int64_t m,
                  int64_t row_bytes) {
    for (int64_t i = 0; i < m; i++)
        memcpy(dst + dst_rows[i] * row_bytes, src + src_rows[i] * row_bytes, (size_t)row_bytes);
}

/* The sampled prefetch hit-rate measurement (SparseStepRunner._measure) of one layer: per row r
 * and KV head h, exact scores of every candidate (p_c = max over the group of the softmax
 * probability over the row's candidates), the exact top-kr by p, and
 *   hits[r, h]      = how many of have[r, h, :kr] are in that top-kr,
 *   mass_have[r, h] = sum of p over have[r, h, :kr],  mass_top[r, h] = sum of p over the top-kr.
 * q [R, H * G, D] float32; slots / ok [R, P]; keys [S, H, D] (one layer) bfloat16 or float32;
 * have [R, H, K] int64 positions; kr [R] int64 (<= K). Tasks (r, h) over `threads` threads.
 * Returns -1 for a shape it does not take. */
int dd_measure(int R, int H, int G, int D, int P, int K, const float *q, const int64_t *slots, const uint8_t *ok,
               const void *keys, int key_bf16, const int64_t *have, const int64_t *kr, float scale,
               int64_t *hits, float *mass_have, float *mass_top, int threads) {
    if (G > MAXG || D > MAXD) return -1;
    const int simd = SIMD_D > 1 && D % SIMD_D == 0, esz = key_bf16 ? 2 : 4;
    if (threads < 1) threads = 1;
    int rc = 0;
#pragma omp parallel num_threads(threads) reduction(| : rc)
    {
        float *a = malloc(sizeof(float) * (size_t)G * P), *p = malloc(sizeof(float) * 3 * (size_t)P);
        int32_t *cpos = malloc(sizeof(int32_t) * (size_t)P), *at = malloc(sizeof(int32_t) * (size_t)P);
        if (!a || !p || !cpos || !at) rc = 1;
#pragma omp for schedule(static)
        for (int t = 0; t < R * H; t++) {
            if (rc) continue;
            int r = t / H, h = t % H;
            float qf[MAXG][MAXD] __attribute__((aligned(64))), z[MAXG];
            const float *qrow = q + ((int64_t)r * H * G + (int64_t)h * G) * D;
            for (int j = 0; j < G; j++)
                for (int d = 0; d < D; d++) qf[j][d] = qrow[j * D + d];
            const int64_t *srow = slots + (int64_t)r * P;
            const uint8_t *okrow = ok + (int64_t)r * P;
            int n = 0;
            for (int x = 0; x < P; x++) {
                at[x] = -1;
                if (okrow[x]) at[x] = n, cpos[n++] = x;
            }
            int64_t *hr = hits + t;
            float *mh = mass_have + t, *mt = mass_top + t;
            *hr = 0, *mh = 0.0f, *mt = 0.0f;
            int k = (int)kr[r];
            if (n == 0 || k < 1) continue;
            for (int c = 0; c < n; c++) {
                if (c + 8 < n) __builtin_prefetch((const char *)keys + ((srow[cpos[c + 8]] * H + h) * D) * esz);
                const char *kp = (const char *)keys + ((srow[cpos[c]] * H + h) * D) * esz;
                float dot[MAXG];
#if SIMD_D > 1
                if (simd && key_bf16)
                    dots_bf16((const uint16_t *)kp, (const float(*)[MAXD])qf, G, D, dot);
                else if (simd)
                    dots_f32((const float *)kp, (const float(*)[MAXD])qf, G, D, dot);
                else
#endif
                    dots_float_ref(kp, key_bf16, (const float(*)[MAXD])qf, G, D, dot);
                for (int j = 0; j < G; j++) a[(int64_t)j * n + c] = dot[j] * scale;
            }
            for (int j = 0; j < G; j++) z[j] = lse(a + (int64_t)j * n, n);
            group_scores(a, n, G, z, p);
            for (int c = 0; c < n; c++) p[c] = expf(p[c]);
            int kk = k < n ? k : n;
            float thr = -INFINITY; /* k >= n: every candidate is in the top */
            if (k < n) {
                thr = kth_largest(p, n, k, (uint32_t *)(p + P));
            }
            float sum_above = 0.0f;
            int above = 0;
            for (int c = 0; c < n; c++)
                if (p[c] > thr) sum_above += p[c], above++;
            int ties = kk - above; /* top-k members equal to the threshold */
            *mt = sum_above + (ties > 0 ? ties * thr : 0.0f);
            const int64_t *hv = have + (int64_t)t * K;
            int tie_hits = 0;
            for (int i = 0; i < k && i < K; i++) {
                int64_t x = hv[i];
                int c = (x >= 0 && x < P) ? at[x] : -1;
                if (c < 0) continue;
                *mh += p[c];
                if (p[c] > thr)
                    (*hr)++;
                else if (p[c] == thr && tie_hits < ties)
                    (*hr)++, tie_hits++;
            }
        }
        free(a);
        free(p);
        free(cpos);
        free(at);
    }
    return rc ? -1 : 0;
}

/* ------------------------------------------------------------------------------------------------
 * Sparse decode attention of a step's sparse rows over their layer ring slot, with the query fold
 * and the output scatter of the PyTorch path (runner.layer_inputs' fold_gqa, SparseAttention.run,
 * runner.scatter_output) in the same call: one call a layer instead of an index, an SDPA and an
 * index_copy. Per task (plan row r, KV head h), for each query position p of the row that has a
 * token (out_tok[r P + p] >= 0) and each of the G query heads of h:
 *   softmax(scale q . k_c) over the columns c < N with mask[r, p, c], then sum_c w_c v_c,
 * in float32 (as PyTorch's CPU SDPA accumulates), stored in the activation dtype (bfloat16
 * rounded to nearest even, or float32).
 *
 * q    activations, token t's head j at q + t * q_stride + j * D (elements); q_tok [R, P]: the
 *      query's token per (row, position)
 * k, v ring slot [rows, H, ncols, D] (kv_bf16: bfloat16, else float32), contiguous
 * mask [R, P, N] uint8 (N <= ncols, at least one column set where out_tok >= 0)
 * out  token t's head j at out + t * out_stride + j * D; out_tok [R, P]: the output token, or -1
 * pool_k, pool_v, res, n_res: when pool_k is not NULL, columns c < n_res (the resident set) are
 *      read from the device pool [slots, H, D] at slot res[r n_res + c] instead of the ring slot
 *      (which then need not hold them)
 * host_k, host_v, crit, c_lo, n_crit: when host_k is not NULL, a column c in [c_lo, c_lo + n_crit)
 *      whose host slot s = crit[(r H + h) n_crit + c - c_lo] is >= 0 is read in place from the host
 *      tier's layer [S, H, D] at slot s (the critical set, never copied into the ring slot)
 * Tasks over `threads` OpenMP threads. Returns 0, or -1 (G > MAXG, D > MAXD, no memory). */
static inline float act_load(const void *p, int bf16, int64_t i) {
    return bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* The K or V row at `src` (D elements) as float32 into dst[0..D). */
static inline void kv_row(const void *src, int bf16, int D, float *dst) {
#if defined(__AVX512F__)
    if (D % 16 == 0) {
        if (bf16) {
            const uint16_t *s = (const uint16_t *)src;
            for (int d = 0; d < D; d += 16) {
                __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(s + d)));
                _mm512_store_ps(dst + d, _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)));
            }
        } else {
            const float *s = (const float *)src;
            for (int d = 0; d < D; d += 16) _mm512_store_ps(dst + d, _mm512_loadu_ps(s + d));
        }
        return;
    }
#endif
    for (int d = 0; d < D; d++) dst[d] = act_load(src, bf16, d);
}

/* One (row r, KV head h) task: every query of the row's positions that have an output token
 * (Q = positions x G query vectors) scored against the union of their columns in one pass over
 * the K and V rows (a row's real and speculated queries read nearly the same columns), each
 * query's columns outside its own mask given weight 0. */
static void attend_task(int r, int h, int H, int G, int P, int D, int N, int64_t ncols, const void *q,
                        int64_t q_stride, const int64_t *q_tok, const void *k, const void *v, const uint8_t *mask,
                        void *out, int64_t out_stride, const int64_t *out_tok, int act_bf16, int kv_bf16,
                        float scale, int32_t *cols, float *s, float (*kb)[MAXD], float (*qf)[MAXD],
                        float (*o)[MAXD], const void *pool_k, const void *pool_v, const int64_t *res, int n_res,
                        const void *host_k, const void *host_v, const int64_t *crit, int c_lo, int n_crit,
                        const char **kp, const char **vp) {
    float row[MAXD] __attribute__((aligned(64)));
    int pos[MAXG], Q = 0; /* the positions with an output, in order; query j = (pos[j / G], g = j % G) */
    const int64_t blk = ((int64_t)r * H + h) * ncols; /* first row of the (r, h) block */
    for (int p = 0; p < P && Q + G <= MAXG; p++) {
        if (out_tok[(int64_t)r * P + p] < 0) continue;
        const int64_t qt = q_tok[(int64_t)r * P + p];
        for (int g = 0; g < G; g++)
            for (int d = 0; d < D; d++) qf[Q + g][d] = act_load(q, act_bf16, qt * q_stride + (int64_t)(h * G + g) * D + d);
        pos[Q / G] = p;
        Q += G;
    }
    if (Q == 0) return;
    const int np = Q / G;
    const uint8_t *m0 = mask + (int64_t)r * P * N;
    int n = 0, partial = 0; /* partial: some position reads fewer columns than the union */
    for (int c = 0; c < N; c++) {
        int any = 0, all = 1;
        for (int j = 0; j < np; j++) {
            int b = m0[(int64_t)pos[j] * N + c] != 0;
            any |= b;
            all &= b;
        }
        cols[n] = c;
        n += any;
        partial |= any & !all;
    }
    if (n == 0) return;
    /* each column's K and V rows: the ring slot's, or for a resident column c < n_res (pool_k set),
     * the device pool's row of slot res[r n_res + c] */
    const int esz = kv_bf16 ? 2 : 4;
    for (int c = 0; c < n; c++) {
        int col = cols[c];
        int64_t off = (blk + col) * D * esz;
        const char *kb0 = (const char *)k, *vb0 = (const char *)v;
        if (pool_k && col < n_res) {
            off = (res[(int64_t)r * n_res + col] * H + h) * D * esz;
            kb0 = (const char *)pool_k, vb0 = (const char *)pool_v;
        } else if (host_k && col >= c_lo && col < c_lo + n_crit) {
            int64_t slot = crit[((int64_t)r * H + h) * n_crit + col - c_lo];
            if (slot >= 0) {
                off = (slot * H + h) * D * esz;
                kb0 = (const char *)host_k, vb0 = (const char *)host_v;
            }
        }
        kp[c] = kb0 + off;
        vp[c] = vb0 + off;
    }
    /* scores s[j n + i] = scale q_j . k_{cols[i]}; each K (then V) row's lines are prefetched a
     * block ahead: read in place from the host tier, consecutive columns are scattered rows */
    const int row_bytes = D * esz;
    for (int c = 0; c < n && c < 16; c++)
        for (int b = 0; b < row_bytes; b += 64) __builtin_prefetch(kp[c] + b);
    int i = 0;
#if defined(__AVX512F__)
    if (D % 16 == 0) {
        for (; i + 16 <= n; i += 16) {
            for (int u = i + 16; u < n && u < i + 32; u++)
                for (int b = 0; b < row_bytes; b += 64) __builtin_prefetch(kp[u] + b);
            for (int u = 0; u < 16; u++) kv_row(kp[i + u], kv_bf16, D, kb[u]);
            for (int j = 0; j < Q; j++) {
                __m512 acc[16];
                for (int u = 0; u < 16; u++) {
                    __m512 a = _mm512_setzero_ps();
                    for (int d = 0; d < D; d += 16)
                        a = _mm512_fmadd_ps(_mm512_load_ps(kb[u] + d), _mm512_load_ps(qf[j] + d), a);
                    acc[u] = a;
                }
                _mm512_storeu_ps(s + (int64_t)j * n + i, _mm512_mul_ps(tree16_ps(acc), _mm512_set1_ps(scale)));
            }
        }
    }
#endif
    for (; i < n; i++) {
        kv_row(kp[i], kv_bf16, D, row);
        for (int j = 0; j < Q; j++) {
            float a = 0.0f;
            for (int d = 0; d < D; d++) a += qf[j][d] * row[d];
            s[(int64_t)j * n + i] = a * scale;
        }
    }
    /* softmax weights (unnormalised; a column outside the query's mask weighs 0), 1 / sum */
    float inv[MAXG];
    for (int j = 0; j < Q; j++) {
        float *sj = s + (int64_t)j * n, mx = -INFINITY, sum = 0.0f;
        const uint8_t *mj = m0 + (int64_t)pos[j / G] * N;
        if (partial)
            for (int c = 0; c < n; c++) sj[c] = mj[cols[c]] ? sj[c] : -INFINITY;
        for (int c = 0; c < n; c++) mx = sj[c] > mx ? sj[c] : mx;
        int c = 0;
#if defined(__AVX512F__)
        __m512 vs = _mm512_setzero_ps(), vmx = _mm512_set1_ps(mx);
        for (; c + 16 <= n; c += 16) {
            __m512 e = exp_neg16(_mm512_sub_ps(_mm512_loadu_ps(sj + c), vmx));
            _mm512_storeu_ps(sj + c, e);
            vs = _mm512_add_ps(vs, e);
        }
        sum = _mm512_reduce_add_ps(vs);
#endif
        for (; c < n; c++) sum += (sj[c] = exp_neg(sj[c] - mx));
        if (partial) { /* exp_neg clamps at exp(-87): make the masked columns exactly 0 */
            sum = 0.0f;
            for (c = 0; c < n; c++) sum += (sj[c] = mj[cols[c]] ? sj[c] : 0.0f);
        }
        inv[j] = 1.0f / sum;
        for (int d = 0; d < D; d++) o[j][d] = 0.0f;
    }
    /* o_j = sum_i w_ji v_i */
    for (int c = 0; c < n && c < 8; c++)
        for (int b = 0; b < row_bytes; b += 64) __builtin_prefetch(vp[c] + b);
    for (i = 0; i < n; i++) {
        if (i + 8 < n)
            for (int b = 0; b < row_bytes; b += 64) __builtin_prefetch(vp[i + 8] + b);
        kv_row(vp[i], kv_bf16, D, row);
#if defined(__AVX512F__)
        if (D % 16 == 0) {
            for (int j = 0; j < Q; j++) {
                __m512 w = _mm512_set1_ps(s[(int64_t)j * n + i]);
                for (int d = 0; d < D; d += 16)
                    _mm512_store_ps(o[j] + d, _mm512_fmadd_ps(w, _mm512_load_ps(row + d), _mm512_load_ps(o[j] + d)));
            }
            continue;
        }
#endif
        for (int j = 0; j < Q; j++) {
            float w = s[(int64_t)j * n + i];
            for (int d = 0; d < D; d++) o[j][d] += w * row[d];
        }
    }
    for (int j = 0; j < Q; j++) {
        const int64_t at = out_tok[(int64_t)r * P + pos[j / G]] * out_stride + (int64_t)(h * G + j % G) * D;
        for (int d = 0; d < D; d++) {
            float x = o[j][d] * inv[j];
            if (act_bf16)
                ((uint16_t *)out)[at + d] = f32_to_bf16(x);
            else
                ((float *)out)[at + d] = x;
        }
    }
}

int dd_sparse_attend(int R, int H, int G, int P, int D, int N, int64_t ncols, const void *q, int64_t q_stride,
                     const int64_t *q_tok, const void *k, const void *v, const uint8_t *mask, void *out,
                     int64_t out_stride, const int64_t *out_tok, int act_bf16, int kv_bf16, float scale,
                     const void *pool_k, const void *pool_v, const int64_t *res, int n_res, const void *host_k,
                     const void *host_v, const int64_t *crit, int c_lo, int n_crit, int threads) {
    if (G < 1 || (int64_t)P * G > MAXG || D < 1 || D > MAXD || N < 1 || N > ncols) return -1;
    if (threads < 1) threads = 1;
    int tasks = R * H, rc = 0;
    if (tasks <= 0) return 0; /* no row: nothing to write */
    if (threads > tasks) threads = tasks;
#pragma omp parallel num_threads(threads) reduction(| : rc)
    {
        int32_t *cols = malloc(sizeof(int32_t) * (size_t)N);
        float *s = malloc(sizeof(float) * (size_t)P * G * N);
        float(*kb)[MAXD] = aligned_alloc(64, sizeof(float) * 16 * MAXD);      /* 16 key rows */
        float(*qo)[MAXD] = aligned_alloc(64, sizeof(float) * 2 * (size_t)P * G * MAXD); /* queries, outputs */
        const char **kp = malloc(sizeof(char *) * 2 * (size_t)N), **vp = kp ? kp + N : NULL;
        if (!cols || !s || !kb || !qo || !kp) rc = 1;
        int id = thread_id(), nt = thread_count();
        for (int t = id; t < tasks && !rc; t += nt)
            attend_task(t / H, t % H, H, G, P, D, N, ncols, q, q_stride, q_tok, k, v, mask, out, out_stride, out_tok,
                        act_bf16, kv_bf16, scale, cols, s, kb, qo, qo + P * G, pool_k, pool_v, res, n_res, host_k,
                        host_v, crit, c_lo, n_crit, kp, vp);
        free(cols);
        free(s);
        free(kb);
        free(qo);
        free(kp);
    }
    return rc ? -1 : 0;
}
