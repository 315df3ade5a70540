// TensorFlow ops and CPU kernels of the ragged exchange's padding:
//
//   padded, exponent = SokBucketPad(x, counts_matrix, rank=r, site=...)
//   y = SokBucketUnpad(received, counts_matrix, exponent, rank=r, site=...)
//
// Pad moves rank r's rows (grouped by destination) into N blocks of
// bucket = 2^exponent rows (the next power of two >= max(counts_matrix)),
// Unpad takes the rows received from every rank out of such blocks. The
// kernels validate their inputs, then call core/bucket_pad.h. Both ops are
// pure (not stateful): they may be pruned, deduplicated or constant-folded
// and are not chained by automatic control dependencies.

#include <cstdint>
#include <functional>
#include <string>

#include "core/bucket_pad.h"
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

#define SOK_BUCKET_TYPES                                                    \
  "{bool, int8, uint8, int16, uint16, int32, uint32, int64, uint64, half, " \
  "bfloat16, float, double, complex64, complex128}"

// [unknown] + shape[1:] of a tensor of rank >= 1.
absl::Status RowsShape(InferenceContext* c, ShapeHandle in,
                       ShapeHandle* out) {
  ShapeHandle rest;
  TF_RETURN_IF_ERROR(c->Subshape(in, 1, &rest));
  return c->Concatenate(c->Vector(c->UnknownDim()), rest, out);
}

absl::Status BucketShape(InferenceContext* c) {
  ShapeHandle rows;
  ShapeHandle counts;
  TF_RETURN_IF_ERROR(c->WithRankAtLeast(c->input(0), 1, &rows));
  TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 2, &counts));
  DimensionHandle n;
  TF_RETURN_IF_ERROR(c->Merge(c->Dim(counts, 0), c->Dim(counts, 1), &n));
  ShapeHandle out;
  TF_RETURN_IF_ERROR(RowsShape(c, rows, &out));
  c->set_output(0, out);
  return absl::OkStatus();
}

REGISTER_OP("SokBucketPad")
    .Input("x: T")
    .Input("counts_matrix: int64")
    .Output("padded: T")
    .Output("exponent: int64")
    .Attr("T: " SOK_BUCKET_TYPES)
    .Attr("rank: int >= 0")
    .Attr("site: string = ''")
    .SetShapeFn([](InferenceContext* c) {
      TF_RETURN_IF_ERROR(BucketShape(c));
      c->set_output(1, c->Scalar());
      return absl::OkStatus();
    })
    .Doc(R"doc(
Pads the rows a rank sends in a ragged all-to-all to equal power-of-two blocks.

x: [S, ...], the rows this rank sends, grouped by destination rank in rank
  order; S must equal sum(counts_matrix[rank, :]).
counts_matrix: [N, N], counts_matrix[i, j] rows go from rank i to rank j;
  identical on every rank, entries >= 0.
padded: [N * bucket, ...]: block j (rows j * bucket + [0, bucket)) starts
  with the counts_matrix[rank, j] rows for rank j; the rest is zero.
exponent: bucket = 2^exponent, the next power of two >= max(counts_matrix)
  (>= 1); the same on every rank.
rank: this rank.
site: the exchange's name, for error messages.
)doc");

REGISTER_OP("SokBucketUnpad")
    .Input("received: T")
    .Input("counts_matrix: int64")
    .Input("exponent: int64")
    .Output("y: T")
    .Attr("T: " SOK_BUCKET_TYPES)
    .Attr("rank: int >= 0")
    .Attr("site: string = ''")
    .SetShapeFn([](InferenceContext* c) {
      TF_RETURN_IF_ERROR(BucketShape(c));
      ShapeHandle e;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(2), 0, &e));
      return absl::OkStatus();
    })
    .Doc(R"doc(
Takes the rows a rank received in a ragged all-to-all out of padded blocks.

received: [N * 2^exponent, ...]: block j holds counts_matrix[j, rank] rows
  from rank j, then padding.
counts_matrix: [N, N], as for SokBucketPad.
exponent: the exponent SokBucketPad returned for counts_matrix.
y: [sum(counts_matrix[:, rank]), ...], the received rows grouped by source
  rank in rank order.
rank: this rank.
site: the exchange's name, for error messages.
)doc");

// Shared validation of counts_matrix and the rows tensor.
class BucketOpBase : public OpKernel {
 public:
  explicit BucketOpBase(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("rank", &rank_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("site", &site_));
    const int size = DataTypeSize(ctx->input_type(0));
    OP_REQUIRES(ctx, size > 0,
                errors::InvalidArgument(Where(), "unsupported dtype ",
                                        DataTypeString(ctx->input_type(0))));
    elem_bytes_ = size;
  }

 protected:
  std::string Where() const {
    return "sok_keras: exchange '" + site_ + "' on rank " +
           std::to_string(rank_) + ": ";
  }

  // Validates rows (rank >= 1) and counts ([N, N], rank < N); sets
  // num_ranks_ / row_bytes_. Returns false (status set) on failure.
  bool Validate(OpKernelContext* ctx, const Tensor& rows,
                const Tensor& counts) {
    if (!TensorShapeUtils::IsMatrix(counts.shape()) ||
        counts.dim_size(0) != counts.dim_size(1)) {
      ctx->CtxFailure(errors::InvalidArgument(
          Where(), "counts_matrix must be a square [N, N] matrix, got shape ",
          counts.shape().DebugString()));
      return false;
    }
    num_ranks = counts.dim_size(0);
    if (rank_ >= num_ranks) {
      ctx->CtxFailure(errors::InvalidArgument(
          Where(), "rank ", rank_, " is out of range for a [", num_ranks, ", ",
          num_ranks, "] counts_matrix"));
      return false;
    }
    if (rows.dims() < 1) {
      ctx->CtxFailure(errors::InvalidArgument(
          Where(), "the rows tensor must have rank >= 1, got shape ",
          rows.shape().DebugString()));
      return false;
    }
    const absl::Status bytes = RowBytes(Where(), rows.shape(), elem_bytes_,
                                        &row_bytes);
    if (!bytes.ok()) ctx->CtxFailure(bytes);
    return bytes.ok();
  }

  bool Check(OpKernelContext* ctx, const bucket::Status& status) {
    if (status.ok()) return true;
    ctx->CtxFailure(errors::InvalidArgument(Where(), status.message()));
    return false;
  }

  // Allocates output `index`, [rows] + rows_like.shape[1:]; false (status
  // set) where that shape cannot be made or allocated.
  bool AllocateRows(OpKernelContext* ctx, int index, const Tensor& rows_like,
                    int64_t rows, Tensor** out) {
    TensorShape shape;
    absl::Status status =
        CheckedRowsShape(Where(), rows_like.shape(), rows, &shape);
    if (status.ok()) status = ctx->allocate_output(index, shape, out);
    if (!status.ok()) ctx->CtxFailure(status);
    return status.ok();
  }

  int64_t rank_ = 0;
  std::string site_;
  int64_t elem_bytes_ = 0;
  int64_t num_ranks = 0;
  int64_t row_bytes = 0;
};

class SokBucketPadOp : public BucketOpBase {
 public:
  using BucketOpBase::BucketOpBase;

  void Compute(OpKernelContext* ctx) override {
    const int64_t* c = nullptr;
    int64_t bucket = 0;
    Tensor* padded = nullptr;
    if (!Prepare(ctx, &c, &bucket, &padded)) return;
    const Tensor& x = ctx->input(0);
    bucket::BucketPad(static_cast<const char*>(x.data()), row_bytes, c,
                      num_ranks, rank_, bucket, CpuParallelFor(ctx),
                      static_cast<char*>(padded->data()));
  }

 protected:
  // Validates the inputs (CPU and GPU), allocates `padded` and writes the
  // exponent (host memory). Returns false (status set) on failure.
  bool Prepare(OpKernelContext* ctx, const int64_t** counts_data,
               int64_t* bucket_rows, Tensor** padded_out) {
    const Tensor& x = ctx->input(0);
    const Tensor& counts = ctx->input(1);
    if (!Validate(ctx, x, counts)) return false;
    const int64_t* c = counts.flat<int64_t>().data();
    int64_t exponent = 0;
    if (!Check(ctx, bucket::BucketExponent(c, num_ranks, &exponent))) {
      return false;
    }
    int64_t send = 0;
    if (!Check(ctx, bucket::CountSum(c, num_ranks, rank_, true, &send))) {
      return false;
    }
    const int64_t rows = x.dim_size(0);
    if (rows != send) {
      ctx->CtxFailure(errors::InvalidArgument(
          Where(), "the rows of x must equal sum(counts_matrix[rank, "
          ":]), but x has ", rows, " rows and sum(counts_matrix[",
          rank_, ", :]) = ", send, " (x shape ",
          x.shape().DebugString(), ")"));
      return false;
    }
    if (!Check(ctx, bucket::CheckPaddedSize(num_ranks, exponent, row_bytes)))
      return false;
    const int64_t bucket = int64_t{1} << exponent;
    Tensor* padded = nullptr;
    if (!AllocateRows(ctx, 0, x, num_ranks * bucket, &padded)) return false;
    Tensor* e = nullptr;
    const absl::Status status = ctx->allocate_output(1, TensorShape({}), &e);
    if (!status.ok()) {
      ctx->CtxFailure(status);
      return false;
    }
    e->scalar<int64_t>()() = exponent;
    *counts_data = c;
    *bucket_rows = bucket;
    *padded_out = padded;
    return true;
  }
};

#ifdef SOK_WITH_CUDA
// x and padded in device memory; counts_matrix and exponent in host memory.
class SokBucketPadGpuOp : public SokBucketPadOp {
 public:
  using SokBucketPadOp::SokBucketPadOp;

  void Compute(OpKernelContext* ctx) override {
    const int64_t* c = nullptr;
    int64_t bucket = 0;
    Tensor* padded = nullptr;
    if (!Prepare(ctx, &c, &bucket, &padded)) return;
    const Tensor& x = ctx->input(0);
    GpuScratch scratch(ctx);
    const GpuDevice d = MakeGpuDevice(ctx, &scratch);
    const Status status = bucket::gpu::BucketPad(
        d, static_cast<const char*>(x.data()), row_bytes, c, num_ranks, rank_,
        bucket, static_cast<char*>(padded->data()));
    OP_REQUIRES(ctx, status.ok(),
                errors::Internal(Where(), "SokBucketPad on GPU: ",
                                 status.message()));
  }
};
#endif  // SOK_WITH_CUDA

class SokBucketUnpadOp : public BucketOpBase {
 public:
  using BucketOpBase::BucketOpBase;

  void Compute(OpKernelContext* ctx) override {
    const int64_t* c = nullptr;
    int64_t bucket = 0;
    Tensor* y = nullptr;
    if (!Prepare(ctx, &c, &bucket, &y)) return;
    const Tensor& received = ctx->input(0);
    bucket::BucketUnpad(static_cast<const char*>(received.data()), row_bytes,
                        c, num_ranks, rank_, bucket, CpuParallelFor(ctx),
                        static_cast<char*>(y->data()));
  }

 protected:
  // Validates the inputs (CPU and GPU) and allocates `y`. Returns false
  // (status set) on failure.
  bool Prepare(OpKernelContext* ctx, const int64_t** counts_data,
               int64_t* bucket_rows, Tensor** y_out) {
    const Tensor& received = ctx->input(0);
    const Tensor& counts = ctx->input(1);
    const Tensor& exponent_t = ctx->input(2);
    if (!Validate(ctx, received, counts)) return false;
    if (!TensorShapeUtils::IsScalar(exponent_t.shape())) {
      ctx->CtxFailure(errors::InvalidArgument(
          Where(), "exponent must be a scalar, got shape ",
          exponent_t.shape().DebugString()));
      return false;
    }
    const int64_t exponent = exponent_t.scalar<int64_t>()();
    if (exponent < 0 || exponent > bucket::kMaxExponent) {
      ctx->CtxFailure(errors::InvalidArgument(Where(), "exponent ", exponent,
                                              " is out of range [0, ",
                                              bucket::kMaxExponent, "]"));
      return false;
    }
    if (!Check(ctx, bucket::CheckPaddedSize(num_ranks, exponent, row_bytes)))
      return false;
    const int64_t bucket = int64_t{1} << exponent;
    if (received.dim_size(0) != num_ranks * bucket) {
      ctx->CtxFailure(errors::InvalidArgument(
          Where(), "received has ", received.dim_size(0),
          " rows, expected num_ranks * 2^exponent = ", num_ranks, " * ",
          bucket));
      return false;
    }
    const int64_t* c = counts.flat<int64_t>().data();
    for (int64_t j = 0; j < num_ranks; ++j) {
      const int64_t n = c[j * num_ranks + rank_];
      if (n < 0 || n > bucket) {
        ctx->CtxFailure(errors::InvalidArgument(
            Where(), "counts_matrix[", j, ", ", rank_, "] = ", n,
            " is out of range [0, 2^exponent = ", bucket, "]"));
        return false;
      }
    }
    int64_t total = 0;
    if (!Check(ctx, bucket::CountSum(c, num_ranks, rank_, false, &total)))
      return false;
    Tensor* y = nullptr;
    if (!AllocateRows(ctx, 0, received, total, &y)) return false;
    *counts_data = c;
    *bucket_rows = bucket;
    *y_out = y;
    return true;
  }
};

#ifdef SOK_WITH_CUDA
// received and y in device memory; counts_matrix and exponent in host
// memory.
class SokBucketUnpadGpuOp : public SokBucketUnpadOp {
 public:
  using SokBucketUnpadOp::SokBucketUnpadOp;

  void Compute(OpKernelContext* ctx) override {
    const int64_t* c = nullptr;
    int64_t bucket = 0;
    Tensor* y = nullptr;
    if (!Prepare(ctx, &c, &bucket, &y)) return;
    const Tensor& received = ctx->input(0);
    GpuScratch scratch(ctx);
    const GpuDevice d = MakeGpuDevice(ctx, &scratch);
    const Status status = bucket::gpu::BucketUnpad(
        d, static_cast<const char*>(received.data()), row_bytes, c, num_ranks,
        rank_, bucket, static_cast<char*>(y->data()));
    OP_REQUIRES(ctx, status.ok(),
                errors::Internal(Where(), "SokBucketUnpad on GPU: ",
                                 status.message()));
  }
};
#endif  // SOK_WITH_CUDA

REGISTER_KERNEL_BUILDER(Name("SokBucketPad")
                            .Device(DEVICE_CPU)
                            .HostMemory("counts_matrix")
                            .HostMemory("exponent"),
                        SokBucketPadOp);
REGISTER_KERNEL_BUILDER(Name("SokBucketUnpad")
                            .Device(DEVICE_CPU)
                            .HostMemory("counts_matrix")
                            .HostMemory("exponent"),
                        SokBucketUnpadOp);

#ifdef SOK_WITH_CUDA
// Every dtype of SOK_BUCKET_TYPES (the copies work in bytes).
#define REGISTER_BUCKET_GPU(T)                                          \
  REGISTER_KERNEL_BUILDER(Name("SokBucketPad")                          \
                              .Device(DEVICE_GPU)                       \
                              .TypeConstraint<T>("T")                   \
                              .HostMemory("counts_matrix")              \
                              .HostMemory("exponent"),                  \
                          SokBucketPadGpuOp);                           \
  REGISTER_KERNEL_BUILDER(Name("SokBucketUnpad")                        \
                              .Device(DEVICE_GPU)                       \
                              .TypeConstraint<T>("T")                   \
                              .HostMemory("counts_matrix")              \
                              .HostMemory("exponent"),                  \
                          SokBucketUnpadGpuOp);
REGISTER_BUCKET_GPU(bool)
REGISTER_BUCKET_GPU(::tensorflow::int8)
REGISTER_BUCKET_GPU(::tensorflow::uint8)
REGISTER_BUCKET_GPU(::tensorflow::int16)
REGISTER_BUCKET_GPU(::tensorflow::uint16)
REGISTER_BUCKET_GPU(::tensorflow::int32)
REGISTER_BUCKET_GPU(::tensorflow::uint32)
REGISTER_BUCKET_GPU(::tensorflow::int64)
REGISTER_BUCKET_GPU(::tensorflow::uint64)
REGISTER_BUCKET_GPU(Eigen::half)
REGISTER_BUCKET_GPU(::tensorflow::bfloat16)
REGISTER_BUCKET_GPU(float)
REGISTER_BUCKET_GPU(double)
REGISTER_BUCKET_GPU(::tensorflow::complex64)
REGISTER_BUCKET_GPU(::tensorflow::complex128)
#undef REGISTER_BUCKET_GPU
#endif  // SOK_WITH_CUDA

}  // namespace
}  // namespace sok
