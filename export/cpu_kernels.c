/* One-row weight matmuls for Kiln's CPU builds: y[n] = sum_k w[n][k] * x[k], for float32,
 * bfloat16 and block-quantized int8 weights; and, at the end, a decode step's attention over the
 * paged KV cache, read in place (export/cpu_attention.py dispatches it).
 *
 * A decode step at batch 1 multiplies one activation row by every weight matrix, so its time
 * is the time to read the weights. Each kernel reads four weight rows side by side, with the
 * activation row held in cache and a software prefetch a few rows ahead: with rows of a few
 * hundred bytes to a few KB, each row's stream is too short for the hardware prefetchers to
 * get ahead of it on their own (benchmarks/NOTES.md, "Hand-written one-row matmuls"). Every
 * kernel also takes a decode step's several input rows (the float32 and 4-bit ones reading each
 * weight from memory once for all of them, the others a pass per row over weights then in
 * cache), and computes each row the same way whatever rows share the call: a step's results do
 * not depend on its batch.
 *
 * Linked into IREE's embedded ELF executables: no libc, no globals, no thread-local state.
 * Each call computes the output rows [row0, row0 + rows) of one workgroup. Prefetches past the
 * end of a buffer are harmless: a prefetch never faults. This is the AVX-512 build;
 * cpu_kernels_avx2.c is the one for x86-64 CPUs without it or without its VNNI (cpu_kernels.h:
 * what both share).
 */
#include "cpu_kernels.h"

/* How many rows ahead of the four being read each kernel prefetches (measured on weights four
 * times the last-level cache: float32 29.5 -> 32 GB/s, bfloat16 and int8 blocks about 1.25x). */
enum { F32_PREFETCH_ROWS = 4, BF16_PREFETCH_ROWS = 8, Q8_PREFETCH_ROWS = 8 };

static inline float dot_tail(const float *w, const float *x, size_t k0, size_t k_dim) {
  float sum = 0.f;
  for (size_t k = k0; k < k_dim; ++k) sum += w[k] * x[k];
  return sum;
}

/* Four weight rows (w0, each k_dim long) times one input row x: out[j] = w_j . x. `prefetch`: also
 * ask for the rows F32_PREFETCH_ROWS ahead (the first pass over these rows, which streams them). */
static inline void f32_one_by_four(const float *x, const float *w0, size_t k_dim, size_t k_vec, __mmask16 tail,
                                   int prefetch, float out[4]) {
  const float *w1 = w0 + k_dim, *w2 = w1 + k_dim, *w3 = w2 + k_dim;
  __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
  size_t k = 0;
  for (; k < k_vec; k += 16) {
    if (prefetch) {
      _mm_prefetch((const char *)(w0 + F32_PREFETCH_ROWS * k_dim + k), _MM_HINT_T0);
      _mm_prefetch((const char *)(w1 + F32_PREFETCH_ROWS * k_dim + k), _MM_HINT_T0);
      _mm_prefetch((const char *)(w2 + F32_PREFETCH_ROWS * k_dim + k), _MM_HINT_T0);
      _mm_prefetch((const char *)(w3 + F32_PREFETCH_ROWS * k_dim + k), _MM_HINT_T0);
    }
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
  out[0] = _mm512_reduce_add_ps(a0);
  out[1] = _mm512_reduce_add_ps(a1);
  out[2] = _mm512_reduce_add_ps(a2);
  out[3] = _mm512_reduce_add_ps(a3);
}

/* Four weight rows times four input rows (x, k_dim apart): out[i][j] = w_j . x_i, each weight
 * vector loaded once for the four inputs (16 accumulators, 4 input vectors, 1 weight vector: the
 * accumulators are named so that they stay in registers). */
#define F32_FOUR_INPUTS(j, wv)                   \
  acc0##j = _mm512_fmadd_ps(wv, x0, acc0##j);    \
  acc1##j = _mm512_fmadd_ps(wv, x1, acc1##j);    \
  acc2##j = _mm512_fmadd_ps(wv, x2, acc2##j);    \
  acc3##j = _mm512_fmadd_ps(wv, x3, acc3##j)

static inline __attribute__((always_inline)) void f32_four_by_four(const float *x, const float *w0, size_t k_dim,
                                                                   size_t k_vec, __mmask16 tail, float out[4][4]) {
  const float *w1 = w0 + k_dim, *w2 = w1 + k_dim, *w3 = w2 + k_dim;
  __m512 acc00 = _mm512_setzero_ps(), acc01 = acc00, acc02 = acc00, acc03 = acc00, acc10 = acc00, acc11 = acc00,
         acc12 = acc00, acc13 = acc00, acc20 = acc00, acc21 = acc00, acc22 = acc00, acc23 = acc00, acc30 = acc00,
         acc31 = acc00, acc32 = acc00, acc33 = acc00;
  size_t k = 0;
  for (; k < k_vec; k += 16) {
    _mm_prefetch((const char *)(w0 + F32_PREFETCH_ROWS * k_dim + k), _MM_HINT_T0);
    _mm_prefetch((const char *)(w1 + F32_PREFETCH_ROWS * k_dim + k), _MM_HINT_T0);
    _mm_prefetch((const char *)(w2 + F32_PREFETCH_ROWS * k_dim + k), _MM_HINT_T0);
    _mm_prefetch((const char *)(w3 + F32_PREFETCH_ROWS * k_dim + k), _MM_HINT_T0);
    __m512 x0 = _mm512_loadu_ps(x + k), x1 = _mm512_loadu_ps(x + k_dim + k);
    __m512 x2 = _mm512_loadu_ps(x + 2 * k_dim + k), x3 = _mm512_loadu_ps(x + 3 * k_dim + k);
    F32_FOUR_INPUTS(0, _mm512_loadu_ps(w0 + k));
    F32_FOUR_INPUTS(1, _mm512_loadu_ps(w1 + k));
    F32_FOUR_INPUTS(2, _mm512_loadu_ps(w2 + k));
    F32_FOUR_INPUTS(3, _mm512_loadu_ps(w3 + k));
  }
  if (tail) {
    __m512 x0 = _mm512_maskz_loadu_ps(tail, x + k), x1 = _mm512_maskz_loadu_ps(tail, x + k_dim + k);
    __m512 x2 = _mm512_maskz_loadu_ps(tail, x + 2 * k_dim + k), x3 = _mm512_maskz_loadu_ps(tail, x + 3 * k_dim + k);
    F32_FOUR_INPUTS(0, _mm512_maskz_loadu_ps(tail, w0 + k));
    F32_FOUR_INPUTS(1, _mm512_maskz_loadu_ps(tail, w1 + k));
    F32_FOUR_INPUTS(2, _mm512_maskz_loadu_ps(tail, w2 + k));
    F32_FOUR_INPUTS(3, _mm512_maskz_loadu_ps(tail, w3 + k));
  }
  out[0][0] = _mm512_reduce_add_ps(acc00); out[0][1] = _mm512_reduce_add_ps(acc01);
  out[0][2] = _mm512_reduce_add_ps(acc02); out[0][3] = _mm512_reduce_add_ps(acc03);
  out[1][0] = _mm512_reduce_add_ps(acc10); out[1][1] = _mm512_reduce_add_ps(acc11);
  out[1][2] = _mm512_reduce_add_ps(acc12); out[1][3] = _mm512_reduce_add_ps(acc13);
  out[2][0] = _mm512_reduce_add_ps(acc20); out[2][1] = _mm512_reduce_add_ps(acc21);
  out[2][2] = _mm512_reduce_add_ps(acc22); out[2][3] = _mm512_reduce_add_ps(acc23);
  out[3][0] = _mm512_reduce_add_ps(acc30); out[3][1] = _mm512_reduce_add_ps(acc31);
  out[3][2] = _mm512_reduce_add_ps(acc32); out[3][3] = _mm512_reduce_add_ps(acc33);
}

/* y [m_dim, n_dim] = x [m_dim, k_dim] times w [n_dim, k_dim] transposed, for the output rows
 * [row0, row0 + rows). One input row streams the weights once (four rows side by side); several
 * (a decode step at a small batch) take them four at a time against four weight rows, so the
 * weights come from memory once and from the core's own cache once per four inputs. */
void kiln_row_matmul_f32(MEMREF_F32(x), MEMREF_F32(w), float *y_allocated, float *restrict y, size_t y_offset,
                         size_t y_size, size_t y_stride, size_t n_dim, size_t k_dim, size_t m_dim, size_t row0,
                         size_t rows) {
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
    const float *w0 = w + r * k_dim;
    size_t i = 0;
    for (; i + 4 <= m_dim; i += 4) {
      float out[4][4];
      f32_four_by_four(x + i * k_dim, w0, k_dim, k_vec, tail, out);
      for (int a = 0; a < 4; ++a)
        for (int b = 0; b < 4; ++b) y[(i + a) * n_dim + r + b] = out[a][b];
    }
    for (; i < m_dim; ++i) {
      float out[4];
      f32_one_by_four(x + i * k_dim, w0, k_dim, k_vec, tail, i == 0, out);
      for (int b = 0; b < 4; ++b) y[i * n_dim + r + b] = out[b];
    }
  }
  for (; r < end; ++r)
    for (size_t i = 0; i < m_dim; ++i) y[i * n_dim + r] = dot_tail(w + r * k_dim, x + i * k_dim, 0, k_dim);
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
static void bf16_one_row(const uint16_t *restrict x, const uint16_t *restrict w, float *restrict y, size_t n_dim,
                         size_t k_dim, size_t row0, size_t rows) {
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

/* x [m_dim, k_dim] in bfloat16 times w [n_dim, k_dim]: each input row a pass of its own over the
 * workgroup's weight rows (from the cache after the first). */
__attribute__((target("avx512f,avx512bw,avx512bf16")))
void kiln_row_matmul_bf16(MEMREF_BF16(x), MEMREF_BF16(w), float *y_allocated, float *restrict y, size_t y_offset,
                          size_t y_size, size_t y_stride, size_t n_dim, size_t k_dim, size_t m_dim, size_t row0,
                          size_t rows) {
  (void)x_allocated; (void)x_size; (void)x_stride; (void)w_allocated; (void)w_size; (void)w_stride;
  (void)y_allocated; (void)y_size; (void)y_stride;
  for (size_t i = 0; i < m_dim; ++i)
    bf16_one_row(x + x_offset + i * k_dim, w + w_offset, y + y_offset + i * n_dim, n_dim, k_dim, row0, rows);
}

/* The block-quantized form (Q8_0, Q4_0, Q4_1: int8 values in blocks of 32 input channels, a
 * float scale per block and row, and for Q4_1 an offset per block and row), with the input
 * quantized by the caller to int8 per block of 32 as llama.cpp's dot products take it:
 *
 *   y[n] = sum_g xs[g] * (isum(g, n) * ws[g][n] + xsum[g] * wo[g][n])
 *
 * where isum(g, n) is block g's int8 dot product, xs the input's block scales and xsum its
 * blocks' sums of quantized values (the offset term only when `flags` has Q8_OFFSETS). With
 * Q8_ROW_SCALES, ws holds one scale per row ([N], int8 with row scales) that every block of the
 * row takes. With Q8_HALF_BLOCKS the weight's scales are per half block of 16 ([2 G, N]: Q6_K's
 * sub-blocks), the input's still per 32, and each half's dot product takes its own scale; no
 * offsets then. Both scales apply inside the loop, so no per-block partial sums are written out.
 * The int8 x int8 products run as AVX512-VNNI's unsigned x signed dot products: |x| times w with
 * x's sign moved onto w. Its flags (cpu_kernels.h) say which form a weight takes. */

/* Two 8-float vectors as one of 16, a first. */
static inline __m512 side_by_side(__m256 a, __m256 b) {
  return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(a)), _mm256_castps_pd(b), 1));
}

__attribute__((target("avx512f,avx512bw,avx512vnni")))
static void q8_one_input(const int8_t *q, const float *xs, const float *xsum, const int8_t *w, const float *ws,
                         const float *wo, float *y, size_t n_dim, size_t k_dim, size_t flags, size_t row0,
                         size_t rows) {
  const size_t groups = k_dim / 32;
  const int has_offset = (flags & Q8_OFFSETS) != 0, halves = (flags & Q8_HALF_BLOCKS) != 0;
  /* Block g's scales start at ws + g * scale_stride: the same [N] for every block with row scales. */
  const size_t scale_stride = flags & Q8_ROW_SCALES ? 0 : n_dim;
  size_t end = row0 + rows < n_dim ? row0 + rows : n_dim;
  const __m512i zero = _mm512_setzero_si512();
  /* Lane i of row j's scale vector: lanes 0-7 take block g's scale (sab lane j), 8-15 block g+1's
   * (sab lane 4 + j), matching the dot product's lanes (eight int32 sums per 32-byte block). */
  const __m512i pick[4] = {
      _mm512_set_epi32(4, 4, 4, 4, 4, 4, 4, 4, 0, 0, 0, 0, 0, 0, 0, 0),
      _mm512_set_epi32(5, 5, 5, 5, 5, 5, 5, 5, 1, 1, 1, 1, 1, 1, 1, 1),
      _mm512_set_epi32(6, 6, 6, 6, 6, 6, 6, 6, 2, 2, 2, 2, 2, 2, 2, 2),
      _mm512_set_epi32(7, 7, 7, 7, 7, 7, 7, 7, 3, 3, 3, 3, 3, 3, 3, 3)};
  /* With half blocks, lanes 0-3, 4-7, 8-11 and 12-15 are halves 2g, 2g+1, 2g+2 and 2g+3, whose
   * scales for rows r..r+3 sit at 0-3, 4-7, 8-11 and 12-15 of the scale vector. */
  const __m512i pick_half[4] = {
      _mm512_set_epi32(12, 12, 12, 12, 8, 8, 8, 8, 4, 4, 4, 4, 0, 0, 0, 0),
      _mm512_set_epi32(13, 13, 13, 13, 9, 9, 9, 9, 5, 5, 5, 5, 1, 1, 1, 1),
      _mm512_set_epi32(14, 14, 14, 14, 10, 10, 10, 10, 6, 6, 6, 6, 2, 2, 2, 2),
      _mm512_set_epi32(15, 15, 15, 15, 11, 11, 11, 11, 7, 7, 7, 7, 3, 3, 3, 3)};
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
      __m512 sab;
      const __m512i *lanes = pick;
      if (halves) {
        const __m128 xa = _mm_set1_ps(xs[g]), xb = _mm_set1_ps(pair ? xs[g + 1] : 0.f);
        const float *h = ws + 2 * g * n_dim + r;
        __m256 low = _mm256_set_m128(_mm_mul_ps(xa, _mm_loadu_ps(h + n_dim)), _mm_mul_ps(xa, _mm_loadu_ps(h)));
        __m256 high = pair ? _mm256_set_m128(_mm_mul_ps(xb, _mm_loadu_ps(h + 3 * n_dim)),
                                             _mm_mul_ps(xb, _mm_loadu_ps(h + 2 * n_dim)))
                           : _mm256_setzero_ps();
        sab = side_by_side(low, high);
        lanes = pick_half;
      } else {
        __m128 sa = _mm_mul_ps(_mm_set1_ps(xs[g]), _mm_loadu_ps(ws + g * scale_stride + r));
        __m128 sb = pair ? _mm_mul_ps(_mm_set1_ps(xs[g + 1]), _mm_loadu_ps(ws + (g + 1) * scale_stride + r))
                         : _mm_setzero_ps();
        sab = _mm512_castps256_ps512(_mm256_set_m128(sb, sa));
      }
      for (int j = 0; j < 4; ++j) {
        _mm_prefetch((const char *)(w + (r + Q8_PREFETCH_ROWS + j) * k_dim + g * 32), _MM_HINT_T0);
        __m512i wv = _mm512_maskz_loadu_epi8(bytes, w + (r + j) * k_dim + g * 32);
        wv = _mm512_mask_sub_epi8(wv, negative, zero, wv);
        __m512i dot = _mm512_dpbusd_epi32(zero, magnitude, wv);
        acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_permutexvar_ps(lanes[j], sab), acc[j]);
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
      int32_t dot[2] = {0, 0};
      for (size_t i = 0; i < 32; ++i) dot[i / 16] += (int32_t)q[g * 32 + i] * (int32_t)w[r * k_dim + g * 32 + i];
      float block = halves ? (float)dot[0] * ws[2 * g * n_dim + r] + (float)dot[1] * ws[(2 * g + 1) * n_dim + r]
                           : (float)(dot[0] + dot[1]) * ws[g * scale_stride + r];
      if (has_offset) block += xsum[g] * wo[g * n_dim + r];
      sum += xs[g] * block;
    }
    y[r] = sum;
  }
}

/* M input rows (q [M, K], xs and xsum [M, G], y [M, N]; M is `flags` >> Q8_ROWS_SHIFT), each a
 * pass of its own over this workgroup's weight rows (from the cache after the first): a row's
 * result is the same whatever else shares the call. */
__attribute__((target("avx512f,avx512bw,avx512vnni")))
void kiln_row_matmul_q8(MEMREF_I8(q), MEMREF_F32(xs), MEMREF_F32(xsum), MEMREF_I8(w), MEMREF_F32(ws),
                        MEMREF_F32(wo), float *y_allocated, float *restrict y, size_t y_offset, size_t y_size,
                        size_t y_stride, size_t n_dim, size_t k_dim, size_t flags, size_t row0, size_t rows) {
  BLOCK_OPERANDS_AT_OFFSETS();
  const size_t groups = k_dim / 32, m_dim = flags >> Q8_ROWS_SHIFT;
  for (size_t m = 0; m < m_dim; ++m)
    q8_one_input(q + m * k_dim, xs + m * groups, xsum + m * groups, w, ws, wo, y + m * n_dim, n_dim, k_dim, flags,
                 row0, rows);
}

/* The same product for 4-bit blocks stored two values a byte (Q4_0, Q4_1, Q4_K), half the bytes
 * of int8 values, for one input row or several (a decode step at batch M: q [M, K], xs and xsum
 * [M, G], y [M, N]). Each block of 32 is 16 bytes as ggml lays it out: byte j's low nibble is
 * value j, its high nibble value j + 16. The values are unsigned (0-15; Q4_0's q - 8 is q with an
 * offset of -8 d), so the dot products take them as VNNI's unsigned operand and the quantized
 * input as its signed one, and the offset term is always there:
 *
 *   y[m][n] = sum_g xs[m][g] * (isum(m, g, n) * ws[g][n] + xsum[m][g] * wo[g][n])
 *
 * Half the bytes leave the arithmetic as what bounds the loop, so it is cut to the bone: the
 * offset terms are a pass of their own (a [G] x [G, rows] product per input row, 16 rows a
 * vector), and the sums read four blocks (64 bytes) of a row at a time, whose 128 values come
 * out as two vectors, the low nibbles (values 0-15 of each block) and the high ones (16-31), with
 * the input's 128 bytes shuffled to the same order. One input row reads eight weight rows side
 * by side, so the input's shuffle and the block scales are set up once for eight; several input
 * rows read four weight rows, unpacked once for four input rows. */
enum { Q4_PREFETCH_ROWS = 16 };  /* rows half as long as Q8_0's: the same bytes ahead */

/* Input blocks g..g+count-1 (count <= 4) as the nibbles meet them: the first halves of the four
 * blocks side by side (x_low), then the last halves (x_high); missing blocks read as zeros. */
__attribute__((target("avx512f,avx512bw")))
static inline void q4_input(const int8_t *q, size_t count, __m512i *x_low, __m512i *x_high) {
  const __mmask64 first = count >= 2 ? ~(__mmask64)0 : (__mmask64)0xFFFFFFFFull;
  const __mmask64 second = count == 4 ? ~(__mmask64)0 : count == 3 ? (__mmask64)0xFFFFFFFFull : 0;
  __m512i x01 = _mm512_maskz_loadu_epi8(first, q);
  __m512i x23 = _mm512_maskz_loadu_epi8(second, q + 64);
  *x_low = _mm512_shuffle_i64x2(x01, x23, _MM_SHUFFLE(2, 0, 2, 0));
  *x_high = _mm512_shuffle_i64x2(x01, x23, _MM_SHUFFLE(3, 1, 3, 1));
}

/* One weight row's four blocks as int32 sums with the input's (lanes 4i..4i+3: block i). */
__attribute__((target("avx512f,avx512bw,avx512vnni")))
static inline __m512i q4_dot(__m512i packed, __m512i x_low, __m512i x_high) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512i w_low = _mm512_and_si512(packed, low);
  __m512i w_high = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low);
  return _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), w_low, x_low), w_high, x_high);
}

/* Lanes 4i..4i+3 of a dot product are block i's: its input scale xs[i] in each (zero past `count`). */
__attribute__((target("avx512f,avx512bw,avx512vnni")))
static inline __m512 q4_input_scale(const float *xs, size_t count) {
  const __m512i spread = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  return _mm512_permutexvar_ps(spread, _mm512_maskz_loadu_ps((__mmask16)((1u << count) - 1u), xs));
}

/* Every input row's product takes the same arithmetic whatever the number of rows, so that a
 * decode step's results do not depend on its batch: each block's integer sum times the weight
 * row's scale, then times the input's, added to the lane (q4_one_row and q4_rows alike). */
__attribute__((target("avx512f,avx512bw,avx512vnni")))
static void q4_one_row(const int8_t *q, const float *xs, const int8_t *w, const float *ws, float *y, size_t n_dim,
                       size_t k_dim, size_t r, size_t end) {
  const size_t groups = k_dim / 32, row_bytes = k_dim / 2;
  /* Row j's scales for a dot product's lanes are picked from the eight rows' scales of blocks g,
   * g + 1 (the first vector) and g + 2, g + 3 (the second): block i's row j is lane 8i + j. */
  __m512i pick[8];
  for (int j = 0; j < 8; ++j)
    pick[j] = _mm512_set_epi32(24 + j, 24 + j, 24 + j, 24 + j, 16 + j, 16 + j, 16 + j, 16 + j,
                               8 + j, 8 + j, 8 + j, 8 + j, j, j, j, j);
  for (; r + 8 <= end; r += 8) {
    __m512 acc[8];
    for (int j = 0; j < 8; ++j) acc[j] = _mm512_setzero_ps();
    for (size_t g = 0; g < groups; g += 4) {
      const size_t count = groups - g < 4 ? groups - g : 4;
      __m512i x_low, x_high;
      q4_input(q + g * 32, count, &x_low, &x_high);
      __m256 s[4];
      for (size_t i = 0; i < 4; ++i) s[i] = i < count ? _mm256_loadu_ps(ws + (g + i) * n_dim + r) : _mm256_setzero_ps();
      __m512 scales01 = side_by_side(s[0], s[1]), scales23 = side_by_side(s[2], s[3]);
      __m512 input_scale = q4_input_scale(xs + g, count);
      const __mmask64 bytes = count == 4 ? ~(__mmask64)0 : (((__mmask64)1 << (16 * count)) - 1);
      for (int j = 0; j < 8; ++j) {
        const int8_t *row = w + (r + j) * row_bytes + g * 16;
        _mm_prefetch((const char *)(row + Q4_PREFETCH_ROWS * row_bytes), _MM_HINT_T0);
        __m512 dot = _mm512_cvtepi32_ps(q4_dot(_mm512_maskz_loadu_epi8(bytes, row), x_low, x_high));
        acc[j] = _mm512_fmadd_ps(_mm512_mul_ps(dot, _mm512_permutex2var_ps(scales01, pick[j], scales23)),
                                 input_scale, acc[j]);
      }
    }
    for (int j = 0; j < 8; ++j) y[r + j] += _mm512_reduce_add_ps(acc[j]);
  }
}

__attribute__((target("avx512f,avx512bw,avx512vnni")))
static void q4_rows(const int8_t *q, const float *xs, const int8_t *w, const float *ws, float *y, size_t n_dim,
                    size_t k_dim, size_t m_dim, size_t r, size_t end) {
  const size_t groups = k_dim / 32, row_bytes = k_dim / 2;
  /* Lanes 4i..4i+3 of a dot product are block i's: weight row j's scale for them is lane 4i + j
   * of the four rows' scales of the four blocks, an input row's is its block i's scale. */
  __m512i pick[4];
  for (int j = 0; j < 4; ++j)
    pick[j] = _mm512_set_epi32(12 + j, 12 + j, 12 + j, 12 + j, 8 + j, 8 + j, 8 + j, 8 + j,
                               4 + j, 4 + j, 4 + j, 4 + j, j, j, j, j);
  for (; r + 4 <= end; r += 4) {
    for (size_t m0 = 0; m0 < m_dim; m0 += 4) {
      const size_t inputs = m_dim - m0 < 4 ? m_dim - m0 : 4;
      __m512 acc[4][4];
      for (int i = 0; i < 4; ++i)
        for (int j = 0; j < 4; ++j) acc[i][j] = _mm512_setzero_ps();
      for (size_t g = 0; g < groups; g += 4) {
        const size_t count = groups - g < 4 ? groups - g : 4;
        const __mmask64 bytes = count == 4 ? ~(__mmask64)0 : (((__mmask64)1 << (16 * count)) - 1);
        __m128 s[4];
        for (size_t i = 0; i < 4; ++i) s[i] = i < count ? _mm_loadu_ps(ws + (g + i) * n_dim + r) : _mm_setzero_ps();
        __m512 scales = _mm512_insertf32x4(
            _mm512_insertf32x4(_mm512_insertf32x4(_mm512_castps128_ps512(s[0]), s[1], 1), s[2], 2), s[3], 3);
        __m512i packed[4];
        __m512 row_scale[4];
        for (int j = 0; j < 4; ++j) {
          const int8_t *row = w + (r + j) * row_bytes + g * 16;
          _mm_prefetch((const char *)(row + Q4_PREFETCH_ROWS * row_bytes), _MM_HINT_T0);
          packed[j] = _mm512_maskz_loadu_epi8(bytes, row);
          row_scale[j] = _mm512_permutexvar_ps(pick[j], scales);
        }
        for (size_t i = 0; i < inputs; ++i) {
          const size_t m = m0 + i;
          __m512i x_low, x_high;
          q4_input(q + m * k_dim + g * 32, count, &x_low, &x_high);
          __m512 input_scale = q4_input_scale(xs + m * groups + g, count);
          for (int j = 0; j < 4; ++j) {
            __m512 dot = _mm512_cvtepi32_ps(q4_dot(packed[j], x_low, x_high));
            acc[i][j] = _mm512_fmadd_ps(_mm512_mul_ps(dot, row_scale[j]), input_scale, acc[i][j]);
          }
        }
      }
      for (size_t i = 0; i < inputs; ++i)
        for (int j = 0; j < 4; ++j) y[(m0 + i) * n_dim + r + j] += _mm512_reduce_add_ps(acc[i][j]);
    }
  }
}

/* y [M, N] rows [row0, row0 + rows) for M input rows and one 4-bit weight (w [N, K / 2], ws and
 * wo [G, N]), the pointers at their data. */
__attribute__((target("avx512f,avx512bw,avx512vnni")))
static void q4_matmul(const int8_t *q, const float *xs, const float *xsum, const int8_t *w, const float *ws,
                      const float *wo, float *y, size_t n_dim, size_t k_dim, size_t m_dim, size_t row0, size_t rows) {
  const size_t groups = k_dim / 32, row_bytes = k_dim / 2;
  const size_t end = row0 + rows < n_dim ? row0 + rows : n_dim;
  /* The offset terms: y[m] = sum_g (xs[m][g] * xsum[m][g]) * wo[g][rows]; the sums are added below. */
  for (size_t m = 0; m < m_dim; ++m) {
    for (size_t r = row0; r < end; r += 16) {
      const __mmask16 lanes = end - r >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (end - r)) - 1u);
      __m512 sum = _mm512_setzero_ps();
      for (size_t g = 0; g < groups; ++g)
        sum = _mm512_fmadd_ps(_mm512_set1_ps(xs[m * groups + g] * xsum[m * groups + g]),
                              _mm512_maskz_loadu_ps(lanes, wo + g * n_dim + r), sum);
      _mm512_mask_storeu_ps(y + m * n_dim + r, lanes, sum);
    }
  }
  /* One input row reads eight weight rows at a time, then four; several read four. The rows the
   * vector loops leave (fewer than four at the end of N) go one at a time. */
  const size_t whole = row0 + (end - row0) / 4 * 4;
  const size_t eights = m_dim == 1 ? row0 + (end - row0) / 8 * 8 : row0;
  q4_one_row(q, xs, w, ws, y, n_dim, k_dim, row0, eights);
  q4_rows(q, xs, w, ws, y, n_dim, k_dim, m_dim, eights, whole);
  for (size_t m = 0; m < m_dim; ++m) {
    for (size_t r = whole; r < end; ++r) {
      const uint8_t *row = (const uint8_t *)w + r * row_bytes;
      float sum = 0.f;
      for (size_t g = 0; g < groups; ++g) {
        int32_t dot = 0;
        for (size_t i = 0; i < 16; ++i) {
          dot += (int32_t)(row[g * 16 + i] & 0x0F) * (int32_t)q[m * k_dim + g * 32 + i];
          dot += (int32_t)(row[g * 16 + i] >> 4) * (int32_t)q[m * k_dim + g * 32 + 16 + i];
        }
        sum += xs[m * groups + g] * (float)dot * ws[g * n_dim + r];
      }
      y[m * n_dim + r] += sum;
    }
  }
}

__attribute__((target("avx512f,avx512bw,avx512vnni")))
void kiln_row_matmul_q4(MEMREF_I8(q), MEMREF_F32(xs), MEMREF_F32(xsum), MEMREF_I8(w), MEMREF_F32(ws),
                        MEMREF_F32(wo), float *y_allocated, float *restrict y, size_t y_offset, size_t y_size,
                        size_t y_stride, size_t n_dim, size_t k_dim, size_t m_dim, size_t row0, size_t rows) {
  BLOCK_OPERANDS_AT_OFFSETS();
  q4_matmul(q, xs, xsum, w, ws, wo, y, n_dim, k_dim, m_dim, row0, rows);
}

/* A mixture's experts, each read where it lies in the stack, for P (expert, input row) pairs:
 * y[p] = q[row p] times expert p's weight, y [P, N]. The stack is one block weight per expert, as
 * the one-row kernels take a dense one: with EXPERT_NIBBLES, 4-bit values (w [E, N, K / 2], ws and
 * wo [E, G, N]); else int8 (w [E, N, K]) with the int8 kernel's flags: block scales ws [E, G, N]
 * (and offsets wo [E, G, N] with Q8_OFFSETS), row scales ws [E, N], or half-block scales
 * ws [E, 2 G, N]; without offsets wo is not read. A decode step's tokens take their k chosen
 * experts this way, reading k experts' bytes and widening none; a prefill's too, expert by expert,
 * so that the workgroup's rows of an expert stay in cache for every token that chose it. Each
 * pair's result is the one-row kernel's for one input row, the same whatever other pairs share
 * the call. A pair naming no expert of the stack is left alone, never read past. */

__attribute__((target("avx512f,avx512bw,avx512vnni")))
void kiln_expert_matmul(MEMREF_I8(q), MEMREF_F32(xs), MEMREF_F32(xsum), MEMREF_I8(w), MEMREF_F32(ws),
                        MEMREF_F32(wo), MEMREF_I64(pairs), float *y_allocated, float *restrict y, size_t y_offset,
                        size_t y_size, size_t y_stride, size_t n_dim, size_t k_dim, size_t e_dim, size_t flags,
                        size_t p_dim, size_t row0, size_t rows) {
  BLOCK_OPERANDS_AT_OFFSETS();
  (void)pairs_allocated; (void)pairs_size; (void)pairs_stride;
  pairs += pairs_offset;
  const size_t groups = k_dim / 32, nibbles = (flags & EXPERT_NIBBLES) != 0;
  const struct expert_sizes expert = expert_sizes_of(n_dim, k_dim, flags);
  for (size_t e = 0; e < e_dim; ++e) {
    for (size_t p = 0; p < p_dim; ++p) {
      if ((size_t)pairs[2 * p] != e) continue;
      const size_t row = (size_t)pairs[2 * p + 1];
      const int8_t *x = q + row * k_dim;
      const float *x_scales = xs + row * groups, *x_sums = xsum + row * groups;
      const int8_t *values = w + e * expert.values;
      const float *scales = ws + e * expert.scales, *offsets = wo + e * expert.offsets;
      if (nibbles)
        q4_matmul(x, x_scales, x_sums, values, scales, offsets, y + p * n_dim, n_dim, k_dim, 1, row0, rows);
      else
        q8_one_input(x, x_scales, x_sums, values, scales, offsets, y + p * n_dim, n_dim, k_dim, flags, row0, rows);
    }
  }
}

/* Decode attention over the paged KV cache (cpu_kernels.h says what it computes and how). */

/* exp(x) for float32 lanes: 2^n * exp(r), n = round(x / ln 2), |r| <= ln 2 / 2, exp(r) by its
 * Taylor series to r^7 (error below 1e-8 relative). x is clamped below at -87, where exp is
 * ~1.6e-38: the callers mask what must be exactly 0. No libm in an embedded executable. */
__attribute__((target("avx512f")))
static inline __m512 exp_ps(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);
  __m512 p = _mm512_set1_ps(1.f / 5040.f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 720.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

__attribute__((target("avx512f")))
static inline __m512 load_i8_ps(const int8_t *p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}

/* 16 e4m3 bytes as float32, 2**-8 times their values: a byte's sign and other 7 bits moved into a
 * float16's sign and exponent/mantissa fields (e4m3's exponent bias is 8 below float16's), which
 * the hardware widens, subnormals included. The 2**8 is folded into the scales. */
__attribute__((target("avx512f")))
static inline __m512 load_fp8_ps(const int8_t *p) {
  __m256i bytes = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p));
  __m256i sign = _mm256_slli_epi16(_mm256_and_si256(bytes, _mm256_set1_epi16(0x80)), 8);
  __m256i rest = _mm256_slli_epi16(_mm256_and_si256(bytes, _mm256_set1_epi16(0x7f)), 7);
  return _mm512_cvtph_ps(_mm256_or_si256(sign, rest));
}

/* 16 bfloat16 bit patterns, widened to float32 by moving them to the high half. */
__attribute__((target("avx512f")))
static inline __m512 load_bf16_scales(const int8_t *p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* 16 values of a block at element `at`: float32, or bytes widened. */
__attribute__((target("avx512f"), always_inline))
static inline __m512 load_keys(const void *block, size_t at, int quantized) {
  if (quantized == CACHE_FP8_E4M3) return load_fp8_ps((const int8_t *)block + at);
  return quantized ? load_i8_ps((const int8_t *)block + at) : _mm512_loadu_ps((const float *)block + at);
}

/* One workgroup's (row, K/V head) of any cache: `quantized` (a CACHE_* form) is a constant at each
 * call, so each entry point below compiles its own loop. */
__attribute__((target("avx512f"), always_inline))
static inline void paged_decode_attention(const float *q, const void *cache, size_t cache_size, const int64_t *pages,
                                          const int64_t *visible, float *out, size_t heads, size_t kv_heads,
                                          size_t head_dim, size_t stride, size_t blocks, size_t workgroup,
                                          int quantized, size_t page_blocks, size_t value_blocks) {
  size_t row = workgroup / kv_heads, kv_head = workgroup % kv_heads;
  size_t group = heads / kv_heads, vectors = head_dim / 16, block = head_dim * stride;
  size_t element = quantized ? 1 : sizeof(float);
  const float *qs = q + (row * heads + kv_head * group) * head_dim;
  float *outs = out + (row * heads + kv_head * group) * head_dim;
  const int64_t *table = pages + (row * kv_heads + kv_head) * blocks;
  int64_t seen = visible[row];
  size_t keys = seen <= 0 ? 0 : (size_t)seen < blocks * stride ? (size_t)seen : blocks * stride;

  __m512 acc[ATTENTION_MAX_GROUP][ATTENTION_MAX_HEAD_DIM / 16];
  float top[ATTENTION_MAX_GROUP], total[ATTENTION_MAX_GROUP];
  for (size_t g = 0; g < group; ++g) {
    top[g] = -__builtin_inff();
    total[g] = 0.f;
    for (size_t c = 0; c < vectors; ++c) acc[g][c] = _mm512_setzero_ps();
  }
  for (size_t key0 = 0; key0 < keys; key0 += ATTENTION_KEYS) {
    int64_t page = table[key0 / stride];
    size_t slot = key0 % stride;
    if (page < 0 || ((size_t)page + kv_heads + 1) * block > cache_size) continue;
    /* Scales sit in their page's scale blocks; a block that is not a value block has none. */
    size_t page_start = quantized ? (size_t)page / page_blocks * page_blocks : 0;
    if (quantized && (size_t)page - page_start + kv_heads >= value_blocks) continue;
    const char *k_block = (const char *)cache + (size_t)page * block * element;
    const char *v_block = (const char *)cache + ((size_t)page + kv_heads) * block * element;
    size_t live_keys = keys - key0 < ATTENTION_KEYS ? keys - key0 : ATTENTION_KEYS;
    __mmask16 live = (__mmask16)((1u << live_keys) - 1u);

    __m512 scores[ATTENTION_MAX_GROUP];
    for (size_t g = 0; g < group; ++g) scores[g] = _mm512_setzero_ps();
    for (size_t d = 0; d < head_dim; ++d) {
      __m512 channel = load_keys(k_block, d * stride + slot, quantized);
      for (size_t g = 0; g < group; ++g)
        scores[g] = _mm512_fmadd_ps(_mm512_set1_ps(qs[g * head_dim + d]), channel, scores[g]);
    }
    __m512 k_scales = _mm512_set1_ps(1.f), v_scales = _mm512_set1_ps(1.f);
    if (quantized) {
      const int8_t *scales = (const int8_t *)cache + (page_start + value_blocks) * block;
      k_scales = load_bf16_scales(scales + ((size_t)page - page_start) * 2 * stride + 2 * slot);
      v_scales = load_bf16_scales(scales + ((size_t)page - page_start + kv_heads) * 2 * stride + 2 * slot);
      if (quantized == CACHE_FP8_E4M3) {
        k_scales = _mm512_mul_ps(k_scales, _mm512_set1_ps(FP8_UNIT));
        v_scales = _mm512_mul_ps(v_scales, _mm512_set1_ps(FP8_UNIT));
      }
    }
    float weights[ATTENTION_MAX_GROUP][ATTENTION_KEYS];
    for (size_t g = 0; g < group; ++g) {
      if (quantized) scores[g] = _mm512_mul_ps(scores[g], k_scales);
      float chunk_top = _mm512_mask_reduce_max_ps(live, scores[g]);
      float new_top = chunk_top > top[g] ? chunk_top : top[g];
      __m512 p = _mm512_maskz_mov_ps(live, exp_ps(_mm512_sub_ps(scores[g], _mm512_set1_ps(new_top))));
      /* exp(-inf) on the first chunk: the clamp makes it ~1e-38, times a total and sums of 0. */
      float rescale = _mm512_cvtss_f32(exp_ps(_mm512_set1_ps(top[g] - new_top)));
      top[g] = new_top;
      total[g] = total[g] * rescale + _mm512_reduce_add_ps(p);
      __m512 rescales = _mm512_set1_ps(rescale);
      for (size_t c = 0; c < vectors; ++c) acc[g][c] = _mm512_mul_ps(acc[g][c], rescales);
      _mm512_storeu_ps(weights[g], quantized ? _mm512_mul_ps(p, v_scales) : p);
    }
    for (size_t j = 0; j < live_keys; ++j) {
      size_t v_row = (slot + j) * head_dim;
      for (size_t c = 0; c < vectors; ++c) {
        __m512 value = load_keys(v_block, v_row + c * 16, quantized);
        for (size_t g = 0; g < group; ++g)
          acc[g][c] = _mm512_fmadd_ps(_mm512_set1_ps(weights[g][j]), value, acc[g][c]);
      }
    }
  }
  for (size_t g = 0; g < group; ++g) {
    __m512 inverse = _mm512_set1_ps(total[g] > 0.f ? 1.f / total[g] : 0.f);
    for (size_t c = 0; c < vectors; ++c) _mm512_storeu_ps(outs + g * head_dim + c * 16, _mm512_mul_ps(acc[g][c], inverse));
  }
}

DECODE_ATTENTION_ENTRY_POINTS()

/* LoRA adapters applied per row (cpu_kernels.h says what it computes). */
__attribute__((target("avx512f")))
void kiln_lora_delta(MEMREF_F32(x), MEMREF_F32(a), MEMREF_F32(b), MEMREF_I64(slots), float *y_allocated,
                     float *restrict y, size_t y_offset, size_t y_size, size_t y_stride, size_t tokens, size_t in,
                     size_t out, size_t rank, size_t slot_count, size_t layer, size_t workgroup) {
  LORA_OPERANDS_AT_OFFSETS();
  const struct lora_work work = lora_work_of(x, a, a_size, b, b_size, slots, y, tokens, in, out, rank, slot_count,
                                             layer, workgroup);
  const size_t count = work.count;
  const float *xs = work.x, *as = work.a, *bs = work.b;
  float *ys = work.y;
  if (!as) {
    for (size_t i = 0; i < count * out; i += 16) _mm512_storeu_ps(ys + i, _mm512_setzero_ps());
    return;
  }
  float low[LORA_TOKENS][LORA_MAX_RANK];
  for (size_t r = 0; r < rank; ++r) {
    const float *a_row = as + r * in;
    for (size_t t = 0; t < count; ++t) {
      __m512 sum = _mm512_setzero_ps();
      for (size_t k = 0; k < in; k += 16)
        sum = _mm512_fmadd_ps(_mm512_loadu_ps(a_row + k), _mm512_loadu_ps(xs + t * in + k), sum);
      low[t][r] = _mm512_reduce_add_ps(sum);
    }
  }
  for (size_t o = 0; o < out; o += 16) {
    __m512 acc[LORA_TOKENS];
    for (size_t t = 0; t < count; ++t) acc[t] = _mm512_setzero_ps();
    for (size_t r = 0; r < rank; ++r) {
      __m512 b_row = _mm512_loadu_ps(bs + r * out + o);
      for (size_t t = 0; t < count; ++t) acc[t] = _mm512_fmadd_ps(_mm512_set1_ps(low[t][r]), b_row, acc[t]);
    }
    for (size_t t = 0; t < count; ++t) _mm512_storeu_ps(ys + t * out + o, acc[t]);
  }
}
