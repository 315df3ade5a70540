// The device seam of core/: every kernel is declared once as a functor
// template over a device type (TensorFlow's `Functor<Device, T>` pattern) and
// implemented for CpuDevice (in *.cc) and GpuDevice (in *.cu.cc).
// TensorFlow-free, and free of CUDA headers, so that the host compiler can
// include it.
#ifndef SOK_CORE_DEVICE_H_
#define SOK_CORE_DEVICE_H_

#include <atomic>
#include <cstdint>
#include <functional>

#include "core/parallel.h"

namespace sok {

// Work on the calling process's CPUs, through the adapter's thread pool.
struct CpuDevice {
  ParallelFor parallel_for;
};

// Work enqueued on one CUDA stream (the framework op's own stream). Scratch
// memory comes from the framework's allocator through `allocate`, which
// returns device memory that stays valid for the rest of the op's
// execution (stream-ordered: freed memory is reused only by work queued
// after it on the same stream), or nullptr when out of memory.
struct GpuDevice {
  void* stream = nullptr;  // a cudaStream_t
  std::function<void*(int64_t bytes)> allocate;
  // Device-to-host copies that size an output or decide an error block the
  // host until the stream reaches them; each adds one to this counter, if
  // set (docs/design.md lists them).
  std::atomic<int64_t>* host_syncs = nullptr;
};

// Whether this build of the library has CUDA kernels.
bool BuiltWithCuda();

}  // namespace sok

#endif  // SOK_CORE_DEVICE_H_
