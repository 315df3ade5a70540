// TensorFlow ops over the NCCL communicator (comm/nccl.h):
//
//   id = SokNcclUniqueId(library)                      CPU; rank 0 only
//   handle = SokNcclInit(id, rank, num_ranks, library, timeout_seconds)
//   y = SokNcclAllToAll(x, send_counts, recv_counts, handle)
//   y = SokNcclAllReduce(x, handle, reduction)
//   y = SokNcclAllGather(x, handle)
//   y = SokNcclBroadcast(x, handle, root)
//   error = SokNcclHealth(handle)                      CPU
//
// The collectives run on the op's own CUDA stream, in program order (they
// are stateful, so tf.function chains them). Every kernel validates its
// inputs on the host before any NCCL call; the checks that can differ
// between ranks (the counts of an all-to-all) cannot be made collective
// here, so a rank that fails them leaves its peers to the watchdog.
//
// The ops are registered in every build; the GPU kernels only where the
// library is built with CUDA (SOK_WITH_CUDA).
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/framework/tensor_shape.h"
#include "tensorflow/core/framework/types.h"
#include "tensorflow/core/lib/core/errors.h"

#ifdef SOK_WITH_CUDA
#include "comm/nccl.h"
#include "tf/gpu_device.h"
#include "xla/stream_executor/stream.h"
#include "xla/stream_executor/stream_executor.h"
#endif

namespace sok {
namespace {

using ::tensorflow::DEVICE_CPU;
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

constexpr int kUniqueIdBytes = 128;

#define SOK_NCCL_TYPES \
  "T: {float, double, half, bfloat16, int32, int64, uint8, int8}"

// ----------------------------------------------------------------------------
// Registrations (every build).

absl::Status ScalarHandle(InferenceContext* c, int index) {
  ShapeHandle unused;
  return c->WithRank(c->input(index), 0, &unused);
}

REGISTER_OP("SokNcclUniqueId")
    .Input("library: string")
    .Output("id: uint8")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle unused;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 0, &unused));
      c->set_output(0, c->Vector(kUniqueIdBytes));
      return absl::OkStatus();
    })
    .Doc(R"doc(
Loads NCCL from `library` and makes a new NCCL unique id (CPU).

The process that makes the id hosts NCCL's bootstrap root for the
communicator created from it: rank 0 makes it and sends it to every rank.

library: Path of the NCCL shared library (libnccl.so.2); "" lets the dynamic
  loader find libnccl.so.2. NCCL is loaded once per process: a later,
  different path is ignored.
id: The unique id, 128 bytes.
)doc");

REGISTER_OP("SokNcclInit")
    .Input("id: uint8")
    .Output("handle: int64")
    .Attr("rank: int >= 0")
    .Attr("num_ranks: int >= 1")
    .Attr("library: string = ''")
    .Attr("timeout_seconds: float = 600")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle id;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 1, &id));
      DimensionHandle unused;
      TF_RETURN_IF_ERROR(c->WithValue(c->Dim(id, 0), kUniqueIdBytes, &unused));
      c->set_output(0, c->Scalar());
      return absl::OkStatus();
    })
    .Doc(R"doc(
Joins an NCCL communicator on this op's GPU (GPU kernel; id and handle in
host memory). Blocks until all num_ranks ranks have joined.

id: The unique id from SokNcclUniqueId on rank 0, the same on every rank.
handle: The communicator's handle in this process, for the collectives.
rank: This process's rank.
num_ranks: The number of ranks, one GPU each.
library: Path of the NCCL shared library (see SokNcclUniqueId).
timeout_seconds: How long joining, or any collective, may take before the
  communicator is aborted with an error; <= 0: no limit.
)doc");

REGISTER_OP("SokNcclAllToAll")
    .Input("x: T")
    .Input("send_counts: int64")
    .Input("recv_counts: int64")
    .Input("handle: int64")
    .Output("y: T")
    .Attr(SOK_NCCL_TYPES)
    .Attr("key: string = ''")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle x;
      TF_RETURN_IF_ERROR(c->WithRankAtLeast(c->input(0), 1, &x));
      ShapeHandle counts;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 1, &counts));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(2), 1, &counts));
      TF_RETURN_IF_ERROR(ScalarHandle(c, 3));
      ShapeHandle inner;
      TF_RETURN_IF_ERROR(c->Subshape(x, 1, &inner));
      ShapeHandle y;
      TF_RETURN_IF_ERROR(
          c->Concatenate(c->Vector(c->UnknownDim()), inner, &y));
      c->set_output(0, y);
      return absl::OkStatus();
    })
    .Doc(R"doc(
Ragged all-to-all of rows over NCCL (GPU; the counts and handle in host
memory).

x: This rank's rows [S, ...], grouped by destination rank in rank order.
send_counts: [num_ranks]; send_counts[j] rows of x go to rank j (they sum
  to S).
recv_counts: [num_ranks]; recv_counts[j] rows come from rank j (rank j's
  send_counts[this rank]).
handle: From SokNcclInit.
y: [sum(recv_counts), ...], the rows from rank 0 first.
key: A name for error messages (the node's name if empty).
)doc");

REGISTER_OP("SokNcclAllReduce")
    .Input("x: T")
    .Input("handle: int64")
    .Output("y: T")
    .Attr(SOK_NCCL_TYPES)
    .Attr("reduction: {'sum', 'prod', 'max', 'min'} = 'sum'")
    .Attr("key: string = ''")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      TF_RETURN_IF_ERROR(ScalarHandle(c, 1));
      c->set_output(0, c->input(0));
      return absl::OkStatus();
    })
    .Doc(R"doc(
All-reduce over NCCL (GPU; the handle in host memory). Every rank passes x
of the same shape.
)doc");

REGISTER_OP("SokNcclAllGather")
    .Input("x: T")
    .Input("handle: int64")
    .Output("y: T")
    .Attr(SOK_NCCL_TYPES)
    .Attr("num_ranks: int >= 0 = 0")
    .Attr("key: string = ''")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle x;
      TF_RETURN_IF_ERROR(c->WithRankAtLeast(c->input(0), 1, &x));
      TF_RETURN_IF_ERROR(ScalarHandle(c, 1));
      int64_t num_ranks = 0;
      TF_RETURN_IF_ERROR(c->GetAttr("num_ranks", &num_ranks));
      DimensionHandle rows = c->UnknownDim();
      if (num_ranks > 0) {
        TF_RETURN_IF_ERROR(c->Multiply(c->Dim(x, 0), num_ranks, &rows));
      }
      ShapeHandle y;
      TF_RETURN_IF_ERROR(c->ReplaceDim(x, 0, rows, &y));
      c->set_output(0, y);
      return absl::OkStatus();
    })
    .Doc(R"doc(
All-gather over NCCL (GPU; the handle in host memory): x [k, ...], the same
shape on every rank, gives y [num_ranks * k, ...], rank r's rows at r * k.

num_ranks: The communicator's number of ranks, for the static shape of y
  (checked); 0: unknown.
)doc");

REGISTER_OP("SokNcclBroadcast")
    .Input("x: T")
    .Input("handle: int64")
    .Output("y: T")
    .Attr(SOK_NCCL_TYPES)
    .Attr("root: int >= 0 = 0")
    .Attr("key: string = ''")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      TF_RETURN_IF_ERROR(ScalarHandle(c, 1));
      c->set_output(0, c->input(0));
      return absl::OkStatus();
    })
    .Doc(R"doc(
Broadcast over NCCL (GPU; the handle in host memory): root's x to every
rank's y. Every rank passes x of the same shape (read on root only).
)doc");

REGISTER_OP("SokNcclHealth")
    .Input("handle: int64")
    .Output("error: string")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      TF_RETURN_IF_ERROR(ScalarHandle(c, 0));
      c->set_output(0, c->Scalar());
      return absl::OkStatus();
    })
    .Doc(R"doc(
The error that aborted the communicator (CPU), or "" while it is healthy.
)doc");

REGISTER_OP("SokNcclAbort")
    .Input("handle: int64")
    .Input("reason: string")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      TF_RETURN_IF_ERROR(ScalarHandle(c, 0));
      return absl::OkStatus();
    })
    .Doc(R"doc(
Aborts the communicator (CPU) with `reason`: no collective starts after it,
and those in flight fail (ncclCommAbort from the watchdog) instead of
waiting. Used when another rank has failed.
)doc");

// ----------------------------------------------------------------------------
// CPU kernels (every build).

#ifndef SOK_WITH_CUDA
absl::Status NoCuda(const char* op) {
  return errors::FailedPrecondition(
      "sok_keras: ", op,
      ": this sok_keras build has no CUDA support, so it has no NCCL "
      "communicator (rebuild with nvcc available).");
}
#endif

class SokNcclUniqueIdOp : public OpKernel {
 public:
  explicit SokNcclUniqueIdOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    const Tensor& library = ctx->input(0);
    OP_REQUIRES(ctx, TensorShapeUtils::IsScalar(library.shape()),
                errors::InvalidArgument(
                    "sok_keras: SokNcclUniqueId: library must be a scalar, "
                    "got shape ",
                    library.shape().DebugString(), "."));
#ifdef SOK_WITH_CUDA
    const std::string path(library.scalar<::tensorflow::tstring>()());
    int version = 0;
    Status s = comm::LoadNccl(path, &version);
    OP_REQUIRES(ctx, s.ok(), errors::FailedPrecondition(s.message()));
    std::string id;
    s = comm::NcclUniqueId(&id);
    OP_REQUIRES(ctx, s.ok(), errors::Unavailable(s.message()));
    OP_REQUIRES(ctx, id.size() == static_cast<size_t>(kUniqueIdBytes),
                errors::Internal("sok_keras: NCCL unique id of ", id.size(),
                                 " bytes."));
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({kUniqueIdBytes}),
                                             &out));
    std::memcpy(out->flat<uint8_t>().data(), id.data(), id.size());
#else
    ctx->CtxFailure(NoCuda("SokNcclUniqueId"));
#endif
  }
};

REGISTER_KERNEL_BUILDER(Name("SokNcclUniqueId").Device(DEVICE_CPU),
                        SokNcclUniqueIdOp);

// Reads a scalar int64 handle input (host memory).
bool ReadHandle(OpKernelContext* ctx, int index, int64_t* handle) {
  const Tensor& t = ctx->input(index);
  if (!TensorShapeUtils::IsScalar(t.shape())) {
    ctx->CtxFailure(errors::InvalidArgument(
        "sok_keras: ", ctx->op_kernel().type_string(),
        ": handle must be a scalar, got shape ", t.shape().DebugString(),
        "."));
    return false;
  }
  *handle = t.scalar<int64_t>()();
  return true;
}

class SokNcclHealthOp : public OpKernel {
 public:
  explicit SokNcclHealthOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    int64_t handle = 0;
    if (!ReadHandle(ctx, 0, &handle)) return;
#ifdef SOK_WITH_CUDA
    std::shared_ptr<comm::NcclComm> c;
    const Status s = comm::LookupComm(handle, &c);
    OP_REQUIRES(ctx, s.ok(), errors::InvalidArgument(s.message()));
    const Status health = c->Health();
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &out));
    out->scalar<::tensorflow::tstring>()() =
        health.ok() ? std::string() : health.message();
#else
    ctx->CtxFailure(NoCuda("SokNcclHealth"));
#endif
  }
};

REGISTER_KERNEL_BUILDER(Name("SokNcclHealth").Device(DEVICE_CPU),
                        SokNcclHealthOp);

class SokNcclAbortOp : public OpKernel {
 public:
  explicit SokNcclAbortOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    int64_t handle = 0;
    if (!ReadHandle(ctx, 0, &handle)) return;
    const Tensor& reason = ctx->input(1);
    OP_REQUIRES(ctx, TensorShapeUtils::IsScalar(reason.shape()),
                errors::InvalidArgument(
                    "sok_keras: SokNcclAbort: reason must be a scalar, got "
                    "shape ",
                    reason.shape().DebugString()));
#ifdef SOK_WITH_CUDA
    std::shared_ptr<comm::NcclComm> c;
    const Status s = comm::LookupComm(handle, &c);
    OP_REQUIRES(ctx, s.ok(), errors::InvalidArgument(s.message()));
    c->Abort(std::string(reason.scalar<::tensorflow::tstring>()()));
#else
    ctx->CtxFailure(NoCuda("SokNcclAbort"));
#endif
  }
};

REGISTER_KERNEL_BUILDER(Name("SokNcclAbort").Device(DEVICE_CPU),
                        SokNcclAbortOp);

// ----------------------------------------------------------------------------
// GPU kernels.

#ifdef SOK_WITH_CUDA

using ::tensorflow::DEVICE_GPU;

// NCCL's data type of a TensorFlow dtype, or -1.
int NcclTypeOf(::tensorflow::DataType dtype) {
  switch (dtype) {
    case ::tensorflow::DT_INT8:
      return comm::kNcclInt8;
    case ::tensorflow::DT_UINT8:
      return comm::kNcclUint8;
    case ::tensorflow::DT_INT32:
      return comm::kNcclInt32;
    case ::tensorflow::DT_INT64:
      return comm::kNcclInt64;
    case ::tensorflow::DT_HALF:
      return comm::kNcclFloat16;
    case ::tensorflow::DT_FLOAT:
      return comm::kNcclFloat32;
    case ::tensorflow::DT_DOUBLE:
      return comm::kNcclFloat64;
    case ::tensorflow::DT_BFLOAT16:
      return comm::kNcclBfloat16;
    default:
      return -1;
  }
}

// The CUDA device ordinal of the op's GPU, or -1.
int CudaOrdinal(OpKernelContext* ctx) {
  auto* dc = ctx->op_device_context();
  if (dc == nullptr || dc->stream() == nullptr ||
      dc->stream()->parent() == nullptr) {
    return -1;
  }
  return dc->stream()->parent()->device_ordinal();
}

class SokNcclInitOp : public OpKernel {
 public:
  explicit SokNcclInitOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("rank", &rank_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("num_ranks", &num_ranks_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("library", &library_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("timeout_seconds", &timeout_seconds_));
    OP_REQUIRES(ctx, rank_ < num_ranks_,
                errors::InvalidArgument(
                    "sok_keras: SokNcclInit: rank (", rank_,
                    ") must be less than num_ranks (", num_ranks_, ")."));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& id = ctx->input(0);
    OP_REQUIRES(ctx,
                TensorShapeUtils::IsVector(id.shape()) &&
                    id.NumElements() == kUniqueIdBytes,
                errors::InvalidArgument(
                    "sok_keras: rank ", rank_,
                    ": SokNcclInit: id must have shape [", kUniqueIdBytes,
                    "], got ", id.shape().DebugString(), "."));
    const int device = CudaOrdinal(ctx);
    OP_REQUIRES(ctx, device >= 0,
                errors::Internal("sok_keras: rank ", rank_,
                                 ": SokNcclInit: cannot find the CUDA device "
                                 "of the op's GPU."));
    int version = 0;
    Status s = comm::LoadNccl(library_, &version);
    OP_REQUIRES(ctx, s.ok(), errors::FailedPrecondition(s.message()));
    const std::string id_bytes(
        reinterpret_cast<const char*>(id.flat<uint8_t>().data()),
        kUniqueIdBytes);
    std::shared_ptr<comm::NcclComm> c;
    s = comm::NcclComm::Create(id_bytes, static_cast<int>(rank_),
                               static_cast<int>(num_ranks_), device,
                               timeout_seconds_, &c);
    OP_REQUIRES(ctx, s.ok(), errors::Unavailable(s.message()));
    int64_t handle = 0;
    s = comm::RegisterComm(c, &handle);
    OP_REQUIRES(ctx, s.ok(), errors::Internal(s.message()));
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &out));
    out->scalar<int64_t>()() = handle;
  }

 private:
  int64_t rank_ = 0;
  int64_t num_ranks_ = 1;
  std::string library_;
  float timeout_seconds_ = 600;
};

REGISTER_KERNEL_BUILDER(Name("SokNcclInit")
                            .Device(DEVICE_GPU)
                            .HostMemory("id")
                            .HostMemory("handle"),
                        SokNcclInitOp);

// The handle lookup, names and dtype shared by the collectives.
class NcclCollectiveOp : public OpKernel {
 public:
  NcclCollectiveOp(OpKernelConstruction* ctx, const char* collective)
      : OpKernel(ctx) {
    std::string key;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("key", &key));
    what_ = std::string(collective) + " '" + (key.empty() ? name() : key) +
            "'";
    ::tensorflow::DataType dtype;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("T", &dtype));
    nccl_dtype_ = NcclTypeOf(dtype);
    OP_REQUIRES(ctx, nccl_dtype_ >= 0,
                errors::InvalidArgument("sok_keras: ", what_,
                                        ": NCCL cannot carry dtype ",
                                        ::tensorflow::DataTypeString(dtype),
                                        "."));
    dtype_size_ = ::tensorflow::DataTypeSize(dtype);
  }

 protected:
  // Looks up the communicator of input `index`; false (status set) if none.
  bool GetComm(OpKernelContext* ctx, int index,
               std::shared_ptr<comm::NcclComm>* c) {
    int64_t handle = 0;
    if (!ReadHandle(ctx, index, &handle)) return false;
    const Status s = comm::LookupComm(handle, c);
    if (!s.ok()) {
      ctx->CtxFailure(errors::InvalidArgument(s.message()));
      return false;
    }
    return true;
  }

  // The prefix of validation errors.
  std::string Where(const comm::NcclComm& c) const {
    return "sok_keras: rank " + std::to_string(c.rank()) + ": NCCL " + what_ +
           ": ";
  }

  // Reports a failed collective (the comm's messages are complete).
  static void Fail(OpKernelContext* ctx, const Status& s) {
    ctx->CtxFailure(errors::Aborted(s.message()));
  }

  std::string what_;
  int nccl_dtype_ = -1;
  int64_t dtype_size_ = 0;
};

// a * b, or false on overflow (both >= 0).
bool MulOk(int64_t a, int64_t b, int64_t* out) {
  return !__builtin_mul_overflow(a, b, out);
}

class SokNcclAllToAllOp : public NcclCollectiveOp {
 public:
  explicit SokNcclAllToAllOp(OpKernelConstruction* ctx)
      : NcclCollectiveOp(ctx, "all-to-all") {}

  void Compute(OpKernelContext* ctx) override {
    std::shared_ptr<comm::NcclComm> c;
    if (!GetComm(ctx, 3, &c)) return;
    const int n = c->num_ranks();
    const Tensor& x = ctx->input(0);
    const Tensor& send_counts = ctx->input(1);
    const Tensor& recv_counts = ctx->input(2);
    OP_REQUIRES(ctx, x.dims() >= 1,
                errors::InvalidArgument(Where(*c),
                                        "x must have rank >= 1, got shape ",
                                        x.shape().DebugString(), "."));
    for (const Tensor* t : {&send_counts, &recv_counts}) {
      OP_REQUIRES(ctx,
                  TensorShapeUtils::IsVector(t->shape()) &&
                      t->NumElements() == n,
                  errors::InvalidArgument(
                      Where(*c), (t == &send_counts ? "send" : "recv"),
                      "_counts must have shape [", n,
                      "] (the number of ranks), got ",
                      t->shape().DebugString(), "."));
    }
    const int64_t* send = send_counts.flat<int64_t>().data();
    const int64_t* recv = recv_counts.flat<int64_t>().data();
    TensorShape inner = x.shape();
    inner.RemoveDim(0);
    int64_t row_bytes = 0;
    OP_REQUIRES(ctx, MulOk(inner.num_elements(), dtype_size_, &row_bytes),
                errors::InvalidArgument(Where(*c), "rows are too large."));
    const int64_t rows = x.dim_size(0);
    std::vector<int64_t> send_bytes(n), send_offsets(n), recv_bytes(n),
        recv_offsets(n);
    int64_t send_total = 0;
    int64_t recv_total = 0;
    for (int j = 0; j < n; ++j) {
      OP_REQUIRES(ctx, send[j] >= 0 && recv[j] >= 0,
                  errors::InvalidArgument(
                      Where(*c), "counts must be >= 0, got send_counts[", j,
                      "] = ", send[j], " and recv_counts[", j, "] = ", recv[j],
                      "."));
      OP_REQUIRES(ctx, send[j] <= rows - send_total,
                  errors::InvalidArgument(
                      Where(*c), "send_counts sum to more than the ", rows,
                      " rows of x."));
      OP_REQUIRES(
          ctx,
          MulOk(send[j], row_bytes, &send_bytes[j]) &&
              MulOk(send_total, row_bytes, &send_offsets[j]) &&
              MulOk(recv[j], row_bytes, &recv_bytes[j]) &&
              MulOk(recv_total, row_bytes, &recv_offsets[j]) &&
              !__builtin_add_overflow(recv_total, recv[j], &recv_total),
          errors::InvalidArgument(Where(*c), "the exchange is too large."));
      send_total += send[j];
    }
    OP_REQUIRES(ctx, send_total == rows,
                errors::InvalidArgument(Where(*c), "send_counts sum to ",
                                        send_total, " but x has ", rows,
                                        " rows."));
    int64_t recv_total_bytes = 0;
    OP_REQUIRES(ctx, MulOk(recv_total, row_bytes, &recv_total_bytes),
                errors::InvalidArgument(Where(*c),
                                        "the exchange is too large."));
    TensorShape y_shape;
    OP_REQUIRES_OK(ctx, y_shape.AddDimWithStatus(recv_total));
    OP_REQUIRES_OK(ctx, y_shape.AppendShapeWithStatus(inner));
    Tensor* y = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, y_shape, &y));
    const Status s = c->AllToAllV(
        x.data(), send_bytes.data(), send_offsets.data(), y->data(),
        recv_bytes.data(), recv_offsets.data(), TfGpuStream(ctx), what_);
    if (!s.ok()) Fail(ctx, s);
  }
};

class SokNcclAllReduceOp : public NcclCollectiveOp {
 public:
  explicit SokNcclAllReduceOp(OpKernelConstruction* ctx)
      : NcclCollectiveOp(ctx, "all-reduce") {
    std::string reduction;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("reduction", &reduction));
    if (reduction == "sum") {
      op_ = comm::kNcclSum;
    } else if (reduction == "prod") {
      op_ = comm::kNcclProd;
    } else if (reduction == "max") {
      op_ = comm::kNcclMax;
    } else if (reduction == "min") {
      op_ = comm::kNcclMin;
    } else {
      ctx->CtxFailure(errors::InvalidArgument(
          "sok_keras: ", what_, ": unknown reduction '", reduction, "'."));
    }
  }

  void Compute(OpKernelContext* ctx) override {
    std::shared_ptr<comm::NcclComm> c;
    if (!GetComm(ctx, 1, &c)) return;
    const Tensor& x = ctx->input(0);
    Tensor* y = nullptr;
    OP_REQUIRES_OK(ctx,
                   ctx->forward_input_or_allocate_output({0}, 0, x.shape(), &y));
    const Status s =
        c->AllReduce(x.data(), y->data(), x.NumElements(), nccl_dtype_, op_,
                     TfGpuStream(ctx), what_);
    if (!s.ok()) Fail(ctx, s);
  }

 private:
  int op_ = comm::kNcclSum;
};

class SokNcclAllGatherOp : public NcclCollectiveOp {
 public:
  explicit SokNcclAllGatherOp(OpKernelConstruction* ctx)
      : NcclCollectiveOp(ctx, "all-gather") {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("num_ranks", &num_ranks_attr_));
  }

  void Compute(OpKernelContext* ctx) override {
    std::shared_ptr<comm::NcclComm> c;
    if (!GetComm(ctx, 1, &c)) return;
    const int n = c->num_ranks();
    OP_REQUIRES(ctx, num_ranks_attr_ == 0 || num_ranks_attr_ == n,
                errors::InvalidArgument(Where(*c), "the num_ranks attr (",
                                        num_ranks_attr_,
                                        ") differs from the communicator's (",
                                        n, ")."));
    const Tensor& x = ctx->input(0);
    OP_REQUIRES(ctx, x.dims() >= 1,
                errors::InvalidArgument(Where(*c),
                                        "x must have rank >= 1, got shape ",
                                        x.shape().DebugString(), "."));
    int64_t rows = 0;
    OP_REQUIRES(ctx, MulOk(x.dim_size(0), n, &rows),
                errors::InvalidArgument(Where(*c), "the result is too large."));
    TensorShape y_shape = x.shape();
    OP_REQUIRES_OK(ctx, y_shape.SetDimWithStatus(0, rows));
    Tensor* y = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, y_shape, &y));
    const Status s = c->AllGather(x.data(), y->data(), x.NumElements(),
                                  nccl_dtype_, TfGpuStream(ctx), what_);
    if (!s.ok()) Fail(ctx, s);
  }

 private:
  int64_t num_ranks_attr_ = 0;
};

class SokNcclBroadcastOp : public NcclCollectiveOp {
 public:
  explicit SokNcclBroadcastOp(OpKernelConstruction* ctx)
      : NcclCollectiveOp(ctx, "broadcast") {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("root", &root_));
  }

  void Compute(OpKernelContext* ctx) override {
    std::shared_ptr<comm::NcclComm> c;
    if (!GetComm(ctx, 1, &c)) return;
    OP_REQUIRES(ctx, root_ < c->num_ranks(),
                errors::InvalidArgument(Where(*c), "root ", root_,
                                        " is not a rank in [0, ",
                                        c->num_ranks(), ")."));
    const Tensor& x = ctx->input(0);
    Tensor* y = nullptr;
    OP_REQUIRES_OK(ctx,
                   ctx->forward_input_or_allocate_output({0}, 0, x.shape(), &y));
    const Status s =
        c->Broadcast(x.data(), y->data(), x.NumElements(), nccl_dtype_,
                     static_cast<int>(root_), TfGpuStream(ctx), what_);
    if (!s.ok()) Fail(ctx, s);
  }

 private:
  int64_t root_ = 0;
};

#define SOK_REGISTER_NCCL_GPU(T)                                         \
  REGISTER_KERNEL_BUILDER(Name("SokNcclAllToAll")                        \
                              .Device(DEVICE_GPU)                        \
                              .TypeConstraint<T>("T")                    \
                              .HostMemory("send_counts")                 \
                              .HostMemory("recv_counts")                 \
                              .HostMemory("handle"),                     \
                          SokNcclAllToAllOp);                            \
  REGISTER_KERNEL_BUILDER(Name("SokNcclAllReduce")                       \
                              .Device(DEVICE_GPU)                        \
                              .TypeConstraint<T>("T")                    \
                              .HostMemory("handle"),                     \
                          SokNcclAllReduceOp);                           \
  REGISTER_KERNEL_BUILDER(Name("SokNcclAllGather")                       \
                              .Device(DEVICE_GPU)                        \
                              .TypeConstraint<T>("T")                    \
                              .HostMemory("handle"),                     \
                          SokNcclAllGatherOp);                           \
  REGISTER_KERNEL_BUILDER(Name("SokNcclBroadcast")                       \
                              .Device(DEVICE_GPU)                        \
                              .TypeConstraint<T>("T")                    \
                              .HostMemory("handle"),                     \
                          SokNcclBroadcastOp);

SOK_REGISTER_NCCL_GPU(float)
SOK_REGISTER_NCCL_GPU(double)
SOK_REGISTER_NCCL_GPU(::Eigen::half)
SOK_REGISTER_NCCL_GPU(::tensorflow::bfloat16)
SOK_REGISTER_NCCL_GPU(::tensorflow::int32)
SOK_REGISTER_NCCL_GPU(::tensorflow::int64)
SOK_REGISTER_NCCL_GPU(::tensorflow::uint8)
SOK_REGISTER_NCCL_GPU(::tensorflow::int8)

#undef SOK_REGISTER_NCCL_GPU

#endif  // SOK_WITH_CUDA

}  // namespace
}  // namespace sok
