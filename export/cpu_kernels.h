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

#endif
