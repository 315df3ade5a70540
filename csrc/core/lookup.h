// Framework-neutral CPU kernels for the embedding lookup path.
//
// Everything here works on raw pointers and has no TensorFlow dependency.
// Errors are returned as a `LookupStatus`; nothing throws or exits.
// Parallelism comes from an injected `ParallelFor` so that the framework
// adapter can supply its own thread pool. Every kernel is deterministic:
// its output does not depend on how the work is split between threads.

#ifndef SOK_KERAS_CORE_LOOKUP_H_
#define SOK_KERAS_CORE_LOOKUP_H_

#include <cmath>
#include <cstdint>
#include <functional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "core/half.h"
#include "core/parallel.h"
#include "core/status.h"

namespace sok {
namespace lookup {

// See core/parallel.h and core/status.h.
using ParallelFor = ::sok::ParallelFor;
using ::sok::SerialParallelFor;
using LookupStatus = ::sok::Status;

// The first invalid id of a lookup: its position and value, or (-1, 0).
struct IdError {
  int64_t position = -1;
  int64_t value = 0;
  bool ok() const { return position < 0; }
};

// An id as an error message shows it. The most negative int64 is what the
// Python layers make of a float id that is no integer (1.5, nan, inf), so
// that every rank refuses it alike; its text says it is either.
std::string IdText(int64_t id);

// Returns the first id (by position) that is < 0 or >= vocab_size.
template <typename Tid>
IdError FindFirstInvalidId(const Tid* ids, int64_t nnz, int64_t vocab_size,
                           const ParallelFor& parallel_for);

// The result of DedupBucketize, sized by the number of unique ids U.
struct DedupResult {
  std::vector<int64_t> unique_ids;  // [U], grouped by owner rank.
  std::vector<int64_t> local_rows;  // [U], row of each id on its owner.
  std::vector<int64_t> counts;      // [num_ranks], unique ids per rank.
};

// Deduplicates `ids` (all of which must be in [0, vocab_size); check with
// FindFirstInvalidId first) and groups the distinct ids by owner rank.
//
// owner < 0 ("distributed"): id lives on rank id % num_ranks, at local row
// id / num_ranks. owner >= 0 ("localized"): every id lives on rank `owner`
// at local row id. The unique ids are ordered by ascending rank, then by
// ascending id. `inverse` ([nnz], written by this call) receives the index
// of each id in the unique ids.
//
// Fails if nnz does not fit the int32 inverse or the arguments are invalid.
template <typename Tid>
LookupStatus DedupBucketize(const Tid* ids, int64_t nnz, int64_t num_ranks,
                            int64_t owner, const ParallelFor& parallel_for,
                            int32_t* inverse, DedupResult* result);

enum class Combiner { kSum, kMean, kSqrtn };

// Pools rows into out[0, dim) one at a time (in the caller's order), then
// divides by the combiner's denominator: mean, the sum of the weights;
// sqrtn, the square root of the sum of squared weights; a zero denominator
// gives zeros. The one CPU pooling step of SegmentCombine and the one-rank
// pooled lookup. The sums run in AccOf<T> (core/half.h: float for the 16-bit
// types, T otherwise) and Finish rounds each element once into out; Finish
// must be called (for the 16-bit types it is what writes out).
template <typename T>
class RowPooler {
 public:
  using Acc = AccOf<T>;

  // `scratch` ([dim] of Acc, optional) holds the sums when Acc is not T, so
  // that a loop over many outputs allocates once; by default the pooler
  // owns a buffer.
  RowPooler(T* out, int64_t dim, Acc* scratch = nullptr)
      : out_(out), dim_(dim) {
    if constexpr (std::is_same<Acc, T>::value) {
      acc_ = out_;
    } else if (scratch != nullptr) {
      acc_ = scratch;
    } else {
      buffer_.resize(static_cast<size_t>(dim_));
      acc_ = buffer_.data();
    }
    for (int64_t c = 0; c < dim_; ++c) acc_[c] = Acc(0);
  }
  void Add(const T* row) {
    for (int64_t c = 0; c < dim_; ++c) acc_[c] += Storage<T>::Load(row[c]);
    weight_sum_ += Acc(1);
    square_sum_ += Acc(1);
  }
  void Add(const T* row, T stored_weight) {
    const Acc weight = Storage<T>::Load(stored_weight);
    for (int64_t c = 0; c < dim_; ++c) {
      acc_[c] += weight * Storage<T>::Load(row[c]);
    }
    weight_sum_ += weight;
    square_sum_ += weight * weight;
  }
  void Finish(Combiner combiner) {
    Acc denominator;
    if (combiner == Combiner::kMean) {
      denominator = weight_sum_;
    } else if (combiner == Combiner::kSqrtn) {
      denominator = std::sqrt(square_sum_);
    } else {
      if constexpr (!std::is_same<Acc, T>::value) {
        for (int64_t c = 0; c < dim_; ++c) {
          out_[c] = Storage<T>::Store(acc_[c]);
        }
      }
      return;
    }
    for (int64_t c = 0; c < dim_; ++c) {
      out_[c] = Storage<T>::Store(denominator == Acc(0)
                                      ? Acc(0)
                                      : acc_[c] / denominator);
    }
  }

 private:
  T* out_;
  int64_t dim_;
  Acc* acc_ = nullptr;
  std::vector<Acc> buffer_;  // the sums, when Acc is not T
  Acc weight_sum_ = 0;
  Acc square_sum_ = 0;
};

// Parses "sum", "mean" or "sqrtn".
LookupStatus ParseCombiner(const std::string& name, Combiner* combiner);

// The table gradient of a one-rank pooled lookup (SokPooledLookup), reduced
// per distinct row, in two halves: a plan from the ids alone, then the
// gradient's sums over it. The ids of `ids` that are not the padding value
// -1 are deduplicated (the distinct rows ascending), and
//   rows_grad[u] = sum over i with ids[i] == rows[u] of
//                  weights[i] / denominator(bag of i) * grad[bag of i]
// summed exactly as SegmentCombineGrad sums it over the padding-free ids
// (the same kGradChunk order), so the result is bit-identical to dropping
// the padding, DedupBucketize and SegmentCombineGrad.
//
// The plan does not read the gradient, so a step can make it (and, on the
// GPU, its one blocking copy, which sizes it) beside the forward, when the
// device has little queued; the sums have no host sync.
//
// On bad input `error` says what and nothing is allocated: an id that is
// neither -1 nor in [0, num_rows) (its position in `ids` and value), or the
// first inconsistent bag of `splits` (PooledGradError::bad_bag).
struct PooledGradError {
  int64_t position = -1;  // of the first invalid id
  int64_t value = 0;      // that id
  int64_t bad_bag = -1;   // first bag with bad splits
  bool ok() const { return position < 0 && bad_bag < 0; }
};

// The plan of a pooled gradient over U distinct rows and `kept`
// padding-free ids, in the gradient's order (the kept positions grouped by
// row, ascending within a row):
//   rows [U]: the distinct ids, ascending;
//   offsets [U + 1]: row u's terms are k in [offsets[u], offsets[u + 1]);
//   segments [kept]: the bag of term k;
//   sorted_weights [kept]: its weight (only when the lookup has weights);
//   denominator [batch]: each bag's combiner denominator over its kept ids
//     (the weights' sum for mean, the square root of their squares' sum for
//     sqrtn; only for those combiners).
template <typename T>
struct PooledGradPlanBuffers {
  int64_t* rows = nullptr;
  int32_t* offsets = nullptr;
  int64_t* segments = nullptr;
  T* sorted_weights = nullptr;
  AccOf<T>* denominator = nullptr;
};

// `allocate(U, kept, &buffers)` is called once, when U and kept are known,
// and must fill `buffers` with [U], [U + 1], [kept], and [kept] and [batch]
// where the lookup has weights / a mean or sqrtn combiner.
template <typename T>
using PooledGradPlanAllocate = std::function<LookupStatus(
    int64_t num_unique, int64_t kept, PooledGradPlanBuffers<T>* buffers)>;

// ids: [nnz]; splits: [batch + 1] (from 0 to nnz, non-decreasing); weights:
// [nnz] or nullptr (all ones); bag_width >= 1: every bag has that many ids
// (splits are then b * bag_width), else -1. Requires nnz <= INT32_MAX.
template <typename T, typename Tid>
LookupStatus PooledGradPlan(const Tid* ids, int64_t nnz,
                            const int64_t* splits, int64_t batch,
                            int64_t bag_width, const T* weights,
                            int64_t num_rows, Combiner combiner,
                            const ParallelFor& parallel_for,
                            const PooledGradPlanAllocate<T>& allocate,
                            PooledGradError* error);

// rows_grad [num_unique, dim] from grad [batch, dim] and a plan (above);
// sorted_weights / denominator nullptr where the plan has none.
template <typename T>
void PooledGradCombine(const T* grad, int64_t dim, int64_t batch,
                       const int32_t* offsets, int64_t num_unique,
                       const int64_t* segments, int64_t kept,
                       const T* sorted_weights, const AccOf<T>* denominator,
                       const ParallelFor& parallel_for, T* rows_grad);

// Checks that every inverse[i] is in [0, num_rows) and every segment_ids[i]
// is in [0, num_segments). Reports the first offending position.
template <typename Tseg>
LookupStatus ValidateSegmentIndices(const int32_t* inverse,
                                    const Tseg* segment_ids, int64_t nnz,
                                    int64_t num_rows, int64_t num_segments,
                                    const ParallelFor& parallel_for);

// Pools the rows of each segment (the forward of a sparse lookup):
//   out[b] = combine({weights[i] * rows[inverse[i]] : segment_ids[i] == b}).
// `weights` may be null (all weights 1). Indices must have been validated.
// rows: [num_rows, dim], out: [num_segments, dim].
template <typename T, typename Tseg>
void SegmentCombine(const T* rows, int64_t dim, const int32_t* inverse,
                    const Tseg* segment_ids, const T* weights, int64_t nnz,
                    int64_t num_segments, Combiner combiner,
                    const ParallelFor& parallel_for, T* out);

// The order of the gradient's per-row sums, the same on both devices: a
// row's terms, in ascending position order, are summed left to right in
// chunks of kGradChunk; a row of more terms than that then sums its chunk
// sums the same way, level after level, until one chunk is left. (A row of
// at most kGradChunk terms is a plain left-to-right sum.) On the GPU the
// chunks of a hot row are summed in parallel.
constexpr int64_t kGradChunk = 64;

// The gradient of SegmentCombine with respect to `rows`, reduced per row:
//   out[u] = sum over i with inverse[i] == u of scale_i * grad[segment_ids[i]]
// (summed in the kGradChunk order above).
// grad: [num_segments, dim], out: [num_rows, dim]. Indices must have been
// validated.
template <typename T, typename Tseg>
void SegmentCombineGrad(const T* grad, int64_t dim, const int32_t* inverse,
                        const Tseg* segment_ids, const T* weights, int64_t nnz,
                        int64_t num_segments, int64_t num_rows,
                        Combiner combiner, const ParallelFor& parallel_for,
                        T* out);

// Checks the gathered per-rank lookup summaries of a multi-rank lookup.
// gathered: [num_ranks, num_ranks + 2], row r = concat(counts_r, error_r).
// Returns the first rank (>= 0) whose error position is not -1, with its
// error, or -1 when every rank is clean.
int64_t FirstRankWithError(const int64_t* gathered, int64_t num_ranks,
                           IdError* error);

}  // namespace lookup
}  // namespace sok

// ============================================================================
// GPU kernels (core/lookup.cu.cc), only in builds with CUDA (SOK_WITH_CUDA).
// Every function enqueues its work on d.stream and returns a CUDA failure as
// an error status (an internal error: the arguments were already checked).
// Device pointers are marked [device], host pointers [host]. Results are
// identical to the CPU kernels above and deterministic (no float atomics;
// every sum runs in ascending position order).
// ============================================================================
#ifdef SOK_WITH_CUDA

#include "core/device.h"

namespace sok {
namespace lookup {
namespace gpu {

// The results of gpu::DedupBucketize.
struct DedupOutput {
  int64_t num_unique = 0;       // U [host]
  IdError error;                // the first invalid id by position [host]
  std::vector<int64_t> counts;  // [num_ranks] unique ids per rank [host]
  // [U] each [device], in scratch memory of `d` (valid while d's scratch
  // lives); copy them into the outputs. Null when U == 0.
  const int64_t* unique_ids = nullptr;
  const int64_t* local_rows = nullptr;
};

// FindFirstInvalidId + DedupBucketize on the device, with one blocking
// device-to-host copy (none when nnz == 0). ids [device] [nnz];
// inverse [device] [nnz] is written. If an id is outside [0, vocab_size),
// out->error is set and, as on the CPU, U = 0, counts are zero and inverse
// is zeroed. Requires 0 <= nnz <= INT32_MAX, num_ranks >= 1 and
// owner < num_ranks.
template <typename Tid>
Status DedupBucketize(const GpuDevice& d, const Tid* ids, int64_t nnz,
                      int64_t num_ranks, int64_t owner, int64_t vocab_size,
                      int32_t* inverse, DedupOutput* out);

// Enqueues a device-to-device copy of `bytes` bytes (nothing if bytes == 0).
Status CopyDeviceToDevice(const GpuDevice& d, void* dst, const void* src,
                          int64_t bytes);

// Reads one int64 of device memory on the host (one counted host sync; for
// error paths).
Status ReadDeviceInt64(const GpuDevice& d, const int64_t* dev,
                       int64_t* value);

// The result of gpu::CheckSegmentIndices.
struct SegmentIndexCheck {
  // ok(), or the message of the CPU ValidateSegmentIndices for the same
  // inputs (an invalid argument).
  Status invalid;
  bool segments_sorted = false;  // segment_ids is non-decreasing
  bool inverse_sorted = false;   // inverse is non-decreasing
};

// ValidateSegmentIndices on the device, with one blocking device-to-host
// copy (none when nnz == 0). inverse, segment_ids [device] [nnz]. Also
// fails (in check->invalid) if nnz > INT32_MAX, a limit of the GPU kernels.
template <typename Tseg>
Status CheckSegmentIndices(const GpuDevice& d, const int32_t* inverse,
                           const Tseg* segment_ids, int64_t nnz,
                           int64_t num_rows, int64_t num_segments,
                           SegmentIndexCheck* check);

// SegmentCombine on the device; no host sync. rows [device] [num_rows, dim],
// inverse, segment_ids [device] [nnz], weights [device] [nnz] or null (all
// ones), out [device] [num_segments, dim]. `check` is the (valid) result of
// CheckSegmentIndices for these indices.
template <typename T, typename Tseg>
Status SegmentCombine(const GpuDevice& d, const T* rows, int64_t dim,
                      const int32_t* inverse, const Tseg* segment_ids,
                      const T* weights, int64_t nnz, int64_t num_segments,
                      Combiner combiner, const SegmentIndexCheck& check,
                      T* out);

// SegmentCombineGrad on the device; no host sync. grad [device]
// [num_segments, dim], out [device] [num_rows, dim]; otherwise as above.
template <typename T, typename Tseg>
Status SegmentCombineGrad(const GpuDevice& d, const T* grad, int64_t dim,
                          const int32_t* inverse, const Tseg* segment_ids,
                          const T* weights, int64_t nnz, int64_t num_segments,
                          int64_t num_rows, Combiner combiner,
                          const SegmentIndexCheck& check, T* out);

// PooledGradPlan (above) on the device, bit-identical to the CPU, with
// one blocking device-to-host copy (U, kept and the errors): one stable sort
// of (id, position) with the padding sorted last, whose order is also the
// gradient's grouping by row. ids, splits, weights [device]; the buffers
// `allocate` gives [device].
template <typename T, typename Tid>
Status PooledGradPlan(const GpuDevice& d, const Tid* ids, int64_t nnz,
                      const int64_t* splits, int64_t batch, int64_t bag_width,
                      const T* weights, int64_t num_rows, Combiner combiner,
                      const PooledGradPlanAllocate<T>& allocate,
                      PooledGradError* error);

// PooledGradCombine (above) on the device: no host sync. All pointers
// [device].
template <typename T>
Status PooledGradCombine(const GpuDevice& d, const T* grad, int64_t dim,
                         int64_t batch, const int32_t* offsets,
                         int64_t num_unique, const int64_t* segments,
                         int64_t kept, const T* sorted_weights,
                         const AccOf<T>* denominator, T* rows_grad);

}  // namespace gpu
}  // namespace lookup
}  // namespace sok

#endif  // SOK_WITH_CUDA

#endif  // SOK_KERAS_CORE_LOOKUP_H_
