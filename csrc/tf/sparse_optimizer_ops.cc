// TensorFlow ops for sparse ("lazy") optimizer updates of ResourceVariables.
//
// Every op takes the resource handles of a variable [rows, ...] and of its
// optimizer slots (same shape), then `indices` [k] (local rows, duplicates
// allowed) and `grad` [k, ...], then the hyperparameters as scalar inputs (so
// that learning-rate schedules work), with structural flags as attrs.
// Duplicate indices are summed first (deterministically), then each unique
// row gets one update; rows not in `indices` are not touched.
//
// Input order of every op: resources..., indices, grad, scalars...
// The variable and grad have dtype T; the slots and the scalars dtype Tacc
// (float32 slots for a half/bfloat16 table, T's own dtype otherwise).
// Resource inputs that the attrs make unused (vhat without amsgrad; mom
// without use_momentum; mg without centered) are never looked up; callers may
// pass any resource handle there (the Python wrappers pass `var`).
//
// Kernels lock all used variables exclusively, in mutex-address order,
// validate everything (dtype, shapes, indices in [0, rows)) before writing,
// and copy a variable's buffer before updating it in place when the buffer is
// shared (e.g. with a tensor read from the variable earlier), so earlier
// reads keep their values.
#define EIGEN_USE_THREADS

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "core/sparse_optimizers.h"
#include "tf/core_types.h"
#include "tf/cpu_parallel.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/resource_var.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/framework/tensor_shape.h"

#ifdef SOK_WITH_CUDA
#include "tf/gpu_device.h"
#endif

namespace sok {
// Bytes copied by copy-on-write (tf/build_info_ops.cc, SokBuildInfo).
std::atomic<int64_t>& VariableCopyBytesCounter();
}  // namespace sok

namespace tensorflow {
namespace {

namespace so = ::sok::sparse_opt;
using shape_inference::DimensionHandle;
using shape_inference::InferenceContext;
using shape_inference::ShapeHandle;

// ---------------------------------------------------------------------------
// Shape functions.

absl::Status SparseApplyShape(InferenceContext* c, int num_resources,
                              int num_scalars) {
  ShapeHandle indices;
  TF_RETURN_IF_ERROR(c->WithRank(c->input(num_resources), 1, &indices));
  ShapeHandle grad;
  TF_RETURN_IF_ERROR(
      c->WithRankAtLeast(c->input(num_resources + 1), 1, &grad));
  DimensionHandle unused_dim;
  TF_RETURN_IF_ERROR(
      c->Merge(c->Dim(indices, 0), c->Dim(grad, 0), &unused_dim));
  ShapeHandle unused;
  for (int i = 0; i < num_scalars; ++i) {
    TF_RETURN_IF_ERROR(c->WithRank(c->input(num_resources + 2 + i), 0, &unused));
  }
  // If the variable's shape is known, its inner dims must match grad's.
  const auto* handle = c->input_handle_shapes_and_types(0);
  if (handle != nullptr && !handle->empty() && c->RankKnown((*handle)[0].shape)) {
    ShapeHandle var = (*handle)[0].shape;
    TF_RETURN_IF_ERROR(c->WithRankAtLeast(var, 1, &var));
    ShapeHandle var_inner, grad_inner;
    TF_RETURN_IF_ERROR(c->Subshape(var, 1, &var_inner));
    TF_RETURN_IF_ERROR(c->Subshape(grad, 1, &grad_inner));
    TF_RETURN_IF_ERROR(c->Merge(var_inner, grad_inner, &unused));
  }
  return absl::OkStatus();
}

#define SOK_SHAPE_FN(NRES, NSCALARS)                 \
  [](InferenceContext* c) -> absl::Status {          \
    return SparseApplyShape(c, (NRES), (NSCALARS));  \
  }

// T: the table's dtype (var and grad). Tacc: the dtype of the slots and the
// hyperparameters, the type every rule computes in: T for float and double,
// float for half and bfloat16 (the new row is rounded once, to nearest even,
// when it is stored).
// indices_are_unique: the indices are known to be distinct and inside the
// variable (sok_keras sets it only when it proves this at trace time: the
// indices are the rows output of SokPooledLookupGrad or of a one-rank
// SokDedupBucketize, validated against this variable's rows). The GPU
// kernel then skips its sort, its validation and its host sync (and never
// writes a row outside the variable); the CPU kernel ignores it.
#define SOK_COMMON_ATTRS                      \
  Attr("T: {half, bfloat16, float, double}")  \
      .Attr("Tacc: {float, double}")          \
      .Attr("Tindices: {int32, int64} = DT_INT64") \
      .Attr("indices_are_unique: bool = false")

REGISTER_OP("SokSparseApplySgd")
    .Input("var: resource")
    .Input("indices: Tindices")
    .Input("grad: T")
    .Input("lr: Tacc")
    .SOK_COMMON_ATTRS
    .SetIsStateful()
    .SetShapeFn(SOK_SHAPE_FN(1, 1))
    .Doc(R"doc(
Lazy SGD: for each unique row r of indices (duplicates summed into g):
var[r] -= lr * g.
)doc");

REGISTER_OP("SokSparseApplyMomentum")
    .Input("var: resource")
    .Input("m: resource")
    .Input("indices: Tindices")
    .Input("grad: T")
    .Input("lr: Tacc")
    .Input("momentum: Tacc")
    .SOK_COMMON_ATTRS
    .Attr("nesterov: bool = false")
    .SetIsStateful()
    .SetShapeFn(SOK_SHAPE_FN(2, 2))
    .Doc(R"doc(
Lazy Keras SGD with momentum, per unique row: m = momentum * m - lr * g;
nesterov: var += momentum * m - lr * g, else var += m.
)doc");

REGISTER_OP("SokSparseApplyAdagrad")
    .Input("var: resource")
    .Input("accumulator: resource")
    .Input("indices: Tindices")
    .Input("grad: T")
    .Input("lr: Tacc")
    .Input("epsilon: Tacc")
    .SOK_COMMON_ATTRS
    .SetIsStateful()
    .SetShapeFn(SOK_SHAPE_FN(2, 2))
    .Doc(R"doc(
Lazy Keras Adagrad, per unique row: acc += g^2;
var -= lr * g / sqrt(acc + epsilon).
)doc");

REGISTER_OP("SokSparseApplyAdam")
    .Input("var: resource")
    .Input("m: resource")
    .Input("v: resource")
    .Input("vhat: resource")
    .Input("indices: Tindices")
    .Input("grad: T")
    .Input("lr: Tacc")
    .Input("beta_1: Tacc")
    .Input("beta_2: Tacc")
    .Input("epsilon: Tacc")
    .Input("step: Tacc")
    .SOK_COMMON_ATTRS
    .Attr("amsgrad: bool = false")
    .SetIsStateful()
    .SetShapeFn(SOK_SHAPE_FN(4, 5))
    .Doc(R"doc(
Lazy Keras Adam, per unique row, with alpha = lr * sqrt(1 - beta_2^step) /
(1 - beta_1^step): m += (g - m)(1 - beta_1); v += (g^2 - v)(1 - beta_2);
amsgrad: vhat = max(vhat, v) and vhat is used instead of v;
var -= m * alpha / (sqrt(v) + epsilon). vhat is ignored unless amsgrad.
)doc");

REGISTER_OP("SokSparseApplyAdamW")
    .Input("var: resource")
    .Input("m: resource")
    .Input("v: resource")
    .Input("vhat: resource")
    .Input("indices: Tindices")
    .Input("grad: T")
    .Input("lr: Tacc")
    .Input("beta_1: Tacc")
    .Input("beta_2: Tacc")
    .Input("epsilon: Tacc")
    .Input("step: Tacc")
    .Input("weight_decay: Tacc")
    .SOK_COMMON_ATTRS
    .Attr("amsgrad: bool = false")
    .SetIsStateful()
    .SetShapeFn(SOK_SHAPE_FN(4, 6))
    .Doc(R"doc(
Lazy Keras AdamW: per unique row, var -= var * weight_decay * lr, then the
SokSparseApplyAdam update.
)doc");

REGISTER_OP("SokSparseApplyFtrl")
    .Input("var: resource")
    .Input("accumulator: resource")
    .Input("linear: resource")
    .Input("indices: Tindices")
    .Input("grad: T")
    .Input("lr: Tacc")
    .Input("lr_power: Tacc")
    .Input("l1: Tacc")
    .Input("l2: Tacc")
    .Input("l2_shrinkage: Tacc")
    .Input("beta: Tacc")
    .SOK_COMMON_ATTRS
    .SetIsStateful()
    .SetShapeFn(SOK_SHAPE_FN(3, 6))
    .Doc(R"doc(
Lazy Keras Ftrl, per unique row (see keras/src/optimizers/ftrl.py).
)doc");

REGISTER_OP("SokSparseApplyRmsprop")
    .Input("var: resource")
    .Input("velocity: resource")
    .Input("mom: resource")
    .Input("mg: resource")
    .Input("indices: Tindices")
    .Input("grad: T")
    .Input("lr: Tacc")
    .Input("rho: Tacc")
    .Input("momentum: Tacc")
    .Input("epsilon: Tacc")
    .SOK_COMMON_ATTRS
    .Attr("centered: bool = false")
    .Attr("use_momentum: bool = false")
    .SetIsStateful()
    .SetShapeFn(SOK_SHAPE_FN(4, 4))
    .Doc(R"doc(
Lazy Keras RMSprop, per unique row: velocity = rho * velocity + (1 - rho) g^2;
centered: mg = rho * mg + (1 - rho) g, denom = velocity - mg^2 + epsilon,
else denom = velocity + epsilon; inc = lr * g / sqrt(denom);
use_momentum: mom = momentum * mom + inc, var -= mom; else var -= inc.
mom is ignored unless use_momentum, mg unless centered.
)doc");

REGISTER_OP("SokSparseApplyAdamax")
    .Input("var: resource")
    .Input("m: resource")
    .Input("u: resource")
    .Input("indices: Tindices")
    .Input("grad: T")
    .Input("lr: Tacc")
    .Input("beta_1: Tacc")
    .Input("beta_2: Tacc")
    .Input("epsilon: Tacc")
    .Input("step: Tacc")
    .SOK_COMMON_ATTRS
    .SetIsStateful()
    .SetShapeFn(SOK_SHAPE_FN(3, 5))
    .Doc(R"doc(
Lazy Keras Adamax, per unique row: m += (g - m)(1 - beta_1);
u = max(beta_2 * u, |g|); var -= lr * m / ((1 - beta_1^step)(u + epsilon)).
)doc");

REGISTER_OP("SokSparseApplyNadam")
    .Input("var: resource")
    .Input("m: resource")
    .Input("v: resource")
    .Input("indices: Tindices")
    .Input("grad: T")
    .Input("lr: Tacc")
    .Input("beta_1: Tacc")
    .Input("beta_2: Tacc")
    .Input("epsilon: Tacc")
    .Input("u_t: Tacc")
    .Input("u_t_1: Tacc")
    .Input("u_product: Tacc")
    .Input("beta_2_power: Tacc")
    .SOK_COMMON_ATTRS
    .SetIsStateful()
    .SetShapeFn(SOK_SHAPE_FN(3, 8))
    .Doc(R"doc(
Lazy Keras Nadam, per unique row: m += (g - m)(1 - beta_1);
v += (g^2 - v)(1 - beta_2); m_hat = u_t_1 m / (1 - u_product u_t_1)
+ (1 - u_t) g / (1 - u_product); var -= m_hat lr / (sqrt(v / (1 -
beta_2_power)) + epsilon). u_t, u_t_1, u_product (the product of the
schedule up to u_t) and beta_2_power = beta_2^step are the step's
schedule as Keras' Nadam computes it.
)doc");

REGISTER_OP("SokSparseApplyAdadelta")
    .Input("var: resource")
    .Input("accumulated_grad: resource")
    .Input("accumulated_delta_var: resource")
    .Input("indices: Tindices")
    .Input("grad: T")
    .Input("lr: Tacc")
    .Input("rho: Tacc")
    .Input("epsilon: Tacc")
    .SOK_COMMON_ATTRS
    .SetIsStateful()
    .SetShapeFn(SOK_SHAPE_FN(3, 3))
    .Doc(R"doc(
Lazy Keras Adadelta, per unique row: ag = rho * ag + (1 - rho) g^2;
delta = -sqrt(ad + epsilon) g / sqrt(ag + epsilon);
ad = rho * ad + (1 - rho) delta^2; var += lr * delta.
)doc");

REGISTER_OP("SokSparseApplyLion")
    .Input("var: resource")
    .Input("m: resource")
    .Input("indices: Tindices")
    .Input("grad: T")
    .Input("lr: Tacc")
    .Input("beta_1: Tacc")
    .Input("beta_2: Tacc")
    .SOK_COMMON_ATTRS
    .SetIsStateful()
    .SetShapeFn(SOK_SHAPE_FN(2, 3))
    .Doc(R"doc(
Lazy Keras Lion, per unique row: var -= lr * sign(beta_1 m + (1 - beta_1) g);
m = beta_2 m + (1 - beta_2) g.
)doc");

#undef SOK_SHAPE_FN
#undef SOK_COMMON_ATTRS

// ---------------------------------------------------------------------------
// Kernels.

template <typename E>
absl::Status EnsureExclusiveBuffer(OpKernelContext* ctx, Var* var) {
  Tensor* t = var->tensor();
  if (t->RefCountIsOne()) return absl::OkStatus();
  ::sok::VariableCopyBytesCounter().fetch_add(
      static_cast<int64_t>(t->TotalBytes()));
  Tensor tmp;
  AllocatorAttributes attr;
  attr.set_gpu_compatible(true);
  attr.set_nic_compatible(true);
  TF_RETURN_IF_ERROR(ctx->allocate_temp(t->dtype(), t->shape(), &tmp, attr));
  if (t->NumElements() > 0) {
    tmp.flat<E>().device(ctx->eigen_cpu_device()) =
        const_cast<const Tensor*>(t)->flat<E>();
  }
  *t = tmp;
  return absl::OkStatus();
}

// The updated buffers of one op: the table (dtype T) and the slots (dtype
// A = Tacc), slot[i] for resource input i (slot[0] and unused ones nullptr).
template <typename T, typename A>
struct Buffers {
  T* var = nullptr;
  std::vector<A*> slot;
};

struct ApplyArgs {
  int64_t rows = 0;
  int64_t dim = 0;
  const int64_t* uniq_rows = nullptr;
  int64_t n = 0;
  so::ParallelFor pf;
};

// Which device a kernel class runs on (the template argument `Device` of
// the kernels below).
struct CpuKernel {};
struct GpuKernel {};

// What the shared host-side validation hands to the device-specific part.
struct Validated {
  std::string op;
  std::vector<int> used;                  // resource inputs read/written
  std::vector<core::RefCountPtr<Var>> vars;  // vars[j] is input used[j]
  int64_t rows = 0;
  int64_t dim = 0;
  int64_t k = 0;
};

// Shared logic; subclasses name their resource inputs and run the rule.
// Compute validates, looks up and locks the variables (identically for both
// devices), then runs the device-specific part (Run).
template <typename Device, typename T, typename Index>
class SokSparseApplyBase : public OpKernel {
 public:
  // The accumulation type (float for half / bfloat16 tables).
  using A = ::sok::TfAccOf<T>;
  using B = Buffers<T, A>;
  // The core/ storage type of the table (sok::Half for Eigen::half, ...).
  using C = ::sok::CoreT<T>;

  SokSparseApplyBase(OpKernelConstruction* c, std::vector<std::string> names,
                     int num_scalars)
      : OpKernel(c), names_(std::move(names)), num_scalars_(num_scalars) {
    OP_REQUIRES_OK(c, c->GetAttr("indices_are_unique", &indices_are_unique_));
  }

  void Compute(OpKernelContext* ctx) override {
    const int nres = static_cast<int>(names_.size());
    Validated val;
    val.op = type_string();
    const std::string& op = val.op;
    const Tensor& indices = ctx->input(nres);
    const Tensor& grad = ctx->input(nres + 1);
    OP_REQUIRES(ctx, TensorShapeUtils::IsVector(indices.shape()),
                errors::InvalidArgument(op, ": indices must be a vector, got "
                                            "shape ",
                                        indices.shape().DebugString()));
    OP_REQUIRES(ctx, grad.dims() >= 1,
                errors::InvalidArgument(op, ": grad must have rank >= 1, got "
                                            "shape ",
                                        grad.shape().DebugString()));
    OP_REQUIRES(ctx, grad.dim_size(0) == indices.dim_size(0),
                errors::InvalidArgument(
                    op, ": grad's first dimension must equal the number of "
                        "indices; grad shape ",
                    grad.shape().DebugString(), ", indices shape ",
                    indices.shape().DebugString()));
    for (int i = 0; i < num_scalars_; ++i) {
      const Tensor& s = ctx->input(nres + 2 + i);
      OP_REQUIRES(ctx, TensorShapeUtils::IsScalar(s.shape()),
                  errors::InvalidArgument(
                      op, ": hyperparameter '",
                      def().input(nres + 2 + i), "' must be a scalar, got "
                      "shape ", s.shape().DebugString()));
    }

    // Look up the used variables.
    val.used = UsedResources();
    const std::vector<int>& used = val.used;
    val.vars.resize(used.size());
    std::vector<core::RefCountPtr<Var>>& vars = val.vars;
    for (size_t j = 0; j < used.size(); ++j) {
      OP_REQUIRES_OK(ctx, LookupResource(ctx, HandleFromInput(ctx, used[j]),
                                         &vars[j]));
    }
    for (size_t a = 0; a < used.size(); ++a) {
      for (size_t b = a + 1; b < used.size(); ++b) {
        OP_REQUIRES(ctx, vars[a].get() != vars[b].get(),
                    errors::InvalidArgument(
                        op, ": '", names_[used[a]], "' and '",
                        names_[used[b]], "' are the same variable"));
      }
    }
    // Lock them all, in a consistent (address) order.
    std::vector<mutex*> mus;
    for (auto& v : vars) mus.push_back(v->mu());
    std::sort(mus.begin(), mus.end());
    std::vector<mutex_lock> locks;
    locks.reserve(mus.size());
    for (mutex* mu : mus) locks.emplace_back(*mu);

    // Validate dtypes and shapes: the table has grad's dtype T, every slot
    // the accumulation dtype A.
    const DataType dt = DataTypeToEnum<T>::v();
    const DataType acc_dt = DataTypeToEnum<A>::v();
    for (size_t j = 0; j < used.size(); ++j) {
      const Tensor* t = vars[j]->tensor();
      const std::string& name = names_[used[j]];
      OP_REQUIRES(ctx, t->IsInitialized(),
                  errors::FailedPrecondition(op, ": variable '", name,
                                             "' is uninitialized"));
      if (used[j] == 0) {
        OP_REQUIRES(ctx, t->dtype() == dt,
                    errors::InvalidArgument(
                        op, ": variable '", name, "' has dtype ",
                        DataTypeString(t->dtype()), " but grad has dtype ",
                        DataTypeString(dt)));
      } else {
        OP_REQUIRES(ctx, t->dtype() == acc_dt,
                    errors::InvalidArgument(
                        op, ": slot '", name, "' has dtype ",
                        DataTypeString(t->dtype()), " but a table of dtype ",
                        DataTypeString(dt), " needs ",
                        DataTypeString(acc_dt), " slots"));
      }
    }
    const TensorShape& var_shape = vars[0]->tensor()->shape();
    OP_REQUIRES(ctx, var_shape.dims() >= 1,
                errors::InvalidArgument(op, ": var must have rank >= 1, got "
                                            "shape ",
                                        var_shape.DebugString()));
    for (size_t j = 1; j < used.size(); ++j) {
      const TensorShape& s = vars[j]->tensor()->shape();
      OP_REQUIRES(ctx, s == var_shape,
                  errors::InvalidArgument(
                      op, ": slot '", names_[used[j]], "' has shape ",
                      s.DebugString(), " but var has shape ",
                      var_shape.DebugString()));
    }
    bool inner_ok = grad.dims() == var_shape.dims();
    int64_t dim = 1;
    for (int d = 1; d < var_shape.dims(); ++d) {
      dim *= var_shape.dim_size(d);
      if (inner_ok && grad.dim_size(d) != var_shape.dim_size(d)) {
        inner_ok = false;
      }
    }
    OP_REQUIRES(ctx, inner_ok,
                errors::InvalidArgument(
                    op, ": grad shape ", grad.shape().DebugString(),
                    " does not match var shape ", var_shape.DebugString(),
                    " (expected [k] + var.shape[1:] with k = number of "
                    "indices)"));
    val.rows = var_shape.dim_size(0);
    val.dim = dim;
    val.k = indices.dim_size(0);
    // The locks stay held until Run returns.
    Run(ctx, &val, indices, grad, Device());
  }

 protected:
  A Scalar(OpKernelContext* ctx, int i) const {
    return ctx->input(static_cast<int>(names_.size()) + 2 + i).scalar<A>()();
  }
  // Indices (into names_) of the resource inputs that are read/written.
  virtual std::vector<int> UsedResources() const {
    std::vector<int> all(names_.size());
    for (size_t i = 0; i < all.size(); ++i) all[i] = static_cast<int>(i);
    return all;
  }
  // CPU: the table and the slots (see Buffers); grad is the summed
  // gradient [n, dim] in A.
  virtual so::Status Apply(OpKernelContext* ctx, const B& bufs, const A* grad,
                           const ApplyArgs& a) = 0;
#ifdef SOK_WITH_CUDA
  // GPU: fills the rule's hyperparameters (read on the host: every scalar
  // input is HostMemory in the GPU registrations) and returns the rule. The
  // slots are passed as s1..s3 = resource inputs 1..3 (nullptr if unused);
  // see so::gpu::ApplyRule.
  virtual so::gpu::Rule GpuRule(OpKernelContext* ctx,
                                so::gpu::Hyper* h) const = 0;
#endif

 private:
  // The CPU part: unique rows, summed duplicates, copy-on-write, Apply.
  void Run(OpKernelContext* ctx, Validated* val, const Tensor& indices,
           const Tensor& grad, CpuKernel) {
    const std::string& op = val->op;
    const std::vector<int>& used = val->used;
    std::vector<core::RefCountPtr<Var>>& vars = val->vars;
    const int64_t rows = val->rows;
    const int64_t dim = val->dim;
    const int64_t k = val->k;

    // Unique rows; validates every index before anything is written.
    so::UniqueIndex uniq;
    so::Status st = so::BuildUniqueIndex<Index>(indices.flat<Index>().data(),
                                                k, rows, &uniq);
    OP_REQUIRES(ctx, st.ok(), errors::InvalidArgument(op, ": ", st.message()));
    if (k == 0) return;

    ApplyArgs args;
    args.rows = rows;
    args.dim = dim;
    args.uniq_rows = uniq.rows.data();
    args.n = static_cast<int64_t>(uniq.rows.size());
    args.pf = ::sok::CpuParallelFor(ctx);

    // Sum duplicates, in A (for a 16-bit table, also loads the gradient
    // into A when there are none).
    const A* g = nullptr;
    Tensor summed;
    if constexpr (std::is_same<T, A>::value) {
      g = grad.flat<T>().data();
    }
    if (!uniq.all_unique || !std::is_same<T, A>::value) {
      OP_REQUIRES_OK(ctx, ctx->allocate_temp(DataTypeToEnum<A>::v(),
                                             TensorShape({args.n, dim}),
                                             &summed));
      so::SumDuplicateRows<::sok::CoreT<T>>(
          ::sok::CorePtr(grad.flat<T>().data()), dim, uniq,
          summed.flat<A>().data(), args.pf);
      g = summed.flat<A>().data();
    }

    // Copy-on-write, then update in place.
    B bufs;
    bufs.slot.assign(names_.size(), nullptr);
    for (size_t j = 0; j < used.size(); ++j) {
      if (used[j] == 0) {
        OP_REQUIRES_OK(ctx, EnsureExclusiveBuffer<T>(ctx, vars[j].get()));
        bufs.var = vars[j]->tensor()->flat<T>().data();
      } else {
        OP_REQUIRES_OK(ctx, EnsureExclusiveBuffer<A>(ctx, vars[j].get()));
        bufs.slot[used[j]] = vars[j]->tensor()->flat<A>().data();
      }
    }
    st = Apply(ctx, bufs, g, args);
    OP_REQUIRES(ctx, st.ok(), errors::Internal(op, ": ", st.message()));
  }

#ifdef SOK_WITH_CUDA
  // The GPU part: validate + deduplicate the indices on the device (one
  // blocking copy of the result), copy-on-write, then one update per unique
  // row with its gradients summed in ascending position order.
  void Run(OpKernelContext* ctx, Validated* val, const Tensor& indices,
           const Tensor& grad, GpuKernel) {
    const std::string& op = val->op;
    const std::vector<int>& used = val->used;
    std::vector<core::RefCountPtr<Var>>& vars = val->vars;
    if (val->k == 0) return;  // nothing to validate or update

    ::sok::GpuScratch scratch(ctx);  // alive until Run returns
    const ::sok::GpuDevice d = ::sok::MakeGpuDevice(ctx, &scratch);

    // Validates every index before anything is written. Indices proven
    // distinct at trace time (indices_are_unique, set by sok_keras only for
    // the rows output of a dedup against this table's rows) skip the sort
    // and its host sync; a row outside the table is then never written.
    so::gpu::DedupResult dedup;
    so::Status st =
        indices_are_unique_
            ? so::gpu::DistinctRows<Index>(d, indices.flat<Index>().data(),
                                           val->k, val->rows, &dedup)
            : so::gpu::Dedup<Index>(d, indices.flat<Index>().data(), val->k,
                                    val->rows, &dedup);
    OP_REQUIRES(ctx, st.ok(), errors::Internal(op, ": ", st.message()));
    OP_REQUIRES(ctx, dedup.bad_position < 0,
                errors::InvalidArgument(
                    op, ": ",
                    so::gpu::InvalidIndexMessage(dedup.bad_position,
                                                 dedup.bad_value, val->rows)));

    // Copy-on-write, then update in place.
    B bufs;
    bufs.slot.assign(names_.size(), nullptr);
    for (size_t j = 0; j < used.size(); ++j) {
      OP_REQUIRES_OK(ctx, EnsureExclusiveBufferGpu(ctx, d, vars[j].get()));
      if (used[j] == 0) {
        bufs.var = vars[j]->tensor()->flat<T>().data();
      } else {
        bufs.slot[used[j]] = vars[j]->tensor()->flat<A>().data();
      }
    }
    so::gpu::Hyper h;
    const so::gpu::Rule rule = GpuRule(ctx, &h);
    auto slot = [&bufs](size_t i) -> A* {
      return i < bufs.slot.size() ? bufs.slot[i] : nullptr;
    };
    st = so::gpu::ApplyRule<::sok::CoreT<T>>(
        d, rule, h, ::sok::CorePtr(bufs.var), slot(1), slot(2), slot(3),
        val->dim, dedup, ::sok::CorePtr(grad.flat<T>().data()));
    OP_REQUIRES(ctx, st.ok(), errors::Internal(op, ": ", st.message()));
  }

  // Device counterpart of EnsureExclusiveBuffer: a stream-ordered copy into
  // a fresh GPU buffer when the variable's buffer is shared.
  static absl::Status EnsureExclusiveBufferGpu(OpKernelContext* ctx,
                                               const ::sok::GpuDevice& d,
                                               Var* var) {
    Tensor* t = var->tensor();
    if (t->RefCountIsOne()) return absl::OkStatus();
    ::sok::VariableCopyBytesCounter().fetch_add(
        static_cast<int64_t>(t->TotalBytes()));
    Tensor tmp;
    TF_RETURN_IF_ERROR(ctx->allocate_temp(t->dtype(), t->shape(), &tmp));
    if (t->NumElements() > 0) {
      const so::Status st = so::gpu::CopyDevice(
          d, tmp.data(), t->data(), static_cast<int64_t>(t->TotalBytes()));
      if (!st.ok()) {
        return errors::Internal("copy-on-write of a variable: ", st.message());
      }
    }
    *t = tmp;
    return absl::OkStatus();
  }
#endif  // SOK_WITH_CUDA

  std::vector<std::string> names_;
  int num_scalars_;
  // The indices are distinct (see so::gpu::DistinctRows). The CPU kernel
  // ignores it: its dedup finds out by itself, at no sync cost.
  bool indices_are_unique_ = false;
};

// Each op class is templated on the device tag (CpuKernel / GpuKernel):
// `Apply` is the CPU rule, `GpuRule` (CUDA builds) names the GPU rule and
// reads the same scalars into a so::gpu::Hyper.
template <typename Device, typename T, typename Index>
class SgdOp : public SokSparseApplyBase<Device, T, Index> {
 public:
  explicit SgdOp(OpKernelConstruction* c)
      : SokSparseApplyBase<Device, T, Index>(c, {"var"}, 1) {}

 protected:
  using typename SokSparseApplyBase<Device, T, Index>::A;
  using typename SokSparseApplyBase<Device, T, Index>::B;
  using typename SokSparseApplyBase<Device, T, Index>::C;
  so::Status Apply(OpKernelContext* ctx, const B& b, const A* g,
                   const ApplyArgs& a) override {
    return so::ApplySgd<C>(::sok::CorePtr(b.var), a.rows, a.dim, a.uniq_rows,
                           g, a.n, this->Scalar(ctx, 0), a.pf);
  }
#ifdef SOK_WITH_CUDA
  so::gpu::Rule GpuRule(OpKernelContext* ctx,
                        so::gpu::Hyper* h) const override {
    h->lr = this->Scalar(ctx, 0);
    return so::gpu::Rule::kSgd;
  }
#endif
};

template <typename Device, typename T, typename Index>
class MomentumOp : public SokSparseApplyBase<Device, T, Index> {
 public:
  explicit MomentumOp(OpKernelConstruction* c)
      : SokSparseApplyBase<Device, T, Index>(c, {"var", "m"}, 2) {
    OP_REQUIRES_OK(c, c->GetAttr("nesterov", &nesterov_));
  }

 protected:
  using typename SokSparseApplyBase<Device, T, Index>::A;
  using typename SokSparseApplyBase<Device, T, Index>::B;
  using typename SokSparseApplyBase<Device, T, Index>::C;
  so::Status Apply(OpKernelContext* ctx, const B& b, const A* g,
                   const ApplyArgs& a) override {
    return so::ApplyMomentum<C>(::sok::CorePtr(b.var), b.slot[1], a.rows,
                                a.dim, a.uniq_rows, g, a.n,
                                this->Scalar(ctx, 0), this->Scalar(ctx, 1),
                                nesterov_, a.pf);
  }
#ifdef SOK_WITH_CUDA
  so::gpu::Rule GpuRule(OpKernelContext* ctx,
                        so::gpu::Hyper* h) const override {
    h->lr = this->Scalar(ctx, 0);
    h->momentum = this->Scalar(ctx, 1);
    h->nesterov = nesterov_;
    return so::gpu::Rule::kMomentum;
  }
#endif

 private:
  bool nesterov_ = false;
};

template <typename Device, typename T, typename Index>
class AdagradOp : public SokSparseApplyBase<Device, T, Index> {
 public:
  explicit AdagradOp(OpKernelConstruction* c)
      : SokSparseApplyBase<Device, T, Index>(c, {"var", "accumulator"}, 2) {}

 protected:
  using typename SokSparseApplyBase<Device, T, Index>::A;
  using typename SokSparseApplyBase<Device, T, Index>::B;
  using typename SokSparseApplyBase<Device, T, Index>::C;
  so::Status Apply(OpKernelContext* ctx, const B& b, const A* g,
                   const ApplyArgs& a) override {
    return so::ApplyAdagrad<C>(::sok::CorePtr(b.var), b.slot[1], a.rows,
                               a.dim, a.uniq_rows, g, a.n,
                               this->Scalar(ctx, 0), this->Scalar(ctx, 1),
                               a.pf);
  }
#ifdef SOK_WITH_CUDA
  so::gpu::Rule GpuRule(OpKernelContext* ctx,
                        so::gpu::Hyper* h) const override {
    h->lr = this->Scalar(ctx, 0);
    h->epsilon = this->Scalar(ctx, 1);
    return so::gpu::Rule::kAdagrad;
  }
#endif
};

template <typename Device, typename T, typename Index, bool kWeightDecay>
class AdamOp : public SokSparseApplyBase<Device, T, Index> {
 public:
  explicit AdamOp(OpKernelConstruction* c)
      : SokSparseApplyBase<Device, T, Index>(c, {"var", "m", "v", "vhat"},
                                             kWeightDecay ? 6 : 5) {
    OP_REQUIRES_OK(c, c->GetAttr("amsgrad", &amsgrad_));
  }

 protected:
  std::vector<int> UsedResources() const override {
    if (amsgrad_) return {0, 1, 2, 3};
    return {0, 1, 2};
  }
  using typename SokSparseApplyBase<Device, T, Index>::A;
  using typename SokSparseApplyBase<Device, T, Index>::B;
  using typename SokSparseApplyBase<Device, T, Index>::C;
  so::Status Apply(OpKernelContext* ctx, const B& b, const A* g,
                   const ApplyArgs& a) override {
    const A wd = kWeightDecay ? this->Scalar(ctx, 5) : A(0);
    return so::ApplyAdam<C>(
        ::sok::CorePtr(b.var), b.slot[1], b.slot[2],
        amsgrad_ ? b.slot[3] : nullptr,
                            a.rows, a.dim, a.uniq_rows, g, a.n,
                            this->Scalar(ctx, 0), this->Scalar(ctx, 1),
                            this->Scalar(ctx, 2), this->Scalar(ctx, 3),
                            this->Scalar(ctx, 4), kWeightDecay, wd, a.pf);
  }
#ifdef SOK_WITH_CUDA
  // vhat (s3) is nullptr unless amsgrad: it is then not in UsedResources.
  so::gpu::Rule GpuRule(OpKernelContext* ctx,
                        so::gpu::Hyper* h) const override {
    h->lr = this->Scalar(ctx, 0);
    h->beta_1 = this->Scalar(ctx, 1);
    h->beta_2 = this->Scalar(ctx, 2);
    h->epsilon = this->Scalar(ctx, 3);
    h->step = this->Scalar(ctx, 4);
    h->apply_weight_decay = kWeightDecay;
    h->weight_decay = kWeightDecay ? this->Scalar(ctx, 5) : 0.0;
    return so::gpu::Rule::kAdam;
  }
#endif

 private:
  bool amsgrad_ = false;
};

template <typename Device, typename T, typename Index>
class FtrlOp : public SokSparseApplyBase<Device, T, Index> {
 public:
  explicit FtrlOp(OpKernelConstruction* c)
      : SokSparseApplyBase<Device, T, Index>(
            c, {"var", "accumulator", "linear"}, 6) {}

 protected:
  using typename SokSparseApplyBase<Device, T, Index>::A;
  using typename SokSparseApplyBase<Device, T, Index>::B;
  using typename SokSparseApplyBase<Device, T, Index>::C;
  so::Status Apply(OpKernelContext* ctx, const B& b, const A* g,
                   const ApplyArgs& a) override {
    return so::ApplyFtrl<C>(::sok::CorePtr(b.var), b.slot[1], b.slot[2],
                            a.rows, a.dim, a.uniq_rows, g, a.n,
                            this->Scalar(ctx, 0), this->Scalar(ctx, 1),
                            this->Scalar(ctx, 2), this->Scalar(ctx, 3),
                            this->Scalar(ctx, 4), this->Scalar(ctx, 5), a.pf);
  }
#ifdef SOK_WITH_CUDA
  so::gpu::Rule GpuRule(OpKernelContext* ctx,
                        so::gpu::Hyper* h) const override {
    h->lr = this->Scalar(ctx, 0);
    h->lr_power = this->Scalar(ctx, 1);
    h->l1 = this->Scalar(ctx, 2);
    h->l2 = this->Scalar(ctx, 3);
    h->l2_shrinkage = this->Scalar(ctx, 4);
    h->beta = this->Scalar(ctx, 5);
    return so::gpu::Rule::kFtrl;
  }
#endif
};

template <typename Device, typename T, typename Index>
class RmspropOp : public SokSparseApplyBase<Device, T, Index> {
 public:
  explicit RmspropOp(OpKernelConstruction* c)
      : SokSparseApplyBase<Device, T, Index>(
            c, {"var", "velocity", "mom", "mg"}, 4) {
    OP_REQUIRES_OK(c, c->GetAttr("centered", &centered_));
    OP_REQUIRES_OK(c, c->GetAttr("use_momentum", &use_momentum_));
  }

 protected:
  std::vector<int> UsedResources() const override {
    std::vector<int> u = {0, 1};
    if (use_momentum_) u.push_back(2);
    if (centered_) u.push_back(3);
    return u;
  }
  using typename SokSparseApplyBase<Device, T, Index>::A;
  using typename SokSparseApplyBase<Device, T, Index>::B;
  using typename SokSparseApplyBase<Device, T, Index>::C;
  so::Status Apply(OpKernelContext* ctx, const B& b, const A* g,
                   const ApplyArgs& a) override {
    return so::ApplyRmsprop<C>(
        ::sok::CorePtr(b.var), b.slot[1], use_momentum_ ? b.slot[2] : nullptr,
        centered_ ? b.slot[3] : nullptr,
        a.rows, a.dim, a.uniq_rows, g, a.n, this->Scalar(ctx, 0),
        this->Scalar(ctx, 1), this->Scalar(ctx, 2), this->Scalar(ctx, 3),
        a.pf);
  }
#ifdef SOK_WITH_CUDA
  // mom (s2) / mg (s3) are nullptr unless use_momentum / centered: they are
  // then not in UsedResources.
  so::gpu::Rule GpuRule(OpKernelContext* ctx,
                        so::gpu::Hyper* h) const override {
    h->lr = this->Scalar(ctx, 0);
    h->rho = this->Scalar(ctx, 1);
    h->momentum = this->Scalar(ctx, 2);
    h->epsilon = this->Scalar(ctx, 3);
    return so::gpu::Rule::kRmsprop;
  }
#endif

 private:
  bool centered_ = false;
  bool use_momentum_ = false;
};

template <typename Device, typename T, typename Index>
class AdamaxOp : public SokSparseApplyBase<Device, T, Index> {
 public:
  explicit AdamaxOp(OpKernelConstruction* c)
      : SokSparseApplyBase<Device, T, Index>(c, {"var", "m", "u"}, 5) {}

 protected:
  using typename SokSparseApplyBase<Device, T, Index>::A;
  using typename SokSparseApplyBase<Device, T, Index>::B;
  using typename SokSparseApplyBase<Device, T, Index>::C;
  so::Status Apply(OpKernelContext* ctx, const B& b, const A* g,
                   const ApplyArgs& a) override {
    return so::ApplyAdamax<C>(::sok::CorePtr(b.var), b.slot[1], b.slot[2],
                              a.rows, a.dim, a.uniq_rows, g, a.n,
                              this->Scalar(ctx, 0), this->Scalar(ctx, 1),
                              this->Scalar(ctx, 2), this->Scalar(ctx, 3),
                              this->Scalar(ctx, 4), a.pf);
  }
#ifdef SOK_WITH_CUDA
  so::gpu::Rule GpuRule(OpKernelContext* ctx,
                        so::gpu::Hyper* h) const override {
    h->lr = this->Scalar(ctx, 0);
    h->beta_1 = this->Scalar(ctx, 1);
    h->beta_2 = this->Scalar(ctx, 2);
    h->epsilon = this->Scalar(ctx, 3);
    h->step = this->Scalar(ctx, 4);
    return so::gpu::Rule::kAdamax;
  }
#endif
};

template <typename Device, typename T, typename Index>
class AdadeltaOp : public SokSparseApplyBase<Device, T, Index> {
 public:
  explicit AdadeltaOp(OpKernelConstruction* c)
      : SokSparseApplyBase<Device, T, Index>(
            c, {"var", "accumulated_grad", "accumulated_delta_var"}, 3) {}

 protected:
  using typename SokSparseApplyBase<Device, T, Index>::A;
  using typename SokSparseApplyBase<Device, T, Index>::B;
  using typename SokSparseApplyBase<Device, T, Index>::C;
  so::Status Apply(OpKernelContext* ctx, const B& b, const A* g,
                   const ApplyArgs& a) override {
    return so::ApplyAdadelta<C>(::sok::CorePtr(b.var), b.slot[1], b.slot[2],
                                a.rows, a.dim, a.uniq_rows, g, a.n,
                                this->Scalar(ctx, 0), this->Scalar(ctx, 1),
                                this->Scalar(ctx, 2), a.pf);
  }
#ifdef SOK_WITH_CUDA
  so::gpu::Rule GpuRule(OpKernelContext* ctx,
                        so::gpu::Hyper* h) const override {
    h->lr = this->Scalar(ctx, 0);
    h->rho = this->Scalar(ctx, 1);
    h->epsilon = this->Scalar(ctx, 2);
    return so::gpu::Rule::kAdadelta;
  }
#endif
};

template <typename Device, typename T, typename Index>
class LionOp : public SokSparseApplyBase<Device, T, Index> {
 public:
  explicit LionOp(OpKernelConstruction* c)
      : SokSparseApplyBase<Device, T, Index>(c, {"var", "m"}, 3) {}

 protected:
  using typename SokSparseApplyBase<Device, T, Index>::A;
  using typename SokSparseApplyBase<Device, T, Index>::B;
  using typename SokSparseApplyBase<Device, T, Index>::C;
  so::Status Apply(OpKernelContext* ctx, const B& b, const A* g,
                   const ApplyArgs& a) override {
    return so::ApplyLion<C>(::sok::CorePtr(b.var), b.slot[1], a.rows, a.dim,
                            a.uniq_rows, g, a.n, this->Scalar(ctx, 0),
                            this->Scalar(ctx, 1), this->Scalar(ctx, 2), a.pf);
  }
#ifdef SOK_WITH_CUDA
  so::gpu::Rule GpuRule(OpKernelContext* ctx,
                        so::gpu::Hyper* h) const override {
    h->lr = this->Scalar(ctx, 0);
    h->beta_1 = this->Scalar(ctx, 1);
    h->beta_2 = this->Scalar(ctx, 2);
    return so::gpu::Rule::kLion;
  }
#endif
};

template <typename Device, typename T, typename Index>
class NadamOp : public SokSparseApplyBase<Device, T, Index> {
 public:
  explicit NadamOp(OpKernelConstruction* c)
      : SokSparseApplyBase<Device, T, Index>(c, {"var", "m", "v"}, 8) {}

 protected:
  using typename SokSparseApplyBase<Device, T, Index>::A;
  using typename SokSparseApplyBase<Device, T, Index>::B;
  using typename SokSparseApplyBase<Device, T, Index>::C;
  so::Status Apply(OpKernelContext* ctx, const B& b, const A* g,
                   const ApplyArgs& a) override {
    return so::ApplyNadam<C>(::sok::CorePtr(b.var), b.slot[1], b.slot[2],
                             a.rows, a.dim, a.uniq_rows, g, a.n,
                             this->Scalar(ctx, 0), this->Scalar(ctx, 1),
                             this->Scalar(ctx, 2), this->Scalar(ctx, 3),
                             this->Scalar(ctx, 4), this->Scalar(ctx, 5),
                             this->Scalar(ctx, 6), this->Scalar(ctx, 7), a.pf);
  }
#ifdef SOK_WITH_CUDA
  so::gpu::Rule GpuRule(OpKernelContext* ctx,
                        so::gpu::Hyper* h) const override {
    h->lr = this->Scalar(ctx, 0);
    h->beta_1 = this->Scalar(ctx, 1);
    h->beta_2 = this->Scalar(ctx, 2);
    h->epsilon = this->Scalar(ctx, 3);
    h->u_t = this->Scalar(ctx, 4);
    h->u_t_1 = this->Scalar(ctx, 5);
    h->u_product = this->Scalar(ctx, 6);
    h->beta_2_power = this->Scalar(ctx, 7);
    return so::gpu::Rule::kNadam;
  }
#endif
};

template <typename Device, typename T, typename Index>
using AdamNoWd = AdamOp<Device, T, Index, false>;
template <typename Device, typename T, typename Index>
using AdamWd = AdamOp<Device, T, Index, true>;

#define SOK_REGISTER(NAME, KERNEL, T, Index)                       \
  REGISTER_KERNEL_BUILDER(Name(NAME)                               \
                              .Device(DEVICE_CPU)                  \
                              .TypeConstraint<T>("T")              \
                              .TypeConstraint<::sok::TfAccOf<T>>(  \
                                  "Tacc")                          \
                              .TypeConstraint<Index>("Tindices"),  \
                          KERNEL<CpuKernel, T, Index>);

#define SOK_REGISTER_ALL(T, Index)                                  \
  SOK_REGISTER("SokSparseApplySgd", SgdOp, T, Index)               \
  SOK_REGISTER("SokSparseApplyMomentum", MomentumOp, T, Index)     \
  SOK_REGISTER("SokSparseApplyAdagrad", AdagradOp, T, Index)       \
  SOK_REGISTER("SokSparseApplyAdam", AdamNoWd, T, Index)           \
  SOK_REGISTER("SokSparseApplyAdamW", AdamWd, T, Index)            \
  SOK_REGISTER("SokSparseApplyFtrl", FtrlOp, T, Index)             \
  SOK_REGISTER("SokSparseApplyRmsprop", RmspropOp, T, Index)       \
  SOK_REGISTER("SokSparseApplyAdamax", AdamaxOp, T, Index)         \
  SOK_REGISTER("SokSparseApplyAdadelta", AdadeltaOp, T, Index)     \
  SOK_REGISTER("SokSparseApplyLion", LionOp, T, Index)             \
  SOK_REGISTER("SokSparseApplyNadam", NadamOp, T, Index)

SOK_REGISTER_ALL(float, int32)
SOK_REGISTER_ALL(float, int64_t)
SOK_REGISTER_ALL(double, int32)
SOK_REGISTER_ALL(double, int64_t)
SOK_REGISTER_ALL(Eigen::half, int32)
SOK_REGISTER_ALL(Eigen::half, int64_t)
SOK_REGISTER_ALL(bfloat16, int32)
SOK_REGISTER_ALL(bfloat16, int64_t)

#undef SOK_REGISTER_ALL
#undef SOK_REGISTER

#ifdef SOK_WITH_CUDA
// GPU kernels: resource handles are host memory (always, for DT_RESOURCE);
// indices and grad are device memory; every scalar hyperparameter is
// HostMemory, read on the host by Scalar() exactly as on the CPU.
#define SOK_REGISTER_GPU(NAME, KERNEL, T, Index, HOST_MEMORY)      \
  REGISTER_KERNEL_BUILDER(Name(NAME)                               \
                              .Device(DEVICE_GPU)                  \
                              .TypeConstraint<T>("T")              \
                              .TypeConstraint<::sok::TfAccOf<T>>(  \
                                  "Tacc")                          \
                              .TypeConstraint<Index>("Tindices")   \
                              HOST_MEMORY,                         \
                          KERNEL<GpuKernel, T, Index>);

#define SOK_HOST_SGD .HostMemory("lr")
#define SOK_HOST_MOMENTUM .HostMemory("lr").HostMemory("momentum")
#define SOK_HOST_ADAGRAD .HostMemory("lr").HostMemory("epsilon")
#define SOK_HOST_ADAM                                              \
  .HostMemory("lr").HostMemory("beta_1").HostMemory("beta_2")      \
      .HostMemory("epsilon").HostMemory("step")
#define SOK_HOST_ADAMW SOK_HOST_ADAM.HostMemory("weight_decay")
#define SOK_HOST_FTRL                                              \
  .HostMemory("lr").HostMemory("lr_power").HostMemory("l1")        \
      .HostMemory("l2").HostMemory("l2_shrinkage").HostMemory("beta")
#define SOK_HOST_RMSPROP                                           \
  .HostMemory("lr").HostMemory("rho").HostMemory("momentum")       \
      .HostMemory("epsilon")
#define SOK_HOST_ADAMAX                                            \
  .HostMemory("lr").HostMemory("beta_1").HostMemory("beta_2")      \
      .HostMemory("epsilon").HostMemory("step")
#define SOK_HOST_ADADELTA                                          \
  .HostMemory("lr").HostMemory("rho").HostMemory("epsilon")
#define SOK_HOST_LION                                              \
  .HostMemory("lr").HostMemory("beta_1").HostMemory("beta_2")
#define SOK_HOST_NADAM                                             \
  SOK_HOST_LION.HostMemory("epsilon").HostMemory("u_t")            \
      .HostMemory("u_t_1").HostMemory("u_product")                 \
      .HostMemory("beta_2_power")

#define SOK_REGISTER_GPU_ALL(T, Index)                                        \
  SOK_REGISTER_GPU("SokSparseApplySgd", SgdOp, T, Index, SOK_HOST_SGD)       \
  SOK_REGISTER_GPU("SokSparseApplyMomentum", MomentumOp, T, Index,           \
                   SOK_HOST_MOMENTUM)                                         \
  SOK_REGISTER_GPU("SokSparseApplyAdagrad", AdagradOp, T, Index,             \
                   SOK_HOST_ADAGRAD)                                          \
  SOK_REGISTER_GPU("SokSparseApplyAdam", AdamNoWd, T, Index, SOK_HOST_ADAM)  \
  SOK_REGISTER_GPU("SokSparseApplyAdamW", AdamWd, T, Index, SOK_HOST_ADAMW)  \
  SOK_REGISTER_GPU("SokSparseApplyFtrl", FtrlOp, T, Index, SOK_HOST_FTRL)    \
  SOK_REGISTER_GPU("SokSparseApplyRmsprop", RmspropOp, T, Index,             \
                   SOK_HOST_RMSPROP)                                          \
  SOK_REGISTER_GPU("SokSparseApplyAdamax", AdamaxOp, T, Index,               \
                   SOK_HOST_ADAMAX)                                           \
  SOK_REGISTER_GPU("SokSparseApplyAdadelta", AdadeltaOp, T, Index,           \
                   SOK_HOST_ADADELTA)                                         \
  SOK_REGISTER_GPU("SokSparseApplyLion", LionOp, T, Index, SOK_HOST_LION)    \
  SOK_REGISTER_GPU("SokSparseApplyNadam", NadamOp, T, Index, SOK_HOST_NADAM)

SOK_REGISTER_GPU_ALL(float, int32)
SOK_REGISTER_GPU_ALL(float, int64_t)
SOK_REGISTER_GPU_ALL(double, int32)
SOK_REGISTER_GPU_ALL(double, int64_t)
SOK_REGISTER_GPU_ALL(Eigen::half, int32)
SOK_REGISTER_GPU_ALL(Eigen::half, int64_t)
SOK_REGISTER_GPU_ALL(bfloat16, int32)
SOK_REGISTER_GPU_ALL(bfloat16, int64_t)

#undef SOK_REGISTER_GPU_ALL
#undef SOK_HOST_NADAM
#undef SOK_HOST_LION
#undef SOK_HOST_ADADELTA
#undef SOK_HOST_ADAMAX
#undef SOK_HOST_RMSPROP
#undef SOK_HOST_FTRL
#undef SOK_HOST_ADAMW
#undef SOK_HOST_ADAM
#undef SOK_HOST_ADAGRAD
#undef SOK_HOST_MOMENTUM
#undef SOK_HOST_SGD
#undef SOK_REGISTER_GPU
#endif  // SOK_WITH_CUDA

}  // namespace
}  // namespace tensorflow
