// GPU implementation of PooledLookupFunctor: `threads_per_bag` lanes of a
// warp pool one bag, each lane owning VEC consecutive columns (16-byte
// loads for float tables whose width is a multiple of 4). Each lane sums its
// bag's rows in position order with correctly rounded adds and multiplies
// (no contraction into FMA), so the result is deterministic and matches the
// CPU kernel bit for bit. Bags of one id (bag_width == 1: the unpooled
// lookup) take a gather kernel instead, which reads no row splits and keeps
// several bags' rows in flight. One blocking copy to the host (the error
// summary) per call.
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdlib>

#include "core/gpu_math.cuh"
#include "core/gpu_util.cuh"
#include "core/pooled_lookup.h"

namespace sok {
namespace lookup {
namespace {

using ::sok::gpu::Add;
using ::sok::gpu::Mul;

struct DeviceError {
  unsigned long long position;  // first bad id position (all ones: none)
  unsigned long long bad_bag;   // first bag with bad splits (all ones: none)
};

template <typename T, int VEC>
struct Loader {
  __device__ __forceinline__ static void Load(const T* p, int64_t valid,
                                              T* v) {
#pragma unroll
    for (int k = 0; k < VEC; ++k) v[k] = k < valid ? p[k] : T(0);
  }
};

template <>
struct Loader<float, 4> {
  __device__ __forceinline__ static void Load(const float* p, int64_t valid,
                                              float* v) {
    const float4 q = __ldg(reinterpret_cast<const float4*>(p));
    v[0] = q.x;
    v[1] = q.y;
    v[2] = q.z;
    v[3] = q.w;
    (void)valid;  // dim % 4 == 0 for this path
  }
};

// One group of `lanes` (a power of 2, <= 32) threads pools one bag; each
// lane owns VEC consecutive columns (a column pass per lanes * VEC columns).
// The group reads its bag's ids `lanes` at a time, one id per lane in one
// coalesced load (the lane also checks its id), and hands them round with
// warp shuffles; then UNROLL rows are loaded before any of them is added
// (UNROLL independent 16-byte loads in flight per lane), and the adds run in
// position order, as on the CPU.
template <typename T, int VEC>
struct Store {
  __device__ __forceinline__ static void Put(T* o, const T* x,
                                             int64_t valid) {
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      if (k < valid) o[k] = x[k];
    }
  }
};

template <>
struct Store<float, 4> {
  // Streaming store: the pooled rows are written once and not read here,
  // so they should not push the hot table rows out of L2.
  __device__ __forceinline__ static void Put(float* o, const float* x,
                                             int64_t valid) {
    (void)valid;
    __stcs(reinterpret_cast<float4*>(o), make_float4(x[0], x[1], x[2], x[3]));
  }
};

// The combiner applied to one bag's sums (as RowPooler::Finish): mean
// divides by the weight sum, sqrtn by the square root of the square sum,
// a zero denominator gives zeros. Shared by both kernels, so that a one-id
// bag comes out the same from either.
template <typename T, int VEC>
__device__ __forceinline__ void Combine(int combiner, T weight_sum,
                                        T square_sum, T* acc) {
  T denominator = T(1);
  bool divide = false;
  if (combiner == static_cast<int>(Combiner::kMean)) {
    denominator = weight_sum;
    divide = true;
  } else if (combiner == static_cast<int>(Combiner::kSqrtn)) {
    denominator = sqrt(square_sum);
    divide = true;
  }
  if (divide) {
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      acc[k] = denominator == T(0) ? T(0) : acc[k] / denominator;
    }
  }
}

// The row of ids[i]: the id, or -1 for the padding -1 and for an id
// outside [0, vocab_size), which also lowers error->position to i (when
// `error` is given: the caller reports once per id).
template <typename Tid>
__device__ __forceinline__ long long CheckedRow(const Tid* __restrict__ ids,
                                                int64_t i, int64_t vocab_size,
                                                DeviceError* error) {
  const int64_t id = static_cast<int64_t>(__ldg(ids + i));
  if (id >= 0 && id < vocab_size) return id;
  if (id != -1 && error != nullptr) {
    atomicMin(&error->position, (unsigned long long)i);
  }
  return -1;
}

template <typename T, typename Tid, int VEC, int UNROLL>
__global__ void __launch_bounds__(256)
    PooledLookupKernel(const T* __restrict__ table, int64_t vocab_size,
                       int64_t dim, const Tid* __restrict__ ids, int64_t nnz,
                       const int64_t* __restrict__ splits, int64_t batch,
                       const T* __restrict__ weights, int combiner,
                       int lanes_log2, T* __restrict__ out,
                       DeviceError* error) {
  const int lanes = 1 << lanes_log2;
  const int lane = threadIdx.x & (lanes - 1);
  const unsigned group_mask = ::sok::gpu::GroupMask(lanes);
  const int64_t passes = ((dim + VEC - 1) / VEC + lanes - 1) / lanes;
  const int64_t groups = (int64_t{gridDim.x} * blockDim.x) >> lanes_log2;
  for (int64_t bag = (blockIdx.x * int64_t{blockDim.x} + threadIdx.x) >>
                     lanes_log2;
       bag < batch; bag += groups) {
    int64_t begin = splits[bag];
    int64_t end = splits[bag + 1];
    if (begin < 0 || end < begin || end > nnz || (bag == 0 && begin != 0) ||
        (bag == batch - 1 && end != nnz)) {
      if (lane == 0 && error != nullptr) {
        atomicMin(&error->bad_bag, (unsigned long long)bag);
      }
      begin = end = 0;  // read nothing out of range
    }
    for (int64_t pass = 0; pass < passes; ++pass) {
      const int64_t c0 = (pass * lanes + lane) * VEC;
      const bool columns = c0 < dim;
      const int64_t valid = dim - c0;
      T acc[VEC];
#pragma unroll
      for (int k = 0; k < VEC; ++k) acc[k] = T(0);
      T weight_sum = 0;
      T square_sum = 0;
      for (int64_t base = begin; base < end; base += lanes) {
        const int n = static_cast<int>(end - base < lanes ? end - base : lanes);
        // This lane's id of the chunk: its row, or -1 (padding, invalid, or
        // past the bag's end).
        long long my_row = -1;
        T my_weight = T(1);
        if (lane < n) {
          const int64_t i = base + lane;
          my_row = CheckedRow(ids, i, vocab_size, pass == 0 ? error : nullptr);
          if (weights != nullptr) my_weight = __ldg(weights + i);
        }
        for (int k0 = 0; k0 < n; k0 += UNROLL) {
          long long row[UNROLL];
          T w[UNROLL];
#pragma unroll
          for (int u = 0; u < UNROLL; ++u) {
            // k0 + u < n is the same for the whole group.
            row[u] = k0 + u < n
                         ? __shfl_sync(group_mask, my_row, k0 + u, lanes)
                         : -1LL;
            w[u] = T(1);
            if (weights != nullptr && k0 + u < n) {
              w[u] = __shfl_sync(group_mask, my_weight, k0 + u, lanes);
            }
          }
          T v[UNROLL][VEC];
#pragma unroll
          for (int u = 0; u < UNROLL; ++u) {
            if (row[u] >= 0 && columns) {
              Loader<T, VEC>::Load(table + row[u] * dim + c0, valid, v[u]);
            } else {
#pragma unroll
              for (int k = 0; k < VEC; ++k) v[u][k] = T(0);
            }
          }
#pragma unroll
          for (int u = 0; u < UNROLL; ++u) {
            if (row[u] < 0) continue;
            if (weights == nullptr) {
#pragma unroll
              for (int k = 0; k < VEC; ++k) acc[k] = Add(acc[k], v[u][k]);
              weight_sum = Add(weight_sum, T(1));
            } else {
#pragma unroll
              for (int k = 0; k < VEC; ++k) {
                acc[k] = Add(acc[k], Mul(w[u], v[u][k]));
              }
              weight_sum = Add(weight_sum, w[u]);
              square_sum = Add(square_sum, Mul(w[u], w[u]));
            }
          }
        }
      }
      if (!columns) continue;
      if (weights == nullptr) square_sum = weight_sum;
      Combine<T, VEC>(combiner, weight_sum, square_sum, acc);
      Store<T, VEC>::Put(out + bag * dim + c0, acc, valid);
    }
  }
}

// Bags of one id (splits[b] == b): a gather. A group of `lanes` threads
// (as above) takes `lanes` consecutive bags at a time: each lane loads and
// checks the id of one of them (one coalesced load, no splits), then the
// group walks the bags with warp shuffles, loading the rows of UNROLL bags
// (UNROLL independent loads in flight per lane) before storing any of them.
// Each bag's result is what PooledLookupKernel computes for a one-id bag:
// the same adds from zero (+0 + -0 is +0) and the same combiner.
template <typename T, typename Tid, int VEC, int UNROLL>
__global__ void __launch_bounds__(256)
    GatherLookupKernel(const T* __restrict__ table, int64_t vocab_size,
                       int64_t dim, const Tid* __restrict__ ids, int64_t batch,
                       const T* __restrict__ weights, int combiner,
                       int lanes_log2, T* __restrict__ out,
                       DeviceError* error) {
  const int lanes = 1 << lanes_log2;
  const int lane = threadIdx.x & (lanes - 1);
  const unsigned group_mask = ::sok::gpu::GroupMask(lanes);
  const int64_t passes = ((dim + VEC - 1) / VEC + lanes - 1) / lanes;
  const int64_t groups = (int64_t{gridDim.x} * blockDim.x) >> lanes_log2;
  const int64_t chunks = (batch + lanes - 1) >> lanes_log2;
  for (int64_t chunk = (blockIdx.x * int64_t{blockDim.x} + threadIdx.x) >>
                       lanes_log2;
       chunk < chunks; chunk += groups) {
    const int64_t first = chunk << lanes_log2;  // the chunk's first bag
    const int n =
        static_cast<int>(batch - first < lanes ? batch - first : lanes);
    // This lane's bag of the chunk: its row, or -1 (padding, invalid, or
    // past the last bag).
    long long my_row = -1;
    T my_weight = T(1);
    if (lane < n) {
      const int64_t i = first + lane;
      my_row = CheckedRow(ids, i, vocab_size, error);
      if (weights != nullptr) my_weight = __ldg(weights + i);
    }
    for (int k0 = 0; k0 < n; k0 += UNROLL) {
      long long row[UNROLL];
      T w[UNROLL];
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        // k0 + u < n is the same for the whole group.
        row[u] = k0 + u < n ? __shfl_sync(group_mask, my_row, k0 + u, lanes)
                            : -1LL;
        w[u] = T(1);
        if (weights != nullptr && k0 + u < n) {
          w[u] = __shfl_sync(group_mask, my_weight, k0 + u, lanes);
        }
      }
      for (int64_t pass = 0; pass < passes; ++pass) {
        const int64_t c0 = (pass * lanes + lane) * VEC;
        const bool columns = c0 < dim;
        const int64_t valid = dim - c0;
        T v[UNROLL][VEC];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
          if (row[u] >= 0 && columns) {
            Loader<T, VEC>::Load(table + row[u] * dim + c0, valid, v[u]);
          }
        }
        if (!columns) continue;
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
          if (k0 + u >= n) continue;
          T acc[VEC];
          T weight_sum = T(0);
          T square_sum = T(0);
#pragma unroll
          for (int k = 0; k < VEC; ++k) acc[k] = T(0);
          if (row[u] >= 0) {  // else a zero row (padding counts for nothing)
            if (weights == nullptr) {
#pragma unroll
              for (int k = 0; k < VEC; ++k) acc[k] = Add(T(0), v[u][k]);
              weight_sum = Add(T(0), T(1));
              square_sum = weight_sum;
            } else {
#pragma unroll
              for (int k = 0; k < VEC; ++k) {
                acc[k] = Add(T(0), Mul(w[u], v[u][k]));
              }
              weight_sum = Add(T(0), w[u]);
              square_sum = Add(T(0), Mul(w[u], w[u]));
            }
          }
          Combine<T, VEC>(combiner, weight_sum, square_sum, acc);
          Store<T, VEC>::Put(out + (first + k0 + u) * dim + c0, acc, valid);
        }
      }
    }
  }
}

// UNROLL: rows loaded before they are added. Measured on the H200 (10M x
// 128 fp32, 26 x 8 Zipf ids, wall ms per forward call, two runs): 1: 1.18 /
// 0.87, 2: 1.14 / 0.83, 4: 0.97 / 0.88, 8: 1.25 / 1.09 (more rows in flight
// cost more registers than they gain; bench/results/gpu/run4/). 4 it is.
// SOK_POOLED_LOOKUP_UNROLL=1|2|4|8 overrides it (for benchmarks); results
// do not depend on it. GatherLookupKernel takes the same UNROLL (bags whose
// rows are in flight at once; not measured separately yet).
int UnrollFor() {
  const char* v = std::getenv("SOK_POOLED_LOOKUP_UNROLL");  // read per call
  const int forced = v == nullptr ? 0 : std::atoi(v);
  if (forced == 1 || forced == 2 || forced == 4 || forced == 8) return forced;
  return 4;
}

// gather: GatherLookupKernel (one-id bags; splits and nnz unused), else
// PooledLookupKernel.
template <typename T, typename Tid, int VEC, int UNROLL>
void LaunchKernel(bool gather, int blocks, int threads, cudaStream_t stream,
                  const T* table, int64_t vocab_size, int64_t dim,
                  const Tid* ids, int64_t nnz, const int64_t* splits,
                  int64_t batch, const T* weights, Combiner combiner,
                  int lanes_log2, T* out, DeviceError* error) {
  if (gather) {
    GatherLookupKernel<T, Tid, VEC, UNROLL><<<blocks, threads, 0, stream>>>(
        table, vocab_size, dim, ids, batch, weights,
        static_cast<int>(combiner), lanes_log2, out, error);
  } else {
    PooledLookupKernel<T, Tid, VEC, UNROLL><<<blocks, threads, 0, stream>>>(
        table, vocab_size, dim, ids, nnz, splits, batch, weights,
        static_cast<int>(combiner), lanes_log2, out, error);
  }
}

template <typename T, typename Tid, int VEC>
Status Launch(const GpuDevice& d, bool gather, const T* table,
              int64_t vocab_size, int64_t dim, const Tid* ids, int64_t nnz,
              const int64_t* splits, int64_t batch, const T* weights,
              Combiner combiner, T* out, DeviceError* error) {
  // Lanes per bag: enough for one pass over the row (<= 32, a power of 2).
  const int64_t chunks = (dim + VEC - 1) / VEC;
  int lanes_log2 = 0;
  while ((int64_t{1} << lanes_log2) < chunks && lanes_log2 < 5) ++lanes_log2;
  const int threads = 256;
  // A group per bag, or (gather) per `lanes` bags: a thread per bag, the
  // last chunk's rounded up.
  const int64_t lanes = int64_t{1} << lanes_log2;
  const int64_t work =
      gather ? (batch + lanes - 1) / lanes * lanes : batch * lanes;
  const int blocks = ::sok::gpu::BlocksFor(work, threads);
  const cudaStream_t stream = ::sok::gpu::StreamOf(d);
  switch (UnrollFor()) {
    case 1:
      LaunchKernel<T, Tid, VEC, 1>(gather, blocks, threads, stream, table,
                                   vocab_size, dim, ids, nnz, splits, batch,
                                   weights, combiner, lanes_log2, out, error);
      break;
    case 2:
      LaunchKernel<T, Tid, VEC, 2>(gather, blocks, threads, stream, table,
                                   vocab_size, dim, ids, nnz, splits, batch,
                                   weights, combiner, lanes_log2, out, error);
      break;
    case 8:
      LaunchKernel<T, Tid, VEC, 8>(gather, blocks, threads, stream, table,
                                   vocab_size, dim, ids, nnz, splits, batch,
                                   weights, combiner, lanes_log2, out, error);
      break;
    default:
      LaunchKernel<T, Tid, VEC, 4>(gather, blocks, threads, stream, table,
                                   vocab_size, dim, ids, nnz, splits, batch,
                                   weights, combiner, lanes_log2, out, error);
  }
  SOK_LAUNCH_RETURN_IF_ERROR("SokPooledLookup");
  return Status::Ok();
}
}  // namespace

template <typename T, typename Tid>
Status PooledLookupFunctor<GpuDevice, T, Tid>::operator()(
    const GpuDevice& d, const T* table, int64_t vocab_size, int64_t dim,
    const Tid* ids, int64_t nnz, const int64_t* splits, int64_t batch,
    int64_t bag_width, const T* weights, Combiner combiner, T* out,
    PooledLookupError* error) {
  if (error != nullptr) *error = PooledLookupError();
  if (batch == 0) {
    if (nnz != 0 && error != nullptr) error->bad_bag = 0;
    return Status::Ok();
  }
  DeviceError* dev_error = nullptr;
  if (error != nullptr) {
    SOK_RETURN_IF_ERROR(
        ::sok::gpu::Scratch(d, 1, &dev_error, "SokPooledLookup"));
    // All ones: "none" for both fields (atomicMin lowers them).
    SOK_CUDA_RETURN_IF_ERROR(
        cudaMemsetAsync(dev_error, 0xff, sizeof(DeviceError),
                        ::sok::gpu::StreamOf(d)),
        "SokPooledLookup init");
  }
  // One-id bags whose count agrees with the ids' (anything else goes to the
  // general kernel, which checks the splits).
  const bool gather = bag_width == 1 && nnz == batch;
  if (dim > 0) {
    const bool vec4 = sizeof(T) == 4 && dim % 4 == 0 &&
                      reinterpret_cast<uintptr_t>(table) % 16 == 0;
    if (vec4) {
      SOK_RETURN_IF_ERROR((Launch<T, Tid, 4>(d, gather, table, vocab_size,
                                             dim, ids, nnz, splits, batch,
                                             weights, combiner, out,
                                             dev_error)));
    } else {
      SOK_RETURN_IF_ERROR((Launch<T, Tid, 1>(d, gather, table, vocab_size,
                                             dim, ids, nnz, splits, batch,
                                             weights, combiner, out,
                                             dev_error)));
    }
  }
  if (error == nullptr) return Status::Ok();  // the ids were checked
  DeviceError host;
  SOK_RETURN_IF_ERROR(::sok::gpu::CopyToHostSync(d, &host, dev_error, sizeof(host),
                                          "SokPooledLookup error check"));
  if (host.bad_bag < static_cast<unsigned long long>(batch)) {
    error->bad_bag = static_cast<int64_t>(host.bad_bag);
  }
  if (host.position < static_cast<unsigned long long>(nnz)) {
    error->position = static_cast<int64_t>(host.position);
    Tid value;
    SOK_RETURN_IF_ERROR(::sok::gpu::CopyToHostSync(d, &value, ids + error->position,
                                            sizeof(Tid),
                                            "SokPooledLookup error value"));
    error->value = static_cast<int64_t>(value);
  }
  return Status::Ok();
}

namespace {
__global__ void UniformSplitsKernel(int64_t width, int64_t batch,
                                    int64_t* splits) {
  for (int64_t b = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
       b <= batch; b += int64_t{gridDim.x} * blockDim.x) {
    splits[b] = b * width;
  }
}
}  // namespace

Status UniformSplitsFunctor<GpuDevice>::operator()(const GpuDevice& d,
                                                   int64_t width,
                                                   int64_t batch,
                                                   int64_t* splits) {
  UniformSplitsKernel<<<::sok::gpu::BlocksFor(batch + 1), 256, 0,
                        ::sok::gpu::StreamOf(d)>>>(width, batch, splits);
  SOK_LAUNCH_RETURN_IF_ERROR("SokPooledLookup uniform splits");
  return Status::Ok();
}

template struct PooledLookupFunctor<GpuDevice, float, int32_t>;
template struct PooledLookupFunctor<GpuDevice, float, int64_t>;
template struct PooledLookupFunctor<GpuDevice, double, int32_t>;
template struct PooledLookupFunctor<GpuDevice, double, int64_t>;

}  // namespace lookup
}  // namespace sok
