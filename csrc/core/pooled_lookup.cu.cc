// GPU implementation of PooledLookupFunctor: `threads_per_bag` lanes of a
// warp pool one bag, each lane owning VEC consecutive columns (16-byte
// loads for float tables whose width is a multiple of 4). Each lane sums its
// bag's rows in position order with correctly rounded adds and multiplies
// (no contraction into FMA), so the result is deterministic and matches the
// CPU kernel bit for bit. One blocking copy to the host (the error
// summary) per call.
#include <cuda_runtime.h>

#include <cstdint>

#include "core/gpu_math.cuh"
#include "core/gpu_util.cuh"
#include "core/pooled_lookup.h"

namespace sok {
namespace lookup {
namespace {

using ::sok::gpu::Add;
using ::sok::gpu::Mul;

struct DeviceError {
  unsigned long long position;  // first bad id position (nnz: none)
  unsigned long long bad_bag;   // first bag with bad splits (batch: none)
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

// Ids of one bag are read UNROLL at a time and their rows loaded before any
// of them is added (UNROLL independent row loads in flight per lane; see
// kUnroll for what pays on the H200); the adds run in position order, as
// on the CPU.
template <typename T, typename Tid, int VEC, int UNROLL>
__global__ void PooledLookupKernel(const T* __restrict__ table,
                                   int64_t vocab_size, int64_t dim,
                                   const Tid* __restrict__ ids, int64_t nnz,
                                   const int64_t* __restrict__ splits,
                                   int64_t batch, const T* __restrict__ weights,
                                   int combiner, int lanes_log2,
                                   T* __restrict__ out, DeviceError* error) {
  const int64_t lanes = int64_t{1} << lanes_log2;
  const int64_t total = batch * lanes;
  for (int64_t t = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; t < total;
       t += int64_t{gridDim.x} * blockDim.x) {
    const int64_t bag = t >> lanes_log2;
    const int64_t lane = t & (lanes - 1);
    int64_t begin = splits[bag];
    int64_t end = splits[bag + 1];
    if (begin < 0 || end < begin || end > nnz || (bag == 0 && begin != 0) ||
        (bag == batch - 1 && end != nnz)) {
      if (lane == 0) atomicMin(&error->bad_bag, (unsigned long long)bag);
      begin = end = 0;  // read nothing out of range
    }
    for (int64_t c0 = lane * VEC; c0 < dim; c0 += lanes * VEC) {
      T acc[VEC];
#pragma unroll
      for (int k = 0; k < VEC; ++k) acc[k] = T(0);
      T weight_sum = 0;
      T square_sum = 0;
      const int64_t valid = dim - c0;
      for (int64_t i0 = begin; i0 < end; i0 += UNROLL) {
        int64_t row[UNROLL];
        bool use[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
          const int64_t i = i0 + u;
          const int64_t id = i < end ? static_cast<int64_t>(__ldg(ids + i))
                                     : int64_t{-1};
          use[u] = id >= 0 && id < vocab_size;
          if (!use[u] && id != -1 && c0 == lane * VEC) {
            atomicMin(&error->position, (unsigned long long)i);
          }
          row[u] = use[u] ? id : 0;
        }
        T v[UNROLL][VEC];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
          if (use[u]) {
            Loader<T, VEC>::Load(table + row[u] * dim + c0, valid, v[u]);
          } else {
#pragma unroll
            for (int k = 0; k < VEC; ++k) v[u][k] = T(0);
          }
        }
        if (weights == nullptr) {
#pragma unroll
          for (int u = 0; u < UNROLL; ++u) {
            if (!use[u]) continue;
#pragma unroll
            for (int k = 0; k < VEC; ++k) acc[k] = Add(acc[k], v[u][k]);
            weight_sum = Add(weight_sum, T(1));
          }
        } else {
          T w[UNROLL];
#pragma unroll
          for (int u = 0; u < UNROLL; ++u) {
            w[u] = use[u] ? __ldg(weights + i0 + u) : T(0);
          }
#pragma unroll
          for (int u = 0; u < UNROLL; ++u) {
            if (!use[u]) continue;
#pragma unroll
            for (int k = 0; k < VEC; ++k) {
              acc[k] = Add(acc[k], Mul(w[u], v[u][k]));
            }
            weight_sum = Add(weight_sum, w[u]);
            square_sum = Add(square_sum, Mul(w[u], w[u]));
          }
        }
      }
      if (weights == nullptr) square_sum = weight_sum;
      T denominator = T(1);
      bool divide = false;
      if (combiner == static_cast<int>(Combiner::kMean)) {
        denominator = weight_sum;
        divide = true;
      } else if (combiner == static_cast<int>(Combiner::kSqrtn)) {
        denominator = sqrt(square_sum);
        divide = true;
      }
      T* o = out + bag * dim + c0;
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        if (k < valid) {
          T x = acc[k];
          if (divide) x = denominator == T(0) ? T(0) : x / denominator;
          o[k] = x;
        }
      }
    }
  }
}

__global__ void InitError(DeviceError* e, int64_t nnz, int64_t batch) {
  e->position = static_cast<unsigned long long>(nnz);
  e->bad_bag = static_cast<unsigned long long>(batch);
}

// UNROLL: ids per batch of row loads. 1 is what runs: on the H200 (10M x
// 128 fp32, 8 ids per bag) 1 took 0.93 ms, 4 took 1.01 and 8 took 1.20 (more
// registers cost more occupancy than the extra loads in flight gain;
// bench/results/gpu/forward_unroll_*.json). Results do not depend on it.
constexpr int kUnroll = 1;

template <typename T, typename Tid, int VEC>
Status Launch(const GpuDevice& d, const T* table, int64_t vocab_size,
              int64_t dim, const Tid* ids, int64_t nnz, const int64_t* splits,
              int64_t batch, const T* weights, Combiner combiner, T* out,
              DeviceError* error) {
  // Lanes per bag: enough for one pass over the row (<= 32, a power of 2).
  const int64_t chunks = (dim + VEC - 1) / VEC;
  int lanes_log2 = 0;
  while ((int64_t{1} << lanes_log2) < chunks && lanes_log2 < 5) ++lanes_log2;
  const int threads = 256;
  const int blocks = ::sok::gpu::BlocksFor(batch << lanes_log2, threads);
  const cudaStream_t stream = ::sok::gpu::StreamOf(d);
  PooledLookupKernel<T, Tid, VEC, kUnroll><<<blocks, threads, 0, stream>>>(
      table, vocab_size, dim, ids, nnz, splits, batch, weights,
      static_cast<int>(combiner), lanes_log2, out, error);
  SOK_LAUNCH_RETURN_IF_ERROR("SokPooledLookup");
  return Status::Ok();
}

}  // namespace

template <typename T, typename Tid>
Status PooledLookupFunctor<GpuDevice, T, Tid>::operator()(
    const GpuDevice& d, const T* table, int64_t vocab_size, int64_t dim,
    const Tid* ids, int64_t nnz, const int64_t* splits, int64_t batch,
    const T* weights, Combiner combiner, T* out, PooledLookupError* error) {
  *error = PooledLookupError();
  if (batch == 0) {
    if (nnz != 0) error->bad_bag = 0;
    return Status::Ok();
  }
  DeviceError* dev_error = nullptr;
  SOK_RETURN_IF_ERROR(::sok::gpu::Scratch(d, 1, &dev_error, "SokPooledLookup"));
  InitError<<<1, 1, 0, ::sok::gpu::StreamOf(d)>>>(dev_error, nnz, batch);
  SOK_LAUNCH_RETURN_IF_ERROR("SokPooledLookup init");
  if (dim > 0) {
    const bool vec4 = sizeof(T) == 4 && dim % 4 == 0 &&
                      reinterpret_cast<uintptr_t>(table) % 16 == 0;
    if (vec4) {
      SOK_RETURN_IF_ERROR((Launch<T, Tid, 4>(d, table, vocab_size, dim, ids,
                                             nnz, splits, batch, weights,
                                             combiner, out, dev_error)));
    } else {
      SOK_RETURN_IF_ERROR((Launch<T, Tid, 1>(d, table, vocab_size, dim, ids,
                                             nnz, splits, batch, weights,
                                             combiner, out, dev_error)));
    }
  }
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

template struct PooledLookupFunctor<GpuDevice, float, int32_t>;
template struct PooledLookupFunctor<GpuDevice, float, int64_t>;
template struct PooledLookupFunctor<GpuDevice, double, int32_t>;
template struct PooledLookupFunctor<GpuDevice, double, int64_t>;

}  // namespace lookup
}  // namespace sok
