// Framework-neutral CPU kernels of the ragged exchange's padding.
//
// A ragged all-to-all between N ranks (rank i sends C[i, j] rows to rank j,
// C an [N, N] count matrix identical on every rank) is carried by a dense
// all-to-all of N equal blocks of `bucket` rows, bucket = the next power of
// two >= max(C) (>= 1). These kernels compute that bucket, move a rank's
// rows into the padded layout (block j holds the rows for rank j, zero
// padded) and take the received rows out of it (block j holds the rows from
// rank j).
//
// Rows are opaque: `row_bytes` bytes each, copied with memcpy, so every
// plain-old-data dtype and trailing shape works. No TensorFlow dependency;
// errors are returned as a status; parallelism through the injected
// ParallelFor of core/lookup.h. Output never depends on the thread split.

#ifndef SOK_KERAS_CORE_BUCKET_PAD_H_
#define SOK_KERAS_CORE_BUCKET_PAD_H_

#include <cstdint>

#include "core/lookup.h"

namespace sok {
namespace bucket {

using ParallelFor = lookup::ParallelFor;
using Status = lookup::LookupStatus;

// The largest exponent a bucket may have (2^62 rows), so that the bucket
// and the instance-key offset fit their types.
constexpr int64_t kMaxExponent = 62;

// Checks that every entry of `counts` ([num_ranks, num_ranks], row-major)
// is >= 0 and returns in *exponent the smallest e >= 0 with
// 2^e >= max(max(counts), 1), computed exactly with integer arithmetic.
// Fails if a count is negative or the bucket would exceed 2^kMaxExponent.
Status BucketExponent(const int64_t* counts, int64_t num_ranks,
                      int64_t* exponent);

// sum(counts[rank, :]) (row = true) or sum(counts[:, rank]) (row = false)
// in *sum; fails on int64 overflow. Counts must be >= 0.
Status CountSum(const int64_t* counts, int64_t num_ranks, int64_t rank,
                bool row, int64_t* sum);

// Checks that num_ranks * bucket rows of row_bytes bytes are addressable.
Status CheckPaddedSize(int64_t num_ranks, int64_t exponent,
                       int64_t row_bytes);

// padded[j * bucket + p] = x[off_j + p] for p < counts[rank, j], where
// off_j = sum(counts[rank, :j]); every other row of padded is zeroed.
// x: [sum(counts[rank, :]) rows], padded: [num_ranks * bucket rows].
// Arguments must have been validated (BucketExponent, CountSum).
void BucketPad(const char* x, int64_t row_bytes, const int64_t* counts,
               int64_t num_ranks, int64_t rank, int64_t bucket,
               const ParallelFor& parallel_for, char* padded);

// out[off_j + p] = received[j * bucket + p] for p < counts[j, rank], where
// off_j = sum(counts[:j, rank]).
// received: [num_ranks * bucket rows], out: [sum(counts[:, rank]) rows].
// Arguments must have been validated (every counts[j, rank] <= bucket).
void BucketUnpad(const char* received, int64_t row_bytes,
                 const int64_t* counts, int64_t num_ranks, int64_t rank,
                 int64_t bucket, const ParallelFor& parallel_for, char* out);

}  // namespace bucket
}  // namespace sok

// ============================================================================
// GPU versions (core/bucket_pad.cu.cc), only in builds with CUDA
// (SOK_WITH_CUDA). Same layout as BucketPad / BucketUnpad above; x, padded,
// received and out are device memory, counts is host memory. The work is
// cudaMemcpyAsync / cudaMemsetAsync calls on d.stream (no kernels, no host
// sync); a CUDA failure is returned as an error status.
// ============================================================================
#ifdef SOK_WITH_CUDA

#include "core/device.h"

namespace sok {
namespace bucket {
namespace gpu {

Status BucketPad(const GpuDevice& d, const char* x, int64_t row_bytes,
                 const int64_t* counts, int64_t num_ranks, int64_t rank,
                 int64_t bucket, char* padded);

Status BucketUnpad(const GpuDevice& d, const char* received,
                   int64_t row_bytes, const int64_t* counts,
                   int64_t num_ranks, int64_t rank, int64_t bucket,
                   char* out);

}  // namespace gpu
}  // namespace bucket
}  // namespace sok

#endif  // SOK_WITH_CUDA

#endif  // SOK_KERAS_CORE_BUCKET_PAD_H_
