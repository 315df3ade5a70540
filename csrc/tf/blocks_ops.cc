// TensorFlow ops and kernels that move consecutive blocks of rows, the
// packing and unpacking of the fused exchange (sok_keras/lookup.py):
//
//   out = SokGatherBlocks(values, starts, lengths, site=...)
//       = concat(values[starts[i] : starts[i] + lengths[i]] for i)
//   out = SokScatterBlocks(grad, starts, lengths, num_rows, site=...)
//       (its gradient: the blocks of grad written back at `starts` into
//        zeros [num_rows, ...]; the blocks must be disjoint)
//
// starts, lengths and num_rows are host memory on both devices (they size
// the output); the kernels validate them, then call core/blocks.h. Both
// ops are pure (not stateful).

#include <cstdint>
#include <string>
#include <type_traits>

#include "core/blocks.h"
#include "tf/cpu_parallel.h"
#include "tf/shapes.h"
#include "tf/gpu_device.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/framework/tensor_shape.h"
#include "tensorflow/core/framework/types.h"
#include "tensorflow/core/lib/core/errors.h"

namespace sok {
namespace {

using ::tensorflow::DataTypeSize;
using ::tensorflow::DataTypeString;
using ::tensorflow::DEVICE_CPU;
#ifdef SOK_WITH_CUDA
using ::tensorflow::DEVICE_GPU;
#endif
using ::tensorflow::OpKernel;
using ::tensorflow::OpKernelConstruction;
using ::tensorflow::OpKernelContext;
using ::tensorflow::Tensor;
using ::tensorflow::TensorShape;
using ::tensorflow::TensorShapeUtils;
using ::tensorflow::shape_inference::DimensionHandle;
using ::tensorflow::shape_inference::InferenceContext;
using ::tensorflow::shape_inference::ShapeHandle;

namespace errors = ::tensorflow::errors;

#define SOK_BLOCK_TYPES                                                     \
  "{bool, int8, uint8, int16, uint16, int32, uint32, int64, uint64, half, " \
  "bfloat16, float, double, complex64, complex128}"

// [unknown] + values.shape[1:]; starts and lengths vectors of one length.
absl::Status BlocksShape(InferenceContext* c) {
  ShapeHandle values;
  ShapeHandle starts;
  ShapeHandle lengths;
  TF_RETURN_IF_ERROR(c->WithRankAtLeast(c->input(0), 1, &values));
  TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 1, &starts));
  TF_RETURN_IF_ERROR(c->WithRank(c->input(2), 1, &lengths));
  DimensionHandle m;
  TF_RETURN_IF_ERROR(c->Merge(c->Dim(starts, 0), c->Dim(lengths, 0), &m));
  ShapeHandle rest;
  TF_RETURN_IF_ERROR(c->Subshape(values, 1, &rest));
  ShapeHandle out;
  TF_RETURN_IF_ERROR(
      c->Concatenate(c->Vector(c->UnknownDim()), rest, &out));
  c->set_output(0, out);
  return absl::OkStatus();
}

REGISTER_OP("SokGatherBlocks")
    .Input("values: T")
    .Input("starts: int64")
    .Input("lengths: int64")
    .Output("out: T")
    .Attr("T: " SOK_BLOCK_TYPES)
    .Attr("site: string = ''")
    .SetShapeFn(BlocksShape)
    .Doc(R"doc(
Concatenates consecutive blocks of rows: out = concat(values[s:s + l]).

values: [n, ...], the rows.
starts: [m], the first row of each block (0 <= starts[i] <= n).
lengths: [m], the rows of each block (lengths[i] >= 0 and
  starts[i] + lengths[i] <= n). Blocks may overlap.
out: [sum(lengths), ...], block i at rows sum(lengths[:i]) + [0, lengths[i]).
site: a name for error messages.
)doc");

REGISTER_OP("SokScatterBlocks")
    .Input("grad: T")
    .Input("starts: int64")
    .Input("lengths: int64")
    .Input("num_rows: int64")
    .Output("out: T")
    .Attr("T: " SOK_BLOCK_TYPES)
    .Attr("site: string = ''")
    .SetShapeFn([](InferenceContext* c) {
      TF_RETURN_IF_ERROR(BlocksShape(c));
      ShapeHandle n;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(3), 0, &n));
      return absl::OkStatus();
    })
    .Doc(R"doc(
The gradient of SokGatherBlocks: writes blocks of rows back into zeros.

grad: [sum(lengths), ...], the blocks, concatenated.
starts: [m], where block i goes (as for SokGatherBlocks).
lengths: [m], the rows of each block; the blocks must be disjoint.
num_rows: the rows of out.
out: [num_rows, ...]: out[starts[i] + p] = grad[sum(lengths[:i]) + p] for
  p < lengths[i], every other row zero.
site: a name for error messages.
)doc");

// Shared validation: shapes, the blocks (core/blocks.h) and the row size.
class BlocksOpBase : public OpKernel {
 public:
  explicit BlocksOpBase(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("site", &site_));
    const int size = DataTypeSize(ctx->input_type(0));
    OP_REQUIRES(ctx, size > 0,
                errors::InvalidArgument(Where(), "unsupported dtype ",
                                        DataTypeString(ctx->input_type(0))));
    elem_bytes_ = size;
  }

 protected:
  std::string Where() const {
    return "sok_keras: " + type_string() + " '" + site_ + "': ";
  }

  // Validates rows (rank >= 1), starts and lengths (vectors of one length,
  // blocks inside [0, num_rows), disjoint if asked); sets num_blocks,
  // row_bytes and total. Returns false (status set) on failure.
  bool Validate(OpKernelContext* ctx, const Tensor& rows, int64_t num_rows,
                bool disjoint) {
    const Tensor& starts = ctx->input(1);
    const Tensor& lengths = ctx->input(2);
    if (rows.dims() < 1) {
      ctx->CtxFailure(errors::InvalidArgument(
          Where(), "the rows tensor must have rank >= 1, got shape ",
          rows.shape().DebugString()));
      return false;
    }
    if (!TensorShapeUtils::IsVector(starts.shape()) ||
        !TensorShapeUtils::IsVector(lengths.shape()) ||
        starts.dim_size(0) != lengths.dim_size(0)) {
      ctx->CtxFailure(errors::InvalidArgument(
          Where(), "starts and lengths must be vectors of one length, got "
          "shapes ", starts.shape().DebugString(), " and ",
          lengths.shape().DebugString()));
      return false;
    }
    num_blocks = starts.dim_size(0);
    starts_data = starts.flat<int64_t>().data();
    lengths_data = lengths.flat<int64_t>().data();
    const Status status = blocks::CheckBlocks(
        starts_data, lengths_data, num_blocks, num_rows, disjoint, &total);
    if (!status.ok()) {
      ctx->CtxFailure(errors::InvalidArgument(Where(), status.message()));
      return false;
    }
    const absl::Status bytes = RowBytes(Where(), rows.shape(), elem_bytes_,
                                        &row_bytes);
    if (!bytes.ok()) ctx->CtxFailure(bytes);
    return bytes.ok();
  }

  std::string site_;
  int64_t elem_bytes_ = 0;
  int64_t num_blocks = 0;
  const int64_t* starts_data = nullptr;
  const int64_t* lengths_data = nullptr;
  int64_t total = 0;
  int64_t row_bytes = 0;
};

template <typename Device>
class SokGatherBlocksOp : public BlocksOpBase {
 public:
  using BlocksOpBase::BlocksOpBase;

  void Compute(OpKernelContext* ctx) override {
    const Tensor& values = ctx->input(0);
    if (!Validate(ctx, values, values.dims() >= 1 ? values.dim_size(0) : 0,
                  /*disjoint=*/false)) {
      return;
    }
    TensorShape shape;
    OP_REQUIRES_OK(ctx, CheckedRowsShape(Where(), values.shape(), total,
                                         &shape));
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, shape, &out));
    const char* src = static_cast<const char*>(values.data());
    char* dst = static_cast<char*>(out->data());
    Status status;
    if constexpr (std::is_same<Device, CpuDevice>::value) {
      CpuDevice d{CpuParallelFor(ctx)};
      status = blocks::GatherBlocksFunctor<CpuDevice>()(
          d, src, row_bytes, starts_data, lengths_data, num_blocks, dst);
    } else {
#ifdef SOK_WITH_CUDA
      GpuScratch scratch(ctx);
      const GpuDevice d = MakeGpuDevice(ctx, &scratch);
      status = blocks::GatherBlocksFunctor<GpuDevice>()(
          d, src, row_bytes, starts_data, lengths_data, num_blocks, dst);
#endif
    }
    OP_REQUIRES(ctx, status.ok(),
                errors::Internal(Where(), status.message()));
  }
};

template <typename Device>
class SokScatterBlocksOp : public BlocksOpBase {
 public:
  using BlocksOpBase::BlocksOpBase;

  void Compute(OpKernelContext* ctx) override {
    const Tensor& grad = ctx->input(0);
    const Tensor& num_rows_t = ctx->input(3);
    OP_REQUIRES(ctx, TensorShapeUtils::IsScalar(num_rows_t.shape()),
                errors::InvalidArgument(
                    Where(), "num_rows must be a scalar, got shape ",
                    num_rows_t.shape().DebugString()));
    const int64_t num_rows = num_rows_t.scalar<int64_t>()();
    OP_REQUIRES(ctx, num_rows >= 0,
                errors::InvalidArgument(Where(), "num_rows must be >= 0, got ",
                                        num_rows));
    if (!Validate(ctx, grad, num_rows, /*disjoint=*/true)) return;
    OP_REQUIRES(ctx, grad.dim_size(0) == total,
                errors::InvalidArgument(
                    Where(), "grad must have sum(lengths) = ", total,
                    " rows, got shape ", grad.shape().DebugString()));
    TensorShape shape;
    OP_REQUIRES_OK(ctx, CheckedRowsShape(Where(), grad.shape(), num_rows,
                                         &shape));
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, shape, &out));
    const char* src = static_cast<const char*>(grad.data());
    char* dst = static_cast<char*>(out->data());
    Status status;
    if constexpr (std::is_same<Device, CpuDevice>::value) {
      CpuDevice d{CpuParallelFor(ctx)};
      status = blocks::ScatterBlocksFunctor<CpuDevice>()(
          d, src, row_bytes, starts_data, lengths_data, num_blocks, num_rows,
          dst);
    } else {
#ifdef SOK_WITH_CUDA
      GpuScratch scratch(ctx);
      const GpuDevice d = MakeGpuDevice(ctx, &scratch);
      status = blocks::ScatterBlocksFunctor<GpuDevice>()(
          d, src, row_bytes, starts_data, lengths_data, num_blocks, num_rows,
          dst);
#endif
    }
    OP_REQUIRES(ctx, status.ok(),
                errors::Internal(Where(), status.message()));
  }
};

REGISTER_KERNEL_BUILDER(Name("SokGatherBlocks")
                            .Device(DEVICE_CPU)
                            .HostMemory("starts")
                            .HostMemory("lengths"),
                        SokGatherBlocksOp<CpuDevice>);
REGISTER_KERNEL_BUILDER(Name("SokScatterBlocks")
                            .Device(DEVICE_CPU)
                            .HostMemory("starts")
                            .HostMemory("lengths")
                            .HostMemory("num_rows"),
                        SokScatterBlocksOp<CpuDevice>);

#ifdef SOK_WITH_CUDA
// Every dtype of SOK_BLOCK_TYPES (the copies work in bytes); values, grad
// and out in device memory, the block bookkeeping in host memory.
#define REGISTER_BLOCKS_GPU(T)                                          \
  REGISTER_KERNEL_BUILDER(Name("SokGatherBlocks")                       \
                              .Device(DEVICE_GPU)                       \
                              .TypeConstraint<T>("T")                   \
                              .HostMemory("starts")                     \
                              .HostMemory("lengths"),                   \
                          SokGatherBlocksOp<GpuDevice>);                \
  REGISTER_KERNEL_BUILDER(Name("SokScatterBlocks")                      \
                              .Device(DEVICE_GPU)                       \
                              .TypeConstraint<T>("T")                   \
                              .HostMemory("starts")                     \
                              .HostMemory("lengths")                    \
                              .HostMemory("num_rows"),                  \
                          SokScatterBlocksOp<GpuDevice>);
REGISTER_BLOCKS_GPU(bool)
REGISTER_BLOCKS_GPU(::tensorflow::int8)
REGISTER_BLOCKS_GPU(::tensorflow::uint8)
REGISTER_BLOCKS_GPU(::tensorflow::int16)
REGISTER_BLOCKS_GPU(::tensorflow::uint16)
REGISTER_BLOCKS_GPU(::tensorflow::int32)
REGISTER_BLOCKS_GPU(::tensorflow::uint32)
REGISTER_BLOCKS_GPU(::tensorflow::int64)
REGISTER_BLOCKS_GPU(::tensorflow::uint64)
REGISTER_BLOCKS_GPU(Eigen::half)
REGISTER_BLOCKS_GPU(::tensorflow::bfloat16)
REGISTER_BLOCKS_GPU(float)
REGISTER_BLOCKS_GPU(double)
REGISTER_BLOCKS_GPU(::tensorflow::complex64)
REGISTER_BLOCKS_GPU(::tensorflow::complex128)
#undef REGISTER_BLOCKS_GPU
#endif  // SOK_WITH_CUDA

}  // namespace
}  // namespace sok
