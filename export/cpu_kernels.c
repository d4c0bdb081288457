/* One-row weight matmuls for Kiln's CPU builds: y[n] = sum_k w[n][k] * x[k], for float32,
 * bfloat16 and block-quantized int8 weights.
 *
 * A decode step at batch 1 multiplies one activation row by every weight matrix, so its time
 * is the time to read the weights. Each kernel reads four weight rows side by side, with the
 * activation row held in cache and a software prefetch a few rows ahead: with rows of a few
 * hundred bytes to a few KB, each row's stream is too short for the hardware prefetchers to
 * get ahead of it on their own (benchmarks/NOTES.md, "Hand-written one-row matmuls").
 *
 * Linked into IREE's embedded ELF executables: no libc, no globals, no thread-local state.
 * Each call computes the output rows [row0, row0 + rows) of one workgroup. Prefetches past the
 * end of a buffer are harmless: a prefetch never faults.
 *
 * Arguments follow MLIR's memref lowering for memref<?xT>: allocated pointer, aligned
 * pointer, offset, size, stride; then the index operands of the dispatch.
 */
#include <stddef.h>
#include <stdint.h>
#include <immintrin.h>

#define MEMREF_F32(name) \
  const float *name##_allocated, const float *restrict name, size_t name##_offset, size_t name##_size, \
  size_t name##_stride

/* How many rows ahead of the four being read each kernel prefetches (measured on weights four
 * times the last-level cache: float32 29.5 -> 32 GB/s, bfloat16 and int8 blocks about 1.25x). */
enum { F32_PREFETCH_ROWS = 4, BF16_PREFETCH_ROWS = 8, Q8_PREFETCH_ROWS = 8 };

static inline float dot_tail(const float *w, const float *x, size_t k0, size_t k_dim) {
  float sum = 0.f;
  for (size_t k = k0; k < k_dim; ++k) sum += w[k] * x[k];
  return sum;
}

void kiln_row_matmul_f32(MEMREF_F32(x), MEMREF_F32(w), float *y_allocated, float *restrict y, size_t y_offset,
                         size_t y_size, size_t y_stride, size_t n_dim, size_t k_dim, size_t row0, size_t rows) {
  (void)x_allocated; (void)x_size; (void)x_stride; (void)w_allocated; (void)w_size; (void)w_stride;
  (void)y_allocated; (void)y_size; (void)y_stride;
  x += x_offset;
  w += w_offset;
  y += y_offset;
  size_t end = row0 + rows < n_dim ? row0 + rows : n_dim;
  size_t k_vec = k_dim & ~(size_t)15;
  __mmask16 tail = (__mmask16)((1u << (k_dim - k_vec)) - 1u);
  size_t r = row0;
  for (; r + 4 <= end; r += 4) {
    const float *w0 = w + r * k_dim, *w1 = w0 + k_dim, *w2 = w1 + k_dim, *w3 = w2 + k_dim;
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
    size_t k = 0;
    for (; k < k_vec; k += 16) {
      _mm_prefetch((const char *)(w0 + F32_PREFETCH_ROWS * k_dim + k), _MM_HINT_T0);
      _mm_prefetch((const char *)(w1 + F32_PREFETCH_ROWS * k_dim + k), _MM_HINT_T0);
      _mm_prefetch((const char *)(w2 + F32_PREFETCH_ROWS * k_dim + k), _MM_HINT_T0);
      _mm_prefetch((const char *)(w3 + F32_PREFETCH_ROWS * k_dim + k), _MM_HINT_T0);
      __m512 xv = _mm512_loadu_ps(x + k);
      a0 = _mm512_fmadd_ps(_mm512_loadu_ps(w0 + k), xv, a0);
      a1 = _mm512_fmadd_ps(_mm512_loadu_ps(w1 + k), xv, a1);
      a2 = _mm512_fmadd_ps(_mm512_loadu_ps(w2 + k), xv, a2);
      a3 = _mm512_fmadd_ps(_mm512_loadu_ps(w3 + k), xv, a3);
    }
    if (tail) {
      __m512 xv = _mm512_maskz_loadu_ps(tail, x + k);
      a0 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tail, w0 + k), xv, a0);
      a1 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tail, w1 + k), xv, a1);
      a2 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tail, w2 + k), xv, a2);
      a3 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tail, w3 + k), xv, a3);
    }
    y[r] = _mm512_reduce_add_ps(a0);
    y[r + 1] = _mm512_reduce_add_ps(a1);
    y[r + 2] = _mm512_reduce_add_ps(a2);
    y[r + 3] = _mm512_reduce_add_ps(a3);
  }
  for (; r < end; ++r) y[r] = dot_tail(w + r * k_dim, x, 0, k_dim);
}

/* The same for bfloat16 x and w (x rounded to bfloat16 by the caller, as the model's matmul
 * input is), products summed in float32 by AVX512-BF16's pairwise dot products. */
#define MEMREF_BF16(name) \
  const uint16_t *name##_allocated, const uint16_t *restrict name, size_t name##_offset, size_t name##_size, \
  size_t name##_stride

static inline float bf16_to_float(uint16_t v) {
  union { uint32_t u; float f; } bits = {(uint32_t)v << 16};
  return bits.f;
}

__attribute__((target("avx512f,avx512bw,avx512bf16")))
void kiln_row_matmul_bf16(MEMREF_BF16(x), MEMREF_BF16(w), float *y_allocated, float *restrict y, size_t y_offset,
                          size_t y_size, size_t y_stride, size_t n_dim, size_t k_dim, size_t row0, size_t rows) {
  (void)x_allocated; (void)x_size; (void)x_stride; (void)w_allocated; (void)w_size; (void)w_stride;
  (void)y_allocated; (void)y_size; (void)y_stride;
  x += x_offset;
  w += w_offset;
  y += y_offset;
  size_t end = row0 + rows < n_dim ? row0 + rows : n_dim;
  size_t k_vec = k_dim & ~(size_t)31;
  __mmask32 tail = (__mmask32)((1ull << (k_dim - k_vec)) - 1ull);
  size_t r = row0;
  for (; r + 4 <= end; r += 4) {
    const uint16_t *w0 = w + r * k_dim, *w1 = w0 + k_dim, *w2 = w1 + k_dim, *w3 = w2 + k_dim;
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
    size_t k = 0;
    for (; k < k_vec; k += 32) {
      _mm_prefetch((const char *)(w0 + BF16_PREFETCH_ROWS * k_dim + k), _MM_HINT_T0);
      _mm_prefetch((const char *)(w1 + BF16_PREFETCH_ROWS * k_dim + k), _MM_HINT_T0);
      _mm_prefetch((const char *)(w2 + BF16_PREFETCH_ROWS * k_dim + k), _MM_HINT_T0);
      _mm_prefetch((const char *)(w3 + BF16_PREFETCH_ROWS * k_dim + k), _MM_HINT_T0);
      __m512bh xv = (__m512bh)_mm512_loadu_si512(x + k);
      a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(w0 + k), xv);
      a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_loadu_si512(w1 + k), xv);
      a2 = _mm512_dpbf16_ps(a2, (__m512bh)_mm512_loadu_si512(w2 + k), xv);
      a3 = _mm512_dpbf16_ps(a3, (__m512bh)_mm512_loadu_si512(w3 + k), xv);
    }
    if (tail) {
      __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(tail, x + k);
      a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_maskz_loadu_epi16(tail, w0 + k), xv);
      a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_maskz_loadu_epi16(tail, w1 + k), xv);
      a2 = _mm512_dpbf16_ps(a2, (__m512bh)_mm512_maskz_loadu_epi16(tail, w2 + k), xv);
      a3 = _mm512_dpbf16_ps(a3, (__m512bh)_mm512_maskz_loadu_epi16(tail, w3 + k), xv);
    }
    y[r] = _mm512_reduce_add_ps(a0);
    y[r + 1] = _mm512_reduce_add_ps(a1);
    y[r + 2] = _mm512_reduce_add_ps(a2);
    y[r + 3] = _mm512_reduce_add_ps(a3);
  }
  for (; r < end; ++r) {
    const uint16_t *w0 = w + r * k_dim;
    float sum = 0.f;
    for (size_t k = 0; k < k_dim; ++k) sum += bf16_to_float(w0[k]) * bf16_to_float(x[k]);
    y[r] = sum;
  }
}

/* The block-quantized form (Q8_0, Q4_0, Q4_1: int8 values in blocks of 32 input channels, a
 * float scale per block and row, and for Q4_1 an offset per block and row), with the input
 * quantized by the caller to int8 per block of 32 as llama.cpp's dot products take it:
 *
 *   y[n] = sum_g xs[g] * (isum(g, n) * ws[g][n] + xsum[g] * wo[g][n])
 *
 * where isum(g, n) is block g's int8 dot product, xs the input's block scales and xsum its
 * blocks' sums of quantized values (the offset term only when has_offset). Both scales apply
 * inside the loop, so no per-block partial sums are written out. The int8 x int8 products run
 * as AVX512-VNNI's unsigned x signed dot products: |x| times w with x's sign moved onto w. */
#define MEMREF_I8(name) \
  const int8_t *name##_allocated, const int8_t *restrict name, size_t name##_offset, size_t name##_size, \
  size_t name##_stride

__attribute__((target("avx512f,avx512bw,avx512vnni")))
void kiln_row_matmul_q8(MEMREF_I8(q), MEMREF_F32(xs), MEMREF_F32(xsum), MEMREF_I8(w), MEMREF_F32(ws),
                        MEMREF_F32(wo), float *y_allocated, float *restrict y, size_t y_offset, size_t y_size,
                        size_t y_stride, size_t n_dim, size_t k_dim, size_t has_offset, size_t row0, size_t rows) {
  (void)q_allocated; (void)q_size; (void)q_stride; (void)xs_allocated; (void)xs_size; (void)xs_stride;
  (void)xsum_allocated; (void)xsum_size; (void)xsum_stride; (void)w_allocated; (void)w_size; (void)w_stride;
  (void)ws_allocated; (void)ws_size; (void)ws_stride; (void)wo_allocated; (void)wo_size; (void)wo_stride;
  (void)y_allocated; (void)y_size; (void)y_stride;
  q += q_offset;
  xs += xs_offset;
  xsum += xsum_offset;
  w += w_offset;
  ws += ws_offset;
  wo += wo_offset;
  y += y_offset;
  const size_t groups = k_dim / 32;
  size_t end = row0 + rows < n_dim ? row0 + rows : n_dim;
  const __m512i zero = _mm512_setzero_si512();
  /* Lane i of row j's scale vector: lanes 0-7 take block g's scale (sab lane j), 8-15 block g+1's
   * (sab lane 4 + j), matching the dot product's lanes (eight int32 sums per 32-byte block). */
  const __m512i pick[4] = {
      _mm512_set_epi32(4, 4, 4, 4, 4, 4, 4, 4, 0, 0, 0, 0, 0, 0, 0, 0),
      _mm512_set_epi32(5, 5, 5, 5, 5, 5, 5, 5, 1, 1, 1, 1, 1, 1, 1, 1),
      _mm512_set_epi32(6, 6, 6, 6, 6, 6, 6, 6, 2, 2, 2, 2, 2, 2, 2, 2),
      _mm512_set_epi32(7, 7, 7, 7, 7, 7, 7, 7, 3, 3, 3, 3, 3, 3, 3, 3)};
  size_t r = row0;
  for (; r + 4 <= end; r += 4) {
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    __m128 offsets = _mm_setzero_ps();
    for (size_t g = 0; g < groups; g += 2) {
      const int pair = g + 1 < groups;
      const __mmask64 bytes = pair ? ~(__mmask64)0 : (__mmask64)0xFFFFFFFFull;
      __m512i xv = _mm512_maskz_loadu_epi8(bytes, q + g * 32);
      __m512i magnitude = _mm512_abs_epi8(xv);
      __mmask64 negative = _mm512_movepi8_mask(xv);
      __m128 sa = _mm_mul_ps(_mm_set1_ps(xs[g]), _mm_loadu_ps(ws + g * n_dim + r));
      __m128 sb = pair ? _mm_mul_ps(_mm_set1_ps(xs[g + 1]), _mm_loadu_ps(ws + (g + 1) * n_dim + r)) : _mm_setzero_ps();
      __m512 sab = _mm512_castps256_ps512(_mm256_set_m128(sb, sa));
      for (int j = 0; j < 4; ++j) {
        _mm_prefetch((const char *)(w + (r + Q8_PREFETCH_ROWS + j) * k_dim + g * 32), _MM_HINT_T0);
        __m512i wv = _mm512_maskz_loadu_epi8(bytes, w + (r + j) * k_dim + g * 32);
        wv = _mm512_mask_sub_epi8(wv, negative, zero, wv);
        __m512i dot = _mm512_dpbusd_epi32(zero, magnitude, wv);
        acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_permutexvar_ps(pick[j], sab), acc[j]);
      }
      if (has_offset) {
        offsets = _mm_fmadd_ps(_mm_set1_ps(xs[g] * xsum[g]), _mm_loadu_ps(wo + g * n_dim + r), offsets);
        if (pair)
          offsets = _mm_fmadd_ps(_mm_set1_ps(xs[g + 1] * xsum[g + 1]), _mm_loadu_ps(wo + (g + 1) * n_dim + r), offsets);
      }
    }
    float extra[4];
    _mm_storeu_ps(extra, offsets);
    for (int j = 0; j < 4; ++j) y[r + j] = _mm512_reduce_add_ps(acc[j]) + extra[j];
  }
  for (; r < end; ++r) {
    float sum = 0.f;
    for (size_t g = 0; g < groups; ++g) {
      int32_t dot = 0;
      for (size_t i = 0; i < 32; ++i) dot += (int32_t)q[g * 32 + i] * (int32_t)w[r * k_dim + g * 32 + i];
      float block = (float)dot * ws[g * n_dim + r];
      if (has_offset) block += xsum[g] * wo[g * n_dim + r];
      sum += xs[g] * block;
    }
    y[r] = sum;
  }
}
