// GPU kernels of the embedding lookup path (see the GPU section of
// core/lookup.h). TensorFlow-free.
//
// Every result is identical to the CPU kernels of core/lookup.cc and
// deterministic:
// - DedupBucketize sorts (key, position) pairs with a stable radix sort,
//   key = owner * rows_per_rank + local_row (distributed) or id
//   (localized), so the unique ids come out by rank, then by id.
// - SegmentCombine(Grad) group positions by segment (or by row) with a
//   stable radix sort of (key, position) - skipped when the keys are
//   already sorted - and sum every output element in one thread in
//   ascending position order, with the same IEEE operations as the CPU
//   (explicit _rn intrinsics, so that nvcc contracts nothing into FMAs).
// No float atomics; integer atomics only for first-error positions and
// flags.

#include <cuda_runtime.h>

#include <cub/cub.cuh>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "core/gpu_math.cuh"
#include "core/gpu_util.cuh"
#include "core/half.h"
#include "core/lookup.h"

namespace sok {
namespace lookup {
namespace gpu {
namespace {

using ::sok::gpu::BitsFor;
using ::sok::gpu::BlocksFor;
using ::sok::gpu::CopyToHostSync;
using ::sok::gpu::Scratch;
using ::sok::gpu::StreamOf;

using ull = unsigned long long;  // NOLINT: the type of CUDA's 64-bit atomics
constexpr ull kNone = ~ull{0};
constexpr int kThreads = 256;
constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();

// ----------------------------------------------------------------------------
// IEEE arithmetic without contraction (core/gpu_math.cuh).
using ::sok::gpu::Add;
using ::sok::gpu::Mul;
using ::sok::gpu::Div;
using ::sok::gpu::Sqrt;

// The number of keys[0, n) that are < value (keys non-decreasing).
template <typename Tkey>
__device__ __forceinline__ int64_t LowerBound(const Tkey* keys, int64_t n,
                                              int64_t value) {
  int64_t lo = 0;
  int64_t hi = n;
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (static_cast<int64_t>(keys[mid]) < value) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return lo;
}

// Temporary storage of a cub call, sized by a first query.
Status CubTemp(const GpuDevice& d, size_t bytes, void** temp) {
  uint8_t* p = nullptr;
  SOK_RETURN_IF_ERROR(Scratch(d, static_cast<int64_t>(bytes) + 1, &p,
                              "cub temporary storage"));
  *temp = p;
  return Status::Ok();
}

// Stable radix sort of (keys_in, 0..n-1) by the low `bits` bits of the keys.
template <typename Tkey>
Status SortPositions(const GpuDevice& d, const Tkey* keys_in,
                     const int32_t* positions_in, int64_t n, int bits,
                     Tkey* keys_out, int32_t* positions_out) {
  const int num_items = static_cast<int>(n);
  size_t temp_bytes = 0;
  SOK_CUDA_RETURN_IF_ERROR(
      cub::DeviceRadixSort::SortPairs(nullptr, temp_bytes, keys_in, keys_out,
                                      positions_in, positions_out, num_items,
                                      0, bits, StreamOf(d)),
      "cub::DeviceRadixSort::SortPairs (size query)");
  void* temp = nullptr;
  SOK_RETURN_IF_ERROR(CubTemp(d, temp_bytes, &temp));
  SOK_CUDA_RETURN_IF_ERROR(
      cub::DeviceRadixSort::SortPairs(temp, temp_bytes, keys_in, keys_out,
                                      positions_in, positions_out, num_items,
                                      0, bits, StreamOf(d)),
      "cub::DeviceRadixSort::SortPairs");
  return Status::Ok();
}

// ----------------------------------------------------------------------------
// DedupBucketize.

// info layout (ull): [0] U, [1] first invalid position (kNone if none),
// [2] its value, [3 + r] counts[r].
constexpr int kInfoUnique = 0;
constexpr int kInfoBadPos = 1;
constexpr int kInfoBadValue = 2;
constexpr int kInfoCounts = 3;

// keys[i] = sort key of ids[i] (0 for an invalid id), positions[i] = i;
// lowers info[kInfoBadPos] to the position of every invalid id.
template <typename Tid, typename Tkey>
__global__ void DedupKeysKernel(const Tid* ids, int64_t nnz, int64_t vocab,
                                int64_t num_ranks, bool distributed,
                                ull rows_per_rank, Tkey* keys,
                                int32_t* positions, ull* info) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < nnz;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t id = static_cast<int64_t>(ids[i]);
    Tkey key = 0;
    if (id < 0 || id >= vocab) {
      atomicMin(&info[kInfoBadPos], static_cast<ull>(i));
    } else if (distributed) {
      key = static_cast<Tkey>(static_cast<ull>(id % num_ranks) *
                                  rows_per_rank +
                              static_cast<ull>(id / num_ranks));
    } else {
      key = static_cast<Tkey>(id);
    }
    keys[i] = key;
    positions[i] = static_cast<int32_t>(i);
  }
}

// flags[k] = 1 where sorted key k starts a run of equal keys.
template <typename Tkey>
__global__ void HeadFlagsKernel(const Tkey* keys, int64_t n, int32_t* flags) {
  for (int64_t k = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; k < n;
       k += int64_t{gridDim.x} * blockDim.x) {
    flags[k] = (k == 0 || keys[k] != keys[k - 1]) ? 1 : 0;
  }
}

// unique = rank[k] - 1 (rank: inclusive scan of the head flags):
// inverse[position[k]] = unique; at a head, the unique id and its row.
template <typename Tid>
__global__ void DedupScatterKernel(const Tid* ids, const int32_t* positions,
                                   const int32_t* flags, const int32_t* rank,
                                   int64_t n, int64_t num_ranks,
                                   bool distributed, int32_t* inverse,
                                   int64_t* unique_ids, int64_t* local_rows) {
  for (int64_t k = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; k < n;
       k += int64_t{gridDim.x} * blockDim.x) {
    const int32_t position = positions[k];
    const int32_t unique = rank[k] - 1;
    inverse[position] = unique;
    if (flags[k] != 0) {
      const int64_t id = static_cast<int64_t>(ids[position]);
      unique_ids[unique] = id;
      local_rows[unique] = distributed ? id / num_ranks : id;
    }
  }
}

// counts[r] = unique keys in [r * rows_per_rank, (r + 1) * rows_per_rank)
// (distributed), or U on rank `owner` (localized); also U and the value of
// the first invalid id.
template <typename Tid, typename Tkey>
__global__ void DedupCountsKernel(const Tid* ids, const Tkey* keys,
                                  const int32_t* rank, int64_t n,
                                  int64_t num_ranks, int64_t owner,
                                  ull rows_per_rank, ull* info) {
  const ull num_unique = static_cast<ull>(rank[n - 1]);
  // The number of unique keys < bound.
  auto unique_below = [&](ull bound) -> ull {
    int64_t lo = 0;
    int64_t hi = n;
    while (lo < hi) {
      const int64_t mid = lo + (hi - lo) / 2;
      if (static_cast<ull>(keys[mid]) < bound) {
        lo = mid + 1;
      } else {
        hi = mid;
      }
    }
    return lo == 0 ? 0 : static_cast<ull>(rank[lo - 1]);
  };
  for (int64_t r = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
       r < num_ranks; r += int64_t{gridDim.x} * blockDim.x) {
    ull count = 0;
    if (owner >= 0) {
      count = r == owner ? num_unique : 0;
    } else {
      const ull lo = static_cast<ull>(r) * rows_per_rank;
      count = (r == num_ranks - 1 ? num_unique : unique_below(lo + rows_per_rank)) -
              unique_below(lo);
    }
    info[kInfoCounts + r] = count;
    if (r == 0) {
      info[kInfoUnique] = num_unique;
      const ull bad = info[kInfoBadPos];
      info[kInfoBadValue] =
          bad == kNone ? 0 : static_cast<ull>(static_cast<int64_t>(ids[bad]));
    }
  }
}

template <typename Tid, typename Tkey>
Status DedupSorted(const GpuDevice& d, const Tid* ids, int64_t nnz,
                   int64_t num_ranks, int64_t owner, int64_t vocab_size,
                   ull rows_per_rank, ull max_key, int32_t* inverse,
                   ull* info, int64_t** unique_ids, int64_t** local_rows) {
  const cudaStream_t stream = StreamOf(d);
  const bool distributed = owner < 0;
  Tkey* keys_in = nullptr;
  Tkey* keys = nullptr;
  int32_t* positions_in = nullptr;
  int32_t* positions = nullptr;
  int32_t* rank = nullptr;
  SOK_RETURN_IF_ERROR(Scratch(d, nnz, &keys_in, "dedup keys"));
  SOK_RETURN_IF_ERROR(Scratch(d, nnz, &keys, "dedup sorted keys"));
  SOK_RETURN_IF_ERROR(Scratch(d, nnz, &positions_in, "dedup positions"));
  SOK_RETURN_IF_ERROR(Scratch(d, nnz, &positions, "dedup sorted positions"));
  SOK_RETURN_IF_ERROR(Scratch(d, nnz, &rank, "dedup unique ranks"));
  SOK_RETURN_IF_ERROR(Scratch(d, nnz, unique_ids, "dedup unique ids"));
  SOK_RETURN_IF_ERROR(Scratch(d, nnz, local_rows, "dedup local rows"));

  const int blocks = BlocksFor(nnz, kThreads);
  DedupKeysKernel<Tid, Tkey><<<blocks, kThreads, 0, stream>>>(
      ids, nnz, vocab_size, num_ranks, distributed, rows_per_rank, keys_in,
      positions_in, info);
  SOK_LAUNCH_RETURN_IF_ERROR("DedupKeysKernel");
  SOK_RETURN_IF_ERROR(SortPositions(d, keys_in, positions_in, nnz,
                                    BitsFor(max_key), keys, positions));
  // The unsorted positions are dead after the sort: reuse them for flags.
  int32_t* flags = positions_in;
  HeadFlagsKernel<Tkey><<<blocks, kThreads, 0, stream>>>(keys, nnz, flags);
  SOK_LAUNCH_RETURN_IF_ERROR("HeadFlagsKernel");

  const int num_items = static_cast<int>(nnz);
  size_t temp_bytes = 0;
  SOK_CUDA_RETURN_IF_ERROR(
      cub::DeviceScan::InclusiveSum(nullptr, temp_bytes, flags, rank,
                                    num_items, stream),
      "cub::DeviceScan::InclusiveSum (size query)");
  void* temp = nullptr;
  SOK_RETURN_IF_ERROR(CubTemp(d, temp_bytes, &temp));
  SOK_CUDA_RETURN_IF_ERROR(
      cub::DeviceScan::InclusiveSum(temp, temp_bytes, flags, rank, num_items,
                                    stream),
      "cub::DeviceScan::InclusiveSum");

  DedupScatterKernel<Tid><<<blocks, kThreads, 0, stream>>>(
      ids, positions, flags, rank, nnz, num_ranks, distributed, inverse,
      *unique_ids, *local_rows);
  SOK_LAUNCH_RETURN_IF_ERROR("DedupScatterKernel");
  DedupCountsKernel<Tid, Tkey>
      <<<BlocksFor(num_ranks, kThreads), kThreads, 0, stream>>>(
          ids, keys, rank, nnz, num_ranks, owner, rows_per_rank, info);
  SOK_LAUNCH_RETURN_IF_ERROR("DedupCountsKernel");
  return Status::Ok();
}

// ----------------------------------------------------------------------------
// Segment indices.

// check layout (ull): [0] first bad inverse position, [1] first bad segment
// position (kNone if none), [2] / [3] their values, [4] segment_ids
// unsorted, [5] inverse unsorted.
// Every thread of a block runs the same number of iterations (the loop is
// over block-sized tiles), as __syncthreads_or requires; it turns the
// unsorted flags into one atomic per block and tile.
template <typename Tseg>
__global__ void CheckIndicesKernel(const int32_t* inverse,
                                   const Tseg* segment_ids, int64_t nnz,
                                   int64_t num_rows, int64_t num_segments,
                                   ull* check) {
  for (int64_t tile = blockIdx.x * int64_t{blockDim.x}; tile < nnz;
       tile += int64_t{gridDim.x} * blockDim.x) {
    const int64_t i = tile + threadIdx.x;
    int segments_unsorted = 0;
    int inverse_unsorted = 0;
    if (i < nnz) {
      const int64_t row = inverse[i];
      const int64_t segment = static_cast<int64_t>(segment_ids[i]);
      if (row < 0 || row >= num_rows) {
        atomicMin(&check[0], static_cast<ull>(i));
      }
      if (segment < 0 || segment >= num_segments) {
        atomicMin(&check[1], static_cast<ull>(i));
      }
      if (i > 0) {
        segments_unsorted =
            segment < static_cast<int64_t>(segment_ids[i - 1]) ? 1 : 0;
        inverse_unsorted = row < inverse[i - 1] ? 1 : 0;
      }
    }
    segments_unsorted = __syncthreads_or(segments_unsorted);
    inverse_unsorted = __syncthreads_or(inverse_unsorted);
    if (threadIdx.x == 0) {
      if (segments_unsorted != 0) atomicOr(&check[4], ull{1});
      if (inverse_unsorted != 0) atomicOr(&check[5], ull{1});
    }
  }
}

template <typename Tseg>
__global__ void CheckValuesKernel(const int32_t* inverse,
                                  const Tseg* segment_ids, ull* check) {
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  if (check[0] != kNone) {
    check[2] = static_cast<ull>(static_cast<int64_t>(inverse[check[0]]));
  }
  if (check[1] != kNone) {
    check[3] = static_cast<ull>(static_cast<int64_t>(segment_ids[check[1]]));
  }
}

// ----------------------------------------------------------------------------
// Grouping positions by key.

// offsets[b] = the number of keys < b, for b in [0, num_keys].
template <typename Tkey>
__global__ void OffsetsKernel(const Tkey* sorted_keys, int64_t n,
                              int64_t num_keys, int32_t* offsets) {
  for (int64_t b = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
       b <= num_keys; b += int64_t{gridDim.x} * blockDim.x) {
    offsets[b] = static_cast<int32_t>(LowerBound(sorted_keys, n, b));
  }
}

template <typename Tin, typename Tkey>
__global__ void SortKeysKernel(const Tin* in, int64_t n, Tkey* keys,
                               int32_t* positions) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    keys[i] = static_cast<Tkey>(in[i]);
    positions[i] = static_cast<int32_t>(i);
  }
}

template <typename Tin, typename Tkey>
Status SortAndOffsets(const GpuDevice& d, const Tin* in, int64_t n,
                      int64_t num_keys, int32_t* offsets,
                      const int32_t** order) {
  const cudaStream_t stream = StreamOf(d);
  Tkey* keys_in = nullptr;
  Tkey* keys = nullptr;
  int32_t* positions_in = nullptr;
  int32_t* positions = nullptr;
  SOK_RETURN_IF_ERROR(Scratch(d, n, &keys_in, "group keys"));
  SOK_RETURN_IF_ERROR(Scratch(d, n, &keys, "group sorted keys"));
  SOK_RETURN_IF_ERROR(Scratch(d, n, &positions_in, "group positions"));
  SOK_RETURN_IF_ERROR(Scratch(d, n, &positions, "group sorted positions"));
  SortKeysKernel<Tin, Tkey><<<BlocksFor(n, kThreads), kThreads, 0, stream>>>(
      in, n, keys_in, positions_in);
  SOK_LAUNCH_RETURN_IF_ERROR("SortKeysKernel");
  SOK_RETURN_IF_ERROR(SortPositions(
      d, keys_in, positions_in, n,
      BitsFor(static_cast<uint64_t>(num_keys - 1)), keys, positions));
  OffsetsKernel<Tkey>
      <<<BlocksFor(num_keys + 1, kThreads), kThreads, 0, stream>>>(
          keys, n, num_keys, offsets);
  SOK_LAUNCH_RETURN_IF_ERROR("OffsetsKernel");
  *order = positions;
  return Status::Ok();
}

// Groups positions [0, n) by key (keys in [0, num_keys), validated, n >= 1,
// num_keys >= 1): the positions with key b are order[offsets[b] ..
// offsets[b + 1]), ascending; order is null when the keys are already
// sorted (the identity).
template <typename Tin>
Status GroupPositions(const GpuDevice& d, const Tin* keys, int64_t n,
                      int64_t num_keys, bool sorted, const int32_t** offsets,
                      const int32_t** order) {
  int32_t* offs = nullptr;
  SOK_RETURN_IF_ERROR(Scratch(d, num_keys + 1, &offs, "group offsets"));
  *offsets = offs;
  *order = nullptr;
  if (sorted) {
    OffsetsKernel<Tin>
        <<<BlocksFor(num_keys + 1, kThreads), kThreads, 0, StreamOf(d)>>>(
            keys, n, num_keys, offs);
    SOK_LAUNCH_RETURN_IF_ERROR("OffsetsKernel");
    return Status::Ok();
  }
  if (static_cast<uint64_t>(num_keys - 1) <=
      std::numeric_limits<uint32_t>::max()) {
    return SortAndOffsets<Tin, uint32_t>(d, keys, n, num_keys, offs, order);
  }
  return SortAndOffsets<Tin, uint64_t>(d, keys, n, num_keys, offs, order);
}

// ----------------------------------------------------------------------------
// Combining.

// A block of (tx, ty) threads: ty groups (segments or rows) at a time, tx
// threads striding over dim.
struct GroupShape {
  dim3 block;
  int blocks;
};

GroupShape ShapeFor(int64_t groups, int64_t dim) {
  int tx = 1;
  while (tx < dim && tx < 128) tx *= 2;
  const int ty = kThreads / tx;
  GroupShape shape;
  shape.block = dim3(tx, ty);
  shape.blocks = BlocksFor(groups, ty);
  return shape;
}

// T is the storage type; the arithmetic runs in A = AccOf<T> (core/half.h)
// and each output element is rounded once, at its store.
template <typename T, typename Tseg>
__global__ void SegmentCombineKernel(const T* rows, int64_t dim,
                                     const int32_t* inverse,
                                     const T* weights,
                                     const int32_t* offsets,
                                     const int32_t* order,
                                     int64_t num_segments, int combiner,
                                     T* out) {
  using A = AccOf<T>;
  using S = Storage<T>;
  for (int64_t b = blockIdx.x * int64_t{blockDim.y} + threadIdx.y;
       b < num_segments; b += int64_t{gridDim.x} * blockDim.y) {
    const int64_t begin = offsets[b];
    const int64_t end = offsets[b + 1];
    T* o = out + b * dim;
    for (int64_t e = threadIdx.x; e < dim; e += blockDim.x) {
      A acc = A(0);
      A weight_sum = A(0);
      A square_sum = A(0);
      for (int64_t k = begin; k < end; ++k) {
        const int64_t i = order == nullptr ? k : order[k];
        const A value =
            S::Load(rows[static_cast<int64_t>(inverse[i]) * dim + e]);
        if (weights == nullptr) {
          acc = Add(acc, value);
          weight_sum = Add(weight_sum, A(1));
        } else {
          const A w = S::Load(weights[i]);
          acc = Add(acc, Mul(w, value));
          weight_sum = Add(weight_sum, w);
          square_sum = Add(square_sum, Mul(w, w));
        }
      }
      if (weights == nullptr) square_sum = weight_sum;
      if (combiner != static_cast<int>(Combiner::kSum)) {
        const A denominator = combiner == static_cast<int>(Combiner::kMean)
                                  ? weight_sum
                                  : Sqrt(square_sum);
        acc = denominator == A(0) ? A(0) : Div(acc, denominator);
      }
      o[e] = S::Store(acc);
    }
  }
}

// denominator[b] for mean (sum of weights) or sqrtn (sqrt of the sum of
// squared weights), summed in ascending position order, in A = AccOf<T>.
template <typename T>
__global__ void DenominatorKernel(const T* weights, const int32_t* offsets,
                                  const int32_t* order, int64_t num_segments,
                                  bool sqrtn, AccOf<T>* denominator) {
  using A = AccOf<T>;
  for (int64_t b = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
       b < num_segments; b += int64_t{gridDim.x} * blockDim.x) {
    A den = A(0);
    for (int64_t k = offsets[b]; k < offsets[b + 1]; ++k) {
      const int64_t i = order == nullptr ? k : order[k];
      const A w = weights == nullptr ? A(1) : Storage<T>::Load(weights[i]);
      den = Add(den, sqrtn ? Mul(w, w) : w);
    }
    denominator[b] = sqrtn ? Sqrt(den) : den;
  }
}

// The gradient's per-row sums in a fixed tree order (core/lookup.h,
// kGradChunk): a row's terms (its positions in ascending order) are summed
// in chunks of kGradChunk, left to right; a row with one chunk is summed
// straight into `out`, otherwise its chunk sums are "partials", summed the
// same way, level after level, until one chunk is left. A hot row (a Zipf
// head id seen 10^5 times in a batch) is then summed by many threads, not
// by one, and the result is still deterministic and equal to the CPU's.
constexpr int64_t kChunk = kGradChunk;

__device__ __forceinline__ int64_t ChunksOf(int64_t n) {
  return (n + kChunk - 1) / kChunk;
}

// chunks[u]: the row's first-level chunks when it has several, else 0 (a
// row of at most kChunk terms, empty ones included, is summed by
// SegmentCombineGradSingleKernel). Its exclusive scan is the base of each
// row's chunk slots and, as a row has one first-level partial per chunk,
// of its partials too. Entry num_rows is 0, so that the scan ends with
// the total.
__global__ void GradChunkCountsKernel(const int32_t* offsets,
                                      int64_t num_rows, int64_t* chunks) {
  for (int64_t u = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
       u <= num_rows; u += int64_t{gridDim.x} * blockDim.x) {
    int64_t c = 0;
    if (u < num_rows) {
      c = ChunksOf(static_cast<int64_t>(offsets[u + 1]) - offsets[u]);
    }
    chunks[u] = c > 1 ? c : 0;
  }
}

// heads[base[u]] = u for each row u with chunk slots (at its first slot);
// the other entries are 0. As rows' slot ranges increase with u, an
// inclusive max-scan of heads then gives every slot its row, in a few
// parallel passes however hot the hottest row is.
__global__ void GradChunkHeadsKernel(const int64_t* base, int64_t num_rows,
                                     int64_t slots, int64_t* heads) {
  for (int64_t u = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
       u < num_rows; u += int64_t{gridDim.x} * blockDim.x) {
    if (base[u + 1] > base[u] && base[u] < slots) heads[base[u]] = u;
  }
}

struct MaxOf {
  __device__ __forceinline__ int64_t operator()(int64_t a, int64_t b) const {
    return a > b ? a : b;
  }
};

// Grid cap of the chunk and reduce kernels. They are launched before the
// number of slots is known on the host (a bound from nnz, some 100 times
// the actual count on Zipf ids) and stride over the slots, so a capped
// grid does the same work without scheduling tens of thousands of blocks
// that only find themselves past the end.
constexpr int kMaxSlotBlocks = 4096;

// Lanes per chunk: enough for one pass over a row of `dim` in VEC-wide
// pieces (a power of 2, at most a warp).
int LanesLog2(int64_t dim, int vec) {
  const int64_t pieces = (dim + vec - 1) / vec;
  int lanes_log2 = 0;
  while ((int64_t{1} << lanes_log2) < pieces && lanes_log2 < 5) ++lanes_log2;
  return lanes_log2;
}

// Loads VEC consecutive values of a row as A (16-byte loads for float rows
// of a width divisible by 4: the VEC == 4 instantiation is only used then).
template <typename T, int VEC>
struct GradLoader {
  __device__ __forceinline__ static void Load(const T* p, int64_t valid,
                                              AccOf<T>* v) {
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      v[k] = k < valid ? Storage<T>::Load(p[k]) : AccOf<T>(0);
    }
  }
};

template <>
struct GradLoader<float, 4> {
  __device__ __forceinline__ static void Load(const float* p, int64_t valid,
                                              float* v) {
    const float4 q = __ldg(reinterpret_cast<const float4*>(p));
    v[0] = q.x;
    v[1] = q.y;
    v[2] = q.z;
    v[3] = q.w;
    (void)valid;
  }
};

constexpr int kTermsInFlight = 4;

// Adds to acc, in A = AccOf<T> and in term order, the terms k in
// [begin, end) of a row for this lane's VEC columns at c0 (`columns`: c0 <
// dim): term k is grad[segment_ids[i]] (i = order[k], or k without an
// order), divided by denominator[that segment] where given (0 for a zero
// denominator), times weights[i] where given. Every lane of the group calls
// it with the same begin and end. The group loads the terms' indices
// `lanes` at a time, one per lane in one coalesced load, hands them round
// with warp shuffles and has kTermsInFlight rows' loads in flight before
// adding any of them; the adds still run one term after the other, so the
// sum is exactly the sequential one.
template <typename T, typename Tseg, int VEC>
__device__ __forceinline__ void SumTerms(
    const T* __restrict__ grad, int64_t dim,
    const Tseg* __restrict__ segment_ids, const T* __restrict__ weights,
    const AccOf<T>* __restrict__ denominator,
    const int32_t* __restrict__ order, int64_t begin, int64_t end,
    int64_t c0, bool columns, int lane, int lanes, unsigned group_mask,
    AccOf<T>* acc) {
  using A = AccOf<T>;
  using S = Storage<T>;
  constexpr int U = kTermsInFlight;
  const int64_t valid = dim - c0;
  for (int64_t base = begin; base < end; base += lanes) {
    const int n = static_cast<int>(end - base < lanes ? end - base : lanes);
    long long my_seg = 0;
    A my_w = A(1);
    A my_den = A(1);
    if (lane < n) {
      const int64_t k = base + lane;
      const int64_t i = order == nullptr ? k : order[k];
      my_seg = static_cast<long long>(segment_ids[i]);
      if (weights != nullptr) my_w = S::Load(weights[i]);
      if (denominator != nullptr) my_den = denominator[my_seg];
    }
    for (int k0 = 0; k0 < n; k0 += U) {
      long long sg[U];
      A w[U];
      A den[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int src = k0 + u < n ? k0 + u : 0;  // the same for the group
        sg[u] = __shfl_sync(group_mask, my_seg, src, lanes);
        w[u] = __shfl_sync(group_mask, my_w, src, lanes);
        den[u] = __shfl_sync(group_mask, my_den, src, lanes);
      }
      A x[U][VEC];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        if (k0 + u < n && columns) {
          GradLoader<T, VEC>::Load(grad + sg[u] * dim + c0, valid, x[u]);
        } else {
#pragma unroll
          for (int v = 0; v < VEC; ++v) x[u][v] = A(0);
        }
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        if (k0 + u >= n) break;
#pragma unroll
        for (int v = 0; v < VEC; ++v) {
          A term = x[u][v];
          if (denominator != nullptr) {
            term = den[u] == A(0) ? A(0) : Div(term, den[u]);
          }
          if (weights != nullptr) term = Mul(term, w[u]);
          acc[v] = Add(acc[v], term);
        }
      }
    }
  }
}

// The rows of at most kChunk terms (most rows): `lanes` threads per row,
// indexed by row (no slot lookup), each owning VEC columns; the terms are
// summed left to right in A = AccOf<T> and stored, rounded once, into
// `out` (zeros for an empty row): exactly the first level's sum of a
// one-chunk row. Longer rows are left to the chunk kernels. The term loop
// is unrolled so that several terms' index and gradient loads are in
// flight at once (the sums still run in order).
template <typename T, typename Tseg, int VEC>
__global__ void SegmentCombineGradSingleKernel(
    const T* __restrict__ grad, int64_t dim,
    const Tseg* __restrict__ segment_ids, const T* __restrict__ weights,
    const AccOf<T>* __restrict__ denominator,
    const int32_t* __restrict__ offsets, const int32_t* __restrict__ order,
    int64_t num_rows, int lanes_log2, T* __restrict__ out) {
  using A = AccOf<T>;
  using S = Storage<T>;
  const int64_t lanes = int64_t{1} << lanes_log2;
  for (int64_t t = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
       t < (num_rows << lanes_log2); t += int64_t{gridDim.x} * blockDim.x) {
    const int64_t u = t >> lanes_log2;
    const int64_t lane = t & (lanes - 1);
    const int64_t begin = offsets[u];
    const int64_t end = offsets[u + 1];
    if (end - begin > kChunk) continue;  // the chunk kernels' row
    for (int64_t c0 = lane * VEC; c0 < dim; c0 += lanes * VEC) {
      const int64_t valid = dim - c0;
      A acc[VEC];
#pragma unroll
      for (int v = 0; v < VEC; ++v) acc[v] = A(0);
#pragma unroll 4
      for (int64_t k = begin; k < end; ++k) {
        const int64_t i = order == nullptr ? k : order[k];
        const int64_t sg = static_cast<int64_t>(segment_ids[i]);
        A x[VEC];
        GradLoader<T, VEC>::Load(grad + sg * dim + c0, valid, x);
        if (denominator != nullptr) {
          const A den = denominator[sg];
#pragma unroll
          for (int v = 0; v < VEC; ++v) {
            x[v] = den == A(0) ? A(0) : Div(x[v], den);
          }
        }
        if (weights != nullptr) {
          const A w = S::Load(weights[i]);
#pragma unroll
          for (int v = 0; v < VEC; ++v) x[v] = Mul(x[v], w);
        }
#pragma unroll
        for (int v = 0; v < VEC; ++v) acc[v] = Add(acc[v], x[v]);
      }
      T* o = out + u * dim + c0;
#pragma unroll
      for (int v = 0; v < VEC; ++v) {
        if (v < valid) o[v] = S::Store(acc[v]);
      }
    }
  }
}

// First level: `lanes` threads per chunk, each owning VEC columns; the
// chunk's terms (<= kChunk) are summed left to right in A = AccOf<T>
// (SumTerms). A row of one chunk is stored (rounded once) into `out`;
// otherwise the sum is a partial, kept in A.
template <typename T, typename Tseg, int VEC>
__global__ void SegmentCombineGradChunkKernel(
    const T* __restrict__ grad, int64_t dim,
    const Tseg* __restrict__ segment_ids, const T* __restrict__ weights,
    const AccOf<T>* __restrict__ denominator,
    const int32_t* __restrict__ offsets, const int32_t* __restrict__ order,
    int64_t num_rows, const int64_t* __restrict__ chunk_base,
    const int64_t* __restrict__ slot_row, int64_t slots, int lanes_log2,
    AccOf<T>* __restrict__ partial, T* __restrict__ out) {
  using A = AccOf<T>;
  using S = Storage<T>;
  const int64_t total = chunk_base[num_rows];
  const int lanes = 1 << lanes_log2;
  const int lane = threadIdx.x & (lanes - 1);
  const unsigned group_mask = ::sok::gpu::GroupMask(lanes);
  const int64_t passes = ((dim + VEC - 1) / VEC + lanes - 1) / lanes;
  for (int64_t t = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
       t < slots * lanes; t += int64_t{gridDim.x} * blockDim.x) {
    const int64_t c = t >> lanes_log2;
    if (c >= total) break;  // later t only have larger c (a whole group)
    const int64_t u = slot_row[c];
    const int64_t j = c - chunk_base[u];
    const bool single = chunk_base[u + 1] - chunk_base[u] == 1;
    const int64_t begin = offsets[u] + j * kChunk;
    const int64_t end =
        min(begin + kChunk, static_cast<int64_t>(offsets[u + 1]));
    for (int64_t pass = 0; pass < passes; ++pass) {
      const int64_t c0 = (pass * lanes + lane) * VEC;
      const bool columns = c0 < dim;
      A acc[VEC];
#pragma unroll
      for (int v = 0; v < VEC; ++v) acc[v] = A(0);
      SumTerms<T, Tseg, VEC>(grad, dim, segment_ids, weights, denominator,
                             order, begin, end, c0, columns, lane, lanes,
                             group_mask, acc);
      if (!columns) continue;
      const int64_t valid = dim - c0;
      if (single) {
        T* o = out + u * dim + c0;
#pragma unroll
        for (int v = 0; v < VEC; ++v) {
          if (v < valid) o[v] = S::Store(acc[v]);
        }
      } else {
        A* o = partial + c * dim + c0;  // the partial of chunk c
#pragma unroll
        for (int v = 0; v < VEC; ++v) {
          if (v < valid) o[v] = acc[v];
        }
      }
    }
  }
}

// One level of the partials' reduction: rows with more than one partial
// at this level (`level` chunkings of the row's length) sum them in chunks
// (in A); a row left with one chunk is stored, rounded once, into `out`.
template <typename T>
__global__ void SegmentCombineGradReduceKernel(
    int64_t dim, const int32_t* __restrict__ offsets, int64_t num_rows,
    const int64_t* __restrict__ partial_base,
    const int64_t* __restrict__ slot_row, int64_t slots, int level,
    const AccOf<T>* __restrict__ in, AccOf<T>* __restrict__ next,
    T* __restrict__ out) {
  using A = AccOf<T>;
  const int64_t total = partial_base[num_rows];
  for (int64_t s = blockIdx.x * int64_t{blockDim.y} + threadIdx.y;
       s < slots && s < total; s += int64_t{gridDim.x} * blockDim.y) {
    const int64_t u = slot_row[s];
    const int64_t j = s - partial_base[u];
    int64_t n = static_cast<int64_t>(offsets[u + 1]) - offsets[u];
    for (int l = 0; l < level; ++l) n = ChunksOf(n);
    if (n <= 1) continue;  // finished at an earlier level
    const int64_t m = ChunksOf(n);
    if (j >= m) continue;
    const int64_t begin = j * kChunk;
    const int64_t end = min(begin + kChunk, n);
    const A* p = in + partial_base[u] * dim;
    for (int64_t e = threadIdx.x; e < dim; e += blockDim.x) {
      A acc = A(0);
      for (int64_t k0 = begin; k0 < end; k0 += 8) {
        A g[8];
#pragma unroll
        for (int t = 0; t < 8; ++t) {
          g[t] = k0 + t < end ? p[(k0 + t) * dim + e] : A(0);
        }
#pragma unroll
        for (int t = 0; t < 8; ++t) {
          if (k0 + t < end) acc = Add(acc, g[t]);
        }
      }
      if (m == 1) {
        out[u * dim + e] = Storage<T>::Store(acc);
      } else {
        next[(partial_base[u] + j) * dim + e] = acc;
      }
    }
  }
}

// Exclusive prefix sums of in[0, n) into out[0, n) (int64).
Status ExclusiveSum(const GpuDevice& d, const int64_t* in, int64_t* out,
                    int64_t n) {
  size_t temp_bytes = 0;
  SOK_CUDA_RETURN_IF_ERROR(
      cub::DeviceScan::ExclusiveSum(nullptr, temp_bytes, in, out,
                                    static_cast<int>(n), StreamOf(d)),
      "cub::DeviceScan::ExclusiveSum (size query)");
  void* temp = nullptr;
  SOK_RETURN_IF_ERROR(CubTemp(d, temp_bytes, &temp));
  SOK_CUDA_RETURN_IF_ERROR(
      cub::DeviceScan::ExclusiveSum(temp, temp_bytes, in, out,
                                    static_cast<int>(n), StreamOf(d)),
      "cub::DeviceScan::ExclusiveSum");
  return Status::Ok();
}

// Inclusive max-scan of in[0, n) into out[0, n) (int64).
Status InclusiveMax(const GpuDevice& d, const int64_t* in, int64_t* out,
                    int64_t n) {
  size_t temp_bytes = 0;
  SOK_CUDA_RETURN_IF_ERROR(
      cub::DeviceScan::InclusiveScan(nullptr, temp_bytes, in, out, MaxOf(),
                                     static_cast<int>(n), StreamOf(d)),
      "cub::DeviceScan::InclusiveScan (size query)");
  void* temp = nullptr;
  SOK_RETURN_IF_ERROR(CubTemp(d, temp_bytes, &temp));
  SOK_CUDA_RETURN_IF_ERROR(
      cub::DeviceScan::InclusiveScan(temp, temp_bytes, in, out, MaxOf(),
                                     static_cast<int>(n), StreamOf(d)),
      "cub::DeviceScan::InclusiveScan");
  return Status::Ok();
}

// The per-row sums of the gradient once its positions are grouped by row
// (positions order[offsets[u] .. offsets[u + 1]) of row u, ascending;
// order null: the identity): the kGradChunk tree of core/lookup.h, over
// nnz >= 1 positions and num_rows >= 1 rows. segment_ids and weights are
// indexed by position; denominator ([num_segments] or null) divides each
// term first.
template <typename T, typename Tseg>
Status CombineGradGrouped(const GpuDevice& d, const T* grad, int64_t dim,
                          const Tseg* segment_ids, const T* weights,
                          const AccOf<T>* denominator, const int32_t* offsets,
                          const int32_t* order, int64_t nnz, int64_t num_rows,
                          T* out) {
  const cudaStream_t stream = StreamOf(d);
  const bool vec4 = std::is_same<T, float>::value && dim % 4 == 0 &&
                    reinterpret_cast<uintptr_t>(grad) % 16 == 0;
  const int vec = vec4 ? 4 : 1;
  const int lanes_log2 = LanesLog2(dim, vec);
  const int single_blocks = BlocksFor(num_rows << lanes_log2, kThreads);
  if (vec4) {
    SegmentCombineGradSingleKernel<T, Tseg, 4>
        <<<single_blocks, kThreads, 0, stream>>>(
            grad, dim, segment_ids, weights, denominator, offsets, order,
            num_rows, lanes_log2, out);
  } else {
    SegmentCombineGradSingleKernel<T, Tseg, 1>
        <<<single_blocks, kThreads, 0, stream>>>(
            grad, dim, segment_ids, weights, denominator, offsets, order,
            num_rows, lanes_log2, out);
  }
  SOK_LAUNCH_RETURN_IF_ERROR("SegmentCombineGradSingleKernel");
  if (nnz <= kChunk) return Status::Ok();  // no row has several chunks
  // Chunk slots per row (see kChunk), and their bases: row u's first-level
  // chunks, and their partials, are slots [base[u], base[u + 1]).
  int64_t* counts = nullptr;
  int64_t* base = nullptr;
  SOK_RETURN_IF_ERROR(Scratch(d, num_rows + 1, &counts, "grad chunks"));
  SOK_RETURN_IF_ERROR(Scratch(d, num_rows + 1, &base, "grad chunks"));
  GradChunkCountsKernel<<<BlocksFor(num_rows + 1, kThreads), kThreads, 0,
                          stream>>>(offsets, num_rows, counts);
  SOK_LAUNCH_RETURN_IF_ERROR("GradChunkCountsKernel");
  SOK_RETURN_IF_ERROR(ExclusiveSum(d, counts, base, num_rows + 1));
  // A bound on the slot count (known on the device only): only rows of
  // more than kChunk terms (at most nnz / kChunk of them) have slots, each
  // at most 1 + n / kChunk.
  const int64_t slots = 2 * (nnz / kChunk + 1);
  using A = AccOf<T>;
  A* partial[2] = {nullptr, nullptr};
  SOK_RETURN_IF_ERROR(
      Scratch(d, 2 * slots * dim, &partial[0], "grad partials"));
  partial[1] = partial[0] + slots * dim;
  int64_t* slot_row = nullptr;
  {
    int64_t* heads = nullptr;
    SOK_RETURN_IF_ERROR(Scratch(d, slots, &heads, "grad chunk rows"));
    SOK_RETURN_IF_ERROR(Scratch(d, slots, &slot_row, "grad chunk rows"));
    SOK_CUDA_RETURN_IF_ERROR(
        cudaMemsetAsync(heads, 0, slots * sizeof(int64_t), stream),
        "grad chunk heads");
    GradChunkHeadsKernel<<<BlocksFor(num_rows, kThreads), kThreads, 0,
                           stream>>>(base, num_rows, slots, heads);
    SOK_LAUNCH_RETURN_IF_ERROR("GradChunkHeadsKernel");
    SOK_RETURN_IF_ERROR(InclusiveMax(d, heads, slot_row, slots));
  }
  const int chunk_blocks =
      std::min(BlocksFor(slots << lanes_log2, kThreads), kMaxSlotBlocks);
  if (vec4) {
    SegmentCombineGradChunkKernel<T, Tseg, 4>
        <<<chunk_blocks, kThreads, 0, stream>>>(
            grad, dim, segment_ids, weights, denominator, offsets, order,
            num_rows, base, slot_row, slots, lanes_log2, partial[0], out);
  } else {
    SegmentCombineGradChunkKernel<T, Tseg, 1>
        <<<chunk_blocks, kThreads, 0, stream>>>(
            grad, dim, segment_ids, weights, denominator, offsets, order,
            num_rows, base, slot_row, slots, lanes_log2, partial[0], out);
  }
  SOK_LAUNCH_RETURN_IF_ERROR("SegmentCombineGradChunkKernel");
  // Level l reduces rows of more than kChunk^l terms; nnz bounds a row.
  GroupShape reduce_shape = ShapeFor(slots, dim);
  reduce_shape.blocks = std::min(reduce_shape.blocks, kMaxSlotBlocks);
  int64_t reach = kChunk;
  for (int level = 1; reach < nnz; ++level, reach *= kChunk) {
    SegmentCombineGradReduceKernel<T>
        <<<reduce_shape.blocks, reduce_shape.block, 0, stream>>>(
            dim, offsets, num_rows, base, slot_row, slots, level,
            partial[(level - 1) % 2], partial[level % 2], out);
    SOK_LAUNCH_RETURN_IF_ERROR("SegmentCombineGradReduceKernel");
  }
  return Status::Ok();
}

}  // namespace

// ----------------------------------------------------------------------------
// Entry points.

template <typename Tid>
Status DedupBucketize(const GpuDevice& d, const Tid* ids, int64_t nnz,
                      int64_t num_ranks, int64_t owner, int64_t vocab_size,
                      int32_t* inverse, DedupOutput* out) {
  if (num_ranks < 1) {
    return Status::Error("num_ranks must be at least 1, got " +
                         std::to_string(num_ranks) + ".");
  }
  if (owner >= num_ranks) {
    return Status::Error("owner must be -1 or less than num_ranks (" +
                         std::to_string(num_ranks) + "), got " +
                         std::to_string(owner) + ".");
  }
  if (nnz < 0 || nnz > kInt32Max) {
    return Status::Error("the number of ids (" + std::to_string(nnz) +
                         ") must fit in int32.");
  }
  out->num_unique = 0;
  out->error = IdError();
  out->counts.assign(num_ranks, 0);
  out->unique_ids = nullptr;
  out->local_rows = nullptr;
  if (nnz == 0) return Status::Ok();
  const cudaStream_t stream = StreamOf(d);

  // Sort keys: rank * rows_per_rank + local row (distributed), else the id.
  const bool distributed = owner < 0;
  const ull vocab = static_cast<ull>(std::max<int64_t>(vocab_size, 0));
  const ull ranks = static_cast<ull>(num_ranks);
  ull rows_per_rank = 0;
  ull max_key = 0;
  if (vocab > 0) {
    if (distributed) {
      rows_per_rank = vocab / ranks + (vocab % ranks != 0 ? 1 : 0);
      max_key = (ranks - 1) * rows_per_rank + (vocab - 1) / ranks;
    } else {
      max_key = vocab - 1;
    }
  }

  const int64_t info_size = kInfoCounts + num_ranks;
  ull* info = nullptr;
  SOK_RETURN_IF_ERROR(Scratch(d, info_size, &info, "dedup summary"));
  SOK_CUDA_RETURN_IF_ERROR(
      cudaMemsetAsync(info, 0, info_size * sizeof(ull), stream),
      "dedup summary init");
  SOK_CUDA_RETURN_IF_ERROR(
      cudaMemsetAsync(info + kInfoBadPos, 0xFF, sizeof(ull), stream),
      "dedup summary init");
  int64_t* unique_ids = nullptr;
  int64_t* local_rows = nullptr;
  if (max_key <= std::numeric_limits<uint32_t>::max()) {
    SOK_RETURN_IF_ERROR((DedupSorted<Tid, uint32_t>(
        d, ids, nnz, num_ranks, owner, vocab_size, rows_per_rank, max_key,
        inverse, info, &unique_ids, &local_rows)));
  } else {
    SOK_RETURN_IF_ERROR((DedupSorted<Tid, uint64_t>(
        d, ids, nnz, num_ranks, owner, vocab_size, rows_per_rank, max_key,
        inverse, info, &unique_ids, &local_rows)));
  }

  // The one blocking copy: U, the first invalid id and the counts.
  std::vector<ull> host(info_size);
  SOK_RETURN_IF_ERROR(CopyToHostSync(d, host.data(), info,
                                     info_size * sizeof(ull),
                                     "SokDedupBucketize summary"));
  if (host[kInfoBadPos] != kNone) {
    out->error.position = static_cast<int64_t>(host[kInfoBadPos]);
    out->error.value = static_cast<int64_t>(host[kInfoBadValue]);
    SOK_CUDA_RETURN_IF_ERROR(
        cudaMemsetAsync(inverse, 0, nnz * sizeof(int32_t), stream),
        "SokDedupBucketize zero inverse");
    return Status::Ok();
  }
  out->num_unique = static_cast<int64_t>(host[kInfoUnique]);
  for (int64_t r = 0; r < num_ranks; ++r) {
    out->counts[r] = static_cast<int64_t>(host[kInfoCounts + r]);
  }
  out->unique_ids = unique_ids;
  out->local_rows = local_rows;
  return Status::Ok();
}

Status ReadDeviceInt64(const GpuDevice& d, const int64_t* dev,
                       int64_t* value) {
  return CopyToHostSync(d, value, dev, sizeof(int64_t), "read of one int64");
}

Status CopyDeviceToDevice(const GpuDevice& d, void* dst, const void* src,
                          int64_t bytes) {
  if (bytes <= 0) return Status::Ok();
  SOK_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(dst, src, static_cast<size_t>(bytes),
                      cudaMemcpyDeviceToDevice, StreamOf(d)),
      "device-to-device copy");
  return Status::Ok();
}

template <typename Tseg>
Status CheckSegmentIndices(const GpuDevice& d, const int32_t* inverse,
                           const Tseg* segment_ids, int64_t nnz,
                           int64_t num_rows, int64_t num_segments,
                           SegmentIndexCheck* check) {
  check->invalid = Status::Ok();
  check->segments_sorted = true;
  check->inverse_sorted = true;
  if (nnz <= 0) return Status::Ok();
  if (nnz > kInt32Max) {
    check->invalid = Status::InvalidArgument(
        "the number of positions (" + std::to_string(nnz) +
        ") must fit in int32 on the GPU.");
    return Status::Ok();
  }
  const cudaStream_t stream = StreamOf(d);
  constexpr int kCheckSize = 6;
  ull* dev = nullptr;
  SOK_RETURN_IF_ERROR(Scratch(d, kCheckSize, &dev, "index check"));
  SOK_CUDA_RETURN_IF_ERROR(
      cudaMemsetAsync(dev, 0, kCheckSize * sizeof(ull), stream),
      "index check init");
  SOK_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(dev, 0xFF, 2 * sizeof(ull), stream),
                           "index check init");
  CheckIndicesKernel<Tseg><<<BlocksFor(nnz, kThreads), kThreads, 0, stream>>>(
      inverse, segment_ids, nnz, num_rows, num_segments, dev);
  SOK_LAUNCH_RETURN_IF_ERROR("CheckIndicesKernel");
  CheckValuesKernel<Tseg><<<1, 1, 0, stream>>>(inverse, segment_ids, dev);
  SOK_LAUNCH_RETURN_IF_ERROR("CheckValuesKernel");

  // The one blocking copy: the first invalid positions, values, sortedness.
  ull host[kCheckSize];
  SOK_RETURN_IF_ERROR(CopyToHostSync(d, host, dev, sizeof(host),
                                     "segment index check"));
  check->segments_sorted = host[4] == 0;
  check->inverse_sorted = host[5] == 0;
  // The messages of the CPU ValidateSegmentIndices.
  if (host[0] != kNone) {
    check->invalid = Status::InvalidArgument(
        "inverse[" + std::to_string(static_cast<int64_t>(host[0])) +
        "] = " + std::to_string(static_cast<int64_t>(host[2])) +
        " is out of range [0, " + std::to_string(num_rows) + ").");
  } else if (host[1] != kNone) {
    check->invalid = Status::InvalidArgument(
        "segment_ids[" + std::to_string(static_cast<int64_t>(host[1])) +
        "] = " + std::to_string(static_cast<int64_t>(host[3])) +
        " is out of range [0, " + std::to_string(num_segments) + ").");
  }
  return Status::Ok();
}

template <typename T, typename Tseg>
Status SegmentCombine(const GpuDevice& d, const T* rows, int64_t dim,
                      const int32_t* inverse, const Tseg* segment_ids,
                      const T* weights, int64_t nnz, int64_t num_segments,
                      Combiner combiner, const SegmentIndexCheck& check,
                      T* out) {
  if (num_segments <= 0 || dim <= 0) return Status::Ok();
  if (!check.invalid.ok()) return check.invalid;
  const cudaStream_t stream = StreamOf(d);
  if (nnz <= 0) {  // every segment is empty
    SOK_CUDA_RETURN_IF_ERROR(
        cudaMemsetAsync(out, 0, num_segments * dim * sizeof(T), stream),
        "SokSegmentCombine zero output");
    return Status::Ok();
  }
  const int32_t* offsets = nullptr;
  const int32_t* order = nullptr;
  SOK_RETURN_IF_ERROR(GroupPositions(d, segment_ids, nnz, num_segments,
                                     check.segments_sorted, &offsets,
                                     &order));
  const GroupShape shape = ShapeFor(num_segments, dim);
  SegmentCombineKernel<T, Tseg><<<shape.blocks, shape.block, 0, stream>>>(
      rows, dim, inverse, weights, offsets, order, num_segments,
      static_cast<int>(combiner), out);
  SOK_LAUNCH_RETURN_IF_ERROR("SegmentCombineKernel");
  return Status::Ok();
}

template <typename T, typename Tseg>
Status SegmentCombineGrad(const GpuDevice& d, const T* grad, int64_t dim,
                          const int32_t* inverse, const Tseg* segment_ids,
                          const T* weights, int64_t nnz, int64_t num_segments,
                          int64_t num_rows, Combiner combiner,
                          const SegmentIndexCheck& check, T* out) {
  if (num_rows <= 0 || dim <= 0) return Status::Ok();
  if (!check.invalid.ok()) return check.invalid;
  const cudaStream_t stream = StreamOf(d);
  if (nnz <= 0) {  // no row is referenced
    SOK_CUDA_RETURN_IF_ERROR(
        cudaMemsetAsync(out, 0, num_rows * dim * sizeof(T), stream),
        "SokSegmentCombineGrad zero output");
    return Status::Ok();
  }
  // nnz > 0 and valid segment ids imply num_segments >= 1.
  AccOf<T>* denominator = nullptr;
  if (combiner != Combiner::kSum) {
    const int32_t* seg_offsets = nullptr;
    const int32_t* seg_order = nullptr;
    SOK_RETURN_IF_ERROR(GroupPositions(d, segment_ids, nnz, num_segments,
                                       check.segments_sorted, &seg_offsets,
                                       &seg_order));
    SOK_RETURN_IF_ERROR(
        Scratch(d, num_segments, &denominator, "segment denominators"));
    DenominatorKernel<T>
        <<<BlocksFor(num_segments, kThreads), kThreads, 0, stream>>>(
            weights, seg_offsets, seg_order, num_segments,
            combiner == Combiner::kSqrtn, denominator);
    SOK_LAUNCH_RETURN_IF_ERROR("DenominatorKernel");
  }
  const int32_t* offsets = nullptr;
  const int32_t* order = nullptr;
  SOK_RETURN_IF_ERROR(GroupPositions(d, inverse, nnz, num_rows,
                                     check.inverse_sorted, &offsets, &order));
  return CombineGradGrouped<T, Tseg>(d, grad, dim, segment_ids, weights,
                                     denominator, offsets, order, nnz,
                                     num_rows, out);
}

namespace {

// ----------------------------------------------------------------------------
// PooledLookupGrad.

// pooled info layout (ull): [0] U, [1] kept ids, [2] first invalid id
// position (kNone if none), [3] its value, [4] first bad bag (kNone).
constexpr int kPgUnique = 0;
constexpr int kPgKept = 1;
constexpr int kPgBadPos = 2;
constexpr int kPgBadValue = 3;
constexpr int kPgBadBag = 4;
constexpr int kPgSize = 5;

// keys[i] = ids[i], or pad_key (= num_rows, above every valid id) for the
// padding -1, positions[i] = i; lowers info[kPgBadPos] at an invalid id.
template <typename Tid, typename Tkey>
__global__ void PooledGradKeysKernel(const Tid* ids, int64_t nnz,
                                     int64_t num_rows, Tkey pad_key,
                                     Tkey* keys, int32_t* positions,
                                     ull* info) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < nnz;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t id = static_cast<int64_t>(ids[i]);
    Tkey key = pad_key;
    if (id != -1) {
      if (id < 0 || id >= num_rows) {
        atomicMin(&info[kPgBadPos], static_cast<ull>(i));
      } else {
        key = static_cast<Tkey>(id);
      }
    }
    keys[i] = key;
    positions[i] = static_cast<int32_t>(i);
  }
}

// Lowers info[kPgBadBag] to every bag b whose splits are inconsistent
// (b == batch: the last split is not nnz).
__global__ void PooledGradSplitsKernel(const int64_t* splits, int64_t batch,
                                       int64_t nnz, ull* info) {
  for (int64_t b = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
       b <= batch; b += int64_t{gridDim.x} * blockDim.x) {
    bool bad;
    if (b == batch) {
      bad = splits[batch] != nnz || (batch == 0 && splits[0] != 0);
    } else {
      bad = splits[b] > splits[b + 1] || (b == 0 && splits[0] != 0);
    }
    if (bad) atomicMin(&info[kPgBadBag], static_cast<ull>(b));
  }
}

// One thread: the kept count (sorted keys below pad_key), U, the bad value.
template <typename Tid, typename Tkey>
__global__ void PooledGradSummaryKernel(const Tid* ids, const Tkey* keys,
                                        const int32_t* rank, int64_t nnz,
                                        Tkey pad_key, ull* info) {
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  const int64_t kept = LowerBound(keys, nnz, static_cast<int64_t>(pad_key));
  info[kPgKept] = static_cast<ull>(kept);
  info[kPgUnique] = kept == 0 ? 0 : static_cast<ull>(rank[kept - 1]);
  const ull bad = info[kPgBadPos];
  info[kPgBadValue] =
      bad == kNone ? 0 : static_cast<ull>(static_cast<int64_t>(ids[bad]));
}

// At the head k of each run of equal kept keys: rows[u] = the id,
// offsets[u] = k (u = rank[k] - 1); offsets[U] = kept.
template <typename Tkey>
__global__ void PooledGradRowsKernel(const Tkey* keys, const int32_t* flags,
                                     const int32_t* rank, int64_t kept,
                                     int64_t num_unique, int64_t* rows,
                                     int32_t* offsets) {
  for (int64_t k = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; k < kept;
       k += int64_t{gridDim.x} * blockDim.x) {
    if (flags[k] != 0) {
      const int32_t u = rank[k] - 1;
      rows[u] = static_cast<int64_t>(keys[k]);
      offsets[u] = static_cast<int32_t>(k);
    }
    if (k == 0) offsets[num_unique] = static_cast<int32_t>(kept);
  }
}

// In sorted order, k < kept: segments[k] = the bag of position
// positions[k] (splits validated; position / bag_width for uniform bags)
// and sorted_weights[k] = its weight (when weights are given), so that the
// gradient's sums read them without the order indirection.
template <typename T>
__global__ void PooledGradSegmentsKernel(const int64_t* splits, int64_t batch,
                                         int64_t bag_width,
                                         const int32_t* positions,
                                         int64_t kept, const T* weights,
                                         int64_t* segments,
                                         T* sorted_weights) {
  for (int64_t k = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; k < kept;
       k += int64_t{gridDim.x} * blockDim.x) {
    const int64_t i = positions[k];
    if (bag_width >= 1) {
      segments[k] = i / bag_width;
    } else {
      // The number of splits[1 .. batch] that are <= i.
      int64_t lo = 0;
      int64_t hi = batch;
      while (lo < hi) {
        const int64_t mid = lo + (hi - lo) / 2;
        if (splits[mid + 1] <= i) {
          lo = mid + 1;
        } else {
          hi = mid;
        }
      }
      segments[k] = lo;
    }
    if (weights != nullptr) sorted_weights[k] = weights[i];
  }
}

// denominator[b] over bag b's kept ids, in ascending position order: the
// DenominatorKernel sums over the padding-free ids.
template <typename T, typename Tid>
__global__ void PooledGradDenominatorKernel(const Tid* ids, const T* weights,
                                            const int64_t* splits,
                                            int64_t batch, bool sqrtn,
                                            AccOf<T>* denominator) {
  using A = AccOf<T>;
  for (int64_t b = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; b < batch;
       b += int64_t{gridDim.x} * blockDim.x) {
    A den = A(0);
    for (int64_t i = splits[b]; i < splits[b + 1]; ++i) {
      if (static_cast<int64_t>(ids[i]) == -1) continue;
      const A w = weights == nullptr ? A(1) : Storage<T>::Load(weights[i]);
      den = Add(den, sqrtn ? Mul(w, w) : w);
    }
    denominator[b] = sqrtn ? Sqrt(den) : den;
  }
}

template <typename T, typename Tid, typename Tkey>
Status PooledGradPlanSorted(const GpuDevice& d, const Tid* ids, int64_t nnz,
                            const int64_t* splits, int64_t batch,
                            int64_t bag_width, const T* weights,
                            int64_t num_rows, Combiner combiner,
                            const PooledGradPlanAllocate<T>& allocate,
                            PooledGradError* error) {
  const cudaStream_t stream = StreamOf(d);
  const Tkey pad_key = static_cast<Tkey>(num_rows);
  ull* info = nullptr;
  Tkey* keys_in = nullptr;
  Tkey* keys = nullptr;
  int32_t* positions_in = nullptr;
  int32_t* positions = nullptr;
  int32_t* rank = nullptr;
  SOK_RETURN_IF_ERROR(Scratch(d, kPgSize, &info, "pooled grad summary"));
  SOK_RETURN_IF_ERROR(Scratch(d, nnz, &keys_in, "pooled grad keys"));
  SOK_RETURN_IF_ERROR(Scratch(d, nnz, &keys, "pooled grad sorted keys"));
  SOK_RETURN_IF_ERROR(Scratch(d, nnz, &positions_in, "pooled grad positions"));
  SOK_RETURN_IF_ERROR(
      Scratch(d, nnz, &positions, "pooled grad sorted positions"));
  SOK_RETURN_IF_ERROR(Scratch(d, nnz, &rank, "pooled grad unique ranks"));
  // All ones: "none" for the two errors (atomicMin lowers them); the
  // summary kernel writes the other fields.
  SOK_CUDA_RETURN_IF_ERROR(
      cudaMemsetAsync(info, 0xFF, kPgSize * sizeof(ull), stream),
      "pooled grad summary init");
  if (bag_width < 1) {  // uniform splits are made right
    PooledGradSplitsKernel<<<BlocksFor(batch + 1, kThreads), kThreads, 0,
                             stream>>>(splits, batch, nnz, info);
    SOK_LAUNCH_RETURN_IF_ERROR("PooledGradSplitsKernel");
  }
  const int blocks = BlocksFor(nnz, kThreads);
  PooledGradKeysKernel<Tid, Tkey><<<blocks, kThreads, 0, stream>>>(
      ids, nnz, num_rows, pad_key, keys_in, positions_in, info);
  SOK_LAUNCH_RETURN_IF_ERROR("PooledGradKeysKernel");
  SOK_RETURN_IF_ERROR(SortPositions(d, keys_in, positions_in, nnz,
                                    BitsFor(static_cast<uint64_t>(pad_key)),
                                    keys, positions));
  // The unsorted positions are dead after the sort: reuse them for flags.
  int32_t* flags = positions_in;
  HeadFlagsKernel<Tkey><<<blocks, kThreads, 0, stream>>>(keys, nnz, flags);
  SOK_LAUNCH_RETURN_IF_ERROR("HeadFlagsKernel");
  size_t temp_bytes = 0;
  SOK_CUDA_RETURN_IF_ERROR(
      cub::DeviceScan::InclusiveSum(nullptr, temp_bytes, flags, rank,
                                    static_cast<int>(nnz), stream),
      "cub::DeviceScan::InclusiveSum (size query)");
  void* temp = nullptr;
  SOK_RETURN_IF_ERROR(CubTemp(d, temp_bytes, &temp));
  SOK_CUDA_RETURN_IF_ERROR(
      cub::DeviceScan::InclusiveSum(temp, temp_bytes, flags, rank,
                                    static_cast<int>(nnz), stream),
      "cub::DeviceScan::InclusiveSum");
  PooledGradSummaryKernel<Tid, Tkey><<<1, 1, 0, stream>>>(
      ids, keys, rank, nnz, pad_key, info);
  SOK_LAUNCH_RETURN_IF_ERROR("PooledGradSummaryKernel");

  // The one blocking copy: U, the kept count and the errors.
  ull host[kPgSize];
  SOK_RETURN_IF_ERROR(CopyToHostSync(d, host, info, sizeof(host),
                                     "SokPooledGradPlan summary"));
  if (host[kPgBadBag] != kNone) {
    error->bad_bag = static_cast<int64_t>(host[kPgBadBag]);
    return Status::Ok();
  }
  if (host[kPgBadPos] != kNone) {
    error->position = static_cast<int64_t>(host[kPgBadPos]);
    error->value = static_cast<int64_t>(host[kPgBadValue]);
    return Status::Ok();
  }
  const int64_t num_unique = static_cast<int64_t>(host[kPgUnique]);
  const int64_t kept = static_cast<int64_t>(host[kPgKept]);
  PooledGradPlanBuffers<T> out;
  SOK_RETURN_IF_ERROR(allocate(num_unique, kept, &out));
  if (combiner != Combiner::kSum && batch > 0) {
    PooledGradDenominatorKernel<T, Tid>
        <<<BlocksFor(batch, kThreads), kThreads, 0, stream>>>(
            ids, weights, splits, batch, combiner == Combiner::kSqrtn,
            out.denominator);
    SOK_LAUNCH_RETURN_IF_ERROR("PooledGradDenominatorKernel");
  }
  if (num_unique == 0) {
    SOK_CUDA_RETURN_IF_ERROR(
        cudaMemsetAsync(out.offsets, 0, sizeof(int32_t), stream),
        "pooled grad offsets");
    return Status::Ok();
  }
  PooledGradRowsKernel<Tkey><<<BlocksFor(kept, kThreads), kThreads, 0,
                               stream>>>(keys, flags, rank, kept, num_unique,
                                         out.rows, out.offsets);
  SOK_LAUNCH_RETURN_IF_ERROR("PooledGradRowsKernel");
  // The sorted positions are the kept positions grouped by row, ascending
  // within a row (a stable sort): the order SegmentCombineGrad's grouping
  // gives the padding-free ids. Their bags and weights are put in that
  // order, so that the sums read them without indirection.
  PooledGradSegmentsKernel<T>
      <<<BlocksFor(kept, kThreads), kThreads, 0, stream>>>(
          splits, batch, bag_width, positions, kept, weights, out.segments,
          weights == nullptr ? nullptr : out.sorted_weights);
  SOK_LAUNCH_RETURN_IF_ERROR("PooledGradSegmentsKernel");
  return Status::Ok();
}

}  // namespace

template <typename T, typename Tid>
Status PooledGradPlan(const GpuDevice& d, const Tid* ids, int64_t nnz,
                      const int64_t* splits, int64_t batch, int64_t bag_width,
                      const T* weights, int64_t num_rows, Combiner combiner,
                      const PooledGradPlanAllocate<T>& allocate,
                      PooledGradError* error) {
  *error = PooledGradError();
  if (batch < 0 || nnz < 0 || num_rows < 0) {
    return Status::Error("negative batch, id count or row count");
  }
  if (nnz > kInt32Max) {
    return Status::Error("the number of ids (" + std::to_string(nnz) +
                         ") must fit in int32 on the GPU.");
  }
  if (nnz == 0) {
    // Only the splits can be wrong (they must all be 0): one small check
    // and its blocking copy.
    const cudaStream_t stream = StreamOf(d);
    ull* info = nullptr;
    SOK_RETURN_IF_ERROR(Scratch(d, kPgSize, &info, "pooled grad summary"));
    SOK_CUDA_RETURN_IF_ERROR(
        cudaMemsetAsync(info, 0xFF, kPgSize * sizeof(ull), stream),
        "pooled grad summary init");
    PooledGradSplitsKernel<<<BlocksFor(batch + 1, kThreads), kThreads, 0,
                             stream>>>(splits, batch, 0, info);
    SOK_LAUNCH_RETURN_IF_ERROR("PooledGradSplitsKernel");
    ull host[kPgSize];
    SOK_RETURN_IF_ERROR(CopyToHostSync(d, host, info, sizeof(host),
                                       "SokPooledGradPlan summary"));
    if (host[kPgBadBag] != kNone) {
      error->bad_bag = static_cast<int64_t>(host[kPgBadBag]);
      return Status::Ok();
    }
    PooledGradPlanBuffers<T> out;
    SOK_RETURN_IF_ERROR(allocate(0, 0, &out));
    SOK_CUDA_RETURN_IF_ERROR(
        cudaMemsetAsync(out.offsets, 0, sizeof(int32_t), stream),
        "pooled grad offsets");
    if (combiner != Combiner::kSum && batch > 0) {  // empty bags: 0
      SOK_CUDA_RETURN_IF_ERROR(
          cudaMemsetAsync(out.denominator, 0, batch * sizeof(AccOf<T>),
                          stream),
          "pooled grad denominators");
    }
    return Status::Ok();
  }
  // The padding key num_rows must fit the sort key.
  if (static_cast<uint64_t>(num_rows) < std::numeric_limits<uint32_t>::max()) {
    return PooledGradPlanSorted<T, Tid, uint32_t>(
        d, ids, nnz, splits, batch, bag_width, weights, num_rows, combiner,
        allocate, error);
  }
  return PooledGradPlanSorted<T, Tid, uint64_t>(
      d, ids, nnz, splits, batch, bag_width, weights, num_rows, combiner,
      allocate, error);
}

template <typename T>
Status PooledGradCombine(const GpuDevice& d, const T* grad, int64_t dim,
                         int64_t batch, const int32_t* offsets,
                         int64_t num_unique, const int64_t* segments,
                         int64_t kept, const T* sorted_weights,
                         const AccOf<T>* denominator, T* rows_grad) {
  (void)batch;
  if (num_unique == 0 || dim <= 0) return Status::Ok();
  return CombineGradGrouped<T, int64_t>(d, grad, dim, segments,
                                        sorted_weights, denominator, offsets,
                                        nullptr, kept, num_unique, rows_grad);
}

// Explicit instantiations.
template Status DedupBucketize<int32_t>(const GpuDevice&, const int32_t*,
                                        int64_t, int64_t, int64_t, int64_t,
                                        int32_t*, DedupOutput*);
template Status DedupBucketize<int64_t>(const GpuDevice&, const int64_t*,
                                        int64_t, int64_t, int64_t, int64_t,
                                        int32_t*, DedupOutput*);

#define SOK_INSTANTIATE_GPU_SEG(Tseg)                                       \
  template Status CheckSegmentIndices<Tseg>(                                \
      const GpuDevice&, const int32_t*, const Tseg*, int64_t, int64_t,      \
      int64_t, SegmentIndexCheck*);
SOK_INSTANTIATE_GPU_SEG(int32_t)
SOK_INSTANTIATE_GPU_SEG(int64_t)
#undef SOK_INSTANTIATE_GPU_SEG

#define SOK_INSTANTIATE_GPU_COMBINE(T, Tseg)                                \
  template Status SegmentCombine<T, Tseg>(                                  \
      const GpuDevice&, const T*, int64_t, const int32_t*, const Tseg*,     \
      const T*, int64_t, int64_t, Combiner, const SegmentIndexCheck&, T*);  \
  template Status SegmentCombineGrad<T, Tseg>(                              \
      const GpuDevice&, const T*, int64_t, const int32_t*, const Tseg*,     \
      const T*, int64_t, int64_t, int64_t, Combiner,                        \
      const SegmentIndexCheck&, T*);
SOK_INSTANTIATE_GPU_COMBINE(float, int32_t)
SOK_INSTANTIATE_GPU_COMBINE(float, int64_t)
SOK_INSTANTIATE_GPU_COMBINE(double, int32_t)
SOK_INSTANTIATE_GPU_COMBINE(double, int64_t)
SOK_INSTANTIATE_GPU_COMBINE(Half, int32_t)
SOK_INSTANTIATE_GPU_COMBINE(Half, int64_t)
SOK_INSTANTIATE_GPU_COMBINE(BFloat16, int32_t)
SOK_INSTANTIATE_GPU_COMBINE(BFloat16, int64_t)
#undef SOK_INSTANTIATE_GPU_COMBINE

#define SOK_INSTANTIATE_GPU_POOLED_GRAD(T, Tid)                             \
  template Status PooledGradPlan<T, Tid>(                                   \
      const GpuDevice&, const Tid*, int64_t, const int64_t*, int64_t,       \
      int64_t, const T*, int64_t, Combiner,                                 \
      const PooledGradPlanAllocate<T>&, PooledGradError*);
SOK_INSTANTIATE_GPU_POOLED_GRAD(float, int32_t)
SOK_INSTANTIATE_GPU_POOLED_GRAD(float, int64_t)
SOK_INSTANTIATE_GPU_POOLED_GRAD(double, int32_t)
SOK_INSTANTIATE_GPU_POOLED_GRAD(double, int64_t)
template Status PooledGradCombine<float>(const GpuDevice&, const float*,
                                         int64_t, int64_t, const int32_t*,
                                         int64_t, const int64_t*, int64_t,
                                         const float*, const float*, float*);
template Status PooledGradCombine<double>(const GpuDevice&, const double*,
                                          int64_t, int64_t, const int32_t*,
                                          int64_t, const int64_t*, int64_t,
                                          const double*, const double*,
                                          double*);
#undef SOK_INSTANTIATE_GPU_POOLED_GRAD

}  // namespace gpu
}  // namespace lookup
}  // namespace sok
