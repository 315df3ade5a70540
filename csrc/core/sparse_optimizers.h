// Sparse ("lazy") optimizer row updates over raw pointers.
//
// Framework-neutral C++17: no TensorFlow headers. The TensorFlow kernels in
// csrc/tf/sparse_optimizer_ops.cc validate shapes/dtypes, lock the variables,
// and then call into here.
//
// Layout: a table (and every slot) is a dense row-major [rows, dim] array.
// A sparse gradient is `k` row indices plus a [k, dim] gradient. Duplicate
// indices are first summed (`BuildUniqueIndex` + `SumDuplicateRows`) so that
// each unique row gets exactly one update; rows that are not present are not
// read or written.
//
// Every `Apply*` function takes the unique row list `rows_idx[n]` and the
// per-row (already summed) gradients `grad[n, dim]`, and updates only those
// rows, in parallel over rows through the injected `ParallelFor`. The formulas
// follow Keras 3's optimizers (keras/src/optimizers/*.py) element by element.
//
// Errors are returned as `Status`, never thrown.
#ifndef SOK_CORE_SPARSE_OPTIMIZERS_H_
#define SOK_CORE_SPARSE_OPTIMIZERS_H_

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "core/device.h"  // GpuDevice, for the GPU entry points below
#include "core/half.h"
#include "core/parallel.h"
#include "core/status.h"

namespace sok {
namespace sparse_opt {

// See core/status.h.
using Status = ::sok::Status;

// parallel_for(n, cost_per_unit, fn) must call fn(begin, end) over disjoint
// ranges that together cover [0, n) (possibly concurrently). `cost_per_unit`
// is a rough number of cycles per unit, for the scheduler.
using WorkFn = ::sok::WorkFn;            // see core/parallel.h
using ParallelFor = ::sok::ParallelFor;

using ::sok::SerialFor;  // runs fn(0, n) on the calling thread

// The unique rows of an index list and, per unique row, the positions at
// which it occurs (CSR layout, ascending positions).
struct UniqueIndex {
  // Unique row ids, in order of first occurrence.
  std::vector<int64_t> rows;
  // positions[offsets[u] .. offsets[u+1]) are the positions of rows[u] in
  // the input index list, ascending. Empty when `all_unique`.
  std::vector<int64_t> offsets;
  std::vector<int64_t> positions;
  // True when the input had no duplicates; then rows[i] == indices[i].
  bool all_unique = true;
};

// Builds `out` from indices[0..k). Fails (without writing anything else) if
// an index is outside [0, num_rows); the message names the position, the
// index and the row count.
template <typename Index>
Status BuildUniqueIndex(const Index* indices, int64_t k, int64_t num_rows,
                        UniqueIndex* out);

// out[u, :] = sum over positions p of unique row u (ascending p) of
// grad[p, :]. `out` has uniq.rows.size() * dim elements. Deterministic.
// The sums run in AccOf<T> (core/half.h: float for Half and BFloat16, T
// itself for float and double), and `out` keeps them there (no rounding).
template <typename T>
void SumDuplicateRows(const T* grad, int64_t dim, const UniqueIndex& uniq,
                      AccOf<T>* out, const ParallelFor& parallel_for);

// ---- Row-update rules. `rows_idx` are unique, already validated in
// [0, num_rows); `grad` is [n, dim] (one summed gradient per unique row).
// All return an error only for inconsistent arguments (checked up front,
// before any write).
//
// Precision: T is the table's storage type (float, double, Half or
// BFloat16); the slots, the summed gradient and the hyperparameters are in
// A = AccOf<T> (float for the 16-bit types). Each rule loads the row
// element into A, runs the formula in A (as the float rule would) and rounds
// the new row element once, to nearest even, when it stores it.

// w -= lr * g
template <typename T>
Status ApplySgd(T* var, int64_t num_rows, int64_t dim, const int64_t* rows_idx,
                const AccOf<T>* grad, int64_t n, AccOf<T> lr,
                const ParallelFor& pf);

// m = momentum * m - lr * g
// nesterov: w += momentum * m - lr * g   else: w += m
template <typename T>
Status ApplyMomentum(T* var, AccOf<T>* mom, int64_t num_rows, int64_t dim,
                     const int64_t* rows_idx, const AccOf<T>* grad, int64_t n,
                     AccOf<T> lr, AccOf<T> momentum, bool nesterov,
                     const ParallelFor& pf);

// acc += g^2;  w -= lr * g / sqrt(acc + epsilon)
template <typename T>
Status ApplyAdagrad(T* var, AccOf<T>* acc, int64_t num_rows, int64_t dim,
                    const int64_t* rows_idx, const AccOf<T>* grad, int64_t n,
                    AccOf<T> lr, AccOf<T> epsilon, const ParallelFor& pf);

// Optional decoupled weight decay (AdamW), then Adam:
//   w -= w * weight_decay * lr                 (only if apply_weight_decay)
//   alpha = lr * sqrt(1 - beta_2^step) / (1 - beta_1^step)
//   m += (g - m) * (1 - beta_1)
//   v += (g^2 - v) * (1 - beta_2)
//   amsgrad (vhat != nullptr): vhat = max(vhat, v); v_used = vhat
//   w -= m * alpha / (sqrt(v_used) + epsilon)
template <typename T>
Status ApplyAdam(T* var, AccOf<T>* m, AccOf<T>* v, AccOf<T>* vhat,
                 int64_t num_rows, int64_t dim, const int64_t* rows_idx,
                 const AccOf<T>* grad, int64_t n, AccOf<T> lr, AccOf<T> beta_1,
                 AccOf<T> beta_2, AccOf<T> epsilon, AccOf<T> step,
                 bool apply_weight_decay, AccOf<T> weight_decay,
                 const ParallelFor& pf);

// Keras Ftrl (keras/src/optimizers/ftrl.py):
//   l2_reg = l2 + beta / (2 * lr)
//   g2 = g + 2 * l2_shrinkage * w
//   new_acc = acc + g^2
//   linear += g2 - (new_acc^(-lr_power) - acc^(-lr_power)) / lr * w
//   quadratic = new_acc^(-lr_power) / lr + 2 * l2_reg
//   w = (clip(linear, -l1, l1) - linear) / quadratic
//   acc = new_acc
template <typename T>
Status ApplyFtrl(T* var, AccOf<T>* acc, AccOf<T>* linear, int64_t num_rows,
                 int64_t dim, const int64_t* rows_idx, const AccOf<T>* grad,
                 int64_t n, AccOf<T> lr, AccOf<T> lr_power, AccOf<T> l1,
                 AccOf<T> l2, AccOf<T> l2_shrinkage, AccOf<T> beta,
                 const ParallelFor& pf);

// Keras RMSprop (keras/src/optimizers/rmsprop.py):
//   vel = rho * vel + (1 - rho) * g^2
//   centered: avg = rho * avg + (1 - rho) * g; denom = vel - avg^2 + epsilon
//   else:     denom = vel + epsilon
//   inc = lr * g / sqrt(denom)
//   mom != nullptr: mom = momentum * mom + inc; w -= mom
//   else:           w -= inc
// `avg` == nullptr means not centered; `mom` == nullptr means no momentum.
template <typename T>
Status ApplyRmsprop(T* var, AccOf<T>* vel, AccOf<T>* mom, AccOf<T>* avg,
                    int64_t num_rows, int64_t dim, const int64_t* rows_idx,
                    const AccOf<T>* grad, int64_t n, AccOf<T> lr, AccOf<T> rho,
                    AccOf<T> momentum, AccOf<T> epsilon,
                    const ParallelFor& pf);


// Keras Adamax (keras/src/optimizers/adamax.py), with
// beta_1_power = beta_1^step:
//   m += (g - m) * (1 - beta_1)
//   u = max(beta_2 * u, |g|)
//   w -= (lr * m) / ((1 - beta_1_power) * (u + epsilon))
template <typename T>
Status ApplyAdamax(T* var, AccOf<T>* m, AccOf<T>* u, int64_t num_rows,
                   int64_t dim, const int64_t* rows_idx, const AccOf<T>* grad,
                   int64_t n, AccOf<T> lr, AccOf<T> beta_1, AccOf<T> beta_2,
                   AccOf<T> epsilon, AccOf<T> step, const ParallelFor& pf);

// Keras Adadelta (keras/src/optimizers/adadelta.py):
//   acc_g = rho * acc_g + (1 - rho) * g^2
//   delta = -(sqrt(acc_d + epsilon) * g) / sqrt(acc_g + epsilon)
//   acc_d = rho * acc_d + (1 - rho) * delta^2
//   w += lr * delta
template <typename T>
Status ApplyAdadelta(T* var, AccOf<T>* acc_grad, AccOf<T>* acc_delta,
                     int64_t num_rows, int64_t dim, const int64_t* rows_idx,
                     const AccOf<T>* grad, int64_t n, AccOf<T> lr,
                     AccOf<T> rho, AccOf<T> epsilon, const ParallelFor& pf);

// Keras Nadam (keras/src/optimizers/nadam.py). The step's momentum
// schedule comes in as Keras computes it: u_t = beta_1 (1 - 0.5 * 0.96^t),
// u_t_1 = beta_1 (1 - 0.5 * 0.96^(t+1)), u_product = the optimizer's product
// of the u's up to u_t (its `_u_product` after this step's update) and
// beta_2_power = beta_2^t:
//   m += (g - m) * (1 - beta_1)
//   v += (g^2 - v) * (1 - beta_2)
//   m_hat = (u_t_1 * m) / (1 - u_product * u_t_1)
//           + ((1 - u_t) * g) / (1 - u_product)
//   w -= (m_hat * lr) / (sqrt(v / (1 - beta_2_power)) + epsilon)
template <typename T>
Status ApplyNadam(T* var, AccOf<T>* m, AccOf<T>* v, int64_t num_rows,
                  int64_t dim, const int64_t* rows_idx, const AccOf<T>* grad,
                  int64_t n, AccOf<T> lr, AccOf<T> beta_1, AccOf<T> beta_2,
                  AccOf<T> epsilon, AccOf<T> u_t, AccOf<T> u_t_1,
                  AccOf<T> u_product, AccOf<T> beta_2_power,
                  const ParallelFor& pf);

// Keras Lion (keras/src/optimizers/lion.py):
//   w -= lr * sign(m * beta_1 + g * (1 - beta_1))
//   m = m * beta_2 + g * (1 - beta_2)
template <typename T>
Status ApplyLion(T* var, AccOf<T>* m, int64_t num_rows, int64_t dim,
                 const int64_t* rows_idx, const AccOf<T>* grad, int64_t n,
                 AccOf<T> lr, AccOf<T> beta_1, AccOf<T> beta_2,
                 const ParallelFor& pf);

// ===========================================================================
// GPU entry points (implemented in core/sparse_optimizers.cu.cc; defined
// only in builds with SOK_WITH_CUDA). Plain C++ declarations, so the host
// compiler can include them; every pointer argument below is device memory
// unless said otherwise. All work is enqueued on d.stream, scratch comes
// from d.allocate; the only host sync is the one inside Dedup
// (DistinctRows has none).
namespace gpu {

// The unique rows of a device index list, grouped by row (CSR layout).
struct DedupResult {
  // Host values (copied back by Dedup with one blocking copy).
  int64_t num_unique = 0;     // U; 0 when k == 0
  int64_t bad_position = -1;  // first position p with indices[p] outside
                              // [0, num_rows), or -1 when all are valid
  int64_t bad_value = 0;      // indices[bad_position] (when >= 0)
  // Device pointers into d's scratch (valid while that scratch lives).
  // Meaningful only when bad_position == -1 and k > 0.
  const int64_t* rows = nullptr;       // [U] unique rows, ascending
  const int64_t* offsets = nullptr;    // [U + 1], offsets[U] == k
  const int64_t* positions = nullptr;  // [k]: positions[offsets[u] ..
                                       // offsets[u+1]) are the positions of
                                       // rows[u], ascending
  // The variable's rows (host). With offsets == positions == nullptr (from
  // DistinctRows) row u is rows[u] with its gradient at position u, and a
  // row outside [0, num_rows) is skipped.
  int64_t num_rows = 0;
};

// Validates indices[0..k) (device) against [0, num_rows) and groups equal
// indices (stable radix sort, so deterministic). Writes no user memory.
// k == 0: returns U = 0 with no device work. A returned error is an internal
// (CUDA / out of memory) failure; an invalid index is reported through
// out->bad_position instead.
template <typename Index>
Status Dedup(const GpuDevice& d, const Index* indices, int64_t k,
             int64_t num_rows, DedupResult* out);

// The DedupResult of indices[0..k) (device) known to be distinct, without
// sorting or validating them and with no host sync: U = k, row u =
// indices[u] (int32 indices are widened into scratch), offsets and
// positions null. For indices that sok_keras proves distinct at trace time
// (the `indices_are_unique` attr: the rows output of SokPooledLookupGrad or
// of a one-rank SokDedupBucketize, validated against the table's rows by
// that op). ApplyRule never writes a row outside [0, num_rows).
template <typename Index>
Status DistinctRows(const GpuDevice& d, const Index* indices, int64_t k,
                    int64_t num_rows, DedupResult* out);

// The message of BuildUniqueIndex for an invalid index (same wording).
inline std::string InvalidIndexMessage(int64_t position, int64_t value,
                                       int64_t num_rows) {
  return "indices[" + std::to_string(position) + "] = " +
         std::to_string(value) + " is not in [0, " + std::to_string(num_rows) +
         ") (the variable has " + std::to_string(num_rows) + " rows)";
}

enum class Rule {
  kSgd,
  kMomentum,
  kAdagrad,
  kAdam,
  kFtrl,
  kRmsprop,
  kAdamax,
  kAdadelta,
  kLion,
  kNadam,
};

// The op's scalar hyperparameters (read on the host as AccOf<T>; stored as
// double, which is exact for float and double, and converted back to
// AccOf<T> before use).
// Only the fields of the chosen rule are read.
struct Hyper {
  double lr = 0;
  double momentum = 0;      // Momentum, Rmsprop
  double epsilon = 0;       // Adagrad, Adam, Rmsprop, Adamax, Adadelta
  double beta_1 = 0;        // Adam, Adamax, Lion
  double beta_2 = 0;        // Adam, Adamax, Lion
  double step = 0;          // Adam, Adamax
  double weight_decay = 0;  // Adam with apply_weight_decay (AdamW)
  double lr_power = 0;      // Ftrl
  double l1 = 0;            // Ftrl
  double l2 = 0;            // Ftrl
  double l2_shrinkage = 0;  // Ftrl
  double beta = 0;          // Ftrl
  double rho = 0;           // Rmsprop, Adadelta
  double u_t = 0;           // Nadam: this step's momentum schedule
  double u_t_1 = 0;         // Nadam: the next step's
  double u_product = 0;     // Nadam: the schedule's product up to u_t
  double beta_2_power = 0;  // Nadam: beta_2^step
  bool nesterov = false;            // Momentum
  bool apply_weight_decay = false;  // Adam -> AdamW
};

// One update per unique row of `dedup` (from Dedup over the same indices,
// with bad_position == -1), with grad [k, dim] summed per row in ascending
// position order (in AccOf<T>). var ([num_rows, dim], storage type T) is
// rounded once per element at its store; the slots are [num_rows, dim] of
// AccOf<T>. Slots per rule (same
// formulas and operation order as the CPU Apply* functions above):
//   kSgd:      -
//   kMomentum: s1 = m
//   kAdagrad:  s1 = accumulator
//   kAdam:     s1 = m, s2 = v, s3 = vhat (nullptr unless amsgrad)
//   kFtrl:     s1 = accumulator, s2 = linear
//   kRmsprop:  s1 = velocity, s2 = mom (nullptr unless momentum),
//              s3 = mg (nullptr unless centered)
//   kAdamax:   s1 = m, s2 = u
//   kAdadelta: s1 = accumulated_grad, s2 = accumulated_delta_var
//   kLion:     s1 = m
//   kNadam:    s1 = m, s2 = v
// U == 0 or dim == 0: no-op.
template <typename T>
Status ApplyRule(const GpuDevice& d, Rule rule, const Hyper& h, T* var,
                 AccOf<T>* s1, AccOf<T>* s2, AccOf<T>* s3, int64_t dim,
                 const DedupResult& dedup, const T* grad);

// Stream-ordered device-to-device copy of `bytes` bytes (0: no-op).
Status CopyDevice(const GpuDevice& d, void* dst, const void* src,
                  int64_t bytes);

}  // namespace gpu
// ===========================================================================

}  // namespace sparse_opt
}  // namespace sok

#endif  // SOK_CORE_SPARSE_OPTIMIZERS_H_
