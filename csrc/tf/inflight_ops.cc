// TensorFlow ops over core/inflight: markers around collectives.
//
//   y, token = SokInflightBegin(x, key=..., cleanup_on_cancel=...)
//   z = SokInflightEnd(y2, token)
//   keys, seconds = SokInflightSnapshot()
//
// Begin and End pass their first input through unchanged (no copy), so a
// data dependency x -> Begin -> collective -> End orders them in a graph.
// With cleanup_on_cancel (used inside tf.function), Begin also registers a
// callback on the step's cancellation manager that ends the entry when the
// step is cancelled or torn down, so that a step that fails between Begin
// and End leaves nothing behind for the watchdog.
#include "core/inflight.h"
#include "tensorflow/core/framework/cancellation.h"
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace tensorflow {
namespace {

REGISTER_OP("SokInflightBegin")
    .Input("x: T")
    .Output("y: T")
    .Output("token: int64")
    .Attr("T: type")
    .Attr("key: string")
    .Attr("cleanup_on_cancel: bool = false")
    .SetIsStateful()
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      c->set_output(0, c->input(0));
      c->set_output(1, c->Scalar());
      return OkStatus();
    })
    .Doc("Records `key` as in flight; passes `x` through.");

REGISTER_OP("SokInflightEnd")
    .Input("x: T")
    .Input("token: int64")
    .Output("y: T")
    .Attr("T: type")
    .SetIsStateful()
    .SetShapeFn(shape_inference::UnchangedShape)
    .Doc("Ends the in-flight entry `token`; passes `x` through.");

REGISTER_OP("SokInflightSnapshot")
    .Output("keys: string")
    .Output("seconds: float64")
    .SetIsStateful()
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      c->set_output(0, c->Vector(c->UnknownDim()));
      c->set_output(1, c->Vector(c->UnknownDim()));
      return OkStatus();
    })
    .Doc("The keys in flight and their ages in seconds, oldest first.");

class SokInflightBeginOp : public OpKernel {
 public:
  explicit SokInflightBeginOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("key", &key_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("cleanup_on_cancel", &cleanup_));
  }

  void Compute(OpKernelContext* ctx) override {
    const int64_t token = sok::inflight::Begin(key_);
    if (cleanup_ && ctx->cancellation_manager() != nullptr) {
      CancellationManager* cm = ctx->cancellation_manager();
      const CancellationToken ct = cm->get_cancellation_token();
      const bool registered =
          cm->RegisterCallback(ct, [token]() { sok::inflight::End(token); });
      if (!registered) {  // already cancelled: nothing will wait for us
        sok::inflight::End(token);
      }
    }
    ctx->set_output(0, ctx->input(0));
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({}), &out));
    out->scalar<int64_t>()() = token;
  }

 private:
  std::string key_;
  bool cleanup_ = false;
};

class SokInflightEndOp : public OpKernel {
 public:
  explicit SokInflightEndOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    const Tensor& token = ctx->input(1);
    OP_REQUIRES(ctx, TensorShapeUtils::IsScalar(token.shape()),
                errors::InvalidArgument("token must be a scalar, got shape ",
                                        token.shape().DebugString()));
    sok::inflight::End(token.scalar<int64_t>()());
    ctx->set_output(0, ctx->input(0));
  }
};

class SokInflightSnapshotOp : public OpKernel {
 public:
  explicit SokInflightSnapshotOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    const std::vector<sok::inflight::Entry> entries =
        sok::inflight::Snapshot();
    const int64_t n = static_cast<int64_t>(entries.size());
    Tensor* keys = nullptr;
    Tensor* seconds = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({n}), &keys));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({n}), &seconds));
    auto k = keys->vec<tstring>();
    auto s = seconds->vec<double>();
    for (int64_t i = 0; i < n; ++i) {
      k(i) = entries[i].key;
      s(i) = entries[i].seconds;
    }
  }
};

REGISTER_KERNEL_BUILDER(Name("SokInflightBegin").Device(DEVICE_CPU),
                        SokInflightBeginOp);
REGISTER_KERNEL_BUILDER(Name("SokInflightEnd").Device(DEVICE_CPU),
                        SokInflightEndOp);
REGISTER_KERNEL_BUILDER(Name("SokInflightSnapshot").Device(DEVICE_CPU),
                        SokInflightSnapshotOp);
// Pass-through markers need no device code: on a GPU the data stays on the
// device and only the token lives in host memory.
REGISTER_KERNEL_BUILDER(
    Name("SokInflightBegin").Device(DEVICE_GPU).HostMemory("token"),
    SokInflightBeginOp);
REGISTER_KERNEL_BUILDER(
    Name("SokInflightEnd").Device(DEVICE_GPU).HostMemory("token"),
    SokInflightEndOp);

}  // namespace
}  // namespace tensorflow
