// Helpers shared by the CUDA kernels of core/ (*.cu.cc only): error
// checking into sok::Status, launch shapes, blocking copies to the host.
// TensorFlow-free.
#ifndef SOK_CORE_GPU_UTIL_CUH_
#define SOK_CORE_GPU_UTIL_CUH_

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "core/device.h"
#include "core/status.h"

namespace sok {
namespace gpu {

inline cudaStream_t StreamOf(const GpuDevice& d) {
  return static_cast<cudaStream_t>(d.stream);
}

inline Status CudaStatus(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return Status::Ok();
  return Status::Error(std::string("CUDA error in ") + what + ": " +
                       cudaGetErrorString(err));
}

// After a kernel launch: reports a launch error (bad configuration etc.).
inline Status LaunchStatus(const char* what) {
  return CudaStatus(cudaGetLastError(), what);
}

#define SOK_CUDA_RETURN_IF_ERROR(expr, what)                       \
  do {                                                             \
    ::sok::Status _sok_cuda = ::sok::gpu::CudaStatus((expr), what); \
    if (!_sok_cuda.ok()) return _sok_cuda;                         \
  } while (0)

#define SOK_LAUNCH_RETURN_IF_ERROR(what)                           \
  do {                                                             \
    ::sok::Status _sok_cuda = ::sok::gpu::LaunchStatus(what);      \
    if (!_sok_cuda.ok()) return _sok_cuda;                         \
  } while (0)

// The shuffle mask of the group of `lanes` threads (a power of 2, <= 32)
// that this thread is in, within its warp: kernels where a group of lanes
// shares one bag or row.
__device__ __forceinline__ unsigned GroupMask(int lanes) {
  return lanes == 32
             ? 0xffffffffu
             : (((1u << lanes) - 1u) << (threadIdx.x & 31 & ~(lanes - 1)));
}

// Blocks 1-D work of n items: a grid-stride launch shape.
inline int BlocksFor(int64_t n, int threads = 256) {
  int64_t blocks = (n + threads - 1) / threads;
  if (blocks < 1) blocks = 1;
  if (blocks > 65535LL * 32) blocks = 65535LL * 32;
  return static_cast<int>(blocks);
}

// Allocates `count` elements of T of scratch; nullptr (and an error status)
// when the framework's allocator is out of memory.
template <typename T>
Status Scratch(const GpuDevice& d, int64_t count, T** out, const char* what) {
  *out = static_cast<T*>(d.allocate(count * static_cast<int64_t>(sizeof(T))));
  if (*out == nullptr) {
    return Status::Error(std::string("out of GPU memory for ") + what);
  }
  return Status::Ok();
}

// Copies device memory to the host and waits for it (one counted host sync).
inline Status CopyToHostSync(const GpuDevice& d, void* host, const void* dev,
                             size_t bytes, const char* what) {
  SOK_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(host, dev, bytes,
                                           cudaMemcpyDeviceToHost,
                                           StreamOf(d)),
                           what);
  SOK_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(StreamOf(d)), what);
  if (d.host_syncs != nullptr) d.host_syncs->fetch_add(1);
  return Status::Ok();
}

// The number of bits needed to represent every value in [0, max_value].
inline int BitsFor(uint64_t max_value) {
  int bits = 1;
  while (bits < 64 && (max_value >> bits) != 0) ++bits;
  return bits;
}

}  // namespace gpu
}  // namespace sok

#endif  // SOK_CORE_GPU_UTIL_CUH_
