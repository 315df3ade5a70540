// SokBuildInfo: what this build of the op library contains, and how many
// blocking device-to-host copies its GPU kernels have made.
#include <atomic>
#include <cstdint>

#include "core/device.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace sok {

std::atomic<int64_t>& GpuHostSyncCounter() {
  static std::atomic<int64_t> counter{0};
  return counter;
}

std::atomic<int64_t>& VariableCopyBytesCounter() {
  static std::atomic<int64_t> counter{0};
  return counter;
}

namespace {

using ::tensorflow::OpKernel;
using ::tensorflow::OpKernelConstruction;
using ::tensorflow::OpKernelContext;
using ::tensorflow::Tensor;
using ::tensorflow::TensorShape;

REGISTER_OP("SokBuildInfo")
    .Output("with_cuda: bool")
    .Output("gpu_host_syncs: int64")
    .Output("variable_copy_bytes: int64")
    .SetIsStateful()
    .SetShapeFn([](::tensorflow::shape_inference::InferenceContext* c) {
      c->set_output(0, c->Scalar());
      c->set_output(1, c->Scalar());
      c->set_output(2, c->Scalar());
      return absl::OkStatus();
    })
    .Doc(R"doc(
with_cuda: whether the library has CUDA kernels.
gpu_host_syncs: blocking device-to-host copies made by its GPU kernels so far.
variable_copy_bytes: bytes the sparse optimizer updates copied so far because
  a table's (or slot's) buffer was still shared with a tensor read earlier
  (copy-on-write); 0 in a well-formed training step.
)doc");

class SokBuildInfoOp : public OpKernel {
 public:
  explicit SokBuildInfoOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}
  void Compute(OpKernelContext* ctx) override {
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &out));
    out->scalar<bool>()() = BuiltWithCuda();
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({}), &out));
    out->scalar<int64_t>()() = GpuHostSyncCounter().load();
    OP_REQUIRES_OK(ctx, ctx->allocate_output(2, TensorShape({}), &out));
    out->scalar<int64_t>()() = VariableCopyBytesCounter().load();
  }
};

REGISTER_KERNEL_BUILDER(Name("SokBuildInfo").Device(::tensorflow::DEVICE_CPU),
                        SokBuildInfoOp);

}  // namespace
}  // namespace sok
