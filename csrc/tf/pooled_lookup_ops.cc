// SokPooledLookup: a pooled lookup straight from a whole (unsharded) table,
// CPU and GPU kernels over core/pooled_lookup.h; SokPooledLookupGrad, its
// table gradient (core/lookup.h PooledLookupGrad).
#include <cstdint>
#include <string>
#include <type_traits>

#include "core/pooled_lookup.h"
#include "tf/cpu_parallel.h"
#include "tf/gpu_device.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/framework/tensor_shape.h"
#include "tensorflow/core/lib/core/errors.h"

namespace sok {
namespace {

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

// The row splits of a lookup: input 2 (row_splits) as given, or, for
// bag_width >= 1, `nnz / bag_width + 1` uniform splits made on the op's
// device (no shape goes through the host).
template <typename Device>
absl::Status RowSplits(OpKernelContext* ctx, int64_t bag_width, int64_t nnz,
                       const std::string& where, Tensor* splits) {
  if (bag_width < 1) {
    const Tensor& given = ctx->input(2);
    if (!TensorShapeUtils::IsVector(given.shape()) ||
        given.NumElements() < 1) {
      return errors::InvalidArgument(where, "row_splits must be a non-empty "
                                     "vector, got shape ",
                                     given.shape().DebugString(), ".");
    }
    *splits = given;
    return absl::OkStatus();
  }
  if (nnz % bag_width != 0) {
    return errors::InvalidArgument(where, "the ", nnz, " ids do not make "
                                   "bags of ", bag_width, " ids.");
  }
  const int64_t batch = nnz / bag_width;
  TF_RETURN_IF_ERROR(ctx->allocate_temp(::tensorflow::DT_INT64,
                                        TensorShape({batch + 1}), splits));
  Status s;
  if constexpr (std::is_same<Device, CpuDevice>::value) {
    CpuDevice d{CpuParallelFor(ctx)};
    s = lookup::UniformSplitsFunctor<CpuDevice>()(
        d, bag_width, batch, splits->flat<int64_t>().data());
  } else {
#ifdef SOK_WITH_CUDA
    GpuScratch scratch(ctx);
    GpuDevice d = MakeGpuDevice(ctx, &scratch);
    s = lookup::UniformSplitsFunctor<GpuDevice>()(
        d, bag_width, batch, splits->flat<int64_t>().data());
#else
    s = Status::Error("built without CUDA");
#endif
  }
  if (!s.ok()) return errors::Internal(where, s.message());
  return absl::OkStatus();
}

// What SokPooledLookup and SokPooledLookupGrad share: their attrs, the
// checks of their ids / row splits / weights inputs (1-3), and the errors
// their kernels report.
template <typename Device>
class PooledOpBase : public OpKernel {
 protected:
  explicit PooledOpBase(OpKernelConstruction* ctx) : OpKernel(ctx) {
    std::string combiner;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("combiner", &combiner));
    const Status s = lookup::ParseCombiner(combiner, &combiner_);
    OP_REQUIRES(ctx, s.ok(), errors::InvalidArgument(s.message()));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("table_name", &table_name_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("bag_width", &bag_width_));
  }

  std::string Where() const {
    return "sok_keras: table '" + table_name_ + "': ";
  }

  // Checks the ids (a vector) and the weights (empty or one per id), and
  // gives the row splits (`RowSplits`).
  absl::Status Bags(OpKernelContext* ctx, const std::string& where,
                    Tensor* splits) const {
    const Tensor& ids = ctx->input(1);
    const Tensor& weights = ctx->input(3);
    if (!TensorShapeUtils::IsVector(ids.shape())) {
      return errors::InvalidArgument(where, "ids must be a vector, got "
                                     "shape ", ids.shape().DebugString(),
                                     ".");
    }
    const int64_t nnz = ids.NumElements();
    TF_RETURN_IF_ERROR(RowSplits<Device>(ctx, bag_width_, nnz, where,
                                         splits));
    if (!TensorShapeUtils::IsVector(weights.shape()) ||
        (weights.NumElements() != 0 && weights.NumElements() != nnz)) {
      return errors::InvalidArgument(
          where, "weights must be empty or have one entry per id (", nnz,
          "), got shape ", weights.shape().DebugString(), ".");
    }
    return absl::OkStatus();
  }

  // The kernel's report on its inputs (a PooledGradError or a
  // PooledLookupError) as the op's error.
  template <typename Error>
  static absl::Status InputError(const std::string& where,
                                 const Error& error, int64_t nnz,
                                 int64_t rows) {
    if (error.bad_bag >= 0) {
      return errors::InvalidArgument(
          where, "row_splits are inconsistent at row ", error.bad_bag,
          " (they must rise from 0 to the number of ids, ", nnz, ").");
    }
    if (error.position >= 0) {
      return errors::InvalidArgument(
          where, "id ", error.value, " at position ", error.position,
          " is out of range [0, ", rows, ") (-1 is padding).");
    }
    return absl::OkStatus();
  }

  lookup::Combiner combiner_ = lookup::Combiner::kSum;
  std::string table_name_;
  int64_t bag_width_ = -1;
};

REGISTER_OP("SokPooledLookup")
    .Input("table: T")
    .Input("ids: Tid")
    .Input("row_splits: int64")
    .Input("weights: T")
    .Output("out: T")
    .Attr("T: {float, double}")
    .Attr("Tid: {int32, int64}")
    .Attr("combiner: {'sum', 'mean', 'sqrtn'} = 'sum'")
    .Attr("table_name: string = ''")
    .Attr("bag_width: int = -1")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle table, ids, splits, weights;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 2, &table));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 1, &ids));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(2), 1, &splits));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(3), 1, &weights));
      int64_t width = -1;
      TF_RETURN_IF_ERROR(c->GetAttr("bag_width", &width));
      DimensionHandle batch;
      if (width >= 1) {
        TF_RETURN_IF_ERROR(c->Divide(c->Dim(ids, 0), width,
                                     /*evenly_divisible=*/false, &batch));
      } else {
        TF_RETURN_IF_ERROR(c->Subtract(c->Dim(splits, 0), 1, &batch));
      }
      c->set_output(0, c->Matrix(batch, c->Dim(table, 1)));
      return absl::OkStatus();
    })
    .Doc(R"doc(
Pools rows of a whole table per bag, reading the table directly.

out[b] = combine(weights[i] * table[ids[i]] for i in
                 [row_splits[b], row_splits[b + 1]) with ids[i] != -1);
combiners as SokSegmentCombine (-1 is padding and counts for nothing).

table: [vocab_size, dim].
ids: [nnz] ids in [0, vocab_size), or -1 for padding.
row_splits: [batch + 1], non-decreasing, from 0 to nnz.
weights: [nnz], or [0] for all-one weights.
out: [batch, dim].
table_name: the table's name, for error messages.
bag_width: >= 1: every bag has bag_width ids (dense ids; nnz must be a
  multiple of it) and row_splits is ignored (pass [0]); the splits are made
  on the op's device. -1: the bags are given by row_splits.
)doc");

template <typename Device, typename T, typename Tid>
class SokPooledLookupOp : public PooledOpBase<Device> {
 public:
  explicit SokPooledLookupOp(OpKernelConstruction* ctx)
      : PooledOpBase<Device>(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    const Tensor& table = ctx->input(0);
    const Tensor& ids = ctx->input(1);
    const Tensor& weights = ctx->input(3);
    const std::string where = this->Where();
    OP_REQUIRES(ctx, TensorShapeUtils::IsMatrix(table.shape()),
                errors::InvalidArgument(where, "the table must be a matrix, "
                                        "got shape ",
                                        table.shape().DebugString(), "."));
    Tensor splits;
    OP_REQUIRES_OK(ctx, this->Bags(ctx, where, &splits));
    const int64_t nnz = ids.NumElements();
    const int64_t batch = splits.NumElements() - 1;
    const int64_t vocab = table.dim_size(0);
    const int64_t dim = table.dim_size(1);
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx,
                   ctx->allocate_output(0, TensorShape({batch, dim}), &out));
    lookup::PooledLookupError error;
    Status status = Run(ctx, table, vocab, dim, ids, nnz, splits, batch,
                        weights, out, &error);
    OP_REQUIRES(ctx, status.ok(), errors::Internal(where, status.message()));
    OP_REQUIRES_OK(ctx, this->InputError(where, error, nnz, vocab));
  }

 private:
  Status Run(OpKernelContext* ctx, const Tensor& table, int64_t vocab,
             int64_t dim, const Tensor& ids, int64_t nnz,
             const Tensor& splits, int64_t batch, const Tensor& weights,
             Tensor* out, lookup::PooledLookupError* error) {
    const T* w = weights.NumElements() == 0 ? nullptr
                                            : weights.flat<T>().data();
    if constexpr (std::is_same<Device, CpuDevice>::value) {
      CpuDevice d{CpuParallelFor(ctx)};
      return lookup::PooledLookupFunctor<CpuDevice, T, Tid>()(
          d, table.flat<T>().data(), vocab, dim, ids.flat<Tid>().data(), nnz,
          splits.flat<int64_t>().data(), batch, this->bag_width_, w,
          this->combiner_, out->flat<T>().data(), error);
    } else {
#ifdef SOK_WITH_CUDA
      GpuScratch scratch(ctx);
      GpuDevice d = MakeGpuDevice(ctx, &scratch);
      return lookup::PooledLookupFunctor<GpuDevice, T, Tid>()(
          d, table.flat<T>().data(), vocab, dim, ids.flat<Tid>().data(), nnz,
          splits.flat<int64_t>().data(), batch, this->bag_width_, w,
          this->combiner_, out->flat<T>().data(), error);
#else
      return Status::Error("built without CUDA");
#endif
    }
  }
};

REGISTER_OP("SokPooledLookupGrad")
    .Input("grad: T")
    .Input("ids: Tid")
    .Input("row_splits: int64")
    .Input("weights: T")
    .Output("rows_grad: T")
    .Output("rows: int64")
    .Attr("T: {float, double}")
    .Attr("Tid: {int32, int64}")
    .Attr("combiner: {'sum', 'mean', 'sqrtn'} = 'sum'")
    .Attr("num_rows: int >= 0")
    .Attr("table_name: string = ''")
    .Attr("bag_width: int = -1")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle grad, ids, splits, weights;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 2, &grad));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 1, &ids));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(2), 1, &splits));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(3), 1, &weights));
      const DimensionHandle unique = c->UnknownDim();
      c->set_output(0, c->Matrix(unique, c->Dim(grad, 1)));
      c->set_output(1, c->Vector(unique));
      return absl::OkStatus();
    })
    .Doc(R"doc(
The table gradient of SokPooledLookup, reduced per distinct row.

rows: the distinct ids of `ids` other than the padding -1, ascending (each
  in [0, num_rows); distinct, so a sparse optimizer need not deduplicate
  them again).
rows_grad[u] = sum over i with ids[i] == rows[u] of
               weights[i] / denominator(bag of i) * grad[bag of i],
  with the combiner's denominator of SokPooledLookup (1 for 'sum'),
  summed in the fixed order of SokSegmentCombineGrad: bit-identical to
  dropping the padding, SokDedupBucketize and SokSegmentCombineGrad.

grad: [batch, dim], the gradient of SokPooledLookup's output.
ids, row_splits, weights: the lookup's inputs (weights [0]: all ones).
num_rows: the table's rows; an id outside [0, num_rows) other than -1 fails
  the op (InvalidArgument, naming the table).
table_name: the table's name, for error messages.
bag_width: as SokPooledLookup's (>= 1: bags of bag_width ids, row_splits
  ignored).
On the GPU: one sort and one blocking device-to-host copy (U and the
errors); the host sync of the padding masks, the segment-id round trip, the
second (group-by-row) sort and the segment-index check of the unfused
chain are gone.
)doc");

template <typename Device, typename T, typename Tid>
class SokPooledLookupGradOp : public PooledOpBase<Device> {
 public:
  explicit SokPooledLookupGradOp(OpKernelConstruction* ctx)
      : PooledOpBase<Device>(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("num_rows", &num_rows_));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& grad = ctx->input(0);
    const Tensor& ids = ctx->input(1);
    const Tensor& weights = ctx->input(3);
    const std::string where = this->Where();
    OP_REQUIRES(ctx, TensorShapeUtils::IsMatrix(grad.shape()),
                errors::InvalidArgument(where, "the gradient must be a "
                                        "matrix, got shape ",
                                        grad.shape().DebugString(), "."));
    Tensor splits;
    OP_REQUIRES_OK(ctx, this->Bags(ctx, where, &splits));
    OP_REQUIRES(ctx,
                TensorShapeUtils::IsVector(splits.shape()) &&
                    splits.NumElements() == grad.dim_size(0) + 1,
                errors::InvalidArgument(
                    where, "row_splits must have one entry more than the "
                    "gradient has rows (", grad.dim_size(0) + 1, "), got "
                    "shape ", splits.shape().DebugString(), "."));
    const int64_t nnz = ids.NumElements();
    const int64_t batch = grad.dim_size(0);
    const int64_t dim = grad.dim_size(1);
    const T* w = weights.NumElements() == 0 ? nullptr
                                            : weights.flat<T>().data();
    lookup::PooledGradAllocate<T> allocate =
        [ctx, dim](int64_t num_unique, T** rows_grad,
                   int64_t** rows) -> Status {
      Tensor* g = nullptr;
      Tensor* r = nullptr;
      absl::Status s =
          ctx->allocate_output(0, TensorShape({num_unique, dim}), &g);
      if (!s.ok()) return Status::Error(std::string(s.message()));
      s = ctx->allocate_output(1, TensorShape({num_unique}), &r);
      if (!s.ok()) return Status::Error(std::string(s.message()));
      *rows_grad = g->flat<T>().data();
      *rows = r->flat<int64_t>().data();
      return Status::Ok();
    };
    lookup::PooledGradError error;
    Status status;
    if constexpr (std::is_same<Device, CpuDevice>::value) {
      status = lookup::PooledLookupGrad<T, Tid>(
          grad.flat<T>().data(), dim, ids.flat<Tid>().data(), nnz,
          splits.flat<int64_t>().data(), batch, w, num_rows_,
          this->combiner_, CpuParallelFor(ctx), allocate, &error);
    } else {
#ifdef SOK_WITH_CUDA
      GpuScratch scratch(ctx);
      GpuDevice d = MakeGpuDevice(ctx, &scratch);
      status = lookup::gpu::PooledLookupGrad<T, Tid>(
          d, grad.flat<T>().data(), dim, ids.flat<Tid>().data(), nnz,
          splits.flat<int64_t>().data(), batch, w, num_rows_,
          this->combiner_, allocate, &error);
#else
      status = Status::Error("built without CUDA");
#endif
    }
    OP_REQUIRES(ctx, status.ok(), errors::Internal(where, status.message()));
    OP_REQUIRES_OK(ctx, this->InputError(where, error, nnz, num_rows_));
  }

 private:
  int64_t num_rows_ = 0;
};

#define REGISTER_POOLED(DEVICE_TYPE, DEV, T, Tid)                   \
  REGISTER_KERNEL_BUILDER(Name("SokPooledLookup")                   \
                              .Device(DEVICE_TYPE)                  \
                              .TypeConstraint<T>("T")               \
                              .TypeConstraint<Tid>("Tid"),          \
                          SokPooledLookupOp<DEV, T, Tid>);  \
  REGISTER_KERNEL_BUILDER(Name("SokPooledLookupGrad")               \
                              .Device(DEVICE_TYPE)                  \
                              .TypeConstraint<T>("T")               \
                              .TypeConstraint<Tid>("Tid"),          \
                          SokPooledLookupGradOp<DEV, T, Tid>);
REGISTER_POOLED(::tensorflow::DEVICE_CPU, CpuDevice, float, int32_t)
REGISTER_POOLED(::tensorflow::DEVICE_CPU, CpuDevice, float, int64_t)
REGISTER_POOLED(::tensorflow::DEVICE_CPU, CpuDevice, double, int32_t)
REGISTER_POOLED(::tensorflow::DEVICE_CPU, CpuDevice, double, int64_t)
#ifdef SOK_WITH_CUDA
REGISTER_POOLED(::tensorflow::DEVICE_GPU, GpuDevice, float, int32_t)
REGISTER_POOLED(::tensorflow::DEVICE_GPU, GpuDevice, float, int64_t)
REGISTER_POOLED(::tensorflow::DEVICE_GPU, GpuDevice, double, int32_t)
REGISTER_POOLED(::tensorflow::DEVICE_GPU, GpuDevice, double, int64_t)
#endif
#undef REGISTER_POOLED

}  // namespace
}  // namespace sok
