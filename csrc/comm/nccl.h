// The NCCL communicator of the op library: collectives between GPU ranks,
// one GPU per rank, enqueued on the caller's CUDA stream.
//
// NCCL is not needed to build: it is loaded at run time with dlopen
// (LoadNccl) from a path the caller gives, and its ABI is declared in
// nccl.cu.cc. Each communicator has a watchdog thread that polls NCCL's
// asynchronous error and the age of every collective in flight, and aborts
// the communicator (ncclCommAbort) on an error or past the timeout, so that
// a dead or stalled peer ends in an error naming the rank and the
// collective instead of a hang. Communicators are never destroyed (they and
// their watchdogs are leaked at process exit, because static destructors
// run after CUDA has shut down).
//
// TensorFlow-free and free of CUDA headers (streams are `void*`, a
// cudaStream_t); only compiled where the library is built with CUDA.
#ifndef SOK_COMM_NCCL_H_
#define SOK_COMM_NCCL_H_

#include <cstdint>
#include <memory>
#include <string>

#include "core/status.h"

namespace sok {
namespace comm {

// NCCL's ncclDataType_t values.
enum NcclDataType : int {
  kNcclInt8 = 0,
  kNcclUint8 = 1,
  kNcclInt32 = 2,
  kNcclUint32 = 3,
  kNcclInt64 = 4,
  kNcclUint64 = 5,
  kNcclFloat16 = 6,
  kNcclFloat32 = 7,
  kNcclFloat64 = 8,
  kNcclBfloat16 = 9,
};

// NCCL's ncclRedOp_t values.
enum NcclRedOp : int {
  kNcclSum = 0,
  kNcclProd = 1,
  kNcclMax = 2,
  kNcclMin = 3,
  kNcclAvg = 4,
};

// The size in bytes of one element of an NcclDataType (0 if unknown).
int NcclDataTypeSize(int nccl_dtype);

// Loads NCCL from `path` (dlopen, RTLD_NOW | RTLD_GLOBAL; an empty path
// means "libnccl.so.2" through the dynamic loader's search) and resolves
// the functions used. Idempotent: once loaded, later calls return the
// loaded library's version whatever their path. *version is NCCL's
// version code (e.g. 22805 for 2.28.5); may be null.
Status LoadNccl(const std::string& path, int* version);

// A new NCCL unique id (ncclGetUniqueId), 128 bytes. The process that makes
// it hosts NCCL's bootstrap root for the communicator created from it, so
// it is rank 0's job. Needs LoadNccl first.
Status NcclUniqueId(std::string* id_bytes);

class NcclComm {
 public:
  // Joins the communicator `id_bytes` (NcclUniqueId's 128 bytes, the same
  // on every rank) as `rank` of `num_ranks` on CUDA device `device` (the
  // ordinal in this process; made current with cudaSetDevice first). Blocks
  // until every rank has joined, or fails after `timeout_s` seconds
  // (timeout_s <= 0: no timeout). `timeout_s` is also the longest a
  // collective may stay in flight. Needs LoadNccl first.
  static Status Create(const std::string& id_bytes, int rank, int num_ranks,
                       int device, double timeout_s,
                       std::shared_ptr<NcclComm>* out);

  // Byte-level ragged all-to-all, one NCCL group of ncclSend/ncclRecv
  // (ncclUint8; self included): block j of send (send_bytes[j] bytes at
  // send + send_offsets[j]) goes to rank j; the block from rank j
  // (recv_bytes[j] bytes) lands at recv + recv_offsets[j]. Every array has
  // num_ranks() entries, in host memory. Empty blocks are skipped (the
  // counts must agree across ranks: my send_bytes[j] == rank j's
  // recv_bytes[me]).
  Status AllToAllV(const void* send, const int64_t* send_bytes,
                   const int64_t* send_offsets, void* recv,
                   const int64_t* recv_bytes, const int64_t* recv_offsets,
                   void* stream, const std::string& what);
  // `count` elements of `nccl_dtype` (NcclDataType), reduced with `nccl_op`
  // (NcclRedOp). in == out is allowed.
  Status AllReduce(const void* in, void* out, int64_t count, int nccl_dtype,
                   int nccl_op, void* stream, const std::string& what);
  // out holds num_ranks() * count_per_rank elements, rank r's at
  // r * count_per_rank.
  Status AllGather(const void* in, void* out, int64_t count_per_rank,
                   int nccl_dtype, void* stream, const std::string& what);
  // Root's `in` to every rank's `out` (`in` is read on root only).
  Status Broadcast(const void* in, void* out, int64_t count, int nccl_dtype,
                   int root, void* stream, const std::string& what);

  // Ok while healthy; otherwise the error that aborted the communicator.
  Status Health() const;

  // Condemns the communicator with `reason` (the first reason wins): no
  // collective starts after it, and the watchdog calls ncclCommAbort within
  // a poll (20 ms), or once an op thread inside NCCL calls has left them,
  // so that collectives in flight end in an error instead of waiting for a
  // peer that will not come (sok_keras.divergence calls it when another
  // rank has failed).
  void Abort(const std::string& reason);

  int rank() const { return rank_; }
  int num_ranks() const { return num_ranks_; }
  int device() const { return device_; }
  // Whether the communicator is nonblocking (ncclCommInitRankConfig with
  // blocking = 0) or blocking (ncclCommInitRank).
  bool nonblocking() const { return nonblocking_; }

  struct State;  // defined in nccl.cu.cc

 private:
  NcclComm() = default;

  std::shared_ptr<State> state_;
  int rank_ = 0;
  int num_ranks_ = 1;
  int device_ = 0;
  bool nonblocking_ = false;
};

// A process-wide registry of communicators (never emptied): handles are
// small positive integers, for TensorFlow ops to pass around.
Status RegisterComm(std::shared_ptr<NcclComm> comm, int64_t* handle);
Status LookupComm(int64_t handle, std::shared_ptr<NcclComm>* comm);

}  // namespace comm
}  // namespace sok

#endif  // SOK_COMM_NCCL_H_
