/* dbr_quant's FP8 linear for the CPU backend: E4M3 weights decoded inside the GEMM's K loop, never written out at
   full width. Compiled as one translation unit after e4m3.c (dbr_quant/kernels/cpu/e4m3.py joins the two files):
   it uses e4m3.c's e4m3_bits, decode_run and OpenMP set-up.

   y[m,n] = (Σ_k x[m,k]·w[n,k]) · (sx[m]·sw[n]) + b[n]        (mode 0: the reference's order, scales on the sum)
   y[m,n] =  Σ_k (x[m,k]·sx[m]) · (w[n,k]·sw[n]) + b[n]        (mode 1: operands dequantized first, each rounded)

   x (M×K) and w (N×K, torch's Linear layout) are E4M3 codes. Products of two E4M3 values are exact in fp32 and in
   vdpbf16ps; the sum is accumulated in fp32 in this kernel's own order (blocks of 16/32 lanes, then a tree), so it
   differs from a torch GEMM's sum by fp32 rounding, within the dot product's error bound γ_K·Σ|x·w|.

   One code path per ISA, picked at compile time (-march): the library built for x86-64-v3 / x86-64-v4 / x86-64
   runs the AVX2-FMA / AVX-512F / portable paths on any newer CPU, so each is tested on one machine.
   * AVX512-BF16 with AVX512-VBMI (Zen 4, Ice Lake and later; mode 0 only): 64 codes per load become two vectors of
     32 bf16 by two 128-entry byte-table lookups (vpermi2b: the bf16's low and high byte; the sign OR-ed in), an
     exact decode (every E4M3 value is a bf16), fed to vdpbf16ps. The byte interleave permutes k within each
     64-block; the activation row is decoded by the same lookups, so both operands share the permutation.
   * AVX-512F and AVX2-FMA (both modes; mode 1 on the BF16 build too): E4M3 bits moved into fp16 and the exact
     hardware fp16 → fp32 conversion, as decode_run does (values 2⁻⁸ too small: the factor 2¹⁶ on the product is
     exact and restored on the sum), fp32 FMAs.
   * portable: scalar loops.
   Batch ≤ 4 rows (decode): each weight block is decoded once in registers and used for every row. More rows: a
   panel of 4 weight rows is decoded once into a thread-local L1-sized buffer, then swept by 4×4 tiles.
   Threads: output columns split over torch's OpenMP team (built against torch's runtime, see e4m3.c). */
#include <stdlib.h>

#define GEMM_NB 4   /* weight rows per block */
#define GEMM_MB 4   /* activation rows per tile */
#define GEMM_SMALL_M 4
/* bytes ahead of the K loop each weight row is prefetched (a prefetch past the row's end is harmless: it never
   faults). Batch-1 decode streams every weight from DRAM once: the hardware prefetchers alone left a core at
   ~3 GB/s here; ahead-of-use requests keep more lines in flight. */
#ifndef GEMM_PREFETCH
#define GEMM_PREFETCH 256
#endif

static void *aligned_buffer(size_t bytes) {
    void *p = NULL;
    if (posix_memalign(&p, 64, bytes ? (bytes + 63) / 64 * 64 : 64) != 0) return NULL;
    return p;
}

/* Per-thread decode buffers kept between calls (the calling thread's decoded activations, each worker's decoded
   weight panel). Allocated per call, the ones above glibc's mmap threshold (128 KiB at first; a
   32-sentence MiniLM's decoded activations are 0.4-1.5 MiB) came back as fresh pages every call: page faults,
   counted as system time, and heap churn that also hit torch's own large temporaries. A thread keeps at most
   GEMM_KEEP_BYTES per slot (a larger GEMM allocates and frees its own: the faults are then small beside its
   work); a pthread key's destructor frees them when the thread ends. */
#include <pthread.h>
#ifndef GEMM_KEEP_BYTES
#define GEMM_KEEP_BYTES ((size_t)16 << 20)
#endif
enum { SLOT_ACTIVATIONS, SLOT_PANEL, SLOTS };
typedef struct { void *p[SLOTS]; size_t cap[SLOTS]; } held_buffers;
static pthread_key_t held_key;
static pthread_once_t held_once = PTHREAD_ONCE_INIT;
static int held_ok;

static void free_held(void *h_) {
    held_buffers *h = (held_buffers *)h_;
    for (int i = 0; i < SLOTS; ++i) free(h->p[i]);
    free(h);
}

static void make_held_key(void) { held_ok = pthread_key_create(&held_key, free_held) == 0; }

/* At least ``bytes`` of 64-byte aligned memory: this thread's kept buffer for ``slot`` (grown when short), or, for
   a large request or when the key is unavailable, a fresh one (*owned = 1: the caller frees it). NULL: no memory. */
static void *thread_buffer(int slot, size_t bytes, int *owned) {
    *owned = 0;
    if (bytes <= GEMM_KEEP_BYTES && pthread_once(&held_once, make_held_key) == 0 && held_ok) {
        held_buffers *h = (held_buffers *)pthread_getspecific(held_key);
        if (!h && (h = (held_buffers *)calloc(1, sizeof *h)) != NULL && pthread_setspecific(held_key, h) != 0) {
            free(h);
            h = NULL;
        }
        if (h) {
            if (h->cap[slot] < bytes) {
                const size_t grown = (bytes + 65535) / 65536 * 65536;  /* whole 64 KiB: fewer regrowths */
                free(h->p[slot]);
                h->p[slot] = aligned_buffer(grown);
                h->cap[slot] = h->p[slot] ? grown : 0;
            }
            if (h->p[slot]) return h->p[slot];
        }
    }
    *owned = 1;
    return aligned_buffer(bytes);
}

/* The epilogue shared by every path: ``acc`` is Σ x·w in the path's units (``unit``: 2¹⁶ where operands were
   decoded 2⁻⁸ too small, else 1). */
static inline float finish(float acc, float unit, int mode, float sx, float sw, const float *bias, int64_t n) {
    float y = mode == 0 ? (acc * unit) * (sx * sw) : acc * unit;
    return bias ? y + bias[n] : y;
}

#if defined(__AVX512BF16__) && defined(__AVX512VBMI__) && defined(__AVX512BW__)
#define GEMM_BF16 1
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define GEMM_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define GEMM_AVX2 1
#endif

/* ---------------------------------------------------------------- AVX512-BF16: vdpbf16ps on table-decoded codes */
#ifdef GEMM_BF16
typedef struct { __m512i lo0, lo1, hi0, hi1; } bf16_tables;

static bf16_tables make_tables(void) {
    uint8_t lo[128], hi[128];
    for (uint32_t c = 0; c < 128; ++c) {  /* the exact bf16 of code c (sign 0): the top half of its fp32 bits */
        uint32_t bits = e4m3_bits(c) >> 16;
        lo[c] = (uint8_t)bits, hi[c] = (uint8_t)(bits >> 8);
    }
    bf16_tables t = {_mm512_loadu_si512(lo), _mm512_loadu_si512(lo + 64), _mm512_loadu_si512(hi),
                     _mm512_loadu_si512(hi + 64)};
    return t;
}

/* 64 codes → two vectors of 32 bf16 (a: codes 16j+0..7 of each 16-byte lane j, b: codes 16j+8..15) */
static inline void decode64(const bf16_tables *t, __m512i c, __m512 *a, __m512 *b) {
    __m512i lo = _mm512_permutex2var_epi8(t->lo0, c, t->lo1);  /* index bits 0..6: the sign bit is ignored */
    __m512i hi = _mm512_permutex2var_epi8(t->hi0, c, t->hi1);
    hi = _mm512_ternarylogic_epi64(hi, c, _mm512_set1_epi8((char)0x80), 0xF8);  /* hi | (c & 0x80) */
    *a = _mm512_castsi512_ps(_mm512_unpacklo_epi8(lo, hi));
    *b = _mm512_castsi512_ps(_mm512_unpackhi_epi8(lo, hi));
}

static inline __m512i load_codes(const uint8_t *p, int64_t k, int64_t K) {
    if (k + 64 <= K) return _mm512_loadu_si512(p + k);
    return _mm512_maskz_loadu_epi8(_cvtu64_mask64(~0ULL >> (64 - (K - k))), p + k);  /* zero codes: 0.0 */
}

/* the activation rows, decoded the same way: Kp (K rounded up to 64) bf16 per row, zero padded */
static void decode_rows_bf16(const bf16_tables *t, const uint8_t *x, int64_t M, int64_t K, int64_t Kp, __m512 *out) {
    for (int64_t m = 0; m < M; ++m)
        for (int64_t k = 0; k < Kp; k += 64) {
            __m512 a, b;
            decode64(t, load_codes(x + m * K, k, K), &a, &b);
            out[(m * Kp + k) / 32] = a, out[(m * Kp + k) / 32 + 1] = b;
        }
}

/* mb (1..4, a constant after inlining) activation rows × 4 weight rows, weights decoded in registers. One weight
   row at a time, so the weights stream through memory in order (the prefetchers' best case: at batch 1 the GEMV
   reads each weight once, from DRAM), with two 64-code steps in flight per row for independent accumulators. */
static inline __attribute__((always_inline)) void bf16_rows(const int mb, const bf16_tables *t, const __m512 *xb,
                                                           int64_t Kp, const uint8_t *const *wr, int64_t K,
                                                           float sums[GEMM_NB * GEMM_MB]) {
    for (int n = 0; n < GEMM_NB; ++n) {
        __m512 acc[GEMM_MB * 2];
        for (int i = 0; i < mb * 2; ++i) acc[i] = _mm512_setzero_ps();
        for (int64_t k = 0; k < Kp; k += 64) {
            __m512 a, b;
            _mm_prefetch((const char *)(wr[n] + k + GEMM_PREFETCH), _MM_HINT_T0);
            decode64(t, load_codes(wr[n], k, K), &a, &b);
            for (int m = 0; m < mb; ++m) {
                acc[2 * m] = _mm512_dpbf16_ps(acc[2 * m], (__m512bh)xb[(m * Kp + k) / 32], (__m512bh)a);
                acc[2 * m + 1] = _mm512_dpbf16_ps(acc[2 * m + 1], (__m512bh)xb[(m * Kp + k) / 32 + 1], (__m512bh)b);
            }
        }
        for (int m = 0; m < mb; ++m) sums[m * GEMM_NB + n] = _mm512_reduce_add_ps(_mm512_add_ps(acc[2 * m], acc[2 * m + 1]));
    }
}

/* More rows: the outer-product form (oneDNN's "VNNI" layout). A panel of 32 weight rows is decoded once into
   pairs-major order, panel[p][n] = the bf16 pair (k = 2p, 2p+1) of row n (32 bits), 2 vectors of 16 rows per
   pair; each tile row broadcasts its own pair p and vdpbf16ps accumulates 16 outputs per vector, so the sums
   need no horizontal reduction. Both operands keep decode64's k permutation (it moves whole pairs). */
#define VNNI_N 32
#define VNNI_M 12
/* dst[q·stride + i] = r[i][q] for a 16×16 block of 32-bit words: unpacks within 128-bit lanes, then a 4×4
   transpose of the lanes */
static inline void transpose16_store(const __m512 *rf, uint32_t *dst, int64_t stride) {
    __m512i t[16], u[16];
    for (int i = 0; i < 8; ++i) {
        __m512i r0 = _mm512_castps_si512(rf[2 * i]), r1 = _mm512_castps_si512(rf[2 * i + 1]);
        t[2 * i] = _mm512_unpacklo_epi32(r0, r1), t[2 * i + 1] = _mm512_unpackhi_epi32(r0, r1);
    }
    for (int i = 0; i < 4; ++i) {  /* u[4i + c], lane L: column 4L + c of rows 4i..4i+3 */
        u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int c = 0; c < 4; ++c) {
        __m512i x0 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x44), x1 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xEE);
        __m512i x2 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x44);
        __m512i x3 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xEE);
        _mm512_store_si512(dst + c * stride, _mm512_shuffle_i32x4(x0, x2, 0x88));
        _mm512_store_si512(dst + (4 + c) * stride, _mm512_shuffle_i32x4(x0, x2, 0xDD));
        _mm512_store_si512(dst + (8 + c) * stride, _mm512_shuffle_i32x4(x1, x3, 0x88));
        _mm512_store_si512(dst + (12 + c) * stride, _mm512_shuffle_i32x4(x1, x3, 0xDD));
    }
}

static void decode_panel_vnni(const bf16_tables *t, const uint8_t *const *wr, int64_t K, int64_t Kp,
                              uint32_t *panel) {
    for (int64_t k = 0; k < Kp; k += 64)
        for (int h = 0; h < VNNI_N / 16; ++h) {
            __m512 a[16], b[16];
            for (int i = 0; i < 16; ++i) decode64(t, load_codes(wr[16 * h + i], k, K), &a[i], &b[i]);
            transpose16_store(a, panel + (k / 2) * VNNI_N + 16 * h, VNNI_N);
            transpose16_store(b, panel + (k / 2 + 16) * VNNI_N + 16 * h, VNNI_N);
        }
}

static inline __attribute__((always_inline)) void vnni_tile(const int mb, const uint32_t *x, int64_t Kp,
                                                           const uint32_t *panel, __m512 acc[VNNI_M * 2]) {
    for (int i = 0; i < mb * 2; ++i) acc[i] = _mm512_setzero_ps();
    const int64_t pairs = Kp / 2;
    for (int64_t p = 0; p < pairs; ++p) {
        __m512 w0 = _mm512_load_ps((const float *)(panel + p * VNNI_N));
        __m512 w1 = _mm512_load_ps((const float *)(panel + p * VNNI_N + 16));
        for (int m = 0; m < mb; ++m) {
            __m512 xv = _mm512_castsi512_ps(_mm512_set1_epi32((int)x[m * pairs + p]));
            acc[2 * m] = _mm512_dpbf16_ps(acc[2 * m], (__m512bh)xv, (__m512bh)w0);
            acc[2 * m + 1] = _mm512_dpbf16_ps(acc[2 * m + 1], (__m512bh)xv, (__m512bh)w1);
        }
    }
}
#endif

/* ---------------------------------------------------------------- fp32 FMA paths (AVX-512F, AVX2) and portable */
#if defined(GEMM_AVX512)
typedef __m512 vecf;
#define VW 16
#define vzero _mm512_setzero_ps
#define vload _mm512_loadu_ps
#define vfma _mm512_fmadd_ps
#define vmul _mm512_mul_ps
#define vset1 _mm512_set1_ps
#define vsum _mm512_reduce_add_ps
/* 2·VW codes → two fp32 vectors of value·2⁻⁸ (natural k order) */
static inline void decode_pair(const uint8_t *p, int64_t k, int64_t K, vecf *a, vecf *b) {
    __m256i c = k + 32 <= K ? _mm256_loadu_si256((const __m256i *)(p + k))
                            : _mm256_maskz_loadu_epi8(_cvtu32_mask32(~0U >> (32 - (K - k))), p + k);
    __m512i w = _mm512_and_si512(_mm512_slli_epi16(_mm512_cvtepi8_epi16(c), 7), _mm512_set1_epi16((short)0xBF80));
    *a = _mm512_cvtph_ps(_mm512_castsi512_si256(w));
    *b = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(w, 1));
}
#elif defined(GEMM_AVX2)
typedef __m256 vecf;
#define VW 8
#define vzero _mm256_setzero_ps
#define vload _mm256_loadu_ps
#define vfma _mm256_fmadd_ps
#define vmul _mm256_mul_ps
#define vset1 _mm256_set1_ps
static inline float vsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
static inline void decode_pair(const uint8_t *p, int64_t k, int64_t K, vecf *a, vecf *b) {
    uint8_t tail[16] = {0};
    const uint8_t *src = p + k;
    if (k + 16 > K) {
        memcpy(tail, src, (size_t)(K - k));
        src = tail;
    }
    __m256i w = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)src));
    w = _mm256_and_si256(_mm256_slli_epi16(w, 7), _mm256_set1_epi16((short)0xBF80));
    *a = _mm256_cvtph_ps(_mm256_castsi256_si128(w));
    *b = _mm256_cvtph_ps(_mm256_extracti128_si256(w, 1));
}
#endif

#if defined(GEMM_AVX512) || defined(GEMM_AVX2)
#define FMA_UNIT 65536.0f  /* both operands decoded 2⁻⁸ too small */
/* activation rows as fp32 (mode 0: value·2⁻⁸; mode 1: value·sx[m]), Kp (K rounded up to 2·VW) per row, zero padded */
static void decode_rows_fp32(const uint8_t *x, int64_t M, int64_t K, int64_t Kp, int mode, const float *xs,
                             int64_t xs_stride, float *out) {
    for (int64_t m = 0; m < M; ++m) {
        decode_run(x + m * K, out + m * Kp, K, mode == 0 ? 0x1p-8f : xs[m * xs_stride]);
        memset(out + m * Kp + K, 0, (size_t)(Kp - K) * sizeof(float));
    }
}

/* mb (1..4) activation rows × 4 weight rows decoded in registers, one weight row at a time (as bf16_rows);
   mode 1 scales each weight row first */
static inline __attribute__((always_inline)) void fma_rows(const int mb, const float *xf, int64_t Kp,
                                                          const uint8_t *const *wr, const float *wmul, int64_t K,
                                                          float sums[GEMM_NB * GEMM_MB]) {
    for (int n = 0; n < GEMM_NB; ++n) {
        vecf acc[GEMM_MB * 2];
        for (int i = 0; i < mb * 2; ++i) acc[i] = vzero();
        const vecf mul = vset1(wmul ? wmul[n] : 1.0f);
        for (int64_t k = 0; k < Kp; k += 2 * VW) {
            vecf a, b;
            _mm_prefetch((const char *)(wr[n] + k + GEMM_PREFETCH), _MM_HINT_T0);
            decode_pair(wr[n], k, K, &a, &b);
            if (wmul) a = vmul(a, mul), b = vmul(b, mul);
            for (int m = 0; m < mb; ++m) {
                acc[2 * m] = vfma(vload(xf + m * Kp + k), a, acc[2 * m]);
                acc[2 * m + 1] = vfma(vload(xf + m * Kp + k + VW), b, acc[2 * m + 1]);
            }
        }
        for (int m = 0; m < mb; ++m) sums[m * GEMM_NB + n] = vsum(acc[2 * m]) + vsum(acc[2 * m + 1]);
    }
}

/* a decoded panel of 4 weight rows (Kp floats each) × a 4-row (AVX-512) / 2-row (AVX2: 16 registers) tile */
#ifdef GEMM_AVX512
#define FMA_TILE_M 4
#else
#define FMA_TILE_M 2
#endif
static inline void fma_tile(const float *xf, int64_t Kp, const float *panel, float sums[GEMM_NB * GEMM_MB]) {
    vecf acc[FMA_TILE_M * GEMM_NB];
    for (int i = 0; i < FMA_TILE_M * GEMM_NB; ++i) acc[i] = vzero();
    for (int64_t k = 0; k < Kp; k += VW) {
        vecf w[GEMM_NB];
        for (int n = 0; n < GEMM_NB; ++n) w[n] = vload(panel + n * Kp + k);
        for (int m = 0; m < FMA_TILE_M; ++m) {
            vecf xv = vload(xf + m * Kp + k);
            for (int n = 0; n < GEMM_NB; ++n) acc[m * GEMM_NB + n] = vfma(xv, w[n], acc[m * GEMM_NB + n]);
        }
    }
    for (int i = 0; i < FMA_TILE_M * GEMM_NB; ++i) sums[i] = vsum(acc[i]);
}
#endif

/* ---------------------------------------------------------------- the driver */
typedef struct {
    const uint8_t *w;
    const float *xs, *ws, *bias;
    int64_t xs_stride, ws_stride, M, N, K, Kp;
    int mode;
    float *y;
} gemm_args;

/* y for activation rows m0..m0+mb-1 and weight rows n0..n0+3 (rows past N are clamped reads, discarded) */
static void store_block(const gemm_args *g, int64_t m0, int mb, int64_t n0, const float *sums, float unit) {
    for (int m = 0; m < mb && m0 + m < g->M; ++m)
        for (int n = 0; n < GEMM_NB && n0 + n < g->N; ++n)
            g->y[(m0 + m) * g->N + n0 + n] = finish(sums[m * GEMM_NB + n], unit, g->mode,
                                                    g->xs[(m0 + m) * g->xs_stride], g->ws[(n0 + n) * g->ws_stride],
                                                    g->bias, n0 + n);
}

static inline const uint8_t *weight_row(const gemm_args *g, int64_t n) {
    return g->w + (n < g->N ? n : g->N - 1) * g->K;
}

#ifdef GEMM_BF16
/* 32 weight rows from n0 against every activation row (M > GEMM_SMALL_M): the VNNI panel, 12-row tiles, the
   epilogue on whole vectors of 16 outputs. ``scratch``: Kp·64 bytes of this thread's. */
static void bf16_panel_block(const gemm_args *g, int64_t n0, const uint32_t *x, void *scratch) {
    const int64_t Kp = g->Kp, pairs = Kp / 2;
    const uint8_t *wr[VNNI_N];
    for (int n = 0; n < VNNI_N; ++n) wr[n] = weight_row(g, n0 + n);
    uint32_t *panel = (uint32_t *)scratch;
    bf16_tables t = make_tables();
    decode_panel_vnni(&t, wr, g->K, Kp, panel);
    const int64_t valid = g->N - n0 < VNNI_N ? g->N - n0 : VNNI_N;
    const __mmask16 k0 = (__mmask16)(valid >= 16 ? 0xFFFF : (1u << valid) - 1u);
    const __mmask16 k1 = (__mmask16)(valid >= 32 ? 0xFFFF : valid > 16 ? (1u << (valid - 16)) - 1u : 0u);
    __m512 sw0, sw1, b0 = _mm512_setzero_ps(), b1 = _mm512_setzero_ps();
    if (g->ws_stride == 0) {
        sw0 = sw1 = _mm512_set1_ps(g->ws[0]);
    } else {
        sw0 = _mm512_maskz_loadu_ps(k0, g->ws + n0), sw1 = _mm512_maskz_loadu_ps(k1, g->ws + n0 + 16);
    }
    if (g->bias) b0 = _mm512_maskz_loadu_ps(k0, g->bias + n0), b1 = _mm512_maskz_loadu_ps(k1, g->bias + n0 + 16);
    __m512 acc[VNNI_M * 2];
    for (int64_t m0 = 0; m0 < g->M; m0 += VNNI_M) {
        const int mb = g->M - m0 < VNNI_M ? (int)(g->M - m0) : VNNI_M;
        const uint32_t *xt = x + m0 * pairs;
        switch (mb) {  /* a constant tile height per case: the accumulators stay in registers */
#define TILE(h) case h: vnni_tile(h, xt, Kp, panel, acc); break;
        TILE(1) TILE(2) TILE(3) TILE(4) TILE(5) TILE(6) TILE(7) TILE(8) TILE(9) TILE(10) TILE(11)
        default: vnni_tile(VNNI_M, xt, Kp, panel, acc); break;
#undef TILE
        }
        for (int m = 0; m < mb; ++m) {  /* (acc · (sx·sw)) + b, as finish() */
            __m512 sx = _mm512_set1_ps(g->xs[(m0 + m) * g->xs_stride]);
            float *out = g->y + (m0 + m) * g->N + n0;
            __m512 y0 = _mm512_mul_ps(acc[2 * m], _mm512_mul_ps(sx, sw0));
            __m512 y1 = _mm512_mul_ps(acc[2 * m + 1], _mm512_mul_ps(sx, sw1));
            if (g->bias) y0 = _mm512_add_ps(y0, b0), y1 = _mm512_add_ps(y1, b1);
            _mm512_mask_storeu_ps(out, k0, y0);
            _mm512_mask_storeu_ps(out + 16, k1, y1);
        }
    }
}
#endif

/* One block of 4 weight rows against every activation row (the decode-sized batches; and every batch on the
   FMA paths). ``xdec``: the decoded activations; ``panel``: this thread's buffer for the decoded weight rows
   (used when M > GEMM_SMALL_M). */
static void gemm_block(const gemm_args *g, int64_t n0, const void *xdec, void *panel) {
    const uint8_t *wr[GEMM_NB];
    for (int n = 0; n < GEMM_NB; ++n) wr[n] = weight_row(g, n0 + n);
    float sums[GEMM_NB * GEMM_MB];
    const int64_t M = g->M, Kp = g->Kp;
    (void)panel, (void)sums, (void)Kp;
#ifdef GEMM_BF16
    if (g->mode == 0) {
        bf16_tables t = make_tables();
        const __m512 *xb = (const __m512 *)xdec;
        switch (M) {
        case 1: bf16_rows(1, &t, xb, Kp, wr, g->K, sums); break;
        case 2: bf16_rows(2, &t, xb, Kp, wr, g->K, sums); break;
        case 3: bf16_rows(3, &t, xb, Kp, wr, g->K, sums); break;
        default: bf16_rows(4, &t, xb, Kp, wr, g->K, sums); break;
        }
        store_block(g, 0, (int)M, n0, sums, 1.0f);
        return;
    }
#endif
#if defined(GEMM_AVX512) || defined(GEMM_AVX2)
    const float *xf = (const float *)xdec;
    float wmul[GEMM_NB];  /* mode 1: 256·sw turns a value·2⁻⁸ into value·sw, rounded once */
    for (int n = 0; n < GEMM_NB; ++n) wmul[n] = 256.0f * g->ws[(n0 + n < g->N ? n0 + n : g->N - 1) * g->ws_stride];
    const float *mul = g->mode == 1 ? wmul : NULL;
    const float unit = g->mode == 1 ? 1.0f : FMA_UNIT;  /* mode 1: both operands carry their exact scales */
    if (M <= GEMM_SMALL_M) {
        switch (M) {
        case 1: fma_rows(1, xf, Kp, wr, mul, g->K, sums); break;
        case 2: fma_rows(2, xf, Kp, wr, mul, g->K, sums); break;
        case 3: fma_rows(3, xf, Kp, wr, mul, g->K, sums); break;
        default: fma_rows(4, xf, Kp, wr, mul, g->K, sums); break;
        }
        store_block(g, 0, (int)M, n0, sums, unit);
        return;
    }
    float *p = (float *)panel;
    for (int n = 0; n < GEMM_NB; ++n) {
        decode_run(wr[n], p + n * Kp, g->K, g->mode == 1 ? wmul[n] * 0x1p-8f : 0x1p-8f);
        memset(p + n * Kp + g->K, 0, (size_t)(Kp - g->K) * sizeof(float));
    }
    for (int64_t m0 = 0; m0 < M; m0 += FMA_TILE_M) {
        int rows = M - m0 < FMA_TILE_M ? (int)(M - m0) : FMA_TILE_M;
        if (rows == FMA_TILE_M) {
            fma_tile(xf + m0 * Kp, Kp, p, sums);
        } else {  /* the last rows, one at a time */
            for (int r = 0; r < rows; ++r) fma_rows(1, xf + (m0 + r) * Kp, Kp, wr, mul, g->K, sums + r * GEMM_NB);
        }
        store_block(g, m0, rows, n0, sums, unit);
    }
#else
    const float *xf = (const float *)xdec;  /* portable: x decoded exactly (×sx in mode 1), scalar sums */
    for (int64_t m = 0; m < M; ++m)
        for (int n = 0; n < GEMM_NB && n0 + n < g->N; ++n) {
            const float sw = g->ws[(n0 + n) * g->ws_stride];
            float acc = 0.0f;
            for (int64_t k = 0; k < g->K; ++k) {
                uint32_t bits = e4m3_bits(wr[n][k]);
                float v;
                memcpy(&v, &bits, 4);
                acc += xf[m * g->Kp + k] * (g->mode == 1 ? v * sw : v);
            }
            g->y[m * g->N + n0 + n] = finish(acc, 1.0f, g->mode, g->xs[m * g->xs_stride], sw, g->bias, n0 + n);
        }
#endif
}

/* The entry point (e4m3.py's fp8_gemm documents it). Returns 0, or -1 when a buffer could not be allocated. */
int dbr_fp8_gemm(const uint8_t *x, const float *xs, int64_t xs_stride, const uint8_t *w, const float *ws,
                 int64_t ws_stride, const float *bias, int64_t M, int64_t N, int64_t K, int32_t mode, float *y) {
    gemm_args g = {w, xs, ws, bias, xs_stride, ws_stride, M, N, K, K, mode, y};
    void *xdec;
    int xdec_owned;
    int64_t block = GEMM_NB;
    size_t scratch = 0;
#ifdef GEMM_BF16
    if (mode == 0) {
        g.Kp = (K + 63) / 64 * 64;
        xdec = thread_buffer(SLOT_ACTIVATIONS, (size_t)(M * g.Kp) * 2, &xdec_owned);
        if (!xdec) return -1;
        bf16_tables t = make_tables();
        decode_rows_bf16(&t, x, M, K, g.Kp, (__m512 *)xdec);
        if (M > GEMM_SMALL_M) block = VNNI_N, scratch = (size_t)g.Kp * 2 * VNNI_N;
    } else
#endif
    {
#if defined(GEMM_AVX512) || defined(GEMM_AVX2)
        g.Kp = (K + 2 * VW - 1) / (2 * VW) * (2 * VW);
        scratch = M > GEMM_SMALL_M ? (size_t)(GEMM_NB * g.Kp) * 4 : 0;
        xdec = thread_buffer(SLOT_ACTIVATIONS, (size_t)(M * g.Kp) * 4, &xdec_owned);
        if (!xdec) return -1;
        decode_rows_fp32(x, M, K, g.Kp, mode, xs, xs_stride, (float *)xdec);
#else
        xdec = thread_buffer(SLOT_ACTIVATIONS, (size_t)(M * K) * 4, &xdec_owned);
        if (!xdec) return -1;
        for (int64_t m = 0; m < M; ++m)
            decode_run(x + m * K, (float *)xdec + m * K, K, mode == 1 ? xs[m * xs_stride] : 1.0f);
#endif
    }
    const int64_t blocks = (N + block - 1) / block;
    int failed = 0, parts = 1;
#ifdef _OPENMP
    /* below parallel_min multiply-adds a GEMM stays on the calling thread (a fork costs a few µs) */
    if (!omp_in_parallel() && M * N * K >= parallel_min) parts = omp_get_max_threads();
    if (parts > blocks) parts = (int)blocks;
#pragma omp parallel num_threads(parts) if (parts > 1) reduction(| : failed)
#endif
    {
        int owned = 0;
        void *buf = scratch ? thread_buffer(SLOT_PANEL, scratch, &owned) : NULL;
        if (scratch && !buf) {
            failed = 1;
        } else {
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
            for (int64_t b = 0; b < blocks; ++b) {
#ifdef GEMM_BF16
                if (block == VNNI_N) {
                    bf16_panel_block(&g, b * VNNI_N, (const uint32_t *)xdec, buf);
                    continue;
                }
#endif
                gemm_block(&g, b * GEMM_NB, xdec, buf);
            }
        }
        if (owned) free(buf);
    }
    if (xdec_owned) free(xdec);
    return failed ? -1 : 0;
}

/* Which code path this build runs (e4m3.py's gemm_isa names them). */
int dbr_fp8_gemm_isa(void) {
#if defined(GEMM_BF16)
    return 3;
#elif defined(GEMM_AVX512)
    return 2;
#elif defined(GEMM_AVX2)
    return 1;
#else
    return 0;
#endif
}
