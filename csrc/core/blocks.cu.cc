// GPU versions of core/blocks.h: the block bookkeeping runs on the host
// (starts and lengths are host memory), the data movement is one
// cudaMemcpyAsync per run of blocks that are consecutive in the source
// (plus one cudaMemsetAsync of ScatterBlocks' output), all on the op's
// stream. Rows are opaque bytes, so every dtype works. Deterministic (every
// output byte is written by exactly one copy); TensorFlow-free; no scratch
// memory, no host sync.

#include <cuda_runtime.h>

#include <cstdint>

#include "core/blocks.h"
#include "core/gpu_util.cuh"

namespace sok {
namespace blocks {

using ::sok::gpu::StreamOf;

namespace {

// Calls copy(src_row, dst_row, rows) once per maximal run of blocks that
// are consecutive both in the concatenation and at `starts` (the fused
// exchange's blocks often are: one table's rows for consecutive ranks).
template <typename Fn>
Status ForRuns(const int64_t* starts, const int64_t* lengths,
               int64_t num_blocks, const Fn& copy) {
  int64_t offset = 0;  // rows of the concatenation before block i
  int64_t run_start = 0, run_offset = 0, run_rows = 0;
  for (int64_t i = 0; i < num_blocks; ++i) {
    const int64_t l = lengths[i];
    if (l == 0) continue;
    if (run_rows > 0 && starts[i] == run_start + run_rows &&
        offset == run_offset + run_rows) {
      run_rows += l;
    } else {
      if (run_rows > 0) SOK_RETURN_IF_ERROR(copy(run_start, run_offset,
                                                 run_rows));
      run_start = starts[i];
      run_offset = offset;
      run_rows = l;
    }
    offset += l;
  }
  if (run_rows > 0) SOK_RETURN_IF_ERROR(copy(run_start, run_offset, run_rows));
  return Status::Ok();
}

}  // namespace

Status GatherBlocksFunctor<GpuDevice>::operator()(
    const GpuDevice& d, const char* values, int64_t row_bytes,
    const int64_t* starts, const int64_t* lengths, int64_t num_blocks,
    char* out) {
  if (row_bytes <= 0 || num_blocks <= 0) return Status::Ok();
  const cudaStream_t stream = StreamOf(d);
  return ForRuns(starts, lengths, num_blocks,
                 [&](int64_t start, int64_t offset, int64_t rows) {
                   SOK_CUDA_RETURN_IF_ERROR(
                       cudaMemcpyAsync(out + offset * row_bytes,
                                       values + start * row_bytes,
                                       static_cast<size_t>(rows * row_bytes),
                                       cudaMemcpyDeviceToDevice, stream),
                       "SokGatherBlocks copy");
                   return Status::Ok();
                 });
}

Status ScatterBlocksFunctor<GpuDevice>::operator()(
    const GpuDevice& d, const char* grad, int64_t row_bytes,
    const int64_t* starts, const int64_t* lengths, int64_t num_blocks,
    int64_t num_rows, char* out) {
  if (row_bytes <= 0) return Status::Ok();
  const cudaStream_t stream = StreamOf(d);
  if (num_rows > 0) {
    SOK_CUDA_RETURN_IF_ERROR(
        cudaMemsetAsync(out, 0, static_cast<size_t>(num_rows * row_bytes),
                        stream),
        "SokScatterBlocks zeros");
  }
  if (num_blocks <= 0) return Status::Ok();
  return ForRuns(starts, lengths, num_blocks,
                 [&](int64_t start, int64_t offset, int64_t rows) {
                   SOK_CUDA_RETURN_IF_ERROR(
                       cudaMemcpyAsync(out + start * row_bytes,
                                       grad + offset * row_bytes,
                                       static_cast<size_t>(rows * row_bytes),
                                       cudaMemcpyDeviceToDevice, stream),
                       "SokScatterBlocks copy");
                   return Status::Ok();
                 });
}

}  // namespace blocks
}  // namespace sok
