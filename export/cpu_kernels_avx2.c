/* Kiln's CPU kernels for x86-64 CPUs with AVX2 and FMA but no AVX-512 (AMD Zen 1-3, Intel's
 * client cores since Alder Lake) or without AVX512-VNNI: the entry points of cpu_kernels.c for
 * float32 weights, int8 blocks (Q8_0, with offsets, row scales or Q6_K's half blocks) and 4-bit
 * blocks two values a byte (Q4_0, Q4_1, Q4_K), a mixture's experts read in place, decode attention
 * over the paged cache (float32, int8 and fp8 pages) and LoRA's per-row deltas, with the same
 * operands (cpu_kernels.h), so that one exported MLIR calls whichever build the exporting machine
 * runs.
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
 * matmul is AVX-512's only (AVX512-BF16; export/cpu_kernels.py knows which build holds what). No libc, no globals: linked into IREE's embedded ELF executables.
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

/* ---- decode attention -------------------------------------------------------------------- */

/* exp(x) for float32 lanes, as the AVX-512 build computes it (2^n * exp(r), exp(r) by its Taylor
 * series to r^7), 2^n built in the exponent field: x is clamped to [-87, 88], so n stays in
 * [-126, 127], a normal float's exponents. */
static inline __m256 exp_ps(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
  __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187045e-06f), r);
  __m256 p = _mm256_set1_ps(1.f / 5040.f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 720.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(two_n));
}

static inline float max_of_lanes(__m256 v) {
  __m128 half = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  half = _mm_max_ps(half, _mm_movehl_ps(half, half));
  return _mm_cvtss_f32(_mm_max_ss(half, _mm_movehdup_ps(half)));
}

/* 8 values of a cache block at element `at`: float32, or bytes widened (fp8 as 2**-8 times its
 * value: the byte's sign and other 7 bits moved into a float16's fields, which F16C widens). */
static inline __attribute__((always_inline)) __m256 load_keys(const void *block, size_t at, int quantized) {
  const int8_t *bytes = (const int8_t *)block + at;
  if (quantized == CACHE_FP8_E4M3) {
    __m128i wide = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)bytes));
    __m128i sign = _mm_slli_epi16(_mm_and_si128(wide, _mm_set1_epi16(0x80)), 8);
    __m128i rest = _mm_slli_epi16(_mm_and_si128(wide, _mm_set1_epi16(0x7f)), 7);
    return _mm256_cvtph_ps(_mm_or_si128(sign, rest));
  }
  if (quantized) return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)bytes)));
  return _mm256_loadu_ps((const float *)block + at);
}

/* 8 bfloat16 scales widened to float32 (moved to the high half), times `unit`. */
static inline __m256 load_bf16_scales(const int8_t *p, float unit) {
  __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
  return _mm256_mul_ps(_mm256_castsi256_ps(_mm256_slli_epi32(wide, 16)), _mm256_set1_ps(unit));
}

/* One workgroup's (row, K/V head), as the AVX-512 build's, for a query group of `group` heads (a
 * constant where inlined, so that the group's score and output sums stay in registers: AVX2 has 16
 * of them, where the AVX-512 build's 32 hold a runtime group's). A chunk of ATTENTION_KEYS keys is
 * two vectors of 8, `half` 0 and 1 below. Each output vector is summed over a chunk's keys in
 * registers and stored once a chunk; a row's sums are those of the AVX-512 build's order. */
static inline __attribute__((always_inline)) void group_decode_attention(
    const float *q, const void *cache, size_t cache_size, const int64_t *pages, const int64_t *visible, float *out,
    size_t heads, size_t kv_heads, size_t head_dim, size_t stride, size_t blocks, size_t workgroup, int quantized,
    size_t page_blocks, size_t value_blocks, const size_t group) {
  size_t row = workgroup / kv_heads, kv_head = workgroup % kv_heads;
  size_t vectors = head_dim / 8, block = head_dim * stride;
  size_t element = quantized ? 1 : sizeof(float);
  const float *qs = q + (row * heads + kv_head * group) * head_dim;
  float *outs = out + (row * heads + kv_head * group) * head_dim;
  const int64_t *table = pages + (row * kv_heads + kv_head) * blocks;
  int64_t seen = visible[row];
  size_t keys = seen <= 0 ? 0 : (size_t)seen < blocks * stride ? (size_t)seen : blocks * stride;
  const float unit = quantized == CACHE_FP8_E4M3 ? FP8_UNIT : 1.f;

  __m256 acc[ATTENTION_MAX_GROUP][ATTENTION_MAX_HEAD_DIM / 8];
  float top[ATTENTION_MAX_GROUP], total[ATTENTION_MAX_GROUP];
  for (size_t g = 0; g < group; ++g) {
    top[g] = -__builtin_inff();
    total[g] = 0.f;
    for (size_t c = 0; c < vectors; ++c) acc[g][c] = _mm256_setzero_ps();
  }
  for (size_t key0 = 0; key0 < keys; key0 += ATTENTION_KEYS) {
    int64_t page = table[key0 / stride];
    size_t slot = key0 % stride;
    if (page < 0 || ((size_t)page + kv_heads + 1) * block > cache_size) continue;
    size_t page_start = quantized ? (size_t)page / page_blocks * page_blocks : 0;
    if (quantized && (size_t)page - page_start + kv_heads >= value_blocks) continue;
    const char *k_block = (const char *)cache + (size_t)page * block * element;
    const char *v_block = (const char *)cache + ((size_t)page + kv_heads) * block * element;
    size_t live_keys = keys - key0 < ATTENTION_KEYS ? keys - key0 : ATTENTION_KEYS;
    __m256i live[2] = {first_lanes(live_keys < 8 ? live_keys : 8), first_lanes(live_keys > 8 ? live_keys - 8 : 0)};

    /* The next chunk's K and V lines, fetched while this one is summed: a chunk's pages lie
     * anywhere in the cache, where the hardware's prefetchers find no stream to follow. */
    const size_t next0 = key0 + ATTENTION_KEYS, next_slot = next0 % stride;
    const int64_t next_page = next0 < keys ? table[next0 / stride] : -1;
    const char *next_k = next_page < 0 ? k_block : (const char *)cache + (size_t)next_page * block * element;
    const char *next_v = next_k + kv_heads * block * element + next_slot * head_dim * element;
    const size_t next_v_bytes = next_page < 0 ? 0 : ATTENTION_KEYS * head_dim * element;

    __m256 scores[ATTENTION_MAX_GROUP][2];
    for (size_t g = 0; g < group; ++g) scores[g][0] = scores[g][1] = _mm256_setzero_ps();
    for (size_t d = 0; d < head_dim; ++d) {
      if (next_page >= 0) _mm_prefetch(next_k + (d * stride + next_slot) * element, _MM_HINT_T0);
      if (d * 64 < next_v_bytes) _mm_prefetch(next_v + d * 64, _MM_HINT_T0);
      __m256 channel[2] = {load_keys(k_block, d * stride + slot, quantized),
                           load_keys(k_block, d * stride + slot + 8, quantized)};
      for (size_t g = 0; g < group; ++g) {
        __m256 query = _mm256_set1_ps(qs[g * head_dim + d]);
        scores[g][0] = _mm256_fmadd_ps(query, channel[0], scores[g][0]);
        scores[g][1] = _mm256_fmadd_ps(query, channel[1], scores[g][1]);
      }
    }
    __m256 k_scales[2] = {_mm256_set1_ps(1.f), _mm256_set1_ps(1.f)};
    __m256 v_scales[2] = {_mm256_set1_ps(1.f), _mm256_set1_ps(1.f)};
    if (quantized) {
      const int8_t *scales = (const int8_t *)cache + (page_start + value_blocks) * block;
      const int8_t *k_at = scales + ((size_t)page - page_start) * 2 * stride + 2 * slot;
      const int8_t *v_at = scales + ((size_t)page - page_start + kv_heads) * 2 * stride + 2 * slot;
      for (int half = 0; half < 2; ++half) {
        k_scales[half] = load_bf16_scales(k_at + 16 * half, unit);
        v_scales[half] = load_bf16_scales(v_at + 16 * half, unit);
      }
    }
    const __m256 minus_inf = _mm256_set1_ps(-__builtin_inff());
    float weights[ATTENTION_MAX_GROUP][ATTENTION_KEYS];
    __m256 rescales[ATTENTION_MAX_GROUP];
    for (size_t g = 0; g < group; ++g) {
      __m256 masked[2];
      for (int half = 0; half < 2; ++half) {
        if (quantized) scores[g][half] = _mm256_mul_ps(scores[g][half], k_scales[half]);
        masked[half] = _mm256_blendv_ps(minus_inf, scores[g][half], _mm256_castsi256_ps(live[half]));
      }
      float chunk_top = max_of_lanes(_mm256_max_ps(masked[0], masked[1]));
      float new_top = chunk_top > top[g] ? chunk_top : top[g];
      __m256 tops = _mm256_set1_ps(new_top), p[2];
      for (int half = 0; half < 2; ++half)
        p[half] = _mm256_and_ps(exp_ps(_mm256_sub_ps(scores[g][half], tops)), _mm256_castsi256_ps(live[half]));
      /* exp(-inf) on the first chunk: the clamp makes it ~1e-38, times a total and sums of 0. */
      float rescale = _mm256_cvtss_f32(exp_ps(_mm256_set1_ps(top[g] - new_top)));
      top[g] = new_top;
      total[g] = total[g] * rescale + sum_of_lanes(_mm256_add_ps(p[0], p[1]));
      rescales[g] = _mm256_set1_ps(rescale);
      for (int half = 0; half < 2; ++half)
        _mm256_storeu_ps(weights[g] + 8 * half, quantized ? _mm256_mul_ps(p[half], v_scales[half]) : p[half]);
    }
    for (size_t c = 0; c < vectors; ++c) {
      __m256 sums[ATTENTION_MAX_GROUP];
      for (size_t g = 0; g < group; ++g) sums[g] = _mm256_mul_ps(acc[g][c], rescales[g]);
      for (size_t j = 0; j < live_keys; ++j) {
        __m256 value = load_keys(v_block, (slot + j) * head_dim + c * 8, quantized);
        for (size_t g = 0; g < group; ++g) sums[g] = _mm256_fmadd_ps(_mm256_set1_ps(weights[g][j]), value, sums[g]);
      }
      for (size_t g = 0; g < group; ++g) acc[g][c] = sums[g];
    }
  }
  for (size_t g = 0; g < group; ++g) {
    __m256 inverse = _mm256_set1_ps(total[g] > 0.f ? 1.f / total[g] : 0.f);
    for (size_t c = 0; c < vectors; ++c) _mm256_storeu_ps(outs + g * head_dim + c * 8, _mm256_mul_ps(acc[g][c], inverse));
  }
}

/* The group sizes of common models (1 to 8 query heads a K/V head: Llama 3, Qwen2.5/3, Gemma 3,
 * SmolLM2) each get their own loop; a larger group takes the loop whose group is a variable. */
static inline __attribute__((always_inline)) void paged_decode_attention(
    const float *q, const void *cache, size_t cache_size, const int64_t *pages, const int64_t *visible, float *out,
    size_t heads, size_t kv_heads, size_t head_dim, size_t stride, size_t blocks, size_t workgroup, int quantized,
    size_t page_blocks, size_t value_blocks) {
#define GROUP_OF(g)                                                                                          \
  group_decode_attention(q, cache, cache_size, pages, visible, out, heads, kv_heads, head_dim, stride, blocks, \
                         workgroup, quantized, page_blocks, value_blocks, g)
  switch (heads / kv_heads) {
    case 1: GROUP_OF(1); break;
    case 2: GROUP_OF(2); break;
    case 3: GROUP_OF(3); break;
    case 4: GROUP_OF(4); break;
    case 5: GROUP_OF(5); break;
    case 6: GROUP_OF(6); break;
    case 7: GROUP_OF(7); break;
    case 8: GROUP_OF(8); break;
    default: GROUP_OF(heads / kv_heads); break;
  }
#undef GROUP_OF
}

DECODE_ATTENTION_ENTRY_POINTS()

/* ---- LoRA -------------------------------------------------------------------------------- */

/* LoRA adapters applied per row (cpu_kernels.h says what it computes), eight lanes a vector. */
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
    for (size_t i = 0; i < count * out; i += 8) _mm256_storeu_ps(ys + i, _mm256_setzero_ps());
    return;
  }
  float low[LORA_TOKENS][LORA_MAX_RANK];
  for (size_t r = 0; r < rank; ++r) {
    const float *a_row = as + r * in;
    for (size_t t = 0; t < count; ++t) {
      __m256 sum = _mm256_setzero_ps();
      for (size_t k = 0; k < in; k += 8)
        sum = _mm256_fmadd_ps(_mm256_loadu_ps(a_row + k), _mm256_loadu_ps(xs + t * in + k), sum);
      low[t][r] = sum_of_lanes(sum);
    }
  }
  for (size_t o = 0; o < out; o += 8) {
    __m256 acc[LORA_TOKENS];
    for (size_t t = 0; t < count; ++t) acc[t] = _mm256_setzero_ps();
    for (size_t r = 0; r < rank; ++r) {
      __m256 b_row = _mm256_loadu_ps(bs + r * out + o);
      for (size_t t = 0; t < count; ++t) acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(low[t][r]), b_row, acc[t]);
    }
    for (size_t t = 0; t < count; ++t) _mm256_storeu_ps(ys + t * out + o, acc[t]);
  }
}
