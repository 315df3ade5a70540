#include "core/sparse_optimizers.h"

#include <algorithm>
#include <cmath>
#include <unordered_map>

namespace sok {
namespace sparse_opt {

template <typename Index>
Status BuildUniqueIndex(const Index* indices, int64_t k, int64_t num_rows,
                        UniqueIndex* out) {
  out->rows.clear();
  out->offsets.clear();
  out->positions.clear();
  out->all_unique = true;
  if (k < 0 || num_rows < 0) {
    return Status::InvalidArgument("negative index count or row count");
  }
  // Validate everything first so that a failure leaves `out` empty.
  for (int64_t p = 0; p < k; ++p) {
    const int64_t r = static_cast<int64_t>(indices[p]);
    if (r < 0 || r >= num_rows) {
      return Status::InvalidArgument(
          "indices[" + std::to_string(p) + "] = " + std::to_string(r) +
          " is not in [0, " + std::to_string(num_rows) +
          ") (the variable has " + std::to_string(num_rows) + " rows)");
    }
  }
  std::vector<int64_t> group(static_cast<size_t>(k));
  std::unordered_map<int64_t, int64_t> id_of;
  id_of.reserve(static_cast<size_t>(k) * 2 + 1);
  out->rows.reserve(static_cast<size_t>(k));
  for (int64_t p = 0; p < k; ++p) {
    const int64_t r = static_cast<int64_t>(indices[p]);
    auto it = id_of.emplace(r, static_cast<int64_t>(out->rows.size()));
    if (it.second) out->rows.push_back(r);
    group[p] = it.first->second;
  }
  const int64_t u = static_cast<int64_t>(out->rows.size());
  if (u == k) return Status::Ok();  // no duplicates: identity grouping
  out->all_unique = false;
  out->offsets.assign(static_cast<size_t>(u) + 1, 0);
  for (int64_t p = 0; p < k; ++p) ++out->offsets[group[p] + 1];
  for (int64_t g = 0; g < u; ++g) out->offsets[g + 1] += out->offsets[g];
  out->positions.resize(static_cast<size_t>(k));
  std::vector<int64_t> fill(out->offsets.begin(), out->offsets.end() - 1);
  for (int64_t p = 0; p < k; ++p) out->positions[fill[group[p]]++] = p;
  return Status::Ok();
}

template <typename T>
void SumDuplicateRows(const T* grad, int64_t dim, const UniqueIndex& uniq,
                      T* out, const ParallelFor& parallel_for) {
  const int64_t u = static_cast<int64_t>(uniq.rows.size());
  if (u == 0 || dim == 0) return;
  if (uniq.all_unique) {
    std::copy(grad, grad + u * dim, out);
    return;
  }
  const int64_t k = static_cast<int64_t>(uniq.positions.size());
  const int64_t cost = std::max<int64_t>(1, dim * (k / u + 1) * 2);
  parallel_for(u, cost, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      T* o = out + g * dim;
      const int64_t s = uniq.offsets[g], e = uniq.offsets[g + 1];
      const T* first = grad + uniq.positions[s] * dim;
      std::copy(first, first + dim, o);
      for (int64_t q = s + 1; q < e; ++q) {
        const T* gp = grad + uniq.positions[q] * dim;
        for (int64_t j = 0; j < dim; ++j) o[j] += gp[j];
      }
    }
  });
}

namespace {

Status CheckRows(int64_t num_rows, int64_t dim, const int64_t* rows_idx,
                 int64_t n) {
  if (num_rows < 0 || dim < 0 || n < 0) {
    return Status::InvalidArgument("negative size");
  }
  for (int64_t i = 0; i < n; ++i) {
    if (rows_idx[i] < 0 || rows_idx[i] >= num_rows) {
      return Status::InvalidArgument(
          "row " + std::to_string(rows_idx[i]) + " is not in [0, " +
          std::to_string(num_rows) + ")");
    }
  }
  return Status::Ok();
}

// Calls body(w_row, i, g_row) for every unique row i, in parallel.
template <typename T, typename Body>
void ForEachRow(T* var, int64_t dim, const int64_t* rows_idx, const T* grad,
                int64_t n, int64_t cost_per_elem, const ParallelFor& pf,
                const Body& body) {
  if (n == 0 || dim == 0) return;
  pf(n, std::max<int64_t>(1, dim * cost_per_elem),
     [&](int64_t begin, int64_t end) {
       for (int64_t i = begin; i < end; ++i) {
         const int64_t off = rows_idx[i] * dim;
         body(off, grad + i * dim);
       }
     });
}

}  // namespace

template <typename T>
Status ApplySgd(T* var, int64_t num_rows, int64_t dim, const int64_t* rows_idx,
                const T* grad, int64_t n, T lr, const ParallelFor& pf) {
  Status s = CheckRows(num_rows, dim, rows_idx, n);
  if (!s.ok()) return s;
  ForEachRow(var, dim, rows_idx, grad, n, 2, pf,
             [&](int64_t off, const T* g) {
               T* w = var + off;
               for (int64_t j = 0; j < dim; ++j) w[j] -= g[j] * lr;
             });
  return Status::Ok();
}

template <typename T>
Status ApplyMomentum(T* var, T* mom, int64_t num_rows, int64_t dim,
                     const int64_t* rows_idx, const T* grad, int64_t n, T lr,
                     T momentum, bool nesterov, const ParallelFor& pf) {
  Status s = CheckRows(num_rows, dim, rows_idx, n);
  if (!s.ok()) return s;
  ForEachRow(var, dim, rows_idx, grad, n, 6, pf,
             [&](int64_t off, const T* g) {
               T* w = var + off;
               T* m = mom + off;
               for (int64_t j = 0; j < dim; ++j) {
                 const T mj = m[j] * momentum - g[j] * lr;
                 m[j] = mj;
                 if (nesterov) {
                   w[j] += mj * momentum - g[j] * lr;
                 } else {
                   w[j] += mj;
                 }
               }
             });
  return Status::Ok();
}

template <typename T>
Status ApplyAdagrad(T* var, T* acc, int64_t num_rows, int64_t dim,
                    const int64_t* rows_idx, const T* grad, int64_t n, T lr,
                    T epsilon, const ParallelFor& pf) {
  Status s = CheckRows(num_rows, dim, rows_idx, n);
  if (!s.ok()) return s;
  ForEachRow(var, dim, rows_idx, grad, n, 20, pf,
             [&](int64_t off, const T* g) {
               T* w = var + off;
               T* a = acc + off;
               for (int64_t j = 0; j < dim; ++j) {
                 const T aj = a[j] + g[j] * g[j];
                 a[j] = aj;
                 w[j] -= (lr * g[j]) / std::sqrt(aj + epsilon);
               }
             });
  return Status::Ok();
}

template <typename T>
Status ApplyAdam(T* var, T* m, T* v, T* vhat, int64_t num_rows, int64_t dim,
                 const int64_t* rows_idx, const T* grad, int64_t n, T lr,
                 T beta_1, T beta_2, T epsilon, T step, bool apply_weight_decay,
                 T weight_decay, const ParallelFor& pf) {
  Status s = CheckRows(num_rows, dim, rows_idx, n);
  if (!s.ok()) return s;
  // Same operation order and precision as Keras' Adam.update_step.
  const T beta_1_power = std::pow(beta_1, step);
  const T beta_2_power = std::pow(beta_2, step);
  const T alpha = lr * std::sqrt(T(1) - beta_2_power) / (T(1) - beta_1_power);
  const T one_minus_b1 = T(1) - beta_1;
  const T one_minus_b2 = T(1) - beta_2;
  ForEachRow(var, dim, rows_idx, grad, n, 30, pf,
             [&](int64_t off, const T* g) {
               T* w = var + off;
               T* mr = m + off;
               T* vr = v + off;
               T* vh = vhat ? vhat + off : nullptr;
               for (int64_t j = 0; j < dim; ++j) {
                 if (apply_weight_decay) w[j] -= w[j] * weight_decay * lr;
                 const T mj = mr[j] + (g[j] - mr[j]) * one_minus_b1;
                 const T vj = vr[j] + (g[j] * g[j] - vr[j]) * one_minus_b2;
                 mr[j] = mj;
                 vr[j] = vj;
                 T vu = vj;
                 if (vh) {
                   vu = std::max(vh[j], vj);
                   vh[j] = vu;
                 }
                 w[j] -= (mj * alpha) / (std::sqrt(vu) + epsilon);
               }
             });
  return Status::Ok();
}

template <typename T>
Status ApplyFtrl(T* var, T* acc, T* linear, int64_t num_rows, int64_t dim,
                 const int64_t* rows_idx, const T* grad, int64_t n, T lr,
                 T lr_power, T l1, T l2, T l2_shrinkage, T beta,
                 const ParallelFor& pf) {
  Status s = CheckRows(num_rows, dim, rows_idx, n);
  if (!s.ok()) return s;
  const T l2_reg = l2 + beta / (T(2) * lr);
  const T two_l2_reg = T(2) * l2_reg;
  const T two_shrink = T(2) * l2_shrinkage;
  const T neg_power = -lr_power;
  ForEachRow(var, dim, rows_idx, grad, n, 80, pf,
             [&](int64_t off, const T* g) {
               T* w = var + off;
               T* a = acc + off;
               T* l = linear + off;
               for (int64_t j = 0; j < dim; ++j) {
                 const T wj = w[j];
                 const T gj = g[j];
                 const T grad_to_use = gj + two_shrink * wj;
                 const T new_acc = a[j] + gj * gj;
                 const T new_pow = std::pow(new_acc, neg_power);
                 const T old_pow = std::pow(a[j], neg_power);
                 const T lj = l[j] + (grad_to_use - ((new_pow - old_pow) / lr) * wj);
                 l[j] = lj;
                 const T quadratic = new_pow / lr + two_l2_reg;
                 const T clipped = std::min(std::max(lj, -l1), l1);
                 w[j] = (clipped - lj) / quadratic;
                 a[j] = new_acc;
               }
             });
  return Status::Ok();
}

template <typename T>
Status ApplyRmsprop(T* var, T* vel, T* mom, T* avg, int64_t num_rows,
                    int64_t dim, const int64_t* rows_idx, const T* grad,
                    int64_t n, T lr, T rho, T momentum, T epsilon,
                    const ParallelFor& pf) {
  Status s = CheckRows(num_rows, dim, rows_idx, n);
  if (!s.ok()) return s;
  const T one_minus_rho = T(1) - rho;
  ForEachRow(var, dim, rows_idx, grad, n, 30, pf,
             [&](int64_t off, const T* g) {
               T* w = var + off;
               T* ve = vel + off;
               T* mo = mom ? mom + off : nullptr;
               T* av = avg ? avg + off : nullptr;
               for (int64_t j = 0; j < dim; ++j) {
                 const T gj = g[j];
                 const T vj = rho * ve[j] + one_minus_rho * (gj * gj);
                 ve[j] = vj;
                 T denom;
                 if (av) {
                   const T aj = rho * av[j] + one_minus_rho * gj;
                   av[j] = aj;
                   denom = vj - aj * aj + epsilon;
                 } else {
                   denom = vj + epsilon;
                 }
                 const T inc = (lr * gj) / std::sqrt(denom);
                 if (mo) {
                   const T mj = momentum * mo[j] + inc;
                   mo[j] = mj;
                   w[j] -= mj;
                 } else {
                   w[j] -= inc;
                 }
               }
             });
  return Status::Ok();
}

#define SOK_INSTANTIATE_INDEX(Index)                                       \
  template Status BuildUniqueIndex<Index>(const Index*, int64_t, int64_t, \
                                          UniqueIndex*);
SOK_INSTANTIATE_INDEX(int32_t)
SOK_INSTANTIATE_INDEX(int64_t)
#undef SOK_INSTANTIATE_INDEX

#define SOK_INSTANTIATE(T)                                                    \
  template void SumDuplicateRows<T>(const T*, int64_t, const UniqueIndex&,    \
                                    T*, const ParallelFor&);                  \
  template Status ApplySgd<T>(T*, int64_t, int64_t, const int64_t*, const T*, \
                              int64_t, T, const ParallelFor&);                \
  template Status ApplyMomentum<T>(T*, T*, int64_t, int64_t, const int64_t*,  \
                                   const T*, int64_t, T, T, bool,             \
                                   const ParallelFor&);                       \
  template Status ApplyAdagrad<T>(T*, T*, int64_t, int64_t, const int64_t*,   \
                                  const T*, int64_t, T, T,                    \
                                  const ParallelFor&);                        \
  template Status ApplyAdam<T>(T*, T*, T*, T*, int64_t, int64_t,              \
                               const int64_t*, const T*, int64_t, T, T, T, T, \
                               T, bool, T, const ParallelFor&);               \
  template Status ApplyFtrl<T>(T*, T*, T*, int64_t, int64_t, const int64_t*,  \
                               const T*, int64_t, T, T, T, T, T, T,           \
                               const ParallelFor&);                           \
  template Status ApplyRmsprop<T>(T*, T*, T*, T*, int64_t, int64_t,           \
                                  const int64_t*, const T*, int64_t, T, T, T, \
                                  T, const ParallelFor&);
SOK_INSTANTIATE(float)
SOK_INSTANTIATE(double)
#undef SOK_INSTANTIATE

}  // namespace sparse_opt
}  // namespace sok
