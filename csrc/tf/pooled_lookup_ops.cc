// SokPooledLookup: a pooled lookup straight from a whole (unsharded) table,
// CPU and GPU kernels over core/pooled_lookup.h; its table gradient
// (core/lookup.h PooledGradPlan and PooledGradCombine) as two ops,
// SokPooledGradPlan and SokPooledGradCombine, and as one,
// SokPooledLookupGrad.
#include <cstdint>
#include <functional>
#include <string>
#include <type_traits>

#include "core/pooled_lookup.h"
#include "tf/cpu_parallel.h"
#include "tf/gpu_device.h"
#include "tf/shapes.h"
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

// fn(device) on the op's device: a CpuDevice over the op's thread pool, or
// a GpuDevice over its stream with scratch from TensorFlow's allocator
// (alive until fn returns).
template <typename Device, typename Fn>
Status OnOpDevice(OpKernelContext* ctx, Fn&& fn) {
  if constexpr (std::is_same<Device, CpuDevice>::value) {
    return fn(CpuDevice{CpuParallelFor(ctx)});
  } else {
#ifdef SOK_WITH_CUDA
    GpuScratch scratch(ctx);
    return fn(MakeGpuDevice(ctx, &scratch));
#else
    return Status::Error("built without CUDA");
#endif
  }
}

// The row splits of a lookup: input `input` (row_splits) as given, or, for
// bag_width >= 1, `nnz / bag_width + 1` uniform splits made on the op's
// device (no shape goes through the host).
template <typename Device>
absl::Status RowSplits(OpKernelContext* ctx, int input, int64_t bag_width,
                       int64_t nnz, const std::string& where,
                       Tensor* splits) {
  if (bag_width < 1) {
    const Tensor& given = ctx->input(input);
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
  int64_t* out = splits->flat<int64_t>().data();
  const Status s = OnOpDevice<Device>(ctx, [&](const Device& d) {
    return lookup::UniformSplitsFunctor<Device>()(d, bag_width, batch, out);
  });
  if (!s.ok()) return errors::Internal(where, s.message());
  return absl::OkStatus();
}

// What the pooled ops share: their attrs, the checks of their ids / row
// splits / weights inputs (`ids_input` and the two after it), and the
// errors their kernels report.
template <typename Device>
class PooledOpBase : public OpKernel {
 protected:
  PooledOpBase(OpKernelConstruction* ctx, int ids_input)
      : OpKernel(ctx), ids_input_(ids_input) {
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
    const Tensor& ids = ctx->input(ids_input_);
    const Tensor& weights = ctx->input(ids_input_ + 2);
    if (!TensorShapeUtils::IsVector(ids.shape())) {
      return errors::InvalidArgument(where, "ids must be a vector, got "
                                     "shape ", ids.shape().DebugString(),
                                     ".");
    }
    const int64_t nnz = ids.NumElements();
    TF_RETURN_IF_ERROR(RowSplits<Device>(ctx, ids_input_ + 1, bag_width_,
                                         nnz, where, splits));
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
          where, "id ", lookup::IdText(error.value), " at position ",
          error.position,
          " is out of range [0, ", rows, ") (-1 is padding).");
    }
    return absl::OkStatus();
  }

  const int ids_input_;
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
    .Attr("check_ids: bool = true")
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
check_ids: false only when a SokPooledGradPlan of the same ids, splits and
  table rows runs first (a control input: a training step's plan validates
  them): the GPU kernel then skips its error copy, the op's one host sync.
  The CPU kernel checks either way (it costs no sync there).
)doc");

template <typename Device, typename T, typename Tid>
class SokPooledLookupOp : public PooledOpBase<Device> {
 public:
  explicit SokPooledLookupOp(OpKernelConstruction* ctx)
      : PooledOpBase<Device>(ctx, /*ids_input=*/1) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("check_ids", &check_ids_));
  }

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
    TensorShape shape;
    OP_REQUIRES_OK(ctx, CheckedShape(where, {batch, dim}, &shape));
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, shape, &out));
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
    // The CPU checks the ids either way (it costs no sync there).
    constexpr bool kCpu = std::is_same<Device, CpuDevice>::value;
    lookup::PooledLookupError* report =
        kCpu || check_ids_ ? error : nullptr;
    return OnOpDevice<Device>(ctx, [&](const Device& d) {
      return lookup::PooledLookupFunctor<Device, T, Tid>()(
          d, table.flat<T>().data(), vocab, dim, ids.flat<Tid>().data(), nnz,
          splits.flat<int64_t>().data(), batch, this->bag_width_, w,
          this->combiner_, out->flat<T>().data(), report);
    });
  }

  bool check_ids_ = true;
};

REGISTER_OP("SokPooledGradPlan")
    .Input("ids: Tid")
    .Input("row_splits: int64")
    .Input("weights: T")
    .Output("rows: int64")
    .Output("offsets: int32")
    .Output("segments: int64")
    .Output("sorted_weights: T")
    .Output("denominator: T")
    .Attr("T: {float, double}")
    .Attr("Tid: {int32, int64}")
    .Attr("combiner: {'sum', 'mean', 'sqrtn'} = 'sum'")
    .Attr("num_rows: int >= 0")
    .Attr("table_name: string = ''")
    .Attr("bag_width: int = -1")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle ids, splits, weights;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 1, &ids));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 1, &splits));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(2), 1, &weights));
      c->set_output(0, c->Vector(c->UnknownDim()));
      c->set_output(1, c->Vector(c->UnknownDim()));
      c->set_output(2, c->Vector(c->UnknownDim()));
      c->set_output(3, c->Vector(c->UnknownDim()));
      c->set_output(4, c->Vector(c->UnknownDim()));
      return absl::OkStatus();
    })
    .Doc(R"doc(
The first half of SokPooledLookup's table gradient: what depends on the ids
alone (core/lookup.h PooledGradPlan), so that a training step can make it
beside the forward. SokPooledGradCombine sums the gradient over it.

rows: [U] the distinct ids of `ids` other than the padding -1, ascending
  (each in [0, num_rows); distinct, so a sparse optimizer need not
  deduplicate them again).
offsets: [U + 1]; the terms of rows[u] are k in [offsets[u], offsets[u+1]).
segments: [kept] the bag of each term (the kept positions grouped by row,
  ascending within a row).
sorted_weights: [kept] their weights, or [0] without weights.
denominator: [batch] each bag's combiner denominator, or [0] for 'sum'.
ids, row_splits, weights: the lookup's inputs (weights [0]: all ones).
num_rows: the table's rows; an id outside [0, num_rows) other than -1 fails
  the op (InvalidArgument, naming the table).
bag_width: as SokPooledLookup's (>= 1: bags of bag_width ids, row_splits
  ignored).
On the GPU: one sort and one blocking device-to-host copy (U, the kept
count and the errors).
)doc");

REGISTER_OP("SokPooledGradCombine")
    .Input("grad: T")
    .Input("offsets: int32")
    .Input("segments: int64")
    .Input("sorted_weights: T")
    .Input("denominator: T")
    .Output("rows_grad: T")
    .Attr("T: {float, double}")
    .Attr("table_name: string = ''")
    .Attr("check_plan: bool = true")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle grad, offsets, segments, weights, denominator;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 2, &grad));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 1, &offsets));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(2), 1, &segments));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(3), 1, &weights));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(4), 1, &denominator));
      DimensionHandle unique;
      TF_RETURN_IF_ERROR(c->Subtract(c->Dim(offsets, 0), 1, &unique));
      c->set_output(0, c->Matrix(unique, c->Dim(grad, 1)));
      return absl::OkStatus();
    })
    .Doc(R"doc(
The second half of SokPooledLookup's table gradient: its sums over a plan
of SokPooledGradPlan (whose outputs offsets, segments, sorted_weights and
denominator it takes, unchanged).

rows_grad[u] = sum over the terms k of row u of
               sorted_weights[k] / denominator[segments[k]] *
               grad[segments[k]],
  summed in the fixed order of SokSegmentCombineGrad: with the plan's rows,
  bit-identical to dropping the padding, SokDedupBucketize and
  SokSegmentCombineGrad.
grad: [batch, dim], the gradient of SokPooledLookup's output.
check_plan: on the CPU, check that offsets rise from 0 to the number of
  segments and that every segment is a row of grad (a plan given by hand);
  SokPooledGradPlan's own outputs need no check (sok_keras passes false).
No host sync on the GPU.
)doc");

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
The table gradient of SokPooledLookup, reduced per distinct row, in one op:
SokPooledGradPlan and SokPooledGradCombine in turn (the same results).

rows: the distinct ids of `ids` other than the padding -1, ascending.
rows_grad[u] = sum over i with ids[i] == rows[u] of
               weights[i] / denominator(bag of i) * grad[bag of i],
  with the combiner's denominator of SokPooledLookup (1 for 'sum'),
  summed in the fixed order of SokSegmentCombineGrad.
grad: [batch, dim], the gradient of SokPooledLookup's output.
ids, row_splits, weights, num_rows, table_name, bag_width: as
  SokPooledGradPlan's.
)doc");

// The plan of a pooled gradient (core/lookup.h PooledGradPlan), into
// buffers `allocate` gives; `where` prefixes its errors.
template <typename Device, typename T, typename Tid>
absl::Status RunPlan(OpKernelContext* ctx, const Tensor& ids,
                     const Tensor& splits, const Tensor& weights,
                     int64_t bag_width, int64_t num_rows,
                     lookup::Combiner combiner, const std::string& where,
                     const lookup::PooledGradPlanAllocate<T>& allocate,
                     lookup::PooledGradError* error) {
  const int64_t nnz = ids.NumElements();
  const int64_t batch = splits.NumElements() - 1;
  const T* w = weights.NumElements() == 0 ? nullptr
                                          : weights.flat<T>().data();
  const Tid* id = ids.flat<Tid>().data();
  const int64_t* split = splits.flat<int64_t>().data();
  const Status status = OnOpDevice<Device>(ctx, [&](const Device& d) {
    if constexpr (std::is_same<Device, CpuDevice>::value) {
      return lookup::PooledGradPlan<T, Tid>(id, nnz, split, batch, bag_width,
                                            w, num_rows, combiner,
                                            d.parallel_for, allocate, error);
    } else {
#ifdef SOK_WITH_CUDA
      return lookup::gpu::PooledGradPlan<T, Tid>(d, id, nnz, split, batch,
                                                 bag_width, w, num_rows,
                                                 combiner, allocate, error);
#endif
    }
  });
  if (!status.ok()) return errors::Internal(where, status.message());
  return absl::OkStatus();
}

// The plan's allocator: rows, offsets, segments, sorted weights and
// denominators from `make(index, shape, &tensor)` (an output or a temp).
template <typename T>
lookup::PooledGradPlanAllocate<T> PlanAllocator(
    std::function<absl::Status(int, const TensorShape&, Tensor**)> make,
    bool weighted, bool divided, int64_t batch) {
  return [make, weighted, divided, batch](
             int64_t num_unique, int64_t kept,
             lookup::PooledGradPlanBuffers<T>* out) -> Status {
    Tensor* t[5] = {nullptr, nullptr, nullptr, nullptr, nullptr};
    const TensorShape shapes[5] = {
        TensorShape({num_unique}), TensorShape({num_unique + 1}),
        TensorShape({kept}), TensorShape({weighted ? kept : 0}),
        TensorShape({divided ? batch : 0})};
    for (int i = 0; i < 5; ++i) {
      const absl::Status s = make(i, shapes[i], &t[i]);
      if (!s.ok()) return Status::Error(std::string(s.message()));
    }
    out->rows = t[0]->flat<int64_t>().data();
    out->offsets = t[1]->flat<int32_t>().data();
    out->segments = t[2]->flat<int64_t>().data();
    out->sorted_weights = weighted ? t[3]->flat<T>().data() : nullptr;
    out->denominator = divided ? t[4]->flat<T>().data() : nullptr;
    return Status::Ok();
  };
}

// Checks a plan given to SokPooledGradCombine on the CPU (host memory):
// offsets rise from 0 to the number of segments, and every segment is a
// row of the gradient's `batch`.
absl::Status CheckGradPlan(const std::string& where, const Tensor& offsets,
                           const Tensor& segments, int64_t batch) {
  const auto offset = offsets.flat<int32_t>();
  const auto segment = segments.flat<int64_t>();
  const int64_t n = offset.size();
  if (offset(0) != 0 || offset(n - 1) != segment.size()) {
    return errors::InvalidArgument(
        where, "offsets must rise from 0 to the number of segments (",
        segment.size(), "); got ", offset(0), " .. ", offset(n - 1),
        " (not SokPooledGradPlan's plan).");
  }
  for (int64_t i = 1; i < n; ++i) {
    if (offset(i) < offset(i - 1)) {
      return errors::InvalidArgument(
          where, "offsets must not decrease; offsets[", i, "] = ", offset(i),
          " < offsets[", i - 1, "] = ", offset(i - 1),
          " (not SokPooledGradPlan's plan).");
    }
  }
  for (int64_t k = 0; k < segment.size(); ++k) {
    if (segment(k) < 0 || segment(k) >= batch) {
      return errors::InvalidArgument(
          where, "segments[", k, "] = ", segment(k), " is not a row of the ",
          batch, "-row gradient (not SokPooledGradPlan's plan).");
    }
  }
  return absl::OkStatus();
}

// rows_grad = the combine of `grad` over a plan's tensors.
template <typename Device, typename T>
absl::Status RunCombine(OpKernelContext* ctx, const Tensor& grad,
                        const Tensor& offsets, const Tensor& segments,
                        const Tensor& sorted_weights,
                        const Tensor& denominator, const std::string& where,
                        Tensor* rows_grad) {
  const int64_t batch = grad.dim_size(0);
  const int64_t dim = grad.dim_size(1);
  const int64_t num_unique = offsets.NumElements() - 1;
  const int64_t kept = segments.NumElements();
  const T* w = sorted_weights.NumElements() == 0
                   ? nullptr
                   : sorted_weights.flat<T>().data();
  const T* den = denominator.NumElements() == 0
                     ? nullptr
                     : denominator.flat<T>().data();
  const T* g = grad.flat<T>().data();
  const int32_t* offset = offsets.flat<int32_t>().data();
  const int64_t* segment = segments.flat<int64_t>().data();
  T* result = rows_grad->flat<T>().data();
  const Status s = OnOpDevice<Device>(ctx, [&](const Device& d) {
    if constexpr (std::is_same<Device, CpuDevice>::value) {
      lookup::PooledGradCombine<T>(g, dim, batch, offset, num_unique, segment,
                                   kept, w, den, d.parallel_for, result);
      return Status::Ok();
    } else {
#ifdef SOK_WITH_CUDA
      return lookup::gpu::PooledGradCombine<T>(d, g, dim, batch, offset,
                                               num_unique, segment, kept, w,
                                               den, result);
#endif
    }
  });
  if (!s.ok()) return errors::Internal(where, s.message());
  return absl::OkStatus();
}

template <typename Device, typename T, typename Tid>
class SokPooledGradPlanOp : public PooledOpBase<Device> {
 public:
  explicit SokPooledGradPlanOp(OpKernelConstruction* ctx)
      : PooledOpBase<Device>(ctx, /*ids_input=*/0) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("num_rows", &num_rows_));
  }

  void Compute(OpKernelContext* ctx) override {
    const std::string where = this->Where();
    Tensor splits;
    OP_REQUIRES_OK(ctx, this->Bags(ctx, where, &splits));
    const Tensor& ids = ctx->input(0);
    const Tensor& weights = ctx->input(2);
    auto make = [ctx](int i, const TensorShape& shape, Tensor** t) {
      return ctx->allocate_output(i, shape, t);
    };
    lookup::PooledGradError error;
    OP_REQUIRES_OK(
        ctx, (RunPlan<Device, T, Tid>(
                 ctx, ids, splits, weights, this->bag_width_, num_rows_,
                 this->combiner_, where,
                 PlanAllocator<T>(make, weights.NumElements() != 0,
                                  this->combiner_ != lookup::Combiner::kSum,
                                  splits.NumElements() - 1),
                 &error)));
    OP_REQUIRES_OK(ctx, this->InputError(where, error, ids.NumElements(),
                                         num_rows_));
  }

 private:
  int64_t num_rows_ = 0;
};

template <typename Device, typename T>
class SokPooledGradCombineOp : public OpKernel {
 public:
  explicit SokPooledGradCombineOp(OpKernelConstruction* ctx)
      : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("table_name", &table_name_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("check_plan", &check_plan_));
  }

  void Compute(OpKernelContext* ctx) override {
    const std::string where = "sok_keras: table '" + table_name_ + "': ";
    const Tensor& grad = ctx->input(0);
    const Tensor& offsets = ctx->input(1);
    const Tensor& segments = ctx->input(2);
    const Tensor& weights = ctx->input(3);
    const Tensor& denominator = ctx->input(4);
    OP_REQUIRES(ctx, TensorShapeUtils::IsMatrix(grad.shape()),
                errors::InvalidArgument(where, "the gradient must be a "
                                        "matrix, got shape ",
                                        grad.shape().DebugString(), "."));
    OP_REQUIRES(ctx,
                TensorShapeUtils::IsVector(offsets.shape()) &&
                    offsets.NumElements() >= 1 &&
                    TensorShapeUtils::IsVector(segments.shape()) &&
                    TensorShapeUtils::IsVector(weights.shape()) &&
                    (weights.NumElements() == 0 ||
                     weights.NumElements() == segments.NumElements()) &&
                    TensorShapeUtils::IsVector(denominator.shape()) &&
                    (denominator.NumElements() == 0 ||
                     denominator.NumElements() == grad.dim_size(0)),
                errors::InvalidArgument(
                    where, "offsets, segments, sorted_weights and "
                    "denominator must be SokPooledGradPlan's outputs for "
                    "this gradient's ", grad.dim_size(0), " bags; got "
                    "shapes ", offsets.shape().DebugString(), ", ",
                    segments.shape().DebugString(), ", ",
                    weights.shape().DebugString(), ", ",
                    denominator.shape().DebugString(), "."));
    if constexpr (std::is_same<Device, CpuDevice>::value) {
      // The kernel reads grad[segments[k]] for k in [offsets[0],
      // offsets[-1]): a plan that is not SokPooledGradPlan's read outside
      // them (QA: a segfault). On the GPU they are device memory, and only
      // the plan's own outputs are given (sok_keras/lookup.py, which skips
      // the check: a serial pass, ~5% of a one-rank CPU step).
      if (check_plan_) {
        OP_REQUIRES_OK(ctx, CheckGradPlan(where, offsets, segments,
                                          grad.dim_size(0)));
      }
    }
    TensorShape shape;
    OP_REQUIRES_OK(ctx, CheckedShape(where, {offsets.NumElements() - 1,
                                             grad.dim_size(1)}, &shape));
    Tensor* rows_grad = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, shape, &rows_grad));
    OP_REQUIRES_OK(ctx, (RunCombine<Device, T>(ctx, grad, offsets, segments,
                                               weights, denominator, where,
                                               rows_grad)));
  }

 private:
  std::string table_name_;
  bool check_plan_ = true;
};

template <typename Device, typename T, typename Tid>
class SokPooledLookupGradOp : public PooledOpBase<Device> {
 public:
  explicit SokPooledLookupGradOp(OpKernelConstruction* ctx)
      : PooledOpBase<Device>(ctx, /*ids_input=*/1) {
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
    // The plan in temps (its rows straight into output 1), then the sums.
    Tensor plan[5];
    auto make = [ctx, &plan](int i, const TensorShape& shape, Tensor** t) {
      if (i == 0) return ctx->allocate_output(1, shape, t);
      *t = &plan[i];
      return ctx->allocate_temp(i == 1   ? ::tensorflow::DT_INT32
                                : i == 2 ? ::tensorflow::DT_INT64
                                         : ::tensorflow::DataTypeToEnum<T>::v(),
                                shape, &plan[i]);
    };
    lookup::PooledGradError error;
    OP_REQUIRES_OK(
        ctx, (RunPlan<Device, T, Tid>(
                 ctx, ids, splits, weights, this->bag_width_, num_rows_,
                 this->combiner_, where,
                 PlanAllocator<T>(make, weights.NumElements() != 0,
                                  this->combiner_ != lookup::Combiner::kSum,
                                  grad.dim_size(0)),
                 &error)));
    OP_REQUIRES_OK(ctx, this->InputError(where, error, ids.NumElements(),
                                         num_rows_));
    TensorShape shape;
    OP_REQUIRES_OK(ctx, CheckedShape(where, {plan[1].NumElements() - 1,
                                             grad.dim_size(1)}, &shape));
    Tensor* rows_grad = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, shape, &rows_grad));
    OP_REQUIRES_OK(ctx, (RunCombine<Device, T>(ctx, grad, plan[1], plan[2],
                                               plan[3], plan[4], where,
                                               rows_grad)));
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
                          SokPooledLookupGradOp<DEV, T, Tid>);      \
  REGISTER_KERNEL_BUILDER(Name("SokPooledGradPlan")                 \
                              .Device(DEVICE_TYPE)                  \
                              .TypeConstraint<T>("T")               \
                              .TypeConstraint<Tid>("Tid"),          \
                          SokPooledGradPlanOp<DEV, T, Tid>);
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

#define REGISTER_COMBINE(DEVICE_TYPE, DEV, T)                                  \
  REGISTER_KERNEL_BUILDER(                                                     \
      Name("SokPooledGradCombine").Device(DEVICE_TYPE).TypeConstraint<T>("T"), \
      SokPooledGradCombineOp<DEV, T>);
REGISTER_COMBINE(::tensorflow::DEVICE_CPU, CpuDevice, float)
REGISTER_COMBINE(::tensorflow::DEVICE_CPU, CpuDevice, double)
#ifdef SOK_WITH_CUDA
REGISTER_COMBINE(::tensorflow::DEVICE_GPU, GpuDevice, float)
REGISTER_COMBINE(::tensorflow::DEVICE_GPU, GpuDevice, double)
#endif
#undef REGISTER_COMBINE

}  // namespace
}  // namespace sok
