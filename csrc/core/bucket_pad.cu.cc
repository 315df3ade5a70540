// GPU versions of the ragged exchange's padding (core/bucket_pad.h): the
// block bookkeeping runs on the host (counts is host memory), the data
// movement is one cudaMemcpyAsync per non-empty block plus one
// cudaMemsetAsync per block's padding, all on the op's stream. Rows are
// opaque bytes, so every dtype works. TensorFlow-free; no host sync.

#include <cuda_runtime.h>

#include <cstdint>

#include "core/bucket_pad.h"
#include "core/gpu_util.cuh"

namespace sok {
namespace bucket {
namespace gpu {

using ::sok::gpu::StreamOf;

Status BucketPad(const GpuDevice& d, const char* x, int64_t row_bytes,
                 const int64_t* counts, int64_t num_ranks, int64_t rank,
                 int64_t bucket, char* padded) {
  if (row_bytes <= 0 || num_ranks <= 0 || bucket <= 0) return Status::Ok();
  const cudaStream_t stream = StreamOf(d);
  const int64_t* send = counts + rank * num_ranks;
  int64_t offset = 0;  // rows of x before block j
  for (int64_t j = 0; j < num_ranks; ++j) {
    const int64_t n = send[j];  // validated: 0 <= n <= bucket
    char* block = padded + j * bucket * row_bytes;
    if (n > 0) {
      SOK_CUDA_RETURN_IF_ERROR(
          cudaMemcpyAsync(block, x + offset * row_bytes,
                          static_cast<size_t>(n * row_bytes),
                          cudaMemcpyDeviceToDevice, stream),
          "SokBucketPad copy");
    }
    if (n < bucket) {
      SOK_CUDA_RETURN_IF_ERROR(
          cudaMemsetAsync(block + n * row_bytes, 0,
                          static_cast<size_t>((bucket - n) * row_bytes),
                          stream),
          "SokBucketPad padding");
    }
    offset += n;
  }
  return Status::Ok();
}

Status BucketUnpad(const GpuDevice& d, const char* received,
                   int64_t row_bytes, const int64_t* counts,
                   int64_t num_ranks, int64_t rank, int64_t bucket,
                   char* out) {
  if (row_bytes <= 0 || num_ranks <= 0) return Status::Ok();
  const cudaStream_t stream = StreamOf(d);
  int64_t offset = 0;  // rows of out before block j
  for (int64_t j = 0; j < num_ranks; ++j) {
    const int64_t n = counts[j * num_ranks + rank];  // validated: <= bucket
    if (n > 0) {
      SOK_CUDA_RETURN_IF_ERROR(
          cudaMemcpyAsync(out + offset * row_bytes,
                          received + j * bucket * row_bytes,
                          static_cast<size_t>(n * row_bytes),
                          cudaMemcpyDeviceToDevice, stream),
          "SokBucketUnpad copy");
    }
    offset += n;
  }
  return Status::Ok();
}

}  // namespace gpu
}  // namespace bucket
}  // namespace sok
