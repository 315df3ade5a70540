// Adapts a TensorFlow GPU op's context to core's GpuDevice: the op's own
// CUDA stream and TensorFlow's allocator for scratch memory. Only compiled
// where the library is built with CUDA (SOK_WITH_CUDA).
#ifndef SOK_TF_GPU_DEVICE_H_
#define SOK_TF_GPU_DEVICE_H_

#ifdef SOK_WITH_CUDA

#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

#include "core/device.h"
#include "tensorflow/core/framework/device_base.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor.h"
#include "xla/stream_executor/stream.h"

namespace sok {

// The number of blocking device-to-host copies made by this library's GPU
// kernels since the library was loaded (see SokGpuHostSyncs).
std::atomic<int64_t>& GpuHostSyncCounter();

// Scratch tensors of one kernel invocation; keep it alive for the whole
// Compute (TensorFlow's GPU allocator is ordered on the op's stream, so
// memory released when Compute returns is reused only by later work).
class GpuScratch {
 public:
  explicit GpuScratch(::tensorflow::OpKernelContext* ctx) : ctx_(ctx) {}

  void* Allocate(int64_t bytes) {
    if (bytes <= 0) bytes = 1;
    tensors_.emplace_back();
    const int64_t words = (bytes + 7) / 8;
    const absl::Status s = ctx_->allocate_temp(
        ::tensorflow::DT_INT64, ::tensorflow::TensorShape({words}),
        &tensors_.back());
    if (!s.ok()) return nullptr;
    return tensors_.back().data();
  }

 private:
  ::tensorflow::OpKernelContext* ctx_;
  std::vector<::tensorflow::Tensor> tensors_;
};

inline void* TfGpuStream(::tensorflow::OpKernelContext* ctx) {
  return ctx->op_device_context()->stream()->platform_specific_handle().stream;
}

// A GpuDevice over ctx's stream whose scratch memory lives in `scratch`.
inline GpuDevice MakeGpuDevice(::tensorflow::OpKernelContext* ctx,
                               GpuScratch* scratch) {
  GpuDevice d;
  d.stream = TfGpuStream(ctx);
  d.allocate = [scratch](int64_t bytes) { return scratch->Allocate(bytes); };
  d.host_syncs = &GpuHostSyncCounter();
  return d;
}

}  // namespace sok

#endif  // SOK_WITH_CUDA
#endif  // SOK_TF_GPU_DEVICE_H_
