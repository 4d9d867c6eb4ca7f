/* dbr_quant's E4M3 kernels for the CPU backend: exact upcasts, the saturating quantize, small linears.
   Compiled on first use by dbr_quant/kernels/cpu/e4m3.py (which documents them and calls them through ctypes)
   with the system C compiler; the build cache is keyed by this file's text. No dependencies beyond libc (and
   OpenMP where available). */
#include <stdint.h>
#include <string.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

/* Written without branches so the compiler vectorizes the loops. One E4M3 code → its fp32 bit pattern.
   Normal codes: exponent and mantissa move up by 20 bits and the exponent is re-biased (7 → 127) by
   adding 120 << 23. Subnormal codes (exponent 0): mantissa · 2^-9
   through an exact int → float conversion. */
static inline uint32_t e4m3_bits(uint32_t c) {
    uint32_t m = c & 0x7Fu;
    uint32_t normal = (m << 20) + (120u << 23);
    float sub = (float)(int32_t)(c & 7u) * 0x1p-9f;
    uint32_t sub_bits;
    memcpy(&sub_bits, &sub, 4);
    uint32_t is_normal = 0u - (uint32_t)(m > 7u);  /* all ones for a normal code: a select, no branch */
    return (normal & is_normal) | (sub_bits & ~is_normal) | ((c & 0x80u) << 24);
}

/* dst = decode(src) · mul. Vector paths: E4M3's bits, sign-extended to 16 bits and shifted left by 7, are an fp16
   bit pattern (exponent and mantissa where fp16 keeps them, the sign's copy in bit 14 masked off) of a value
   2^-8 times too small (biases 15 vs 7), so the hardware's exact fp16 → fp32 conversion (vcvtph2ps, which takes
   fp16 subnormals whatever the denormals-are-zero mode) and one multiply by 256·mul finish the job: the product
   is the exact value times mul, rounded once, as in the scalar tail. The NaN codes give ±480 on both. */
static void decode_run(const uint8_t *src, float *dst, int64_t n, float mul) {
    int64_t i = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
    const __m512 vs = _mm512_set1_ps(256.0f * mul);
    const __m512i mask = _mm512_set1_epi16((short)0xBF80);
    for (; i + 32 <= n; i += 32) {
        __m512i w = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(src + i)));
        w = _mm512_and_si512(_mm512_slli_epi16(w, 7), mask);
        _mm512_storeu_ps(dst + i, _mm512_mul_ps(_mm512_cvtph_ps(_mm512_castsi512_si256(w)), vs));
        _mm512_storeu_ps(dst + i + 16, _mm512_mul_ps(_mm512_cvtph_ps(_mm512_extracti64x4_epi64(w, 1)), vs));
    }
#elif defined(__AVX2__) && defined(__F16C__)
    const __m256 vs = _mm256_set1_ps(256.0f * mul);
    const __m256i mask = _mm256_set1_epi16((short)0xBF80);
    for (; i + 16 <= n; i += 16) {
        __m256i w = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(src + i)));
        w = _mm256_and_si256(_mm256_slli_epi16(w, 7), mask);
        _mm256_storeu_ps(dst + i, _mm256_mul_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(w)), vs));
        _mm256_storeu_ps(dst + i + 8, _mm256_mul_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(w, 1)), vs));
    }
#endif
    for (; i < n; ++i) {
        uint32_t bits = e4m3_bits(src[i]);
        float v;
        memcpy(&v, &bits, 4);
        dst[i] = v * mul;
    }
}

static void to_fp32_rows(const void *src, void *dst, int64_t rows, int64_t cols, const float *scale, int64_t stride) {
    (void)scale, (void)stride;
    decode_run((const uint8_t *)src, (float *)dst, rows * cols, 1.0f);
}

/* bf16 is the top half of fp32; E4M3's 3 mantissa bits fit in bf16's 7, so the truncation is exact. Decoded
   through a small fp32 buffer that stays in L1. */
static void to_bf16_rows(const void *src_, void *dst_, int64_t rows, int64_t cols, const float *scale,
                         int64_t stride) {
    (void)scale, (void)stride;
    const uint8_t *src = (const uint8_t *)src_;
    uint16_t *dst = (uint16_t *)dst_;
    int64_t n = rows * cols;
    float buf[1024];
    for (int64_t start = 0; start < n; start += 1024) {
        int64_t len = n - start < 1024 ? n - start : 1024;
        decode_run(src + start, buf, len, 1.0f);
        for (int64_t i = 0; i < len; ++i) {
            uint32_t bits;
            memcpy(&bits, buf + i, 4);
            dst[start + i] = (uint16_t)(bits >> 16);
        }
    }
}

/* Per-row scaled upcast to fp32: dst = decode(src) · scale[row] (one fp32 multiply, rounded once), the operand
   a dequantize-first GEMM takes. scale_stride 0: one scale for all rows. */
static void scaled_rows(const void *src_, void *dst_, int64_t rows, int64_t cols, const float *scale,
                        int64_t scale_stride) {
    const uint8_t *src = (const uint8_t *)src_;
    float *dst = (float *)dst_;
    if (scale_stride == 0) {
        decode_run(src, dst, rows * cols, scale[0]);
        return;
    }
    for (int64_t r = 0; r < rows; ++r) decode_run(src + r * cols, dst + r * cols, cols, scale[r]);
}

/* fp32 value → E4M3 code: saturate to ±448, round to nearest even, NaN → 0x7F with its sign; equal bit for bit
   to clamp(-448, 448) followed by torch's cast. Normal results (|y| ≥ 2^-6) round in the integer domain
   (add half an ulp of the 3-bit mantissa, ties to even, then drop 20 bits; the exponent re-biases 127 → 7 by
   subtracting 120 << 3). Subnormal results are |y|·2^9 rounded to an integer (k · 2^-9, k = 0..8; 8 is the
   smallest normal code, so the two ranges meet): ×512 is exact and adding 2^23 rounds to an integer in the
   FPU's default round-to-nearest-even mode. Branch-free so the loops vectorize. */
static inline uint8_t e4m3_code(float y) {
    uint32_t b;
    memcpy(&b, &y, 4);
    uint32_t sign = (b >> 24) & 0x80u;
    uint32_t a = b & 0x7FFFFFFFu;
    uint32_t is_nan = 0u - (uint32_t)(a > 0x7F800000u);
    uint32_t c = a > 0x43E00000u ? 0x43E00000u : a;  /* saturate at 448 (infinities too) */
    uint32_t normal = ((c + 0x7FFFFu + ((c >> 20) & 1u)) >> 20) - (120u << 3);
    float cf;
    memcpy(&cf, &c, 4);
    float t = cf * 512.0f + 8388608.0f;
    uint32_t tb;
    memcpy(&tb, &t, 4);
    uint32_t code = c >= 0x3C800000u ? normal : tb - 0x4B000000u;
    code = (code & ~is_nan) | (0x7Fu & is_nan);
    return (uint8_t)(code | sign);
}

/* dst = E4M3(x · (1/scale[row])): the reciprocal once per row, as torch.reciprocal does, then one multiply. */
static void quantize_fp32_rows(const void *x_, void *dst_, int64_t rows, int64_t cols, const float *scale,
                               int64_t scale_stride) {
    const float *x = (const float *)x_;
    uint8_t *dst = (uint8_t *)dst_;
    for (int64_t r = 0; r < rows; ++r) {
        const float inv = 1.0f / scale[r * scale_stride];
        const float *in = x + r * cols;
        uint8_t *out = dst + r * cols;
        for (int64_t i = 0; i < cols; ++i) out[i] = e4m3_code(in[i] * inv);
    }
}

static void quantize_bf16_rows(const void *x_, void *dst_, int64_t rows, int64_t cols, const float *scale,
                               int64_t scale_stride) {
    const uint16_t *x = (const uint16_t *)x_;
    uint8_t *dst = (uint8_t *)dst_;
    for (int64_t r = 0; r < rows; ++r) {
        const float inv = 1.0f / scale[r * scale_stride];
        const uint16_t *in = x + r * cols;
        uint8_t *out = dst + r * cols;
        for (int64_t i = 0; i < cols; ++i) {
            uint32_t bits = (uint32_t)in[i] << 16;
            float v;
            memcpy(&v, &bits, 4);
            out[i] = e4m3_code(v * inv);
        }
    }
}

/* The passes above are memory-bound loops; torch runs its own elementwise ops and GEMMs on torch.get_num_threads()
   threads, so a large pass is split the same way: built with OpenMP against torch's own OpenMP runtime (the
   library torch loaded: one thread team, the one torch.set_num_threads sizes), chunks of whole rows when each
   row has its own scale, else of elements. Below parallel_min elements per chunk a pass stays on one thread.
   Every element is computed on its own, so the bits do not depend on the split. */
typedef void (*rows_fn)(const void *src, void *dst, int64_t rows, int64_t cols, const float *scale, int64_t stride);
static int64_t parallel_min = 1 << 17;
void dbr_set_parallel_min(int64_t n) { parallel_min = n > 1 ? n : 1; }

/* How many threads a pass over n elements takes: one per parallel_min elements, at most torch's thread count,
   one inside a parallel region or without OpenMP. */
static int64_t thread_parts(int64_t n) {
    int64_t parts = n / parallel_min;
#ifdef _OPENMP
    if (parts > omp_get_max_threads()) parts = omp_get_max_threads();
    if (omp_in_parallel()) parts = 1;
#else
    parts = 1;
#endif
    return parts;
}

static void run_chunks(rows_fn fn, const uint8_t *src, int64_t in_size, uint8_t *dst, int64_t out_size, int64_t rows,
                       int64_t cols, const float *scale, int64_t stride) {
    int64_t n = rows * cols, parts = thread_parts(n);
    if (stride != 0 && parts > rows) parts = rows;
    if (parts <= 1) {
        fn(src, dst, rows, cols, scale, stride);
        return;
    }
    if (stride == 0) {
        int64_t step = ((n + parts - 1) / parts + 63) / 64 * 64, count = (n + step - 1) / step;
#ifdef _OPENMP
#pragma omp parallel for num_threads((int)parts) schedule(static)
#endif
        for (int64_t c = 0; c < count; ++c) {
            int64_t a = c * step;
            fn(src + a * in_size, dst + a * out_size, 1, n - a < step ? n - a : step, scale, 0);
        }
    } else {
        int64_t step = (rows + parts - 1) / parts, count = (rows + step - 1) / step;
#ifdef _OPENMP
#pragma omp parallel for num_threads((int)parts) schedule(static)
#endif
        for (int64_t c = 0; c < count; ++c) {
            int64_t a = c * step;
            fn(src + a * cols * in_size, dst + a * cols * out_size, rows - a < step ? rows - a : step, cols,
               scale + a * stride, stride);
        }
    }
}

void dbr_e4m3_to_fp32(const uint8_t *src, float *dst, int64_t n) {
    run_chunks(to_fp32_rows, src, 1, (uint8_t *)dst, 4, 1, n, 0, 0);
}
void dbr_e4m3_to_bf16(const uint8_t *src, uint16_t *dst, int64_t n) {
    run_chunks(to_bf16_rows, src, 1, (uint8_t *)dst, 2, 1, n, 0, 0);
}
void dbr_e4m3_to_fp32_scaled(const uint8_t *src, float *dst, int64_t rows, int64_t cols, const float *scale,
                             int64_t stride) {
    run_chunks(scaled_rows, src, 1, (uint8_t *)dst, 4, rows, cols, scale, stride);
}
void dbr_quantize_e4m3_fp32(const float *x, uint8_t *dst, int64_t rows, int64_t cols, const float *scale,
                            int64_t stride) {
    run_chunks(quantize_fp32_rows, (const uint8_t *)x, 4, dst, 1, rows, cols, scale, stride);
}
void dbr_quantize_e4m3_bf16(const uint16_t *x, uint8_t *dst, int64_t rows, int64_t cols, const float *scale,
                            int64_t stride) {
    run_chunks(quantize_bf16_rows, (const uint8_t *)x, 2, dst, 1, rows, cols, scale, stride);
}

/* A small FP8 linear in one call (both operands ≤ SMALL elements, checked by the caller), where torch's per-op
   cost, not arithmetic, is the time: y[m,n] = act(Σ_k (x[m,k]·sx[m]) · (w[n,k]·sw[n]) + b[n]) + r[m,n], the
   operands dequantized first as the reference's fp32 GEMMs do, the sum in k order with every product and
   every addition rounded to fp32 (built with -ffp-contract=off: no fused multiply-adds). act: 0 none, 1 relu
   (torch's: NaN and -0 pass). Output fp32, or E4M3 codes of y·(1/so) when out_q is given. */
#define SMALL 4096
void dbr_small_linear(const uint8_t *xq, const float *xs, int64_t xs_stride, const uint8_t *wq, const float *ws,
                      int64_t ws_stride, const float *bias, const float *residual, int32_t act, int64_t M,
                      int64_t N, int64_t K, float *out, uint8_t *out_q, const float *out_scale) {
    float xd[SMALL], wd[SMALL];
    for (int64_t n = 0; n < N; ++n)
        for (int64_t k = 0; k < K; ++k) {
            uint32_t bits = e4m3_bits(wq[n * K + k]);
            float v;
            memcpy(&v, &bits, 4);
            wd[n * K + k] = v * ws[n * ws_stride];
        }
    for (int64_t m = 0; m < M; ++m)
        for (int64_t k = 0; k < K; ++k) {
            uint32_t bits = e4m3_bits(xq[m * K + k]);
            float v;
            memcpy(&v, &bits, 4);
            xd[m * K + k] = v * xs[m * xs_stride];
        }
    const float inv = out_q ? 1.0f / out_scale[0] : 0.0f;
    for (int64_t m = 0; m < M; ++m)
        for (int64_t n = 0; n < N; ++n) {
            float acc = 0.0f;
            for (int64_t k = 0; k < K; ++k) acc += xd[m * K + k] * wd[n * K + k];
            float y = bias ? acc + bias[n] : acc;
            if (act == 1) y = y < 0.0f ? 0.0f : y;
            if (residual) y += residual[m * N + n];
            if (out_q) out_q[m * N + n] = e4m3_code(y * inv);
            else out[m * N + n] = y;
        }
}

/* Dynamic quantize in one call: the amax of each row (per_token) or of the whole tensor, non-finite values
   ignored, as a max of the magnitudes' bit patterns (for non-negative floats the integer order is the float order,
   so the max is exact and vectorizes); the scale safe_scale makes of it (amax / 448, one division; 1 where that
   is 0 or not finite; at least FLT_MIN); then the row quantized as quantize_*_rows does, while it is still in
   cache. Writes the codes and the scales (one per row, or one). */
static inline uint32_t magnitude_if_finite(uint32_t bits) {
    uint32_t a = bits & 0x7FFFFFFFu;
    return a & (0u - (uint32_t)(a < 0x7F800000u));  /* a mask, not a select: GCC 12 vectorizes this max, not ?: */
}

static float safe_scale_of(uint32_t amax_bits) {
    float amax;
    memcpy(&amax, &amax_bits, 4);
    float scale = amax / 448.0f;
    if (!(scale > 0.0f) || scale > 3.4028234663852886e38f) scale = 1.0f;
    return scale < 1.1754943508222875e-38f ? 1.1754943508222875e-38f : scale;
}

static uint32_t amax_fp32(const float *x, int64_t n) {
    const uint32_t *b = (const uint32_t *)x;
    uint32_t m = 0;
    for (int64_t i = 0; i < n; ++i) {
        uint32_t a = magnitude_if_finite(b[i]);
        m = a > m ? a : m;
    }
    return m;
}

static uint32_t amax_bf16(const uint16_t *x, int64_t n) {
    uint32_t m = 0;
    for (int64_t i = 0; i < n; ++i) {
        uint32_t a = magnitude_if_finite((uint32_t)x[i] << 16);
        m = a > m ? a : m;
    }
    return m;
}

static void dynamic_rows(const void *x, int is_bf16, uint8_t *dst, int64_t rows, int64_t cols, float *scale) {
    for (int64_t r = 0; r < rows; ++r) {
        const void *row = is_bf16 ? (const void *)((const uint16_t *)x + r * cols) : (const void *)((const float *)x + r * cols);
        scale[r] = safe_scale_of(is_bf16 ? amax_bf16((const uint16_t *)row, cols) : amax_fp32((const float *)row, cols));
        (is_bf16 ? quantize_bf16_rows : quantize_fp32_rows)(row, dst + r * cols, 1, cols, scale + r, 0);
    }
}

void dbr_dynamic_quantize_e4m3(const void *x, int32_t is_bf16, uint8_t *dst, int64_t rows, int64_t cols,
                               int32_t per_token, float *scale) {
    const int64_t in_size = is_bf16 ? 2 : 4;
    if (!per_token) {  /* one amax over everything, then the quantize split as any other pass */
        uint32_t m = 0;
        const int64_t n = rows * cols;
        int parts = 1;
#ifdef _OPENMP
        if (!omp_in_parallel() && n >= 2 * parallel_min) parts = omp_get_max_threads();
#pragma omp parallel for num_threads(parts) if (parts > 1) reduction(max : m) schedule(static)
#endif
        for (int64_t c = 0; c < parts; ++c) {
            int64_t a = n * c / parts, e = n * (c + 1) / parts;
            uint32_t part = is_bf16 ? amax_bf16((const uint16_t *)x + a, e - a) : amax_fp32((const float *)x + a, e - a);
            m = part > m ? part : m;
        }
        scale[0] = safe_scale_of(m);
        run_chunks(is_bf16 ? quantize_bf16_rows : quantize_fp32_rows, (const uint8_t *)x, in_size, dst, 1, 1, n,
                   scale, 0);
        return;
    }
    int64_t parts = thread_parts(rows * cols);
    if (parts > rows) parts = rows;
    if (parts <= 1) {
        dynamic_rows(x, is_bf16, dst, rows, cols, scale);
        return;
    }
    const int64_t step = (rows + parts - 1) / parts, count = (rows + step - 1) / step;
#ifdef _OPENMP
#pragma omp parallel for num_threads((int)parts) schedule(static)
#endif
    for (int64_t c = 0; c < count; ++c) {
        int64_t a = c * step;
        dynamic_rows((const uint8_t *)x + a * cols * in_size, is_bf16, dst + a * cols, rows - a < step ? rows - a : step,
                     cols, scale + a);
    }
}
