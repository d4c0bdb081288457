/* What Kiln's two builds of the CPU kernels share: cpu_kernels.c (AVX-512) and
 * cpu_kernels_avx2.c (AVX2, for x86-64 CPUs without AVX-512) define the same entry points with
 * these operands, so that one MLIR calls either; export/cpu_kernels.py compiles the one the
 * exporting machine runs.
 *
 * Arguments follow MLIR's memref lowering for memref<?xT>: allocated pointer, aligned pointer,
 * offset, size, stride; then the index operands of the dispatch. */
#ifndef KILN_CPU_KERNELS_H
#define KILN_CPU_KERNELS_H

#include <stddef.h>
#include <stdint.h>
#include <immintrin.h>

#define MEMREF_F32(name) \
  const float *name##_allocated, const float *restrict name, size_t name##_offset, size_t name##_size, \
  size_t name##_stride

#define MEMREF_I8(name) \
  const int8_t *name##_allocated, const int8_t *restrict name, size_t name##_offset, size_t name##_size, \
  size_t name##_stride

/* The block kernels' operands (q, xs, xsum, w, ws, wo, y) moved to their offsets; the memref
 * fields they do not read are dropped. */
#define BLOCK_OPERANDS_AT_OFFSETS()                                                                     \
  do {                                                                                                 \
    (void)q_allocated; (void)q_size; (void)q_stride; (void)xs_allocated; (void)xs_size; (void)xs_stride; \
    (void)xsum_allocated; (void)xsum_size; (void)xsum_stride; (void)w_allocated; (void)w_size;         \
    (void)w_stride; (void)ws_allocated; (void)ws_size; (void)ws_stride; (void)wo_allocated;            \
    (void)wo_size; (void)wo_stride; (void)y_allocated; (void)y_size; (void)y_stride;                   \
    q += q_offset;                                                                                     \
    xs += xs_offset;                                                                                   \
    xsum += xsum_offset;                                                                               \
    w += w_offset;                                                                                     \
    ws += ws_offset;                                                                                   \
    wo += wo_offset;                                                                                   \
    y += y_offset;                                                                                     \
  } while (0)

#define MEMREF_I64(name) \
  const int64_t *name##_allocated, const int64_t *restrict name, size_t name##_offset, size_t name##_size, \
  size_t name##_stride

/* The int8 block kernel's flags (see kiln_row_matmul_q8): offsets, a scale per row, a scale per
 * half block of 16; its input row count sits above them. */
enum { Q8_OFFSETS = 1, Q8_ROW_SCALES = 2, Q8_HALF_BLOCKS = 4, Q8_ROWS_SHIFT = 3 };

/* The expert kernel's flag for 4-bit values two a byte, above the int8 kernel's. */
enum { EXPERT_NIBBLES = 1 << Q8_ROWS_SHIFT };

/* One expert's share of a mixture's stack (kiln_expert_matmul's w, ws and wo), in elements: its
 * values ([N, K / 2] with EXPERT_NIBBLES, else [N, K]), its scales ([N] with Q8_ROW_SCALES,
 * [2 G, N] with Q8_HALF_BLOCKS, else [G, N]) and its offsets ([G, N] where it has any). */
struct expert_sizes {
  size_t values, scales, offsets;
};

static inline struct expert_sizes expert_sizes_of(size_t n_dim, size_t k_dim, size_t flags) {
  const size_t groups = k_dim / 32, nibbles = (flags & EXPERT_NIBBLES) != 0;
  struct expert_sizes sizes = {
      n_dim * (nibbles ? k_dim / 2 : k_dim),
      flags & Q8_ROW_SCALES ? n_dim : (flags & Q8_HALF_BLOCKS ? 2 : 1) * groups * n_dim,
      nibbles || flags & Q8_OFFSETS ? groups * n_dim : 0};
  return sizes;
}

/* Pairs of one 4-bit expert gathered for one call of the dense 4-bit kernel (the AVX2 build's):
 * enough to stream the workgroup's weight rows once per 64 tokens, few enough for the stack. */
enum { EXPERT_TILE = 64 };

/* Input row m of a call is row `inputs[m]` of q and xs, and its result row `outputs[m]` of y; with
 * no list (NULL), row m itself: a mixture's pairs of one expert take the dense kernel this way. */
static inline size_t row_of(const size_t *list, size_t m) { return list ? list[m] : m; }

/* Decode attention over the paged KV cache, reading each page where it lies.
 *
 * The model's own form gathers every K and V page of every sequence into a contiguous copy and
 * then runs batch matmuls and a blocked softmax over the copy: about ten dispatches a layer, and
 * the copy grows with the batch and the context. Here one workgroup takes one (sequence, K/V
 * head) and walks its block table: ATTENTION_KEYS (16) keys at a time, it scores the group's query
 * heads against the keys (a K page is stored transposed, [head_dim, stride], so one AVX-512 vector,
 * or two AVX2 ones, holds one channel of the 16 keys), folds them into a running softmax
 * (flash-decoding's online form: the running maximum, the sum of weights, the weighted sum of V
 * rows, rescaled as the maximum grows) and adds the weighted V rows ([stride, head_dim]). q arrives scaled by 1/sqrt(head_dim).
 *
 * Operands: q and out [rows, heads, head_dim]; cache the whole cache buffer; pages [rows, kv_heads,
 * blocks] the K page of each block (its V page is kv_heads pages later, in units of
 * head_dim * stride elements); visible [rows] how many keys each row's query sees (0 for a
 * padding row, whose output is 0). A page past the end of the cache is skipped, never read.
 */

/* The byte caches' forms (models/kv_quant.py, models/llama.py's CachePages): their blocks hold a
 * byte a value, int8 or fp8 e4m3 (OCP's e4m3fn), K^T or V as above, and a page of `page_blocks`
 * blocks ends in scale blocks after its first `value_blocks`: value block i's scales, one bfloat16
 * per key, are the i-th run of 2 * stride bytes there. A chunk's scores take its keys' scales after
 * the dot products; the value weights take the values' scales before the sum. A quarter of
 * float32's bytes are read, each widened to float32 as it is loaded. fp8 values are widened as
 * 2**-8 times themselves (float16's exponent bias is 8 above e4m3's); FP8_UNIT folds that back into
 * the scales. */
enum { CACHE_FLOAT32 = 0, CACHE_INT8 = 1, CACHE_FP8_E4M3 = 2 };
#define FP8_UNIT 256.f

enum { ATTENTION_KEYS = 16, ATTENTION_MAX_GROUP = 16, ATTENTION_MAX_HEAD_DIM = 256 };

#define ATTENTION_OPERANDS_AT_OFFSETS()                                                                   \
  do {                                                                                                   \
    (void)q_allocated; (void)q_size; (void)q_stride; (void)cache_allocated; (void)cache_stride;          \
    (void)pages_allocated; (void)pages_size; (void)pages_stride; (void)visible_allocated;                \
    (void)visible_size; (void)visible_stride; (void)out_allocated; (void)out_size; (void)out_stride;     \
  } while (0)

#define BYTE_CACHE_ATTENTION(symbol, form)                                                                \
  void symbol(MEMREF_F32(q), MEMREF_I8(cache), MEMREF_I64(pages), MEMREF_I64(visible), float *out_allocated, \
              float *restrict out, size_t out_offset, size_t out_size, size_t out_stride, size_t heads,       \
              size_t kv_heads, size_t head_dim, size_t stride, size_t blocks, size_t page_blocks,             \
              size_t value_blocks, size_t workgroup) {                                                        \
    ATTENTION_OPERANDS_AT_OFFSETS();                                                                      \
    paged_decode_attention(q + q_offset, cache + cache_offset, cache_size, pages + pages_offset,          \
                           visible + visible_offset, out + out_offset, heads, kv_heads, head_dim, stride,   \
                           blocks, workgroup, form, page_blocks, value_blocks);                             \
  }

/* The three entry points (float32, int8 and fp8 caches), over the including build's
 * `paged_decode_attention` (one workgroup's (row, K/V head), its cache form a constant). */
#define DECODE_ATTENTION_ENTRY_POINTS()                                                                   \
  void kiln_paged_decode_attention(MEMREF_F32(q), MEMREF_F32(cache), MEMREF_I64(pages), MEMREF_I64(visible), \
                                   float *out_allocated, float *restrict out, size_t out_offset,            \
                                   size_t out_size, size_t out_stride, size_t heads, size_t kv_heads,        \
                                   size_t head_dim, size_t stride, size_t blocks, size_t workgroup) {        \
    ATTENTION_OPERANDS_AT_OFFSETS();                                                                      \
    paged_decode_attention(q + q_offset, cache + cache_offset, cache_size, pages + pages_offset,          \
                           visible + visible_offset, out + out_offset, heads, kv_heads, head_dim, stride,   \
                           blocks, workgroup, CACHE_FLOAT32, 0, 0);                                          \
  }                                                                                                      \
  BYTE_CACHE_ATTENTION(kiln_paged_decode_attention_i8, CACHE_INT8)                                        \
  BYTE_CACHE_ATTENTION(kiln_paged_decode_attention_fp8, CACHE_FP8_E4M3)

/* LoRA adapters applied per row (punica's BGMV): y[n, t] = (x[n, t] . A_s^T) . B_s for the row's
 * slot s = slots[n], reading the slot's weights where they lie in the stacked arguments, A
 * [layers, slot_count, rank, in] and B^T [layers, slot_count, rank, out], at layer `layer`. A row
 * with slot 0 (no adapter) or a slot out of range gets zeros and reads no weight. One workgroup
 * takes one row and up to LORA_TOKENS of its tokens: each rank's dot product with every token
 * while its row of A is in cache, then every output vector as a sum of B^T's rows scaled by the
 * tokens' low-rank values. in and out are whole vectors of 16. */
enum { LORA_TOKENS = 16, LORA_MAX_RANK = 256 };

#define LORA_OPERANDS_AT_OFFSETS()                                                                       \
  do {                                                                                                  \
    (void)x_allocated; (void)x_size; (void)x_stride; (void)a_allocated; (void)a_stride; (void)b_allocated; \
    (void)b_stride; (void)slots_allocated; (void)slots_size; (void)slots_stride; (void)y_allocated;     \
    (void)y_size; (void)y_stride;                                                                       \
    x += x_offset;                                                                                      \
    a += a_offset;                                                                                      \
    b += b_offset;                                                                                      \
    slots += slots_offset;                                                                              \
    y += y_offset;                                                                                      \
  } while (0)

/* One LoRA workgroup's share: its `count` tokens' inputs x and outputs y, and its row's slot's A
 * and B^T at the layer, or a and b NULL where the row has no adapter (its outputs are zeros). */
struct lora_work {
  const float *x, *a, *b;
  float *y;
  size_t count;
};

static inline struct lora_work lora_work_of(const float *x, const float *a, size_t a_size, const float *b,
                                            size_t b_size, const int64_t *slots, float *y, size_t tokens,
                                            size_t in, size_t out, size_t rank, size_t slot_count, size_t layer,
                                            size_t workgroup) {
  const size_t chunks = (tokens + LORA_TOKENS - 1) / LORA_TOKENS;
  const size_t row = workgroup / chunks, t0 = workgroup % chunks * LORA_TOKENS;
  const int64_t slot = slots[row];
  const size_t a_at = (layer * slot_count + (size_t)slot) * rank * in;
  const size_t b_at = (layer * slot_count + (size_t)slot) * rank * out;
  struct lora_work work = {x + (row * tokens + t0) * in, NULL, NULL, y + (row * tokens + t0) * out,
                           tokens - t0 < LORA_TOKENS ? tokens - t0 : LORA_TOKENS};
  if (slot > 0 && (size_t)slot < slot_count && rank <= LORA_MAX_RANK && a_at + rank * in <= a_size &&
      b_at + rank * out <= b_size) {
    work.a = a + a_at;
    work.b = b + b_at;
  }
  return work;
}

#endif
