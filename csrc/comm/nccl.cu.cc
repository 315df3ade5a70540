// The NCCL communicator (comm/nccl.h): NCCL loaded with dlopen, its ABI
// declared here (nccl.h is not available at build time), one watchdog
// thread per communicator.
//
// Init: a nonblocking communicator (ncclCommInitRankConfig, blocking = 0)
// where NCCL is 2.17 or newer and exports it, else a blocking one
// (ncclCommInitRank); SOK_NCCL_BLOCKING=1 forces blocking. ncclConfig_t is
// passed in its NCCL 2.17 layout (size, magic 0xcafebeef, version, blocking,
// cgaClusterSize, minCTAs, maxCTAs, netName: 40 bytes, no padding) with
// version 2.17.0. NCCL (2.17 ... 2.29 alike) copies min(config.size, its
// own sizeof) bytes over its NCCL_CONFIG_INITIALIZER defaults and resets
// every field newer than `version` to its default, so this shorter struct
// is exact for NCCL 2.28 without knowing its newer fields.
//
// ncclInProgress is handled after every call that may return it (init and
// ncclGroupEnd): the calling thread polls ncclCommGetAsyncError until the
// state settles, giving up (and aborting) after the timeout.
#include <cuda_runtime.h>
#include <dlfcn.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <algorithm>
#include <deque>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "comm/nccl.h"
#include "core/status.h"

namespace sok {
namespace comm {
namespace {

// ---------------------------------------------------------------------------
// NCCL's ABI (from nccl.h; stable across NCCL 2.x).

struct ncclComm;  // opaque
typedef ncclComm* ncclComm_t;
struct ncclUniqueId {
  char internal[128];
};
typedef int ncclResult_t;  // a C enum
constexpr ncclResult_t ncclSuccess = 0;
constexpr ncclResult_t ncclInProgress = 7;
typedef int ncclDataType_t;
typedef int ncclRedOp_t;

constexpr int kNcclConfigUndefInt = std::numeric_limits<int>::min();
constexpr unsigned int kNcclConfigMagic = 0xcafebeef;
constexpr int kNcclVersion2_17 = 21700;  // NCCL_VERSION(2, 17, 0)
constexpr int kNcclVersion2_10 = 21000;  // bfloat16 from here on

// ncclConfig_t as of NCCL 2.17 (see the file comment).
struct NcclConfig217 {
  size_t size;
  unsigned int magic;
  unsigned int version;
  int blocking;
  int cgaClusterSize;
  int minCTAs;
  int maxCTAs;
  const char* netName;
};
static_assert(sizeof(NcclConfig217) == 40, "ncclConfig_t 2.17 layout");

struct NcclApi {
  ncclResult_t (*GetVersion)(int*) = nullptr;
  ncclResult_t (*GetUniqueId)(ncclUniqueId*) = nullptr;
  ncclResult_t (*CommInitRank)(ncclComm_t*, int, ncclUniqueId, int) = nullptr;
  ncclResult_t (*CommInitRankConfig)(ncclComm_t*, int, ncclUniqueId, int,
                                     NcclConfig217*) = nullptr;  // optional
  ncclResult_t (*CommGetAsyncError)(ncclComm_t, ncclResult_t*) = nullptr;
  ncclResult_t (*CommAbort)(ncclComm_t) = nullptr;
  ncclResult_t (*CommDestroy)(ncclComm_t) = nullptr;
  const char* (*GetErrorString)(ncclResult_t) = nullptr;
  const char* (*GetLastError)(ncclComm_t) = nullptr;  // optional (>= 2.13)
  ncclResult_t (*GroupStart)() = nullptr;
  ncclResult_t (*GroupEnd)() = nullptr;
  ncclResult_t (*Send)(const void*, size_t, ncclDataType_t, int, ncclComm_t,
                       cudaStream_t) = nullptr;
  ncclResult_t (*Recv)(void*, size_t, ncclDataType_t, int, ncclComm_t,
                       cudaStream_t) = nullptr;
  ncclResult_t (*AllReduce)(const void*, void*, size_t, ncclDataType_t,
                            ncclRedOp_t, ncclComm_t, cudaStream_t) = nullptr;
  ncclResult_t (*AllGather)(const void*, void*, size_t, ncclDataType_t,
                            ncclComm_t, cudaStream_t) = nullptr;
  ncclResult_t (*Broadcast)(const void*, void*, size_t, ncclDataType_t, int,
                            ncclComm_t, cudaStream_t) = nullptr;
  int version = 0;
  std::string path;
};

// Process-wide state, leaked on purpose (no static destructors).
std::mutex& LoadMutex() {
  static std::mutex* mu = new std::mutex;
  return *mu;
}
std::atomic<const NcclApi*> g_api{nullptr};
std::atomic<bool> g_exiting{false};

const NcclApi* Api() { return g_api.load(std::memory_order_acquire); }

Status NotLoaded() {
  return Status::Error(
      "sok_keras: NCCL is not loaded (LoadNccl must come first).");
}

std::string ResultText(const NcclApi& api, ncclResult_t r, ncclComm_t comm) {
  std::string text = api.GetErrorString != nullptr ? api.GetErrorString(r)
                                                   : "NCCL error";
  text += " (ncclResult_t " + std::to_string(r) + ")";
  if (api.GetLastError != nullptr) {
    const char* last = api.GetLastError(comm);
    if (last != nullptr && last[0] != '\0') text += std::string(": ") + last;
  }
  return text;
}

std::string Seconds(double s) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%g", s);
  return buf;
}

using Clock = std::chrono::steady_clock;

double SecondsSince(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// Stops the watchdogs from touching CUDA or NCCL once exit() has begun (the
// handler is registered after CUDA initialised, so it runs before CUDA's
// own teardown).
void OnExit() { g_exiting.store(true); }

void RegisterExitHandlerOnce() {
  static std::once_flag once;
  std::call_once(once, [] { std::atexit(OnExit); });
}

// Makes `device` current on the calling thread for a scope, restoring the
// previous device after.
class ScopedDevice {
 public:
  explicit ScopedDevice(int device) {
    if (cudaGetDevice(&previous_) != cudaSuccess) previous_ = -1;
    if (previous_ != device) {
      status_ = cudaSetDevice(device);
      changed_ = status_ == cudaSuccess && previous_ >= 0;
    }
  }
  ~ScopedDevice() {
    if (changed_) (void)cudaSetDevice(previous_);
  }
  cudaError_t status() const { return status_; }

 private:
  int previous_ = -1;
  cudaError_t status_ = cudaSuccess;
  bool changed_ = false;
};

}  // namespace

// ---------------------------------------------------------------------------

int NcclDataTypeSize(int nccl_dtype) {
  switch (nccl_dtype) {
    case kNcclInt8:
    case kNcclUint8:
      return 1;
    case kNcclFloat16:
    case kNcclBfloat16:
      return 2;
    case kNcclInt32:
    case kNcclUint32:
    case kNcclFloat32:
      return 4;
    case kNcclInt64:
    case kNcclUint64:
    case kNcclFloat64:
      return 8;
    default:
      return 0;
  }
}

Status LoadNccl(const std::string& path, int* version) {
  std::lock_guard<std::mutex> lock(LoadMutex());
  if (const NcclApi* loaded = Api()) {
    if (version != nullptr) *version = loaded->version;
    return Status::Ok();
  }
  const std::string where = path.empty() ? "libnccl.so.2" : path;
  dlerror();
  void* lib = dlopen(where.c_str(), RTLD_NOW | RTLD_GLOBAL);
  if (lib == nullptr) {
    const char* err = dlerror();
    return Status::Error(
        "sok_keras: cannot load NCCL from '" + where + "': " +
        (err != nullptr ? err : "unknown dlopen error") +
        " (set SOK_NCCL_LIBRARY, or pip install nvidia-nccl-cu12).");
  }
  // Never dlclose'd: the communicators outlive every caller.
  NcclApi* api = new NcclApi;
  api->path = where;
  std::string missing;
  auto resolve = [&](auto** fn, const char* name, bool required) {
    void* sym = dlsym(lib, name);
    *fn = reinterpret_cast<std::remove_pointer_t<decltype(fn)>>(sym);
    if (sym == nullptr && required) {
      missing += (missing.empty() ? "" : ", ") + std::string(name);
    }
  };
  resolve(&api->GetVersion, "ncclGetVersion", true);
  resolve(&api->GetUniqueId, "ncclGetUniqueId", true);
  resolve(&api->CommInitRank, "ncclCommInitRank", true);
  resolve(&api->CommInitRankConfig, "ncclCommInitRankConfig", false);
  resolve(&api->CommGetAsyncError, "ncclCommGetAsyncError", true);
  resolve(&api->CommAbort, "ncclCommAbort", true);
  resolve(&api->CommDestroy, "ncclCommDestroy", true);
  resolve(&api->GetErrorString, "ncclGetErrorString", true);
  resolve(&api->GetLastError, "ncclGetLastError", false);
  resolve(&api->GroupStart, "ncclGroupStart", true);
  resolve(&api->GroupEnd, "ncclGroupEnd", true);
  resolve(&api->Send, "ncclSend", true);
  resolve(&api->Recv, "ncclRecv", true);
  resolve(&api->AllReduce, "ncclAllReduce", true);
  resolve(&api->AllGather, "ncclAllGather", true);
  resolve(&api->Broadcast, "ncclBroadcast", true);
  if (!missing.empty()) {
    delete api;
    return Status::Error("sok_keras: the NCCL library '" + where +
                         "' lacks " + missing +
                         " (sok_keras needs NCCL 2.7 or newer).");
  }
  const ncclResult_t r = api->GetVersion(&api->version);
  if (r != ncclSuccess) {
    const std::string text = ResultText(*api, r, nullptr);
    delete api;
    return Status::Error("sok_keras: ncclGetVersion failed for '" + where +
                         "': " + text);
  }
  g_api.store(api, std::memory_order_release);
  if (version != nullptr) *version = api->version;
  return Status::Ok();
}

Status NcclUniqueId(std::string* id_bytes) {
  const NcclApi* api = Api();
  if (api == nullptr) return NotLoaded();
  ncclUniqueId id;
  std::memset(&id, 0, sizeof(id));
  const ncclResult_t r = api->GetUniqueId(&id);
  if (r != ncclSuccess) {
    return Status::Error("sok_keras: ncclGetUniqueId failed: " +
                         ResultText(*api, r, nullptr));
  }
  id_bytes->assign(id.internal, sizeof(id.internal));
  return Status::Ok();
}

// ---------------------------------------------------------------------------
// The communicator's state, shared by the ops' threads and the watchdog.

struct NcclComm::State {
  struct InFlight {
    cudaEvent_t event;
    std::string what;
    Clock::time_point start;
  };

  const NcclApi* api = nullptr;
  ncclComm_t comm = nullptr;  // never used once `aborted` is set
  int rank = 0;
  int num_ranks = 1;
  int device = 0;
  double timeout_s = 0;  // <= 0: none
  bool nonblocking = false;

  // Serialises the ops' NCCL calls (NCCL communicators are not thread
  // safe). The watchdog never takes it, so it can abort a hung call.
  std::mutex op_mu;

  // Guards everything below. Held by the watchdog across its NCCL and CUDA
  // queries (short calls), so that they never overlap ncclCommAbort.
  mutable std::mutex mu;
  // Set (with `error`) as soon as the communicator is condemned: no
  // collective starts after it. ncclCommAbort follows at once, or, when an
  // op thread is inside NCCL calls at that moment, as soon as it leaves
  // them (or after kAbortGrace s if it seems stuck there).
  std::atomic<bool> aborted{false};
  bool comm_aborted = false;  // ncclCommAbort called (or claimed)
  std::string error;          // why it was aborted
  // A collective being enqueued (from ncclGroupStart until its
  // ncclGroupEnd has settled), for the watchdog to time out a hung call.
  bool enqueuing = false;
  std::string enqueue_what;
  Clock::time_point enqueue_start;
  std::deque<InFlight> in_flight;  // oldest first
  std::vector<cudaEvent_t> free_events;

  static constexpr double kAbortGrace = 2.0;

  std::string Prefix() const {
    return "sok_keras: rank " + std::to_string(rank) + ": ";
  }

  std::string TimeoutText(const std::string& what) const {
    return Prefix() + "NCCL " + what + " did not complete within " +
           Seconds(timeout_s) +
           " s (a peer may have died or stalled); the communicator was "
           "aborted";
  }

  // Condemns the communicator with `reason` (the first reason wins); mu
  // held.
  void MarkAbortedLocked(const std::string& reason) {
    if (aborted.load()) return;
    error = reason;
    aborted.store(true);
    std::fprintf(stderr, "%s\n", reason.c_str());
    std::fflush(stderr);
  }

  // Calls ncclCommAbort once; `lock` (on mu) is released first, because
  // ncclCommAbort may take a while. ncclCommAbort is documented as safe
  // while another thread is stuck inside an NCCL call on this
  // communicator.
  void CommAbortOnce(std::unique_lock<std::mutex>* lock) {
    if (comm_aborted) return;
    comm_aborted = true;
    lock->unlock();
    if (comm != nullptr && !g_exiting.load()) (void)api->CommAbort(comm);
  }

  Status AbortedStatus(const std::string& what) const {
    std::lock_guard<std::mutex> lock(mu);
    return Status::Error(error + " [refusing to start NCCL " + what + "]");
  }

  // Polls ncclCommGetAsyncError until the communicator leaves
  // ncclInProgress; on the op thread, with op_mu held. Stops early once the
  // watchdog has condemned the communicator.
  ncclResult_t Settle(ncclResult_t r, bool* timed_out) {
    *timed_out = false;
    const Clock::time_point start = Clock::now();
    int spins = 0;
    while (r == ncclInProgress) {
      if (aborted.load()) return r;
      if (api->CommGetAsyncError(comm, &r) != ncclSuccess) break;
      if (r != ncclInProgress) break;
      if (timeout_s > 0 && SecondsSince(start) > timeout_s) {
        *timed_out = true;
        return r;
      }
      if (++spins < 1000) {
        std::this_thread::yield();
      } else {
        std::this_thread::sleep_for(std::chrono::microseconds(50));
      }
    }
    return r;
  }

  cudaEvent_t TakeEvent() {  // mu held
    if (!free_events.empty()) {
      cudaEvent_t e = free_events.back();
      free_events.pop_back();
      return e;
    }
    cudaEvent_t e = nullptr;
    if (cudaEventCreateWithFlags(&e, cudaEventDisableTiming) != cudaSuccess) {
      return nullptr;
    }
    return e;
  }

  // One collective: `enqueue` issues the NCCL calls (inside one group);
  // then an event on `stream` is handed to the watchdog.
  template <typename Enqueue>
  Status Run(const std::string& what, void* stream_ptr, Enqueue enqueue) {
    std::lock_guard<std::mutex> op_lock(op_mu);
    cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
    // The events and NCCL's calls belong to the communicator's device.
    ScopedDevice scoped(device);
    cudaEvent_t event = nullptr;
    {
      std::lock_guard<std::mutex> lock(mu);
      if (aborted.load()) {
        return Status::Error(error + " [refusing to start NCCL " + what +
                             "]");
      }
      event = TakeEvent();
      if (event == nullptr) {
        (void)cudaGetLastError();
        return Status::Error(Prefix() + "NCCL " + what +
                             ": cannot create a CUDA event");
      }
      enqueuing = true;
      enqueue_what = what;
      enqueue_start = Clock::now();
    }
    std::string failure;
    ncclResult_t r = ncclSuccess;
    bool timed_out = false;
    if (scoped.status() != cudaSuccess) {
      failure = Prefix() + "NCCL " + what + ": cudaSetDevice(" +
                std::to_string(device) +
                ") failed: " + cudaGetErrorString(scoped.status()) +
                "; the communicator was aborted";
    } else {
      r = api->GroupStart();
      if (r == ncclSuccess) {
        r = enqueue(stream);
        if (r == ncclInProgress) r = ncclSuccess;
        const ncclResult_t end = api->GroupEnd();  // always paired
        if (r == ncclSuccess) r = end;
      }
      if (r == ncclInProgress) r = Settle(r, &timed_out);
    }
    if (!failure.empty()) {
    } else if (timed_out) {
      failure = TimeoutText(what);
    } else if (aborted.load()) {
      // Condemned by the watchdog meanwhile; it aborts NCCL once we are out.
    } else if (r != ncclSuccess) {
      failure = Prefix() + "NCCL " + what + " failed: " +
                ResultText(*api, r, comm) + "; the communicator was aborted";
    } else {
      const cudaError_t err = cudaEventRecord(event, stream);
      if (err != cudaSuccess) {
        failure = Prefix() + "NCCL " + what +
                  ": cudaEventRecord failed: " + cudaGetErrorString(err) +
                  "; the communicator was aborted";
      }
    }
    std::unique_lock<std::mutex> lock(mu);
    enqueuing = false;
    if (!failure.empty()) MarkAbortedLocked(failure);
    if (aborted.load()) {
      free_events.push_back(event);
      Status status = Status::Error(error + " [during NCCL " + what + "]");
      if (!failure.empty()) status = Status::Error(error);
      CommAbortOnce(&lock);
      return status;
    }
    in_flight.push_back({event, what, Clock::now()});
    return Status::Ok();
  }

  // Returns Ok while the communicator is healthy.
  Status Health() const {
    std::lock_guard<std::mutex> lock(mu);
    if (aborted.load()) return Status::Error(error);
    return Status::Ok();
  }

  // One poll of the watchdog; false once it should stop.
  bool Poll() {
    if (g_exiting.load()) return false;
    std::unique_lock<std::mutex> lock(mu);
    if (!aborted.load()) {
      const std::string reason = FindFailureLocked();
      if (reason.empty()) return true;
      MarkAbortedLocked(reason);
    }
    if (comm_aborted) return false;
    // An op thread inside NCCL calls: let it leave them first (it sees
    // `aborted`), unless it seems stuck there.
    if (enqueuing && SecondsSince(enqueue_start) <
                         std::min(kAbortGrace, timeout_s > 0 ? timeout_s
                                                             : kAbortGrace)) {
      return true;
    }
    CommAbortOnce(&lock);
    return false;
  }

  // Why the communicator must be aborted now, or ""; mu held.
  std::string FindFailureLocked() {
    // NCCL's asynchronous error. A nonblocking communicator's state is
    // ncclInProgress while a call settles (the op thread polls it then;
    // ncclCommGetAsyncError may complete pending group work, so it is not
    // called from here meanwhile).
    if (!nonblocking || !enqueuing) {
      ncclResult_t async = ncclSuccess;
      if (api->CommGetAsyncError(comm, &async) == ncclSuccess &&
          async != ncclSuccess && async != ncclInProgress) {
        return Prefix() + "NCCL reported an asynchronous error: " +
               ResultText(*api, async, comm) +
               (in_flight.empty() ? std::string()
                                  : " (oldest collective in flight: " +
                                        in_flight.front().what + ")") +
               "; the communicator was aborted";
      }
    }
    // A host call stuck past the timeout (a nonblocking op thread times
    // itself out first; this is the backstop).
    if (enqueuing && timeout_s > 0 &&
        SecondsSince(enqueue_start) > timeout_s + (nonblocking ? 5.0 : 0.0)) {
      return TimeoutText(enqueue_what);
    }
    // The collectives in flight, oldest first.
    while (!in_flight.empty()) {
      InFlight& f = in_flight.front();
      const cudaError_t err = cudaEventQuery(f.event);
      if (err == cudaSuccess) {
        free_events.push_back(f.event);
        in_flight.pop_front();
        continue;
      }
      if (err == cudaErrorNotReady) {
        if (timeout_s > 0 && SecondsSince(f.start) > timeout_s) {
          return TimeoutText(f.what);
        }
        return "";
      }
      if (err == cudaErrorCudartUnloading || g_exiting.load()) return "";
      (void)cudaGetLastError();
      return Prefix() + "CUDA error while NCCL " + f.what +
             " was in flight: " + cudaGetErrorString(err) +
             "; the communicator was aborted";
    }
    return "";
  }
};

namespace {

void Watchdog(std::shared_ptr<NcclComm::State> state) {
  (void)cudaSetDevice(state->device);
  while (state->Poll()) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

}  // namespace

// ---------------------------------------------------------------------------

namespace {

// ncclCommInitRank on a helper thread, waited for at most timeout_s
// (<= 0: forever). A blocking init cannot be aborted (there is no
// communicator to abort until it returns), so on a timeout the helper is
// left behind (it leaks the communicator if it ever completes) and the
// caller gets an error instead of a hang.
Status BlockingInit(const NcclApi& api, const ncclUniqueId& id, int rank,
                    int num_ranks, int device, double timeout_s,
                    const std::string& prefix, ncclComm_t* out) {
  struct Result {
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
    ncclResult_t r = ncclSuccess;
    ncclComm_t comm = nullptr;
  };
  auto result = std::make_shared<Result>();
  const NcclApi* api_ptr = &api;
  std::thread([=] {
    ncclComm_t comm = nullptr;
    ncclResult_t r = ncclSuccess;
    if (cudaSetDevice(device) != cudaSuccess) {
      r = 1;  // ncclUnhandledCudaError
    } else {
      r = api_ptr->CommInitRank(&comm, num_ranks, id, rank);
    }
    std::lock_guard<std::mutex> lock(result->mu);
    result->done = true;
    result->r = r;
    result->comm = comm;
    result->cv.notify_all();
  }).detach();
  std::unique_lock<std::mutex> lock(result->mu);
  if (timeout_s > 0) {
    const bool done = result->cv.wait_for(
        lock, std::chrono::duration<double>(timeout_s),
        [&] { return result->done; });
    if (!done) {
      return Status::Error(
          prefix + "NCCL init (" + std::to_string(num_ranks) +
          " ranks, blocking) did not complete within " + Seconds(timeout_s) +
          " s (is every rank running, with the same unique id?)");
    }
  } else {
    result->cv.wait(lock, [&] { return result->done; });
  }
  if (result->r != ncclSuccess) {
    const std::string text = ResultText(api, result->r, result->comm);
    if (result->comm != nullptr) (void)api.CommAbort(result->comm);
    return Status::Error(prefix + "NCCL init (" + std::to_string(num_ranks) +
                         " ranks, device " + std::to_string(device) +
                         ") failed: " + text);
  }
  *out = result->comm;
  return Status::Ok();
}

}  // namespace

Status NcclComm::Create(const std::string& id_bytes, int rank, int num_ranks,
                        int device, double timeout_s,
                        std::shared_ptr<NcclComm>* out) {
  const NcclApi* api = Api();
  if (api == nullptr) return NotLoaded();
  const std::string prefix = "sok_keras: rank " + std::to_string(rank) + ": ";
  if (num_ranks < 1 || rank < 0 || rank >= num_ranks) {
    return Status::InvalidArgument(
        prefix + "NCCL init needs 0 <= rank < num_ranks, got rank " +
        std::to_string(rank) + " of " + std::to_string(num_ranks) + ".");
  }
  ncclUniqueId id;
  if (id_bytes.size() != sizeof(id.internal)) {
    return Status::InvalidArgument(
        prefix + "the NCCL unique id must have " +
        std::to_string(sizeof(id.internal)) + " bytes, got " +
        std::to_string(id_bytes.size()) + ".");
  }
  std::memcpy(id.internal, id_bytes.data(), sizeof(id.internal));
  if (device < 0) {
    return Status::InvalidArgument(prefix + "bad CUDA device ordinal " +
                                   std::to_string(device) + ".");
  }
  // NCCL takes the device from the calling thread; leave it current (the
  // op's thread already works on this device).
  cudaError_t err = cudaSetDevice(device);
  if (err != cudaSuccess) {
    return Status::Error(prefix + "cudaSetDevice(" + std::to_string(device) +
                         ") failed: " + cudaGetErrorString(err));
  }
  err = cudaFree(nullptr);  // initialises the device's primary context
  if (err != cudaSuccess) {
    return Status::Error(prefix + "CUDA initialisation on device " +
                         std::to_string(device) +
                         " failed: " + cudaGetErrorString(err));
  }
  RegisterExitHandlerOnce();

  const char* force_blocking = std::getenv("SOK_NCCL_BLOCKING");
  const bool nonblocking =
      api->CommInitRankConfig != nullptr && api->version >= kNcclVersion2_17 &&
      !(force_blocking != nullptr && std::strcmp(force_blocking, "1") == 0);
  ncclComm_t comm = nullptr;
  ncclResult_t r;
  if (nonblocking) {
    NcclConfig217 config;
    std::memset(&config, 0, sizeof(config));
    config.size = sizeof(config);
    config.magic = kNcclConfigMagic;
    config.version = kNcclVersion2_17;
    config.blocking = 0;
    config.cgaClusterSize = kNcclConfigUndefInt;
    config.minCTAs = kNcclConfigUndefInt;
    config.maxCTAs = kNcclConfigUndefInt;
    config.netName = nullptr;  // NCCL_CONFIG_UNDEF_PTR
    r = api->CommInitRankConfig(&comm, num_ranks, id, rank, &config);
  } else {
    SOK_RETURN_IF_ERROR(BlockingInit(*api, id, rank, num_ranks, device,
                                     timeout_s, prefix, &comm));
    r = ncclSuccess;
  }
  const Clock::time_point start = Clock::now();
  int spins = 0;
  while (r == ncclInProgress && comm != nullptr) {
    if (api->CommGetAsyncError(comm, &r) != ncclSuccess) break;
    if (r != ncclInProgress) break;
    if (timeout_s > 0 && SecondsSince(start) > timeout_s) {
      (void)api->CommAbort(comm);
      return Status::Error(
          prefix + "NCCL init (" + std::to_string(num_ranks) +
          " ranks) did not complete within " + Seconds(timeout_s) +
          " s (is every rank running, with the same unique id?); the "
          "communicator was aborted");
    }
    if (++spins < 100) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }
  if (r != ncclSuccess) {
    const std::string text = ResultText(*api, r, comm);
    if (comm != nullptr) (void)api->CommAbort(comm);
    return Status::Error(prefix + "NCCL init (" + std::to_string(num_ranks) +
                         " ranks, device " + std::to_string(device) +
                         ") failed: " + text);
  }

  auto state = std::make_shared<State>();
  state->api = api;
  state->comm = comm;
  state->rank = rank;
  state->num_ranks = num_ranks;
  state->device = device;
  state->timeout_s = timeout_s;
  state->nonblocking = nonblocking;
  // Detached and never joined: it and the communicator live until the
  // process exits.
  std::thread(Watchdog, state).detach();

  std::shared_ptr<NcclComm> c(new NcclComm);
  c->state_ = state;
  c->rank_ = rank;
  c->num_ranks_ = num_ranks;
  c->device_ = device;
  c->nonblocking_ = nonblocking;
  *out = std::move(c);
  return Status::Ok();
}

Status NcclComm::AllToAllV(const void* send, const int64_t* send_bytes,
                           const int64_t* send_offsets, void* recv,
                           const int64_t* recv_bytes,
                           const int64_t* recv_offsets, void* stream,
                           const std::string& what) {
  State& s = *state_;
  bool any = false;
  for (int j = 0; j < num_ranks_; ++j) {
    if (send_bytes[j] < 0 || recv_bytes[j] < 0 || send_offsets[j] < 0 ||
        recv_offsets[j] < 0) {
      return Status::InvalidArgument(
          s.Prefix() + "NCCL " + what +
          ": negative size or offset for rank " + std::to_string(j) + ".");
    }
    any = any || send_bytes[j] > 0 || recv_bytes[j] > 0;
  }
  if (!any) {
    if (s.aborted.load()) return s.AbortedStatus(what);
    return Status::Ok();
  }
  const char* in = static_cast<const char*>(send);
  char* outp = static_cast<char*>(recv);
  const NcclApi& api = *s.api;
  ncclComm_t comm = s.comm;
  const int n = num_ranks_;
  const int me = rank_;
  return s.Run(what, stream, [&](cudaStream_t st) -> ncclResult_t {
    // Peers in the order me, me+1, ..., so that every rank starts with a
    // different partner.
    for (int k = 0; k < n; ++k) {
      const int j = (me + k) % n;
      if (send_bytes[j] > 0) {
        const ncclResult_t r =
            api.Send(in + send_offsets[j], static_cast<size_t>(send_bytes[j]),
                     kNcclUint8, j, comm, st);
        if (r != ncclSuccess && r != ncclInProgress) return r;
      }
      if (recv_bytes[j] > 0) {
        const ncclResult_t r =
            api.Recv(outp + recv_offsets[j], static_cast<size_t>(recv_bytes[j]),
                     kNcclUint8, j, comm, st);
        if (r != ncclSuccess && r != ncclInProgress) return r;
      }
    }
    return ncclSuccess;
  });
}

namespace {

Status CheckDtype(const NcclComm::State& s, int nccl_dtype,
                  const std::string& what) {
  if (NcclDataTypeSize(nccl_dtype) == 0) {
    return Status::InvalidArgument(s.Prefix() + "NCCL " + what +
                                   ": unknown NCCL data type " +
                                   std::to_string(nccl_dtype) + ".");
  }
  if (nccl_dtype == kNcclBfloat16 && s.api->version < kNcclVersion2_10) {
    return Status::InvalidArgument(
        s.Prefix() + "NCCL " + what + ": bfloat16 needs NCCL 2.10 or newer "
        "(loaded: " + std::to_string(s.api->version) + ").");
  }
  return Status::Ok();
}

Status CheckCount(const NcclComm::State& s, int64_t count,
                  const std::string& what) {
  if (count < 0) {
    return Status::InvalidArgument(s.Prefix() + "NCCL " + what +
                                   ": negative element count " +
                                   std::to_string(count) + ".");
  }
  return Status::Ok();
}

}  // namespace

Status NcclComm::AllReduce(const void* in, void* out, int64_t count,
                           int nccl_dtype, int nccl_op, void* stream,
                           const std::string& what) {
  State& s = *state_;
  SOK_RETURN_IF_ERROR(CheckDtype(s, nccl_dtype, what));
  SOK_RETURN_IF_ERROR(CheckCount(s, count, what));
  if (nccl_op < kNcclSum || nccl_op > kNcclAvg) {
    return Status::InvalidArgument(s.Prefix() + "NCCL " + what +
                                   ": unknown reduction " +
                                   std::to_string(nccl_op) + ".");
  }
  if (count == 0) {
    if (s.aborted.load()) return s.AbortedStatus(what);
    return Status::Ok();
  }
  const NcclApi& api = *s.api;
  ncclComm_t comm = s.comm;
  return s.Run(what, stream, [&](cudaStream_t st) {
    return api.AllReduce(in, out, static_cast<size_t>(count), nccl_dtype,
                         nccl_op, comm, st);
  });
}

Status NcclComm::AllGather(const void* in, void* out, int64_t count_per_rank,
                           int nccl_dtype, void* stream,
                           const std::string& what) {
  State& s = *state_;
  SOK_RETURN_IF_ERROR(CheckDtype(s, nccl_dtype, what));
  SOK_RETURN_IF_ERROR(CheckCount(s, count_per_rank, what));
  if (count_per_rank == 0) {
    if (s.aborted.load()) return s.AbortedStatus(what);
    return Status::Ok();
  }
  const NcclApi& api = *s.api;
  ncclComm_t comm = s.comm;
  return s.Run(what, stream, [&](cudaStream_t st) {
    return api.AllGather(in, out, static_cast<size_t>(count_per_rank),
                         nccl_dtype, comm, st);
  });
}

Status NcclComm::Broadcast(const void* in, void* out, int64_t count,
                           int nccl_dtype, int root, void* stream,
                           const std::string& what) {
  State& s = *state_;
  SOK_RETURN_IF_ERROR(CheckDtype(s, nccl_dtype, what));
  SOK_RETURN_IF_ERROR(CheckCount(s, count, what));
  if (root < 0 || root >= num_ranks_) {
    return Status::InvalidArgument(
        s.Prefix() + "NCCL " + what + ": root " + std::to_string(root) +
        " is not a rank in [0, " + std::to_string(num_ranks_) + ").");
  }
  if (count == 0) {
    if (s.aborted.load()) return s.AbortedStatus(what);
    return Status::Ok();
  }
  const NcclApi& api = *s.api;
  ncclComm_t comm = s.comm;
  return s.Run(what, stream, [&](cudaStream_t st) {
    return api.Broadcast(in, out, static_cast<size_t>(count), nccl_dtype,
                         root, comm, st);
  });
}

Status NcclComm::Health() const { return state_->Health(); }

void NcclComm::Abort(const std::string& reason) {
  std::lock_guard<std::mutex> lock(state_->mu);
  state_->MarkAbortedLocked(reason);
}

// ---------------------------------------------------------------------------

namespace {

struct Registry {
  std::mutex mu;
  std::map<int64_t, std::shared_ptr<NcclComm>> comms;
  int64_t next = 1;
};

Registry& TheRegistry() {
  static Registry* r = new Registry;  // leaked: comms are never destroyed
  return *r;
}

}  // namespace

Status RegisterComm(std::shared_ptr<NcclComm> comm, int64_t* handle) {
  if (comm == nullptr) {
    return Status::InvalidArgument("sok_keras: RegisterComm got no comm.");
  }
  Registry& r = TheRegistry();
  std::lock_guard<std::mutex> lock(r.mu);
  *handle = r.next++;
  r.comms[*handle] = std::move(comm);
  return Status::Ok();
}

Status LookupComm(int64_t handle, std::shared_ptr<NcclComm>* comm) {
  Registry& r = TheRegistry();
  std::lock_guard<std::mutex> lock(r.mu);
  auto it = r.comms.find(handle);
  if (it == r.comms.end()) {
    return Status::InvalidArgument(
        "sok_keras: no NCCL communicator has handle " +
        std::to_string(handle) + " in this process (SokNcclInit makes one).");
  }
  *comm = it->second;
  return Status::Ok();
}

}  // namespace comm
}  // namespace sok
