// Gathering and scattering consecutive blocks of rows: the packing and
// unpacking of the fused exchange's buckets (sok_keras/lookup.py).
//
//   GatherBlocks:  out = concat(values[starts[i] : starts[i] + lengths[i]])
//   ScatterBlocks: out = zeros([num_rows, ...]) with
//                  out[starts[i] : starts[i] + lengths[i]] = the i-th block
//                  of grad (grad = the blocks, concatenated), blocks disjoint
//
// ScatterBlocks is GatherBlocks' gradient. The block bookkeeping (starts,
// lengths: a few entries, from the exchange's count matrices) is host
// memory on both devices; the rows are opaque `row_bytes` bytes each,
// copied with memcpy, so every plain-old-data dtype and trailing shape
// works. One functor per operation, implemented for CpuDevice (blocks.cc)
// and GpuDevice (blocks.cu.cc). Results never depend on the thread split
// or the device. TensorFlow-free; errors are returned as a status.

#ifndef SOK_KERAS_CORE_BLOCKS_H_
#define SOK_KERAS_CORE_BLOCKS_H_

#include <cstdint>

#include "core/device.h"
#include "core/status.h"

namespace sok {
namespace blocks {

// Checks the blocks (starts[i], lengths[i]), i < num_blocks, over a tensor
// of `num_rows` rows: every start and length >= 0 and every block inside
// [0, num_rows); with `disjoint`, also that no two blocks share a row. The
// message names the first bad block. Returns the rows of all blocks in
// *total (int64 overflow is an error).
Status CheckBlocks(const int64_t* starts, const int64_t* lengths,
                   int64_t num_blocks, int64_t num_rows, bool disjoint,
                   int64_t* total);

// out[off_i + p] = values[starts[i] + p] for p < lengths[i], where
// off_i = lengths[0] + ... + lengths[i - 1]. values and out are memory of
// the device; starts and lengths are host memory, checked by CheckBlocks.
template <typename Device>
struct GatherBlocksFunctor {
  Status operator()(const Device& d, const char* values, int64_t row_bytes,
                    const int64_t* starts, const int64_t* lengths,
                    int64_t num_blocks, char* out);
};

// out[starts[i] + p] = grad[off_i + p] for p < lengths[i]; every other row
// of out ([num_rows rows]) is zero. Blocks must be disjoint (CheckBlocks
// with disjoint = true), so that no row is written twice.
template <typename Device>
struct ScatterBlocksFunctor {
  Status operator()(const Device& d, const char* grad, int64_t row_bytes,
                    const int64_t* starts, const int64_t* lengths,
                    int64_t num_blocks, int64_t num_rows, char* out);
};

template <>
struct GatherBlocksFunctor<CpuDevice> {
  Status operator()(const CpuDevice& d, const char* values, int64_t row_bytes,
                    const int64_t* starts, const int64_t* lengths,
                    int64_t num_blocks, char* out);
};

template <>
struct ScatterBlocksFunctor<CpuDevice> {
  Status operator()(const CpuDevice& d, const char* grad, int64_t row_bytes,
                    const int64_t* starts, const int64_t* lengths,
                    int64_t num_blocks, int64_t num_rows, char* out);
};

// GPU (blocks.cu.cc, builds with CUDA only): one cudaMemcpyAsync per run of
// source-contiguous blocks (plus one cudaMemsetAsync for ScatterBlocks'
// zeros) on d.stream: no kernels, no scratch, no host sync.
template <>
struct GatherBlocksFunctor<GpuDevice> {
  Status operator()(const GpuDevice& d, const char* values, int64_t row_bytes,
                    const int64_t* starts, const int64_t* lengths,
                    int64_t num_blocks, char* out);
};

template <>
struct ScatterBlocksFunctor<GpuDevice> {
  Status operator()(const GpuDevice& d, const char* grad, int64_t row_bytes,
                    const int64_t* starts, const int64_t* lengths,
                    int64_t num_blocks, int64_t num_rows, char* out);
};

}  // namespace blocks
}  // namespace sok

#endif  // SOK_KERAS_CORE_BLOCKS_H_
