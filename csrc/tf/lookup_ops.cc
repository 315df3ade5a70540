// TensorFlow ops and CPU kernels of the embedding lookup path:
// SokDedupBucketize, SokCheckExchange, SokSegmentCombine and
// SokSegmentCombineGrad. The kernels validate their inputs, then call the
// framework-neutral implementations in core/lookup.h.

#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "core/lookup.h"
#include "tf/core_types.h"
#include "tf/cpu_parallel.h"
#include "tf/gpu_device.h"
#include "tf/shapes.h"
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/framework/tensor_shape.h"
#include "tensorflow/core/framework/types.h"
#include "tensorflow/core/lib/core/errors.h"
#include "tensorflow/core/util/work_sharder.h"

namespace sok {
namespace {

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

// Reads the "combiner" attr into *combiner; reports a failure on ctx.
void ParseCombinerAttr(OpKernelConstruction* ctx, lookup::Combiner* combiner) {
  std::string name;
  OP_REQUIRES_OK(ctx, ctx->GetAttr("combiner", &name));
  const lookup::LookupStatus status = lookup::ParseCombiner(name, combiner);
  OP_REQUIRES(ctx, status.ok(), errors::InvalidArgument(status.message()));
}

// ----------------------------------------------------------------------------
// SokDedupBucketize

REGISTER_OP("SokDedupBucketize")
    .Input("ids: Tids")
    .Input("positions: N * int64")
    .Output("unique_ids: int64")
    .Output("local_rows: int64")
    .Output("inverse: int32")
    .Output("counts: int64")
    .Output("error: int64")
    .Attr("Tids: {int32, int64}")
    .Attr("N: int >= 0 = 0")
    .Attr("num_ranks: int >= 1")
    .Attr("owner: int >= -1 = -1")
    .Attr("vocab_size: int >= 0")
    .Attr("table_name: string = ''")
    .Attr("raise_on_error: bool = true")
    .Attr("padding: bool = true")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle ids;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 1, &ids));
      int64_t num_ranks = 0;
      TF_RETURN_IF_ERROR(c->GetAttr("num_ranks", &num_ranks));
      const DimensionHandle unique = c->UnknownDim();
      c->set_output(0, c->Vector(unique));
      c->set_output(1, c->Vector(unique));
      c->set_output(2, c->Vector(c->Dim(ids, 0)));
      c->set_output(3, c->Vector(num_ranks));
      c->set_output(4, c->Vector(2));
      return absl::OkStatus();
    })
    .Doc(R"doc(
Deduplicates embedding ids and groups the distinct ids by owner rank.

ids: The ids to look up, [nnz]; padding must have been removed.
positions: None (N = 0: a graph of an earlier version has none), or one
  [nnz] vector: each id's position in the caller's input (with its
  padding), named by an invalid id's error instead of its position in ids.
unique_ids: The distinct ids, grouped by owner rank in ascending rank order,
  ascending within a rank.
local_rows: The row of each unique id in its owner's local table.
inverse: unique_ids[inverse[i]] == ids[i].
counts: The number of unique ids owned by each rank.
error: (position, value) of the first id outside [0, vocab_size), or (-1, 0).
num_ranks: The number of ranks the table is sharded over.
owner: -1 for a distributed table (id lives on rank id % num_ranks at row
  id // num_ranks); otherwise the rank that holds the whole table.
vocab_size: The number of rows of the whole table.
table_name: The table's name, for error messages.
raise_on_error: Whether an invalid id fails the op. If false, the op returns
  no unique ids, a zero inverse and zero counts, and reports the id in error.
padding: Whether the caller's ids take -1 as padding (removed before this op);
  only the error message says so.
)doc");

// The most ranks a table is sharded over (the ops size host vectors by it).
constexpr int64_t kMaxRanks = int64_t{1} << 20;

// The attrs, input checks and output writers shared by the CPU and GPU
// kernels of SokDedupBucketize.
class SokDedupBucketizeBase : public OpKernel {
 public:
  explicit SokDedupBucketizeBase(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("num_ranks", &num_ranks_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("owner", &owner_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("vocab_size", &vocab_size_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("table_name", &table_name_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("raise_on_error", &raise_on_error_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("padding", &padding_));
    // (QA: a num_ranks of 2**40 sized a host vector, and the process died
    // on the allocation's exception.)
    OP_REQUIRES(ctx, num_ranks_ <= kMaxRanks,
                errors::InvalidArgument(
                    "sok_keras: table '", table_name_, "': num_ranks (",
                    num_ranks_, ") must be at most ", kMaxRanks, "."));
    OP_REQUIRES(ctx, owner_ < num_ranks_,
                errors::InvalidArgument(
                    "sok_keras: table '", table_name_, "': owner (", owner_,
                    ") must be -1 or less than num_ranks (", num_ranks_,
                    ")."));
  }

 protected:
  // Checks the ids input; returns its size in *nnz, or false (status set).
  bool ValidateIds(OpKernelContext* ctx, const Tensor& ids, int64_t* nnz) {
    if (!TensorShapeUtils::IsVector(ids.shape())) {
      ctx->CtxFailure(errors::InvalidArgument(
          "sok_keras: table '", table_name_,
          "': ids must be a vector, got shape ", ids.shape().DebugString(),
          "."));
      return false;
    }
    *nnz = ids.NumElements();
    if (*nnz > std::numeric_limits<int32_t>::max()) {
      ctx->CtxFailure(errors::InvalidArgument(
          "sok_keras: table '", table_name_, "': the number of ids (", *nnz,
          ") must fit in int32."));
      return false;
    }
    return true;
  }

  // Checks the positions input (none, or one [nnz] vector); sets
  // *positions to it or nullptr. Returns false (status set) if not.
  bool ValidatePositions(OpKernelContext* ctx, int64_t nnz,
                         const Tensor** positions) {
    *positions = nullptr;
    if (ctx->num_inputs() < 2) return true;
    const Tensor& given = ctx->input(1);
    if (ctx->num_inputs() > 2 || !TensorShapeUtils::IsVector(given.shape()) ||
        given.NumElements() != nnz) {
      ctx->CtxFailure(errors::InvalidArgument(
          "sok_keras: table '", table_name_, "': positions must be one "
          "vector of one entry per id (", nnz, "), got ",
          ctx->num_inputs() - 1, " inputs, the first of shape ",
          given.shape().DebugString(), "."));
      return false;
    }
    *positions = &given;
    return true;
  }

  // error with its position replaced by `mapped` (the caller's); false
  // (status set) where that is negative, which would read as no error.
  bool MapPosition(OpKernelContext* ctx, int64_t mapped,
                   lookup::IdError* error) {
    if (mapped < 0) {
      ctx->CtxFailure(errors::InvalidArgument(
          "sok_keras: table '", table_name_, "': positions[",
          error->position, "] = ", mapped, " is negative (invalid id ",
          lookup::IdText(error->value), ")."));
      return false;
    }
    error->position = mapped;
    return true;
  }

  // The error of an invalid id when raise_on_error is set.
  absl::Status InvalidIdError(const lookup::IdError& error) const {
    return errors::InvalidArgument(
        "sok_keras: table '", table_name_, "': id ",
        lookup::IdText(error.value),
        " at position ", error.position, " is out of range [0, ", vocab_size_,
        padding_ ? ") (-1 is padding)." : ").");
  }

  // Allocates output `index` ([size] int64) and copies `size` values into
  // it (host memory).
  static void CopyOut(OpKernelContext* ctx, int index,
                      const std::vector<int64_t>& values, int64_t size) {
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(index, TensorShape({size}), &out));
    if (size > 0) {
      std::memcpy(out->flat<int64_t>().data(), values.data(),
                  size * sizeof(int64_t));
    }
  }

  // Writes the error output (host memory).
  static void WriteError(OpKernelContext* ctx, const lookup::IdError& error) {
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(4, TensorShape({2}), &out));
    out->flat<int64_t>()(0) = error.position;
    out->flat<int64_t>()(1) = error.value;
  }

  int64_t num_ranks_ = 1;
  int64_t owner_ = -1;
  int64_t vocab_size_ = 0;
  std::string table_name_;
  bool raise_on_error_ = true;
  bool padding_ = true;
};

template <typename Tids>
class SokDedupBucketizeOp : public SokDedupBucketizeBase {
 public:
  using SokDedupBucketizeBase::SokDedupBucketizeBase;

  void Compute(OpKernelContext* ctx) override {
    const Tensor& ids = ctx->input(0);
    int64_t nnz = 0;
    const Tensor* positions = nullptr;
    if (!ValidateIds(ctx, ids, &nnz) ||
        !ValidatePositions(ctx, nnz, &positions)) {
      return;
    }
    const Tids* ids_data = ids.flat<Tids>().data();
    const lookup::ParallelFor parallel_for = CpuParallelFor(ctx);

    lookup::IdError error =
        lookup::FindFirstInvalidId(ids_data, nnz, vocab_size_, parallel_for);
    if (!error.ok()) {
      if (positions != nullptr &&
          !MapPosition(ctx, positions->flat<int64_t>()(error.position),
                       &error)) {
        return;
      }
      OP_REQUIRES(ctx, !raise_on_error_, InvalidIdError(error));
      Tensor* out = nullptr;
      OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({0}), &out));
      OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({0}), &out));
      OP_REQUIRES_OK(ctx, ctx->allocate_output(2, TensorShape({nnz}), &out));
      out->flat<int32_t>().setZero();
      OP_REQUIRES_OK(ctx,
                     ctx->allocate_output(3, TensorShape({num_ranks_}), &out));
      out->flat<int64_t>().setZero();
      WriteError(ctx, error);
      return;
    }

    Tensor* inverse = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(2, TensorShape({nnz}), &inverse));
    lookup::DedupResult result;
    const lookup::LookupStatus status = lookup::DedupBucketize(
        ids_data, nnz, num_ranks_, owner_, parallel_for,
        inverse->flat<int32_t>().data(), &result);
    OP_REQUIRES(ctx, status.ok(),
                errors::InvalidArgument("sok_keras: table '", table_name_,
                                        "': ", status.message()));
    const int64_t num_unique = static_cast<int64_t>(result.unique_ids.size());
    CopyOut(ctx, 0, result.unique_ids, num_unique);
    CopyOut(ctx, 1, result.local_rows, num_unique);
    CopyOut(ctx, 3, result.counts, num_ranks_);
    WriteError(ctx, error);
  }
};

#ifdef SOK_WITH_CUDA
// ids, unique_ids, local_rows and inverse in device memory; counts and error
// in host memory. One blocking device-to-host copy (in
// lookup::gpu::DedupBucketize) sizes the outputs and decides the error.
template <typename Tids>
class SokDedupBucketizeGpuOp : public SokDedupBucketizeBase {
 public:
  using SokDedupBucketizeBase::SokDedupBucketizeBase;

  void Compute(OpKernelContext* ctx) override {
    const Tensor& ids = ctx->input(0);
    int64_t nnz = 0;
    const Tensor* positions = nullptr;
    if (!ValidateIds(ctx, ids, &nnz) ||
        !ValidatePositions(ctx, nnz, &positions)) {
      return;
    }
    GpuScratch scratch(ctx);
    const GpuDevice d = MakeGpuDevice(ctx, &scratch);

    Tensor* inverse = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(2, TensorShape({nnz}), &inverse));
    lookup::gpu::DedupOutput result;
    const Status status = lookup::gpu::DedupBucketize<Tids>(
        d, ids.flat<Tids>().data(), nnz, num_ranks_, owner_, vocab_size_,
        inverse->flat<int32_t>().data(), &result);
    OP_REQUIRES(ctx, status.ok(),
                errors::Internal("sok_keras: table '", table_name_,
                                 "': SokDedupBucketize on GPU: ",
                                 status.message()));
    if (!result.error.ok()) {
      if (positions != nullptr) {
        // The error path's one more copy: the position in the caller's
        // input (device memory).
        int64_t mapped = -1;
        const Status read = lookup::gpu::ReadDeviceInt64(
            d, positions->flat<int64_t>().data() + result.error.position,
            &mapped);
        OP_REQUIRES(ctx, read.ok(),
                    errors::Internal("sok_keras: table '", table_name_,
                                     "': SokDedupBucketize on GPU: ",
                                     read.message()));
        if (!MapPosition(ctx, mapped, &result.error)) return;
      }
      // inverse was zeroed; the same outputs as the CPU kernel.
      OP_REQUIRES(ctx, !raise_on_error_, InvalidIdError(result.error));
      Tensor* out = nullptr;
      OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({0}), &out));
      OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({0}), &out));
      OP_REQUIRES_OK(ctx,
                     ctx->allocate_output(3, TensorShape({num_ranks_}), &out));
      out->flat<int64_t>().setZero();
      WriteError(ctx, result.error);
      return;
    }

    const int64_t num_unique = result.num_unique;
    CopyOutDevice(ctx, d, 0, result.unique_ids, num_unique);
    if (!ctx->status().ok()) return;
    CopyOutDevice(ctx, d, 1, result.local_rows, num_unique);
    if (!ctx->status().ok()) return;
    CopyOut(ctx, 3, result.counts, num_ranks_);
    WriteError(ctx, result.error);
  }

 private:
  // Allocates output `index` ([size] int64, device memory) and copies `size`
  // values of device memory into it, on the op's stream.
  void CopyOutDevice(OpKernelContext* ctx, const GpuDevice& d, int index,
                     const int64_t* values, int64_t size) {
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(index, TensorShape({size}), &out));
    if (size == 0) return;
    const Status status = lookup::gpu::CopyDeviceToDevice(
        d, out->flat<int64_t>().data(), values, size * sizeof(int64_t));
    OP_REQUIRES(ctx, status.ok(),
                errors::Internal("sok_keras: table '", table_name_,
                                 "': SokDedupBucketize on GPU: ",
                                 status.message()));
  }
};
#endif  // SOK_WITH_CUDA

#define REGISTER_DEDUP(Tids)                                      \
  REGISTER_KERNEL_BUILDER(Name("SokDedupBucketize")               \
                              .Device(DEVICE_CPU)                 \
                              .TypeConstraint<Tids>("Tids"),      \
                          SokDedupBucketizeOp<Tids>);
REGISTER_DEDUP(int32_t)
REGISTER_DEDUP(int64_t)
#undef REGISTER_DEDUP

#ifdef SOK_WITH_CUDA
#define REGISTER_DEDUP_GPU(Tids)                                  \
  REGISTER_KERNEL_BUILDER(Name("SokDedupBucketize")               \
                              .Device(DEVICE_GPU)                 \
                              .TypeConstraint<Tids>("Tids")       \
                              .HostMemory("counts")               \
                              .HostMemory("error"),               \
                          SokDedupBucketizeGpuOp<Tids>);
REGISTER_DEDUP_GPU(int32_t)
REGISTER_DEDUP_GPU(int64_t)
#undef REGISTER_DEDUP_GPU
#endif  // SOK_WITH_CUDA

// ----------------------------------------------------------------------------
// SokCheckExchange

REGISTER_OP("SokCheckExchange")
    .Input("gathered: int64")
    .Output("counts_matrix: int64")
    .Attr("table_name: string")
    .Attr("vocab_size: int >= 0")
    .Attr("padding: bool = true")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle gathered;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 2, &gathered));
      const DimensionHandle num_ranks = c->Dim(gathered, 0);
      DimensionHandle width;
      TF_RETURN_IF_ERROR(c->Add(num_ranks, 2, &width));
      DimensionHandle merged;
      TF_RETURN_IF_ERROR(c->Merge(width, c->Dim(gathered, 1), &merged));
      c->set_output(0, c->Matrix(num_ranks, num_ranks));
      return absl::OkStatus();
    })
    .Doc(R"doc(
Checks the lookup summaries gathered from every rank of a multi-rank lookup.

Fails on every rank with the same message if any rank saw an invalid id.

gathered: [num_ranks, num_ranks + 2]; row r is rank r's concat(counts, error)
  from SokDedupBucketize.
counts_matrix: [num_ranks, num_ranks], the counts of every rank.
table_name: The table's name, for error messages.
vocab_size: The number of rows of the whole table, for error messages.
padding: Whether the caller's ids take -1 as padding, for error messages.
)doc");

class SokCheckExchangeOp : public OpKernel {
 public:
  explicit SokCheckExchangeOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("table_name", &table_name_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("vocab_size", &vocab_size_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("padding", &padding_));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& gathered = ctx->input(0);
    OP_REQUIRES(ctx, TensorShapeUtils::IsMatrix(gathered.shape()),
                errors::InvalidArgument(
                    "sok_keras: table '", table_name_,
                    "': gathered must be a matrix, got shape ",
                    gathered.shape().DebugString(), "."));
    const int64_t num_ranks = gathered.dim_size(0);
    OP_REQUIRES(ctx, gathered.dim_size(1) == num_ranks + 2,
                errors::InvalidArgument(
                    "sok_keras: table '", table_name_,
                    "': gathered must have shape [num_ranks, num_ranks + 2], "
                    "got ", gathered.shape().DebugString(), "."));
    const int64_t* data = gathered.flat<int64_t>().data();
    lookup::IdError error;
    const int64_t rank = lookup::FirstRankWithError(data, num_ranks, &error);
    OP_REQUIRES(ctx, rank < 0,
                errors::InvalidArgument(
                    "sok_keras: table '", table_name_, "': rank ", rank,
                    " looked up id ", lookup::IdText(error.value),
                    " (position ",
                    error.position, "), out of range [0, ", vocab_size_,
                    padding_ ? ") (-1 is padding)." : ")."));
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(
                            0, TensorShape({num_ranks, num_ranks}), &out));
    int64_t* out_data = out->flat<int64_t>().data();
    for (int64_t r = 0; r < num_ranks; ++r) {
      std::memcpy(out_data + r * num_ranks, data + r * (num_ranks + 2),
                  num_ranks * sizeof(int64_t));
    }
  }

 private:
  std::string table_name_;
  int64_t vocab_size_ = 0;
  bool padding_ = true;
};

REGISTER_KERNEL_BUILDER(Name("SokCheckExchange").Device(DEVICE_CPU),
                        SokCheckExchangeOp);
#ifdef SOK_WITH_CUDA
// A host-side check: the same kernel, with every tensor in host memory.
REGISTER_KERNEL_BUILDER(Name("SokCheckExchange")
                            .Device(DEVICE_GPU)
                            .HostMemory("gathered")
                            .HostMemory("counts_matrix"),
                        SokCheckExchangeOp);
#endif  // SOK_WITH_CUDA

// ----------------------------------------------------------------------------
// SokSegmentCombine and SokSegmentCombineGrad

// Validates the shapes of the inputs shared by SokSegmentCombine and its
// gradient (CPU and GPU): `dense` is rows ([U, D], forward) or grad
// ([B, D], backward).
void ValidateCombineShapes(OpKernelContext* ctx, const char* dense_name) {
  const Tensor& dense = ctx->input(0);
  const Tensor& inverse = ctx->input(1);
  const Tensor& segment_ids = ctx->input(2);
  const Tensor& weights = ctx->input(3);
  OP_REQUIRES(ctx, TensorShapeUtils::IsMatrix(dense.shape()),
              errors::InvalidArgument(dense_name,
                                      " must be a matrix, got shape ",
                                      dense.shape().DebugString(), "."));
  OP_REQUIRES(ctx, TensorShapeUtils::IsVector(inverse.shape()),
              errors::InvalidArgument("inverse must be a vector, got shape ",
                                      inverse.shape().DebugString(), "."));
  const int64_t nnz = inverse.NumElements();
  OP_REQUIRES(ctx, TensorShapeUtils::IsVector(segment_ids.shape()),
              errors::InvalidArgument(
                  "segment_ids must be a vector, got shape ",
                  segment_ids.shape().DebugString(), "."));
  OP_REQUIRES(ctx, segment_ids.NumElements() == nnz,
              errors::InvalidArgument(
                  "segment_ids and inverse must have the same size, got ",
                  segment_ids.NumElements(), " and ", nnz, "."));
  OP_REQUIRES(ctx, TensorShapeUtils::IsVector(weights.shape()),
              errors::InvalidArgument("weights must be a vector, got shape ",
                                      weights.shape().DebugString(), "."));
  OP_REQUIRES(ctx, weights.NumElements() == 0 || weights.NumElements() == nnz,
              errors::InvalidArgument(
                  "weights must be empty or have the size of inverse (", nnz,
                  "), got size ", weights.NumElements(), "."));
}

// Validates the inputs shared by SokSegmentCombine and its gradient on the
// CPU: the shapes, then the indices (host memory).
template <typename T, typename Tseg>
void ValidateCombineInputs(OpKernelContext* ctx, const char* dense_name,
                           int64_t num_rows,
                           int64_t num_segments) {
  ValidateCombineShapes(ctx, dense_name);
  if (!ctx->status().ok()) return;
  const Tensor& inverse = ctx->input(1);
  const Tensor& segment_ids = ctx->input(2);
  const int64_t nnz = inverse.NumElements();
  const lookup::LookupStatus status = lookup::ValidateSegmentIndices(
      inverse.flat<int32_t>().data(), segment_ids.flat<Tseg>().data(), nnz,
      num_rows, num_segments, CpuParallelFor(ctx));
  OP_REQUIRES(ctx, status.ok(), errors::InvalidArgument(status.message()));
}

absl::Status ScalarInt64(OpKernelContext* ctx, int index, const char* name,
                   int64_t* value) {
  const Tensor& t = ctx->input(index);
  if (!TensorShapeUtils::IsScalar(t.shape())) {
    return errors::InvalidArgument(name, " must be a scalar, got shape ",
                                   t.shape().DebugString(), ".");
  }
  *value = t.scalar<int64_t>()();
  return absl::OkStatus();
}

// Reads the count input 4 (num_segments or num_unique, host memory), which
// must be >= 0; returns false (status set) otherwise.
bool ReadCount(OpKernelContext* ctx, const char* name, int64_t* value) {
  const absl::Status status = ScalarInt64(ctx, 4, name, value);
  if (!status.ok()) {
    ctx->CtxFailure(status);
    return false;
  }
  if (*value < 0) {
    ctx->CtxFailure(errors::InvalidArgument(
        name, " must be non-negative, got ", *value, "."));
    return false;
  }
  return true;
}

absl::Status CombineShapeFn(InferenceContext* c) {
  ShapeHandle dense;
  ShapeHandle vector;
  ShapeHandle scalar;
  TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 2, &dense));
  TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 1, &vector));
  DimensionHandle nnz = c->Dim(vector, 0);
  TF_RETURN_IF_ERROR(c->WithRank(c->input(2), 1, &vector));
  TF_RETURN_IF_ERROR(c->Merge(nnz, c->Dim(vector, 0), &nnz));
  TF_RETURN_IF_ERROR(c->WithRank(c->input(3), 1, &vector));
  TF_RETURN_IF_ERROR(c->WithRank(c->input(4), 0, &scalar));
  DimensionHandle size;
  TF_RETURN_IF_ERROR(c->MakeDimForScalarInput(4, &size));
  c->set_output(0, c->Matrix(size, c->Dim(dense, 1)));
  return absl::OkStatus();
}

REGISTER_OP("SokSegmentCombine")
    .Input("rows: T")
    .Input("inverse: int32")
    .Input("segment_ids: Tseg")
    .Input("weights: T")
    .Input("num_segments: int64")
    .Output("out: T")
    .Attr("T: {half, bfloat16, float, double}")
    .Attr("Tseg: {int32, int64}")
    .Attr("combiner: {'sum', 'mean', 'sqrtn'} = 'sum'")
    .SetShapeFn(CombineShapeFn)
    .Doc(R"doc(
Pools looked-up rows per segment (the forward of a sparse embedding lookup).

out[b] = combine(weights[i] * rows[inverse[i]] for i with segment_ids[i] == b)
where combine is a sum, a weighted mean, or a sum divided by the square root
of the sum of squared weights; a zero denominator gives zeros.

rows: [U, D], the unique rows.
inverse: [nnz], the row of each position.
segment_ids: [nnz], the output row (batch row) of each position, any order.
weights: [nnz], or [0] for all-one weights.
num_segments: The number of output rows (the batch size).
out: [num_segments, D].
)doc");

REGISTER_OP("SokSegmentCombineGrad")
    .Input("grad: T")
    .Input("inverse: int32")
    .Input("segment_ids: Tseg")
    .Input("weights: T")
    .Input("num_unique: int64")
    .Output("rows_grad: T")
    .Attr("T: {half, bfloat16, float, double}")
    .Attr("Tseg: {int32, int64}")
    .Attr("combiner: {'sum', 'mean', 'sqrtn'} = 'sum'")
    .SetShapeFn(CombineShapeFn)
    .Doc(R"doc(
The gradient of SokSegmentCombine with respect to rows, reduced per row.

grad: [B, D], the gradient of SokSegmentCombine's output.
inverse: [nnz], as given to SokSegmentCombine.
segment_ids: [nnz], as given to SokSegmentCombine.
weights: [nnz] or [0], as given to SokSegmentCombine.
num_unique: U, the number of rows given to SokSegmentCombine.
rows_grad: [U, D].
)doc");

template <typename T, typename Tseg>
class SokSegmentCombineOp : public OpKernel {
 public:
  explicit SokSegmentCombineOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    ParseCombinerAttr(ctx, &combiner_);
  }

  void Compute(OpKernelContext* ctx) override {
    int64_t num_segments = 0;
    if (!ReadCount(ctx, "num_segments", &num_segments)) return;
    const Tensor& rows = ctx->input(0);
    const int64_t num_rows = rows.dims() == 2 ? rows.dim_size(0) : 0;
    ValidateCombineInputs<T, Tseg>(ctx, "rows", num_rows,
                                   num_segments);
    if (!ctx->status().ok()) return;

    const Tensor& inverse = ctx->input(1);
    const Tensor& segment_ids = ctx->input(2);
    const Tensor& weights = ctx->input(3);
    const int64_t dim = rows.dim_size(1);
    Tensor* out = nullptr;
    TensorShape shape;
    OP_REQUIRES_OK(ctx, CheckedShape("sok_keras: " + type_string() + ": ",
                                     {num_segments, dim}, &shape));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, shape, &out));
    if (out->NumElements() == 0) return;
    lookup::SegmentCombine<CoreT<T>, Tseg>(
        CorePtr(rows.flat<T>().data()), dim, inverse.flat<int32_t>().data(),
        segment_ids.flat<Tseg>().data(),
        weights.NumElements() == 0 ? nullptr
                                   : CorePtr(weights.flat<T>().data()),
        inverse.NumElements(), num_segments, combiner_, CpuParallelFor(ctx),
        CorePtr(out->flat<T>().data()));
  }

 private:
  lookup::Combiner combiner_ = lookup::Combiner::kSum;
};

template <typename T, typename Tseg>
class SokSegmentCombineGradOp : public OpKernel {
 public:
  explicit SokSegmentCombineGradOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    ParseCombinerAttr(ctx, &combiner_);
  }

  void Compute(OpKernelContext* ctx) override {
    int64_t num_unique = 0;
    if (!ReadCount(ctx, "num_unique", &num_unique)) return;
    const Tensor& grad = ctx->input(0);
    const int64_t num_segments = grad.dims() == 2 ? grad.dim_size(0) : 0;
    ValidateCombineInputs<T, Tseg>(ctx, "grad", num_unique,
                                   num_segments);
    if (!ctx->status().ok()) return;

    const Tensor& inverse = ctx->input(1);
    const Tensor& segment_ids = ctx->input(2);
    const Tensor& weights = ctx->input(3);
    const int64_t dim = grad.dim_size(1);
    Tensor* out = nullptr;
    TensorShape shape;
    OP_REQUIRES_OK(ctx, CheckedShape("sok_keras: " + type_string() + ": ",
                                     {num_unique, dim}, &shape));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, shape, &out));
    if (out->NumElements() == 0) return;
    lookup::SegmentCombineGrad<CoreT<T>, Tseg>(
        CorePtr(grad.flat<T>().data()), dim, inverse.flat<int32_t>().data(),
        segment_ids.flat<Tseg>().data(),
        weights.NumElements() == 0 ? nullptr
                                   : CorePtr(weights.flat<T>().data()),
        inverse.NumElements(), num_segments, num_unique, combiner_,
        CpuParallelFor(ctx), CorePtr(out->flat<T>().data()));
  }

 private:
  lookup::Combiner combiner_ = lookup::Combiner::kSum;
};

#ifdef SOK_WITH_CUDA
// Checks the indices of a combine op on the device (one blocking
// device-to-host copy) after ValidateCombineShapes; fails the op with the
// CPU kernel's message if one is out of range. Returns false (status set)
// on failure.
template <typename Tseg>
bool CheckCombineIndicesGpu(OpKernelContext* ctx, const GpuDevice& d,
                            const char* op, int64_t num_rows,
                            int64_t num_segments,
                            lookup::gpu::SegmentIndexCheck* check) {
  const Tensor& inverse = ctx->input(1);
  const Tensor& segment_ids = ctx->input(2);
  const Status status = lookup::gpu::CheckSegmentIndices<Tseg>(
      d, inverse.flat<int32_t>().data(), segment_ids.flat<Tseg>().data(),
      inverse.NumElements(), num_rows, num_segments, check);
  if (!status.ok()) {
    ctx->CtxFailure(errors::Internal(op, " on GPU: ", status.message()));
    return false;
  }
  if (!check->invalid.ok()) {
    ctx->CtxFailure(errors::InvalidArgument(check->invalid.message()));
    return false;
  }
  return true;
}

// rows, inverse, segment_ids, weights and out in device memory,
// num_segments in host memory.
template <typename T, typename Tseg>
class SokSegmentCombineGpuOp : public OpKernel {
 public:
  explicit SokSegmentCombineGpuOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    ParseCombinerAttr(ctx, &combiner_);
  }

  void Compute(OpKernelContext* ctx) override {
    int64_t num_segments = 0;
    if (!ReadCount(ctx, "num_segments", &num_segments)) return;
    const Tensor& rows = ctx->input(0);
    const int64_t num_rows = rows.dims() == 2 ? rows.dim_size(0) : 0;
    ValidateCombineShapes(ctx, "rows");
    if (!ctx->status().ok()) return;
    GpuScratch scratch(ctx);
    const GpuDevice d = MakeGpuDevice(ctx, &scratch);
    lookup::gpu::SegmentIndexCheck check;
    if (!CheckCombineIndicesGpu<Tseg>(ctx, d, "SokSegmentCombine", num_rows,
                                      num_segments, &check)) {
      return;
    }

    const Tensor& inverse = ctx->input(1);
    const Tensor& segment_ids = ctx->input(2);
    const Tensor& weights = ctx->input(3);
    const int64_t dim = rows.dim_size(1);
    Tensor* out = nullptr;
    TensorShape shape;
    OP_REQUIRES_OK(ctx, CheckedShape("sok_keras: " + type_string() + ": ",
                                     {num_segments, dim}, &shape));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, shape, &out));
    if (out->NumElements() == 0) return;
    const Status status = lookup::gpu::SegmentCombine<CoreT<T>, Tseg>(
        d, CorePtr(rows.flat<T>().data()), dim,
        inverse.flat<int32_t>().data(), segment_ids.flat<Tseg>().data(),
        weights.NumElements() == 0 ? nullptr
                                   : CorePtr(weights.flat<T>().data()),
        inverse.NumElements(), num_segments, combiner_, check,
        CorePtr(out->flat<T>().data()));
    OP_REQUIRES(ctx, status.ok(),
                errors::Internal("SokSegmentCombine on GPU: ",
                                 status.message()));
  }

 private:
  lookup::Combiner combiner_ = lookup::Combiner::kSum;
};

// grad, inverse, segment_ids, weights and rows_grad in device memory,
// num_unique in host memory.
template <typename T, typename Tseg>
class SokSegmentCombineGradGpuOp : public OpKernel {
 public:
  explicit SokSegmentCombineGradGpuOp(OpKernelConstruction* ctx)
      : OpKernel(ctx) {
    ParseCombinerAttr(ctx, &combiner_);
  }

  void Compute(OpKernelContext* ctx) override {
    int64_t num_unique = 0;
    if (!ReadCount(ctx, "num_unique", &num_unique)) return;
    const Tensor& grad = ctx->input(0);
    const int64_t num_segments = grad.dims() == 2 ? grad.dim_size(0) : 0;
    ValidateCombineShapes(ctx, "grad");
    if (!ctx->status().ok()) return;
    GpuScratch scratch(ctx);
    const GpuDevice d = MakeGpuDevice(ctx, &scratch);
    lookup::gpu::SegmentIndexCheck check;
    if (!CheckCombineIndicesGpu<Tseg>(ctx, d, "SokSegmentCombineGrad",
                                      num_unique, num_segments, &check)) {
      return;
    }

    const Tensor& inverse = ctx->input(1);
    const Tensor& segment_ids = ctx->input(2);
    const Tensor& weights = ctx->input(3);
    const int64_t dim = grad.dim_size(1);
    Tensor* out = nullptr;
    TensorShape shape;
    OP_REQUIRES_OK(ctx, CheckedShape("sok_keras: " + type_string() + ": ",
                                     {num_unique, dim}, &shape));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, shape, &out));
    if (out->NumElements() == 0) return;
    const Status status = lookup::gpu::SegmentCombineGrad<CoreT<T>, Tseg>(
        d, CorePtr(grad.flat<T>().data()), dim,
        inverse.flat<int32_t>().data(), segment_ids.flat<Tseg>().data(),
        weights.NumElements() == 0 ? nullptr
                                   : CorePtr(weights.flat<T>().data()),
        inverse.NumElements(), num_segments, num_unique, combiner_, check,
        CorePtr(out->flat<T>().data()));
    OP_REQUIRES(ctx, status.ok(),
                errors::Internal("SokSegmentCombineGrad on GPU: ",
                                 status.message()));
  }

 private:
  lookup::Combiner combiner_ = lookup::Combiner::kSum;
};
#endif  // SOK_WITH_CUDA

#define REGISTER_COMBINE(T, Tseg)                                      \
  REGISTER_KERNEL_BUILDER(Name("SokSegmentCombine")                    \
                              .Device(DEVICE_CPU)                      \
                              .TypeConstraint<T>("T")                  \
                              .TypeConstraint<Tseg>("Tseg")            \
                              .HostMemory("num_segments"),             \
                          SokSegmentCombineOp<T, Tseg>);               \
  REGISTER_KERNEL_BUILDER(Name("SokSegmentCombineGrad")                \
                              .Device(DEVICE_CPU)                      \
                              .TypeConstraint<T>("T")                  \
                              .TypeConstraint<Tseg>("Tseg")            \
                              .HostMemory("num_unique"),               \
                          SokSegmentCombineGradOp<T, Tseg>);
REGISTER_COMBINE(float, int32_t)
REGISTER_COMBINE(float, int64_t)
REGISTER_COMBINE(double, int32_t)
REGISTER_COMBINE(double, int64_t)
REGISTER_COMBINE(Eigen::half, int32_t)
REGISTER_COMBINE(Eigen::half, int64_t)
REGISTER_COMBINE(::tensorflow::bfloat16, int32_t)
REGISTER_COMBINE(::tensorflow::bfloat16, int64_t)
#undef REGISTER_COMBINE

#ifdef SOK_WITH_CUDA
#define REGISTER_COMBINE_GPU(T, Tseg)                                  \
  REGISTER_KERNEL_BUILDER(Name("SokSegmentCombine")                    \
                              .Device(DEVICE_GPU)                      \
                              .TypeConstraint<T>("T")                  \
                              .TypeConstraint<Tseg>("Tseg")            \
                              .HostMemory("num_segments"),             \
                          SokSegmentCombineGpuOp<T, Tseg>);            \
  REGISTER_KERNEL_BUILDER(Name("SokSegmentCombineGrad")                \
                              .Device(DEVICE_GPU)                      \
                              .TypeConstraint<T>("T")                  \
                              .TypeConstraint<Tseg>("Tseg")            \
                              .HostMemory("num_unique"),               \
                          SokSegmentCombineGradGpuOp<T, Tseg>);
REGISTER_COMBINE_GPU(float, int32_t)
REGISTER_COMBINE_GPU(float, int64_t)
REGISTER_COMBINE_GPU(double, int32_t)
REGISTER_COMBINE_GPU(double, int64_t)
REGISTER_COMBINE_GPU(Eigen::half, int32_t)
REGISTER_COMBINE_GPU(Eigen::half, int64_t)
REGISTER_COMBINE_GPU(::tensorflow::bfloat16, int32_t)
REGISTER_COMBINE_GPU(::tensorflow::bfloat16, int64_t)
#undef REGISTER_COMBINE_GPU
#endif  // SOK_WITH_CUDA

}  // namespace
}  // namespace sok
