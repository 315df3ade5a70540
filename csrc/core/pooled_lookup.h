// Pooled lookup straight from a whole table (one rank, no exchange): the
// forward of `lookup_sparse` / a pooled layer when the table is not
// sharded. One functor, implemented for CpuDevice (pooled_lookup.cc) and
// GpuDevice (pooled_lookup.cu.cc). TensorFlow-free.
#ifndef SOK_CORE_POOLED_LOOKUP_H_
#define SOK_CORE_POOLED_LOOKUP_H_

#include <cstdint>

#include "core/device.h"
#include "core/lookup.h"
#include "core/status.h"

namespace sok {
namespace lookup {

// What was wrong with the inputs, if anything: the first (by position) id
// outside [0, vocab_size) that is not the padding value -1, and the first
// bag whose row splits are inconsistent (decreasing, outside [0, nnz], not
// starting at 0 or not ending at nnz). The same report as the gradient's
// (core/lookup.h).
using PooledLookupError = PooledGradError;

// out[b] = combine(weights[i] * table[ids[i]] for i in
//                  [splits[b], splits[b + 1]) with ids[i] != -1)
// table: [vocab_size, dim]; ids: [nnz]; splits: [batch + 1]; weights: [nnz]
// or nullptr (all ones); out: [batch, dim]. Combiners as SegmentCombine
// (padding counts for nothing, a zero denominator gives zeros). Results
// are deterministic and equal on both devices bit for bit (the GPU
// computes the same sums in the same order, with the same rounding). On
// invalid input `error` says what, and `out` is unspecified.
// bag_width: >= 1 when every bag has that many ids (splits[b] == b *
// bag_width, nnz == batch * bag_width; `splits` must still be given, it is
// what is checked), -1 when the bags are only known from `splits`. A hint:
// the results do not depend on it. The GPU gathers one-id bags
// (bag_width == 1, the unpooled lookup) with a kernel of its own that reads
// no splits; the CPU ignores it.
// error nullptr (GPU only): the caller has validated the ids and splits
// (SokPooledGradPlan ran first), so none is reported and the GPU makes no
// blocking copy.
template <typename Device, typename T, typename Tid>
struct PooledLookupFunctor {
  Status operator()(const Device& d, const T* table, int64_t vocab_size,
                    int64_t dim, const Tid* ids, int64_t nnz,
                    const int64_t* splits, int64_t batch, int64_t bag_width,
                    const T* weights, Combiner combiner, T* out,
                    PooledLookupError* error);
};

template <typename T, typename Tid>
struct PooledLookupFunctor<GpuDevice, T, Tid> {
  Status operator()(const GpuDevice& d, const T* table, int64_t vocab_size,
                    int64_t dim, const Tid* ids, int64_t nnz,
                    const int64_t* splits, int64_t batch, int64_t bag_width,
                    const T* weights, Combiner combiner, T* out,
                    PooledLookupError* error);
};

// splits[b] = b * width for b in [0, batch]: the row splits of `batch` bags
// of `width` ids each (dense ids), made where the lookup runs, so that no
// shape goes through the host to build them.
template <typename Device>
struct UniformSplitsFunctor {
  Status operator()(const Device& d, int64_t width, int64_t batch,
                    int64_t* splits);
};

template <>
struct UniformSplitsFunctor<GpuDevice> {
  Status operator()(const GpuDevice& d, int64_t width, int64_t batch,
                    int64_t* splits);
};

}  // namespace lookup
}  // namespace sok

#endif  // SOK_CORE_POOLED_LOOKUP_H_
