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
                      AccOf<T>* out, const ParallelFor& parallel_for) {
  using S = Storage<T>;
  const int64_t u = static_cast<int64_t>(uniq.rows.size());
  if (u == 0 || dim == 0) return;
  if (uniq.all_unique) {
    std::transform(grad, grad + u * dim, out, [](T x) { return S::Load(x); });
    return;
  }
  const int64_t k = static_cast<int64_t>(uniq.positions.size());
  const int64_t cost = std::max<int64_t>(1, dim * (k / u + 1) * 2);
  parallel_for(u, cost, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      AccOf<T>* o = out + g * dim;
      const int64_t s = uniq.offsets[g], e = uniq.offsets[g + 1];
      const T* first = grad + uniq.positions[s] * dim;
      for (int64_t j = 0; j < dim; ++j) o[j] = S::Load(first[j]);
      for (int64_t q = s + 1; q < e; ++q) {
        const T* gp = grad + uniq.positions[q] * dim;
        for (int64_t j = 0; j < dim; ++j) o[j] += S::Load(gp[j]);
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
template <typename T, typename G, typename Body>
void ForEachRow(T* var, int64_t dim, const int64_t* rows_idx, const G* grad,
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

// Every rule loads the stored row element into A = AccOf<T> (core/half.h),
// computes in A exactly as the float/double rule does, and rounds once when
// it stores the row element (the identity for float and double). Slots,
// gradients and hyperparameters are already in A.

template <typename T>
Status ApplySgd(T* var, int64_t num_rows, int64_t dim, const int64_t* rows_idx,
                const AccOf<T>* grad, int64_t n, AccOf<T> lr,
                const ParallelFor& pf) {
  using A = AccOf<T>;
  using S = Storage<T>;
  Status s = CheckRows(num_rows, dim, rows_idx, n);
  if (!s.ok()) return s;
  ForEachRow(var, dim, rows_idx, grad, n, 2, pf,
             [&](int64_t off, const A* g) {
               T* w = var + off;
               for (int64_t j = 0; j < dim; ++j) {
                 w[j] = S::Store(S::Load(w[j]) - g[j] * lr);
               }
             });
  return Status::Ok();
}

template <typename T>
Status ApplyMomentum(T* var, AccOf<T>* mom, int64_t num_rows, int64_t dim,
                     const int64_t* rows_idx, const AccOf<T>* grad, int64_t n,
                     AccOf<T> lr, AccOf<T> momentum, bool nesterov,
                     const ParallelFor& pf) {
  using A = AccOf<T>;
  using S = Storage<T>;
  Status s = CheckRows(num_rows, dim, rows_idx, n);
  if (!s.ok()) return s;
  ForEachRow(var, dim, rows_idx, grad, n, 6, pf,
             [&](int64_t off, const A* g) {
               T* w = var + off;
               A* m = mom + off;
               for (int64_t j = 0; j < dim; ++j) {
                 const A mj = m[j] * momentum - g[j] * lr;
                 m[j] = mj;
                 if (nesterov) {
                   w[j] = S::Store(S::Load(w[j]) + (mj * momentum - g[j] * lr));
                 } else {
                   w[j] = S::Store(S::Load(w[j]) + mj);
                 }
               }
             });
  return Status::Ok();
}

template <typename T>
Status ApplyAdagrad(T* var, AccOf<T>* acc, int64_t num_rows, int64_t dim,
                    const int64_t* rows_idx, const AccOf<T>* grad, int64_t n,
                    AccOf<T> lr, AccOf<T> epsilon, const ParallelFor& pf) {
  using A = AccOf<T>;
  using S = Storage<T>;
  Status s = CheckRows(num_rows, dim, rows_idx, n);
  if (!s.ok()) return s;
  ForEachRow(var, dim, rows_idx, grad, n, 20, pf,
             [&](int64_t off, const A* g) {
               T* w = var + off;
               A* a = acc + off;
               for (int64_t j = 0; j < dim; ++j) {
                 const A aj = a[j] + g[j] * g[j];
                 a[j] = aj;
                 w[j] = S::Store(S::Load(w[j]) -
                                 (lr * g[j]) / std::sqrt(aj + epsilon));
               }
             });
  return Status::Ok();
}

template <typename T>
Status ApplyAdam(T* var, AccOf<T>* m, AccOf<T>* v, AccOf<T>* vhat,
                 int64_t num_rows, int64_t dim, const int64_t* rows_idx,
                 const AccOf<T>* grad, int64_t n, AccOf<T> lr, AccOf<T> beta_1,
                 AccOf<T> beta_2, AccOf<T> epsilon, AccOf<T> step,
                 bool apply_weight_decay, AccOf<T> weight_decay,
                 const ParallelFor& pf) {
  using A = AccOf<T>;
  using S = Storage<T>;
  Status s = CheckRows(num_rows, dim, rows_idx, n);
  if (!s.ok()) return s;
  // Same operation order and precision as Keras' Adam.update_step.
  const A beta_1_power = std::pow(beta_1, step);
  const A beta_2_power = std::pow(beta_2, step);
  const A alpha = lr * std::sqrt(A(1) - beta_2_power) / (A(1) - beta_1_power);
  const A one_minus_b1 = A(1) - beta_1;
  const A one_minus_b2 = A(1) - beta_2;
  ForEachRow(var, dim, rows_idx, grad, n, 30, pf,
             [&](int64_t off, const A* g) {
               T* wr = var + off;
               A* mr = m + off;
               A* vr = v + off;
               A* vh = vhat ? vhat + off : nullptr;
               for (int64_t j = 0; j < dim; ++j) {
                 A w = S::Load(wr[j]);
                 if (apply_weight_decay) w -= w * weight_decay * lr;
                 const A mj = mr[j] + (g[j] - mr[j]) * one_minus_b1;
                 const A vj = vr[j] + (g[j] * g[j] - vr[j]) * one_minus_b2;
                 mr[j] = mj;
                 vr[j] = vj;
                 A vu = vj;
                 if (vh) {
                   vu = std::max(vh[j], vj);
                   vh[j] = vu;
                 }
                 wr[j] = S::Store(w - (mj * alpha) / (std::sqrt(vu) + epsilon));
               }
             });
  return Status::Ok();
}

template <typename T>
Status ApplyFtrl(T* var, AccOf<T>* acc, AccOf<T>* linear, int64_t num_rows,
                 int64_t dim, const int64_t* rows_idx, const AccOf<T>* grad,
                 int64_t n, AccOf<T> lr, AccOf<T> lr_power, AccOf<T> l1,
                 AccOf<T> l2, AccOf<T> l2_shrinkage, AccOf<T> beta,
                 const ParallelFor& pf) {
  using A = AccOf<T>;
  using S = Storage<T>;
  Status s = CheckRows(num_rows, dim, rows_idx, n);
  if (!s.ok()) return s;
  const A l2_reg = l2 + beta / (A(2) * lr);
  const A two_l2_reg = A(2) * l2_reg;
  const A two_shrink = A(2) * l2_shrinkage;
  const A neg_power = -lr_power;
  ForEachRow(var, dim, rows_idx, grad, n, 80, pf,
             [&](int64_t off, const A* g) {
               T* w = var + off;
               A* a = acc + off;
               A* l = linear + off;
               for (int64_t j = 0; j < dim; ++j) {
                 const A wj = S::Load(w[j]);
                 const A gj = g[j];
                 const A grad_to_use = gj + two_shrink * wj;
                 const A new_acc = a[j] + gj * gj;
                 const A new_pow = std::pow(new_acc, neg_power);
                 const A old_pow = std::pow(a[j], neg_power);
                 const A lj = l[j] + (grad_to_use - ((new_pow - old_pow) / lr) * wj);
                 l[j] = lj;
                 const A quadratic = new_pow / lr + two_l2_reg;
                 const A clipped = std::min(std::max(lj, -l1), l1);
                 w[j] = S::Store((clipped - lj) / quadratic);
                 a[j] = new_acc;
               }
             });
  return Status::Ok();
}

template <typename T>
Status ApplyRmsprop(T* var, AccOf<T>* vel, AccOf<T>* mom, AccOf<T>* avg,
                    int64_t num_rows, int64_t dim, const int64_t* rows_idx,
                    const AccOf<T>* grad, int64_t n, AccOf<T> lr, AccOf<T> rho,
                    AccOf<T> momentum, AccOf<T> epsilon,
                    const ParallelFor& pf) {
  using A = AccOf<T>;
  using S = Storage<T>;
  Status s = CheckRows(num_rows, dim, rows_idx, n);
  if (!s.ok()) return s;
  const A one_minus_rho = A(1) - rho;
  ForEachRow(var, dim, rows_idx, grad, n, 30, pf,
             [&](int64_t off, const A* g) {
               T* w = var + off;
               A* ve = vel + off;
               A* mo = mom ? mom + off : nullptr;
               A* av = avg ? avg + off : nullptr;
               for (int64_t j = 0; j < dim; ++j) {
                 const A gj = g[j];
                 const A vj = rho * ve[j] + one_minus_rho * (gj * gj);
                 ve[j] = vj;
                 A denom;
                 if (av) {
                   const A aj = rho * av[j] + one_minus_rho * gj;
                   av[j] = aj;
                   denom = vj - aj * aj + epsilon;
                 } else {
                   denom = vj + epsilon;
                 }
                 const A inc = (lr * gj) / std::sqrt(denom);
                 if (mo) {
                   const A mj = momentum * mo[j] + inc;
                   mo[j] = mj;
                   w[j] = S::Store(S::Load(w[j]) - mj);
                 } else {
                   w[j] = S::Store(S::Load(w[j]) - inc);
                 }
               }
             });
  return Status::Ok();
}

template <typename T>
Status ApplyAdamax(T* var, AccOf<T>* m, AccOf<T>* u, int64_t num_rows,
                   int64_t dim, const int64_t* rows_idx, const AccOf<T>* grad,
                   int64_t n, AccOf<T> lr, AccOf<T> beta_1, AccOf<T> beta_2,
                   AccOf<T> epsilon, AccOf<T> step, const ParallelFor& pf) {
  using A = AccOf<T>;
  using S = Storage<T>;
  Status s = CheckRows(num_rows, dim, rows_idx, n);
  if (!s.ok()) return s;
  // Same operation order as Keras' Adamax.update_step. (Keras rounds
  // 1 - beta_1 from the Python float; here it is 1 - float(beta_1), which
  // may differ in its last bit, as for Adam's and RMSprop's factors.)
  const A one_minus_b1_power = A(1) - std::pow(beta_1, step);
  const A one_minus_b1 = A(1) - beta_1;
  ForEachRow(var, dim, rows_idx, grad, n, 20, pf,
             [&](int64_t off, const A* g) {
               T* w = var + off;
               A* mr = m + off;
               A* ur = u + off;
               for (int64_t j = 0; j < dim; ++j) {
                 const A mj = mr[j] + (g[j] - mr[j]) * one_minus_b1;
                 const A uj = std::max(beta_2 * ur[j], std::abs(g[j]));
                 mr[j] = mj;
                 ur[j] = uj;
                 w[j] = S::Store(S::Load(w[j]) -
                                 (lr * mj) / (one_minus_b1_power * (uj + epsilon)));
               }
             });
  return Status::Ok();
}

template <typename T>
Status ApplyAdadelta(T* var, AccOf<T>* acc_grad, AccOf<T>* acc_delta,
                     int64_t num_rows, int64_t dim, const int64_t* rows_idx,
                     const AccOf<T>* grad, int64_t n, AccOf<T> lr,
                     AccOf<T> rho, AccOf<T> epsilon, const ParallelFor& pf) {
  using A = AccOf<T>;
  using S = Storage<T>;
  Status s = CheckRows(num_rows, dim, rows_idx, n);
  if (!s.ok()) return s;
  const A one_minus_rho = A(1) - rho;
  ForEachRow(var, dim, rows_idx, grad, n, 40, pf,
             [&](int64_t off, const A* g) {
               T* w = var + off;
               A* ag = acc_grad + off;
               A* ad = acc_delta + off;
               for (int64_t j = 0; j < dim; ++j) {
                 const A gj = g[j];
                 const A agj = rho * ag[j] + one_minus_rho * (gj * gj);
                 ag[j] = agj;
                 const A delta = -((std::sqrt(ad[j] + epsilon) * gj) /
                                   std::sqrt(agj + epsilon));
                 ad[j] = rho * ad[j] + one_minus_rho * (delta * delta);
                 w[j] = S::Store(S::Load(w[j]) + lr * delta);
               }
             });
  return Status::Ok();
}

template <typename T>
Status ApplyLion(T* var, AccOf<T>* m, int64_t num_rows, int64_t dim,
                 const int64_t* rows_idx, const AccOf<T>* grad, int64_t n,
                 AccOf<T> lr, AccOf<T> beta_1, AccOf<T> beta_2,
                 const ParallelFor& pf) {
  using A = AccOf<T>;
  using S = Storage<T>;
  Status s = CheckRows(num_rows, dim, rows_idx, n);
  if (!s.ok()) return s;
  const A one_minus_b1 = A(1) - beta_1;
  const A one_minus_b2 = A(1) - beta_2;
  ForEachRow(var, dim, rows_idx, grad, n, 10, pf,
             [&](int64_t off, const A* g) {
               T* w = var + off;
               A* mr = m + off;
               for (int64_t j = 0; j < dim; ++j) {
                 const A c = mr[j] * beta_1 + g[j] * one_minus_b1;
                 // sign() as tf.sign: +-1, and 0 (or NaN) stays itself.
                 const A sign = c > A(0) ? A(1) : (c < A(0) ? A(-1) : c);
                 w[j] = S::Store(S::Load(w[j]) - lr * sign);
                 mr[j] = mr[j] * beta_2 + g[j] * one_minus_b2;
               }
             });
  return Status::Ok();
}

template <typename T>
Status ApplyNadam(T* var, AccOf<T>* m, AccOf<T>* v, int64_t num_rows,
                  int64_t dim, const int64_t* rows_idx, const AccOf<T>* grad,
                  int64_t n, AccOf<T> lr, AccOf<T> beta_1, AccOf<T> beta_2,
                  AccOf<T> epsilon, AccOf<T> u_t, AccOf<T> u_t_1,
                  AccOf<T> u_product, AccOf<T> beta_2_power,
                  const ParallelFor& pf) {
  using A = AccOf<T>;
  using S = Storage<T>;
  Status s = CheckRows(num_rows, dim, rows_idx, n);
  if (!s.ok()) return s;
  // Same operation order as Keras' Nadam.update_step.
  const A one_minus_b1 = A(1) - beta_1;
  const A one_minus_b2 = A(1) - beta_2;
  const A one_minus_up_1 = A(1) - u_product * u_t_1;
  const A one_minus_u_t = A(1) - u_t;
  const A one_minus_up = A(1) - u_product;
  const A one_minus_b2_power = A(1) - beta_2_power;
  ForEachRow(var, dim, rows_idx, grad, n, 30, pf,
             [&](int64_t off, const A* g) {
               T* w = var + off;
               A* mr = m + off;
               A* vr = v + off;
               for (int64_t j = 0; j < dim; ++j) {
                 const A gj = g[j];
                 const A mj = mr[j] + (gj - mr[j]) * one_minus_b1;
                 const A vj = vr[j] + (gj * gj - vr[j]) * one_minus_b2;
                 mr[j] = mj;
                 vr[j] = vj;
                 const A m_hat = (u_t_1 * mj) / one_minus_up_1 +
                                 (one_minus_u_t * gj) / one_minus_up;
                 const A v_hat = vj / one_minus_b2_power;
                 w[j] = S::Store(S::Load(w[j]) -
                                 (m_hat * lr) / (std::sqrt(v_hat) + epsilon));
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
                                    AccOf<T>*, const ParallelFor&);           \
  template Status ApplySgd<T>(T*, int64_t, int64_t, const int64_t*,           \
                              const AccOf<T>*, int64_t, AccOf<T>,             \
                              const ParallelFor&);                            \
  template Status ApplyMomentum<T>(T*, AccOf<T>*, int64_t, int64_t,           \
                                   const int64_t*, const AccOf<T>*, int64_t,  \
                                   AccOf<T>, AccOf<T>, bool,                  \
                                   const ParallelFor&);                       \
  template Status ApplyAdagrad<T>(T*, AccOf<T>*, int64_t, int64_t,            \
                                  const int64_t*, const AccOf<T>*, int64_t,   \
                                  AccOf<T>, AccOf<T>, const ParallelFor&);    \
  template Status ApplyAdam<T>(T*, AccOf<T>*, AccOf<T>*, AccOf<T>*, int64_t,  \
                               int64_t, const int64_t*, const AccOf<T>*,      \
                               int64_t, AccOf<T>, AccOf<T>, AccOf<T>,         \
                               AccOf<T>, AccOf<T>, bool, AccOf<T>,            \
                               const ParallelFor&);                           \
  template Status ApplyFtrl<T>(T*, AccOf<T>*, AccOf<T>*, int64_t, int64_t,    \
                               const int64_t*, const AccOf<T>*, int64_t,      \
                               AccOf<T>, AccOf<T>, AccOf<T>, AccOf<T>,        \
                               AccOf<T>, AccOf<T>, const ParallelFor&);       \
  template Status ApplyRmsprop<T>(T*, AccOf<T>*, AccOf<T>*, AccOf<T>*,        \
                                  int64_t, int64_t, const int64_t*,           \
                                  const AccOf<T>*, int64_t, AccOf<T>,         \
                                  AccOf<T>, AccOf<T>, AccOf<T>,               \
                                  const ParallelFor&);                        \
  template Status ApplyAdamax<T>(T*, AccOf<T>*, AccOf<T>*, int64_t, int64_t,  \
                                 const int64_t*, const AccOf<T>*, int64_t,    \
                                 AccOf<T>, AccOf<T>, AccOf<T>, AccOf<T>,      \
                                 AccOf<T>, const ParallelFor&);               \
  template Status ApplyAdadelta<T>(T*, AccOf<T>*, AccOf<T>*, int64_t,         \
                                   int64_t, const int64_t*, const AccOf<T>*,  \
                                   int64_t, AccOf<T>, AccOf<T>, AccOf<T>,     \
                                   const ParallelFor&);                       \
  template Status ApplyLion<T>(T*, AccOf<T>*, int64_t, int64_t,               \
                               const int64_t*, const AccOf<T>*, int64_t,      \
                               AccOf<T>, AccOf<T>, AccOf<T>,                  \
                               const ParallelFor&);                           \
  template Status ApplyNadam<T>(T*, AccOf<T>*, AccOf<T>*, int64_t, int64_t,   \
                                const int64_t*, const AccOf<T>*, int64_t,     \
                                AccOf<T>, AccOf<T>, AccOf<T>, AccOf<T>,       \
                                AccOf<T>, AccOf<T>, AccOf<T>, AccOf<T>,       \
                                const ParallelFor&);
SOK_INSTANTIATE(float)
SOK_INSTANTIATE(double)
SOK_INSTANTIATE(Half)
SOK_INSTANTIATE(BFloat16)
#undef SOK_INSTANTIATE

}  // namespace sparse_opt
}  // namespace sok
