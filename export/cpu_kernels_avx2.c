/* Kiln's weight matmul kernels for x86-64 CPUs with AVX2 and FMA but no AVX-512 (AMD Zen 1-3,
 * Intel's client cores since Alder Lake): the entry points of cpu_kernels.c for float32 weights,
 * int8 blocks (Q8_0, with offsets, row scales or Q6_K's half blocks) and 4-bit blocks two values a
 * byte (Q4_0, Q4_1, Q4_K), and a mixture's experts read in place, with the same operands
 * (cpu_kernels.h), so that one exported MLIR calls whichever build the exporting machine runs.
 * Without them such a CPU runs IREE's code, which on the block types transposes every int8 weight
 * on every call (the bundled SmolLM2's decode step: 55 ms, two thirds of it those copies; 17 ms
 * here: docs/quantization.md).
 *
 * The int8 products are AVX2's unsigned x signed pairs (vpmaddubsw, then vpmaddwd to 32 bits),
 * as llama.cpp's AVX2 code multiplies: 4-bit values are unsigned already (Q4_0's q - 8 is q with
 * an offset of -8 d), and for int8 weights the input's sign moves onto the weight. Pairs of
 * products stay below 2 x 15 x 127 (4-bit) and 2 x 127 x 127 (int8): vpmaddubsw never saturates.
 *
 * Every (input row, weight row) pair is summed by the same instructions in the same order
 * whatever else shares the call (the row count, which tile it falls in), so that a decode step's
 * results do not depend on its batch and a prompt's rows equal a decode step's. The bfloat16
 * matmul, decode attention and LoRA kernels are AVX-512 only (export/cpu_kernels.py knows which
 * build holds what). No libc, no globals: linked into IREE's embedded ELF executables.
 */
#include "cpu_kernels.h"

enum { AVX2_PREFETCH_ROWS = 8 };

static inline float sum_of_lanes(__m256 v) {
  __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  half = _mm_add_ps(half, _mm_movehl_ps(half, half));
  return _mm_cvtss_f32(_mm_add_ss(half, _mm_movehdup_ps(half)));
}

/* Eight int32 sums of four products of u (unsigned bytes) and s (signed bytes), as floats. */
static inline __m256 byte_dots(__m256i u, __m256i s) {
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}

/* Four weight rows' scales (rows r..r+3 of scale row `g` of a [rows, N] table; with count 1,
 * row r's alone in lane 0), zeros for a scale row past `limit`. */
static inline __m128 row_scales(const float *ws, size_t n_dim, size_t g, size_t limit, size_t r, const size_t count) {
  if (g >= limit) return _mm_setzero_ps();
  return count == 4 ? _mm_loadu_ps(ws + g * n_dim + r) : _mm_load_ss(ws + g * n_dim + r);
}

/* Each lane of two blocks' dot products (lanes 0-3 block g's, 4-7 block g + 1's) takes weight
 * row j's scale of its block: lanes j and 4 + j of the rows' scales, spread. */
static inline __m256 row_scale(__m256 scales, int j) {
  return _mm256_permutevar8x32_ps(scales, _mm256_setr_epi32(j, j, j, j, 4 + j, 4 + j, 4 + j, 4 + j));
}

static inline __m256i load_block(const int8_t *block) { return _mm256_loadu_si256((const __m256i *)block); }

/* Lanes [0, count) set, count <= 8. */
static inline __m256i first_lanes(size_t count) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)count), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/* ---- float32 ----------------------------------------------------------------------------- */

/* Weight rows [r, r + count) (count 4 or 1, a constant where inlined) times input x: out[j].
 * Eight lanes of products a row, the K % 8 left over added after the lanes' sum. */
static inline __attribute__((always_inline)) void f32_rows(const float *x, const float *w, size_t k_dim,
                                                           const size_t count, int prefetch, float *out) {
  const size_t k_vec = k_dim & ~(size_t)7;
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  for (size_t k = 0; k < k_vec; k += 8) {
    const __m256 xv = _mm256_loadu_ps(x + k);
    for (size_t j = 0; j < count; ++j) {
      if (prefetch) _mm_prefetch((const char *)(w + (j + 4) * k_dim + k), _MM_HINT_T0);
      acc[j] = _mm256_fmadd_ps(_mm256_loadu_ps(w + j * k_dim + k), xv, acc[j]);
    }
  }
  for (size_t j = 0; j < count; ++j) {
    float sum = sum_of_lanes(acc[j]);
    for (size_t k = k_vec; k < k_dim; ++k) sum += w[j * k_dim + k] * x[k];
    out[j] = sum;
  }
}

void kiln_row_matmul_f32(MEMREF_F32(x), MEMREF_F32(w), float *y_allocated, float *restrict y, size_t y_offset,
                         size_t y_size, size_t y_stride, size_t n_dim, size_t k_dim, size_t m_dim, size_t row0,
                         size_t rows) {
  (void)x_allocated; (void)x_size; (void)x_stride; (void)w_allocated; (void)w_size; (void)w_stride;
  (void)y_allocated; (void)y_size; (void)y_stride;
  x += x_offset;
  w += w_offset;
  y += y_offset;
  const size_t end = row0 + rows < n_dim ? row0 + rows : n_dim;
  for (size_t r = row0; r < end;) {
    const size_t count = end - r >= 4 ? 4 : 1;
    for (size_t m = 0; m < m_dim; ++m) {
      float out[4];
      if (count == 4)
        f32_rows(x + m * k_dim, w + r * k_dim, k_dim, 4, m == 0, out);
      else
        f32_rows(x + m * k_dim, w + r * k_dim, k_dim, 1, m == 0, out);
      for (size_t j = 0; j < count; ++j) y[m * n_dim + r + j] = out[j];
    }
    r += count;
  }
}

/* ---- offsets ----------------------------------------------------------------------------- */

/* y[m][rows] = sum_g (xs[m][g] * xsum[m][g]) * wo[g][rows]: the offset terms of the block kernels,
 * stored first; the products' sums are added to them. Input row m is inputs[m] (row_of). */
static void store_offsets(const float *xs, const float *xsum, const float *wo, float *y, size_t n_dim,
                          size_t groups, size_t m_dim, const size_t *inputs, const size_t *outputs, size_t row0,
                          size_t end) {
  for (size_t i = 0; i < m_dim; ++i) {
    const size_t m = row_of(inputs, i);
    float *out = y + row_of(outputs, i) * n_dim;
    for (size_t r = row0; r < end; r += 8) {
      const __m256i lanes = first_lanes(end - r < 8 ? end - r : 8);
      __m256 sum = _mm256_setzero_ps();
      for (size_t g = 0; g < groups; ++g)
        sum = _mm256_fmadd_ps(_mm256_set1_ps(xs[m * groups + g] * xsum[m * groups + g]),
                              _mm256_maskload_ps(wo + g * n_dim + r, lanes), sum);
      _mm256_maskstore_ps(out + r, lanes, sum);
    }
  }
}

/* ---- 4-bit blocks ------------------------------------------------------------------------ */

/* Input blocks g and g + 1 (zeros past `groups`) as two 4-bit weight blocks' nibbles meet them:
 * the first halves of both blocks (values 0-15 of g, then of g + 1), then the last halves. */
static inline void q4_input_pair(const int8_t *x, size_t g, size_t groups, __m256i *first, __m256i *last) {
  const __m256i a = load_block(x + g * 32);
  const __m256i b = g + 1 < groups ? load_block(x + (g + 1) * 32) : _mm256_setzero_si256();
  *first = _mm256_permute2x128_si256(a, b, 0x20);
  *last = _mm256_permute2x128_si256(a, b, 0x31);
}

/* Two blocks' input scales, lanes 0-3 block g's and 4-7 block g + 1's (zero past `groups`). */
static inline __m256 input_scale_pair(const float *xs, size_t g, size_t groups) {
  return _mm256_set_m128(_mm_set1_ps(g + 1 < groups ? xs[g + 1] : 0.f), _mm_set1_ps(xs[g]));
}

/* Weight rows [r, r + count) (count 4 or 1) of a 4-bit weight times one input row (x0) or two
 * (x0, x1): y0[j] += ..., y1[j] += .... Two blocks a step: a row's 32 bytes of them hold, in their
 * low nibbles, the first halves of both blocks (values 0-15 of each) and in their high nibbles the
 * last halves, which the input's blocks are shuffled to meet (q4_input_pair); the two halves'
 * pairwise sums add up (at most 4 x 15 x 127 in 16 bits) before widening to one int32 sum of
 * four products a lane, lanes 0-3 block g's and 4-7 block g + 1's, each lane then times its
 * block's weight and input scales. One unpacking of a weight row serves both inputs. Inlined with
 * count and two as constants, so that the accumulators stay in registers. */
static inline __attribute__((always_inline)) void q4_tile(const int8_t *x0, const float *xs0, const int8_t *x1,
                                                          const float *xs1, const int8_t *w, const float *ws,
                                                          size_t n_dim, size_t k_dim, size_t r, const size_t count,
                                                          const int two, float *y0, float *y1) {
  const size_t groups = k_dim / 32, row_bytes = k_dim / 2;
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  __m256 acc0[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  __m256 acc1[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  for (size_t g = 0; g < groups; g += 2) {
    const int pair = g + 1 < groups;
    __m256i first0, last0, first1 = _mm256_setzero_si256(), last1 = _mm256_setzero_si256();
    q4_input_pair(x0, g, groups, &first0, &last0);
    if (two) q4_input_pair(x1, g, groups, &first1, &last1);
    const __m256 scales = _mm256_set_m128(row_scales(ws, n_dim, g + 1, groups, r, count),
                                          row_scales(ws, n_dim, g, groups, r, count));
    const __m256 scales0 = _mm256_mul_ps(scales, input_scale_pair(xs0, g, groups));
    const __m256 scales1 = two ? _mm256_mul_ps(scales, input_scale_pair(xs1, g, groups)) : scales0;
    for (size_t j = 0; j < count; ++j) {
      const int8_t *row = w + (r + j) * row_bytes + g * 16;
      _mm_prefetch((const char *)(row + AVX2_PREFETCH_ROWS * row_bytes), _MM_HINT_T0);
      const __m256i packed = pair ? load_block(row) : _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)row));
      const __m256i first = _mm256_and_si256(packed, low);
      const __m256i last = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low);
      const __m256i sums0 = _mm256_add_epi16(_mm256_maddubs_epi16(first, first0), _mm256_maddubs_epi16(last, last0));
      acc0[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(sums0, ones)), row_scale(scales0, (int)j),
                                acc0[j]);
      if (two) {
        const __m256i sums1 = _mm256_add_epi16(_mm256_maddubs_epi16(first, first1),
                                               _mm256_maddubs_epi16(last, last1));
        acc1[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(sums1, ones)), row_scale(scales1, (int)j),
                                  acc1[j]);
      }
    }
  }
  for (size_t j = 0; j < count; ++j) {
    y0[r + j] += sum_of_lanes(acc0[j]);
    if (two) y1[r + j] += sum_of_lanes(acc1[j]);
  }
}

/* y rows [row0, row0 + rows) for M input rows and one 4-bit weight (w [N, K / 2], ws and wo
 * [G, N]); input row m is row `inputs[m]` of q, xs and xsum, its result row `outputs[m]` of y. */
static void q4_matmul(const int8_t *q, const float *xs, const float *xsum, const int8_t *w, const float *ws,
                      const float *wo, float *y, size_t n_dim, size_t k_dim, size_t m_dim, const size_t *inputs,
                      const size_t *outputs, size_t row0, size_t rows) {
  const size_t groups = k_dim / 32;
  const size_t end = row0 + rows < n_dim ? row0 + rows : n_dim;
  store_offsets(xs, xsum, wo, y, n_dim, groups, m_dim, inputs, outputs, row0, end);
  for (size_t r = row0; r < end;) {
    const size_t count = end - r >= 4 ? 4 : 1;
    for (size_t i = 0; i < m_dim; i += 2) {
      const size_t a = row_of(inputs, i), b = i + 1 < m_dim ? row_of(inputs, i + 1) : a;
      const int8_t *x0 = q + a * k_dim, *x1 = q + b * k_dim;
      float *y0 = y + row_of(outputs, i) * n_dim, *y1 = i + 1 < m_dim ? y + row_of(outputs, i + 1) * n_dim : y0;
      if (count == 4 && i + 1 < m_dim)
        q4_tile(x0, xs + a * groups, x1, xs + b * groups, w, ws, n_dim, k_dim, r, 4, 1, y0, y1);
      else if (count == 4)
        q4_tile(x0, xs + a * groups, x0, xs + a * groups, w, ws, n_dim, k_dim, r, 4, 0, y0, y0);
      else if (i + 1 < m_dim)
        q4_tile(x0, xs + a * groups, x1, xs + b * groups, w, ws, n_dim, k_dim, r, 1, 1, y0, y1);
      else
        q4_tile(x0, xs + a * groups, x0, xs + a * groups, w, ws, n_dim, k_dim, r, 1, 0, y0, y0);
    }
    r += count;
  }
}

void kiln_row_matmul_q4(MEMREF_I8(q), MEMREF_F32(xs), MEMREF_F32(xsum), MEMREF_I8(w), MEMREF_F32(ws),
                        MEMREF_F32(wo), float *y_allocated, float *restrict y, size_t y_offset, size_t y_size,
                        size_t y_stride, size_t n_dim, size_t k_dim, size_t m_dim, size_t row0, size_t rows) {
  BLOCK_OPERANDS_AT_OFFSETS();
  q4_matmul(q, xs, xsum, w, ws, wo, y, n_dim, k_dim, m_dim, NULL, NULL, row0, rows);
}

/* ---- int8 blocks ------------------------------------------------------------------------- */

/* Weight rows [r, r + count) (count 4 or 1) of an int8 weight times one input row: the products'
 * sums, each block's (or half block's) times its scales, summed. Inlined with count a constant. */
static inline __attribute__((always_inline)) void q8_rows(const int8_t *q, const float *xs, const int8_t *w,
                                                          const float *ws, float *sums, size_t n_dim, size_t k_dim,
                                                          size_t scale_stride, int halves, size_t r,
                                                          const size_t count) {
  const size_t groups = k_dim / 32;
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  for (size_t g = 0; g < groups; ++g) {
    const __m256i in = load_block(q + g * 32);
    const __m256i magnitude = _mm256_sign_epi8(in, in);
    /* Lanes 0-3 of a dot product hold the block's first 16 products, 4-7 its last 16: with half
     * blocks each half takes its own scale, else both the block's (or the row's). */
    const __m128 first = halves ? row_scales(ws, n_dim, 2 * g, 2 * groups, r, count)
                                : row_scales(ws, scale_stride, g, groups, r, count);
    const __m128 last = halves ? row_scales(ws, n_dim, 2 * g + 1, 2 * groups, r, count) : first;
    const __m256 scales = _mm256_mul_ps(_mm256_set_m128(last, first), _mm256_set1_ps(xs[g]));
    for (size_t j = 0; j < count; ++j) {
      const int8_t *row = w + (r + j) * k_dim + g * 32;
      _mm_prefetch((const char *)(row + AVX2_PREFETCH_ROWS * k_dim), _MM_HINT_T0);
      const __m256 dots = byte_dots(magnitude, _mm256_sign_epi8(load_block(row), in));
      acc[j] = _mm256_fmadd_ps(dots, row_scale(scales, (int)j), acc[j]);
    }
  }
  for (size_t j = 0; j < count; ++j) sums[j] = sum_of_lanes(acc[j]);
}

/* One input row (q [K], xs and xsum [G]) times int8 weight rows [row0, row0 + rows): y [N]. The
 * flags (cpu_kernels.h) give the weight's form: scales per block ws [G, N], per row ws [N], or per
 * half block ws [2 G, N]; offsets wo [G, N] with Q8_OFFSETS. */
static void q8_one_input(const int8_t *q, const float *xs, const float *xsum, const int8_t *w, const float *ws,
                         const float *wo, float *y, size_t n_dim, size_t k_dim, size_t flags, size_t row0,
                         size_t rows) {
  const size_t groups = k_dim / 32;
  const int has_offset = (flags & Q8_OFFSETS) != 0, halves = (flags & Q8_HALF_BLOCKS) != 0;
  const size_t scale_stride = flags & Q8_ROW_SCALES ? 0 : n_dim;
  const size_t end = row0 + rows < n_dim ? row0 + rows : n_dim;
  if (has_offset) store_offsets(xs, xsum, wo, y, n_dim, groups, 1, NULL, NULL, row0, end);
  for (size_t r = row0; r < end;) {
    const size_t count = end - r >= 4 ? 4 : 1;
    float sums[4];
    if (count == 4)
      q8_rows(q, xs, w, ws, sums, n_dim, k_dim, scale_stride, halves, r, 4);
    else
      q8_rows(q, xs, w, ws, sums, n_dim, k_dim, scale_stride, halves, r, 1);
    for (size_t j = 0; j < count; ++j) y[r + j] = (has_offset ? y[r + j] : 0.f) + sums[j];
    r += count;
  }
}

/* M input rows (q [M, K], xs and xsum [M, G], y [M, N]; M is `flags` >> Q8_ROWS_SHIFT), a pass
 * each over this workgroup's weight rows. */
void kiln_row_matmul_q8(MEMREF_I8(q), MEMREF_F32(xs), MEMREF_F32(xsum), MEMREF_I8(w), MEMREF_F32(ws),
                        MEMREF_F32(wo), float *y_allocated, float *restrict y, size_t y_offset, size_t y_size,
                        size_t y_stride, size_t n_dim, size_t k_dim, size_t flags, size_t row0, size_t rows) {
  BLOCK_OPERANDS_AT_OFFSETS();
  const size_t groups = k_dim / 32, m_dim = flags >> Q8_ROWS_SHIFT;
  for (size_t m = 0; m < m_dim; ++m)
    q8_one_input(q + m * k_dim, xs + m * groups, xsum + m * groups, w, ws, wo, y + m * n_dim, n_dim, k_dim, flags,
                 row0, rows);
}

/* ---- a mixture's experts ----------------------------------------------------------------- */

/* As cpu_kernels.c's: P (expert, input row) pairs, each row times its expert's weight where it
 * lies in the stack (w [E, N, K / 2] with EXPERT_NIBBLES, else [E, N, K] as the int8 kernel's
 * flags say), y [P, N]; a pair naming no expert of the stack is left alone. */
void kiln_expert_matmul(MEMREF_I8(q), MEMREF_F32(xs), MEMREF_F32(xsum), MEMREF_I8(w), MEMREF_F32(ws),
                        MEMREF_F32(wo), MEMREF_I64(pairs), float *y_allocated, float *restrict y, size_t y_offset,
                        size_t y_size, size_t y_stride, size_t n_dim, size_t k_dim, size_t e_dim, size_t flags,
                        size_t p_dim, size_t row0, size_t rows) {
  BLOCK_OPERANDS_AT_OFFSETS();
  (void)pairs_allocated; (void)pairs_size; (void)pairs_stride;
  pairs += pairs_offset;
  const size_t groups = k_dim / 32, nibbled = (flags & EXPERT_NIBBLES) != 0;
  const struct expert_sizes expert = expert_sizes_of(n_dim, k_dim, flags);
  for (size_t e = 0; e < e_dim; ++e) {
    const int8_t *values = w + e * expert.values;
    const float *scales = ws + e * expert.scales, *offsets = wo + e * expert.offsets;
    size_t inputs[EXPERT_TILE], outputs[EXPERT_TILE], count = 0;
    for (size_t p = 0; p < p_dim; ++p) {
      if ((size_t)pairs[2 * p] != e) continue;
      const size_t row = (size_t)pairs[2 * p + 1];
      if (!nibbled) {
        q8_one_input(q + row * k_dim, xs + row * groups, xsum + row * groups, values, scales, offsets, y + p * n_dim,
                     n_dim, k_dim, flags, row0, rows);
        continue;
      }
      inputs[count] = row;
      outputs[count++] = p;
      if (count == EXPERT_TILE) {
        q4_matmul(q, xs, xsum, values, scales, offsets, y, n_dim, k_dim, count, inputs, outputs, row0, rows);
        count = 0;
      }
    }
    if (count)
      q4_matmul(q, xs, xsum, values, scales, offsets, y, n_dim, k_dim, count, inputs, outputs, row0, rows);
  }
}
