// CUDA kernels of the sparse ("lazy") optimizer updates: see the GPU section
// of core/sparse_optimizers.h. TensorFlow-free.
//
// Dedup: validate indices (atomicMin of the first invalid position), stable
// radix sort of (row, position) pairs, segment heads + inclusive scan -> CSR
// (rows, offsets, positions), one blocking copy of {bad position, bad value,
// U} to the host.
// ApplyRule: one generic kernel over unique rows (up to a warp of lanes per
// row, float4 loads of the gradient and, for Adam, of row, m and v where
// the width allows), templated on a per-rule functor. Each thread sums
// grad[p, c] over the row's positions in ascending order (no float atomics,
// deterministic) and applies the rule at [row, c]. Indices known to be
// distinct (DistinctRows) skip the sort: row u is indices[u].
//
// Floating point: the rule functors use the _rn intrinsics (__fmul_rn etc.),
// which nvcc never contracts into FMAs, so that every operation rounds as in
// the CPU code (core/sparse_optimizers.cc), in the same order. Scalars
// derived from the hyperparameters (Adam's alpha, Ftrl's l2_reg, ...) are
// computed on the host with the same expressions as the CPU code. Only
// pow() (Ftrl, when lr_power != -0.5) may differ from the host's by an ulp,
// which Ftrl's cancellations can amplify.
#include <cub/cub.cuh>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>

#include "core/gpu_math.cuh"
#include "core/gpu_util.cuh"
#include "core/half.h"
#include "core/sparse_optimizers.h"

namespace sok {
namespace sparse_opt {
namespace gpu {
namespace {

namespace cu = ::sok::gpu;

// ---------------------------------------------------------------------------
// Dedup kernels.

// keys[p] = indices[p] (0 where invalid, to keep the sort's bit range),
// pos[p] = p; the first invalid position goes to *bad (initialised to
// all-ones, i.e. UINT64_MAX, by the caller).
template <typename Index, typename Key>
__global__ void PrepareKeysKernel(const Index* __restrict__ indices, int64_t k,
                                  int64_t num_rows, Key* __restrict__ keys,
                                  int64_t* __restrict__ pos,
                                  unsigned long long* bad) {
  for (int64_t p = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
       p < k; p += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = static_cast<int64_t>(indices[p]);
    const bool valid = r >= 0 && r < num_rows;
    keys[p] = valid ? static_cast<Key>(r) : Key(0);
    pos[p] = p;
    if (!valid) atomicMin(bad, static_cast<unsigned long long>(p));
  }
}

// seg[i] = 1 where sorted key i starts a new run, else 0.
template <typename Key>
__global__ void HeadFlagsKernel(const Key* __restrict__ keys, int64_t k,
                                int64_t* __restrict__ seg) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
       i < k; i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    seg[i] = (i == 0 || keys[i] != keys[i - 1]) ? 1 : 0;
  }
}

// seg is the inclusive scan of the head flags (1-based run id). Writes
// offsets[u], rows[u] at each run head, offsets[U] = k, and
// info = {bad position, bad value, U}.
template <typename Index, typename Key>
__global__ void ScatterRunsKernel(const Key* __restrict__ keys,
                                  const int64_t* __restrict__ seg, int64_t k,
                                  const Index* __restrict__ indices,
                                  int64_t* __restrict__ offsets,
                                  int64_t* __restrict__ rows,
                                  int64_t* __restrict__ info) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
       i < k; i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t s = seg[i];
    if (i == 0 || s != seg[i - 1]) {
      offsets[s - 1] = i;
      rows[s - 1] = static_cast<int64_t>(keys[i]);
    }
    if (i == k - 1) {
      offsets[s] = k;
      info[2] = s;
      const int64_t bad = info[0];  // -1 (all ones) when every index is valid
      info[1] = (bad >= 0 && bad < k) ? static_cast<int64_t>(indices[bad]) : 0;
    }
  }
}

// ---------------------------------------------------------------------------
// Rounding-exact arithmetic, never contracted into FMA (core/gpu_math.cuh).
using ::sok::gpu::Add;
using ::sok::gpu::Sub;
using ::sok::gpu::Mul;
using ::sok::gpu::Div;
using ::sok::gpu::Sqrt;

// pow() as in Ftrl, as close to the host's std::pow as we can get: the
// common lr_power = -0.5 (pow(x, 0.5)) through the correctly rounded sqrt for
// positive finite x (glibc's pow/powf are correctly rounded there in
// practice, CUDA's pow is not always), otherwise CUDA's pow; float in double
// precision, then rounded (what glibc's powf effectively does).
__device__ __forceinline__ float Pow(float a, float b) {
  if (b == 0.5f && a > 0.0f && a <= 3.402823466e+38f) return __fsqrt_rn(a);
  return static_cast<float>(pow(static_cast<double>(a), static_cast<double>(b)));
}
__device__ __forceinline__ double Pow(double a, double b) {
  if (b == 0.5 && a > 0.0 && a <= 1.7976931348623157e+308) return __dsqrt_rn(a);
  return pow(a, b);
}
// std::max / std::min semantics (including NaN handling).
template <typename T>
__device__ __forceinline__ T StdMax(T a, T b) { return (a < b) ? b : a; }
template <typename T>
__device__ __forceinline__ T StdMin(T a, T b) { return (b < a) ? b : a; }

// ---------------------------------------------------------------------------
// Rule functors: operator()(i, g) updates element i (= row * dim + c) of var
// and the slots with the summed gradient g. Mirrors the Apply* loop bodies of
// core/sparse_optimizers.cc expression by expression.

// T is the table's storage type; A = AccOf<T> the type of the slots, the
// summed gradient, the hyperparameters and all arithmetic (core/half.h). A
// row element is loaded into A and rounded once at its store.

template <typename T>
struct SgdFn {
  using A = AccOf<T>;
  using S = Storage<T>;
  T* var;
  A lr;
  __device__ __forceinline__ void operator()(int64_t i, A g) const {
    var[i] = S::Store(Sub(S::Load(var[i]), Mul(g, lr)));  // w -= g * lr
  }
};

template <typename T>
struct MomentumFn {
  using A = AccOf<T>;
  using S = Storage<T>;
  T* var;
  A* mom;
  A lr, momentum;
  bool nesterov;
  __device__ __forceinline__ void operator()(int64_t i, A g) const {
    const A mj = Sub(Mul(mom[i], momentum), Mul(g, lr));
    mom[i] = mj;
    if (nesterov) {
      var[i] = S::Store(
          Add(S::Load(var[i]), Sub(Mul(mj, momentum), Mul(g, lr))));
    } else {
      var[i] = S::Store(Add(S::Load(var[i]), mj));
    }
  }
};

template <typename T>
struct AdagradFn {
  using A = AccOf<T>;
  using S = Storage<T>;
  T* var;
  A* acc;
  A lr, epsilon;
  __device__ __forceinline__ void operator()(int64_t i, A g) const {
    const A aj = Add(acc[i], Mul(g, g));
    acc[i] = aj;
    var[i] = S::Store(
        Sub(S::Load(var[i]), Div(Mul(lr, g), Sqrt(Add(aj, epsilon)))));
  }
};

template <typename T>
struct AdamFn {
  using A = AccOf<T>;
  using S = Storage<T>;
  T* var;
  A* m;
  A* v;
  A* vhat;  // nullptr unless amsgrad
  A lr, epsilon, alpha, one_minus_b1, one_minus_b2, weight_decay;
  bool apply_weight_decay;
  __device__ __forceinline__ void operator()(int64_t i, A g) const {
    A w = S::Load(var[i]);
    if (apply_weight_decay) w = Sub(w, Mul(Mul(w, weight_decay), lr));
    const A mr = m[i];
    const A vr = v[i];
    const A mj = Add(mr, Mul(Sub(g, mr), one_minus_b1));
    const A vj = Add(vr, Mul(Sub(Mul(g, g), vr), one_minus_b2));
    m[i] = mj;
    v[i] = vj;
    A vu = vj;
    if (vhat != nullptr) {
      vu = StdMax(vhat[i], vj);
      vhat[i] = vu;
    }
    var[i] = S::Store(Sub(w, Div(Mul(mj, alpha), Add(Sqrt(vu), epsilon))));
  }
};

template <typename T>
struct FtrlFn {
  using A = AccOf<T>;
  using S = Storage<T>;
  T* var;
  A* acc;
  A* linear;
  A lr, l1, two_l2_reg, two_shrink, neg_power;
  __device__ __forceinline__ void operator()(int64_t i, A g) const {
    const A wj = S::Load(var[i]);
    const A aj = acc[i];
    const A grad_to_use = Add(g, Mul(two_shrink, wj));
    const A new_acc = Add(aj, Mul(g, g));
    const A new_pow = Pow(new_acc, neg_power);
    const A old_pow = Pow(aj, neg_power);
    const A lj =
        Add(linear[i], Sub(grad_to_use, Mul(Div(Sub(new_pow, old_pow), lr), wj)));
    linear[i] = lj;
    const A quadratic = Add(Div(new_pow, lr), two_l2_reg);
    const A clipped = StdMin(StdMax(lj, -l1), l1);
    var[i] = S::Store(Div(Sub(clipped, lj), quadratic));
    acc[i] = new_acc;
  }
};

template <typename T>
struct RmspropFn {
  using A = AccOf<T>;
  using S = Storage<T>;
  T* var;
  A* vel;
  A* mom;  // nullptr unless momentum
  A* avg;  // nullptr unless centered
  A lr, rho, one_minus_rho, momentum, epsilon;
  __device__ __forceinline__ void operator()(int64_t i, A g) const {
    const A vj = Add(Mul(rho, vel[i]), Mul(one_minus_rho, Mul(g, g)));
    vel[i] = vj;
    A denom;
    if (avg != nullptr) {
      const A aj = Add(Mul(rho, avg[i]), Mul(one_minus_rho, g));
      avg[i] = aj;
      denom = Add(Sub(vj, Mul(aj, aj)), epsilon);
    } else {
      denom = Add(vj, epsilon);
    }
    const A inc = Div(Mul(lr, g), Sqrt(denom));
    if (mom != nullptr) {
      const A mj = Add(Mul(momentum, mom[i]), inc);
      mom[i] = mj;
      var[i] = S::Store(Sub(S::Load(var[i]), mj));
    } else {
      var[i] = S::Store(Sub(S::Load(var[i]), inc));
    }
  }
};

template <typename T>
struct AdamaxFn {
  using A = AccOf<T>;
  using S = Storage<T>;
  T* var;
  A* m;
  A* u;
  A lr, beta_2, epsilon, one_minus_b1, one_minus_b1_power;
  __device__ __forceinline__ void operator()(int64_t i, A g) const {
    const A mr = m[i];
    const A mj = Add(mr, Mul(Sub(g, mr), one_minus_b1));
    const A uj = StdMax(Mul(beta_2, u[i]), g < A(0) ? -g : g);
    m[i] = mj;
    u[i] = uj;
    var[i] = S::Store(Sub(S::Load(var[i]),
                          Div(Mul(lr, mj),
                              Mul(one_minus_b1_power, Add(uj, epsilon)))));
  }
};

template <typename T>
struct AdadeltaFn {
  using A = AccOf<T>;
  using S = Storage<T>;
  T* var;
  A* acc_grad;
  A* acc_delta;
  A lr, rho, one_minus_rho, epsilon;
  __device__ __forceinline__ void operator()(int64_t i, A g) const {
    const A agj = Add(Mul(rho, acc_grad[i]), Mul(one_minus_rho, Mul(g, g)));
    acc_grad[i] = agj;
    const A adr = acc_delta[i];
    const A delta =
        -Div(Mul(Sqrt(Add(adr, epsilon)), g), Sqrt(Add(agj, epsilon)));
    acc_delta[i] = Add(Mul(rho, adr), Mul(one_minus_rho, Mul(delta, delta)));
    var[i] = S::Store(Add(S::Load(var[i]), Mul(lr, delta)));
  }
};

template <typename T>
struct LionFn {
  using A = AccOf<T>;
  using S = Storage<T>;
  T* var;
  A* m;
  A lr, beta_1, beta_2, one_minus_b1, one_minus_b2;
  __device__ __forceinline__ void operator()(int64_t i, A g) const {
    const A mr = m[i];
    const A c = Add(Mul(mr, beta_1), Mul(g, one_minus_b1));
    const A sign = c > A(0) ? A(1) : (c < A(0) ? A(-1) : c);
    var[i] = S::Store(Sub(S::Load(var[i]), Mul(lr, sign)));
    m[i] = Add(Mul(mr, beta_2), Mul(g, one_minus_b2));
  }
};

template <typename T>
struct NadamFn {
  using A = AccOf<T>;
  using S = Storage<T>;
  T* var;
  A* m;
  A* v;
  A lr, epsilon, u_t_1, one_minus_b1, one_minus_b2, one_minus_up_1,
      one_minus_u_t, one_minus_up, one_minus_b2_power;
  __device__ __forceinline__ void operator()(int64_t i, A g) const {
    const A mr = m[i];
    const A vr = v[i];
    const A mj = Add(mr, Mul(Sub(g, mr), one_minus_b1));
    const A vj = Add(vr, Mul(Sub(Mul(g, g), vr), one_minus_b2));
    m[i] = mj;
    v[i] = vj;
    const A m_hat = Add(Div(Mul(u_t_1, mj), one_minus_up_1),
                        Div(Mul(one_minus_u_t, g), one_minus_up));
    const A v_hat = Div(vj, one_minus_b2_power);
    var[i] = S::Store(Sub(S::Load(var[i]),
                          Div(Mul(m_hat, lr), Add(Sqrt(v_hat), epsilon))));
  }
};

// ---------------------------------------------------------------------------
// Vectorised element updates: VecApply<Fn, VEC>::Apply(fn, i, g, valid)
// updates elements i .. i + valid - 1 (valid <= VEC) with the summed
// gradients g[0 .. valid). The default calls the rule's scalar operator();
// Adam on float rows of a width divisible by 4 (16-byte aligned) loads and
// stores row, m and v as float4, with the same operations per element.
template <typename Fn, int VEC>
struct VecApply {
  template <typename A>
  __device__ __forceinline__ static void Apply(const Fn& fn, int64_t i,
                                               const A* g, int64_t valid) {
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      if (j < valid) fn(i + j, g[j]);
    }
  }
};

// One Adam element, as AdamFn::operator() without amsgrad.
__device__ __forceinline__ void AdamElement(const AdamFn<float>& fn, float& w,
                                            float& m, float& v, float g) {
  if (fn.apply_weight_decay) w = Sub(w, Mul(Mul(w, fn.weight_decay), fn.lr));
  const float mj = Add(m, Mul(Sub(g, m), fn.one_minus_b1));
  const float vj = Add(v, Mul(Sub(Mul(g, g), v), fn.one_minus_b2));
  m = mj;
  v = vj;
  w = Sub(w, Div(Mul(mj, fn.alpha), Add(Sqrt(vj), fn.epsilon)));
}

template <>
struct VecApply<AdamFn<float>, 4> {
  __device__ __forceinline__ static void Apply(const AdamFn<float>& fn,
                                               int64_t i, const float* g,
                                               int64_t valid) {
    if (fn.vhat != nullptr) {  // amsgrad: the scalar path
      for (int j = 0; j < 4 && j < valid; ++j) fn(i + j, g[j]);
      return;
    }
    float4 w = *reinterpret_cast<const float4*>(fn.var + i);
    float4 m = *reinterpret_cast<const float4*>(fn.m + i);
    float4 v = *reinterpret_cast<const float4*>(fn.v + i);
    AdamElement(fn, w.x, m.x, v.x, g[0]);
    AdamElement(fn, w.y, m.y, v.y, g[1]);
    AdamElement(fn, w.z, m.z, v.z, g[2]);
    AdamElement(fn, w.w, m.w, v.w, g[3]);
    *reinterpret_cast<float4*>(fn.m + i) = m;
    *reinterpret_cast<float4*>(fn.v + i) = v;
    *reinterpret_cast<float4*>(fn.var + i) = w;
  }
};

// Loads VEC consecutive gradient values as A (float4 for VEC == 4, used
// only for float gradients of a width divisible by 4, 16-byte aligned).
template <typename T, int VEC>
struct GradVec {
  __device__ __forceinline__ static void Load(const T* p, int64_t valid,
                                              AccOf<T>* v) {
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      v[j] = j < valid ? Storage<T>::Load(p[j]) : AccOf<T>(0);
    }
  }
};

template <>
struct GradVec<float, 4> {
  __device__ __forceinline__ static void Load(const float* p, int64_t valid,
                                              float* v) {
    const float4 q = __ldg(reinterpret_cast<const float4*>(p));
    v[0] = q.x;
    v[1] = q.y;
    v[2] = q.z;
    v[3] = q.w;
    (void)valid;
  }
};

// ---------------------------------------------------------------------------
// The one apply kernel. 2^lanes_log2 threads (at most a warp) per unique
// row, each owning VEC consecutive columns at a time; a 1-D grid-stride
// loop over (row, lane). Each thread sums grad over the row's positions in
// ascending order (first, then the rest, as SumDuplicateRows) and applies
// the rule. offsets == nullptr: the indices are known to be distinct, row
// u is indices[u] = rows[u] with its gradient at position u, and a row
// outside [0, num_rows) is skipped (never written).
template <typename T, typename Fn, int VEC>
__global__ void ApplyKernel(Fn fn, const int64_t* __restrict__ rows,
                            const int64_t* __restrict__ offsets,
                            const int64_t* __restrict__ positions,
                            const T* __restrict__ grad, int64_t num_unique,
                            int64_t dim, int64_t num_rows, int lanes_log2) {
  using A = AccOf<T>;
  const int64_t lanes = int64_t{1} << lanes_log2;
  const int64_t total = num_unique << lanes_log2;
  for (int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
       t < total; t += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t u = t >> lanes_log2;
    const int64_t lane = t & (lanes - 1);
    const int64_t row = rows[u];
    int64_t s = u;
    int64_t e = u + 1;
    int64_t first = u;
    if (offsets != nullptr) {
      s = offsets[u];
      e = offsets[u + 1];
      first = positions[s];
    } else if (row < 0 || row >= num_rows) {
      continue;
    }
    const int64_t base = row * dim;
    for (int64_t c = lane * VEC; c < dim; c += lanes * VEC) {
      const int64_t valid = dim - c;
      A g[VEC];
      GradVec<T, VEC>::Load(grad + first * dim + c, valid, g);
      for (int64_t q = s + 1; q < e; ++q) {
        A x[VEC];
        GradVec<T, VEC>::Load(grad + positions[q] * dim + c, valid, x);
#pragma unroll
        for (int j = 0; j < VEC; ++j) g[j] = Add(g[j], x[j]);
      }
      VecApply<Fn, VEC>::Apply(fn, base + c, g, valid);
    }
  }
}

// Lanes per row: enough for one pass over `dim` in VEC-wide pieces (a
// power of 2, at most a warp).
int LanesLog2(int64_t dim, int vec) {
  const int64_t pieces = (dim + vec - 1) / vec;
  int lanes_log2 = 0;
  while ((int64_t{1} << lanes_log2) < pieces && lanes_log2 < 5) ++lanes_log2;
  return lanes_log2;
}

// vec4: float rows, dim % 4 == 0 and every buffer 16-byte aligned.
template <typename T, typename Fn>
Status LaunchApply(const GpuDevice& d, const Fn& fn, int64_t dim,
                   const DedupResult& dd, const T* grad, bool vec4) {
  if (dd.num_unique <= 0 || dim <= 0) return Status::Ok();
  constexpr int kThreads = 256;
  const bool use4 = std::is_same<T, float>::value && vec4 && dim % 4 == 0;
  const int lanes_log2 = LanesLog2(dim, use4 ? 4 : 1);
  const int blocks = cu::BlocksFor(dd.num_unique << lanes_log2, kThreads);
  if (use4) {
    ApplyKernel<T, Fn, 4><<<blocks, kThreads, 0, cu::StreamOf(d)>>>(
        fn, dd.rows, dd.offsets, dd.positions, grad, dd.num_unique, dim,
        dd.num_rows, lanes_log2);
  } else {
    ApplyKernel<T, Fn, 1><<<blocks, kThreads, 0, cu::StreamOf(d)>>>(
        fn, dd.rows, dd.offsets, dd.positions, grad, dd.num_unique, dim,
        dd.num_rows, lanes_log2);
  }
  SOK_LAUNCH_RETURN_IF_ERROR("sparse optimizer ApplyKernel");
  return Status::Ok();
}

// rows[p] = indices[p] as int64.
template <typename Index>
__global__ void WidenRowsKernel(const Index* __restrict__ indices, int64_t k,
                                int64_t* __restrict__ rows) {
  for (int64_t p = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
       p < k; p += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    rows[p] = static_cast<int64_t>(indices[p]);
  }
}

Status MissingSlot(const char* rule, const char* slot) {
  return Status::Error(std::string("GPU ") + rule + " update needs slot '" +
                       slot + "' (got nullptr)");
}

}  // namespace

// ---------------------------------------------------------------------------

template <typename Index>
Status Dedup(const GpuDevice& d, const Index* indices, int64_t k,
             int64_t num_rows, DedupResult* out) {
  *out = DedupResult();
  if (k < 0 || num_rows < 0) {
    return Status::InvalidArgument("negative index count or row count");
  }
  if (k == 0) return Status::Ok();
  using Key = typename std::make_unsigned<Index>::type;
  const cudaStream_t stream = cu::StreamOf(d);

  Key* keys_in = nullptr;
  Key* keys_out = nullptr;
  int64_t* pos_in = nullptr;
  int64_t* pos_out = nullptr;
  int64_t* seg = nullptr;
  int64_t* offsets = nullptr;
  int64_t* rows = nullptr;
  int64_t* info = nullptr;  // {bad position, bad value, U}
  SOK_RETURN_IF_ERROR(cu::Scratch<Key>(d, k, &keys_in, "dedup keys"));
  SOK_RETURN_IF_ERROR(cu::Scratch<Key>(d, k, &keys_out, "dedup sorted keys"));
  SOK_RETURN_IF_ERROR(cu::Scratch<int64_t>(d, k, &pos_in, "dedup positions"));
  SOK_RETURN_IF_ERROR(
      cu::Scratch<int64_t>(d, k, &pos_out, "dedup sorted positions"));
  SOK_RETURN_IF_ERROR(cu::Scratch<int64_t>(d, k, &seg, "dedup run ids"));
  SOK_RETURN_IF_ERROR(cu::Scratch<int64_t>(d, k + 1, &offsets, "dedup offsets"));
  SOK_RETURN_IF_ERROR(cu::Scratch<int64_t>(d, k, &rows, "dedup rows"));
  SOK_RETURN_IF_ERROR(cu::Scratch<int64_t>(d, 3, &info, "dedup result"));

  // Sort only the bits that a valid row can have.
  int end_bit = cu::BitsFor(num_rows > 0 ? static_cast<uint64_t>(num_rows - 1)
                                         : uint64_t{0});
  end_bit = std::min<int>(end_bit, static_cast<int>(sizeof(Key) * 8));

  // cub temp storage: one buffer big enough for the sort and the scan.
  size_t sort_bytes = 0;
  SOK_CUDA_RETURN_IF_ERROR(
      cub::DeviceRadixSort::SortPairs(nullptr, sort_bytes, keys_in, keys_out,
                                      pos_in, pos_out, k, 0, end_bit, stream),
      "cub::DeviceRadixSort::SortPairs (size query)");
  size_t scan_bytes = 0;
  SOK_CUDA_RETURN_IF_ERROR(
      cub::DeviceScan::InclusiveSum(nullptr, scan_bytes, seg, seg, k, stream),
      "cub::DeviceScan::InclusiveSum (size query)");
  const size_t temp_bytes = std::max<size_t>(1, std::max(sort_bytes, scan_bytes));
  uint8_t* temp = nullptr;
  SOK_RETURN_IF_ERROR(cu::Scratch<uint8_t>(
      d, static_cast<int64_t>(temp_bytes), &temp, "dedup cub temp storage"));

  // info[0] = all ones (no invalid index yet); info[1], info[2] are written
  // by ScatterRunsKernel.
  SOK_CUDA_RETURN_IF_ERROR(
      cudaMemsetAsync(info, 0xFF, 3 * sizeof(int64_t), stream),
      "cudaMemsetAsync (dedup result)");
  const int blocks = cu::BlocksFor(k);
  PrepareKeysKernel<Index, Key><<<blocks, 256, 0, stream>>>(
      indices, k, num_rows, keys_in, pos_in,
      reinterpret_cast<unsigned long long*>(info));
  SOK_LAUNCH_RETURN_IF_ERROR("sparse optimizer PrepareKeysKernel");

  size_t bytes = temp_bytes;
  SOK_CUDA_RETURN_IF_ERROR(
      cub::DeviceRadixSort::SortPairs(temp, bytes, keys_in, keys_out, pos_in,
                                      pos_out, k, 0, end_bit, stream),
      "cub::DeviceRadixSort::SortPairs");
  HeadFlagsKernel<Key><<<blocks, 256, 0, stream>>>(keys_out, k, seg);
  SOK_LAUNCH_RETURN_IF_ERROR("sparse optimizer HeadFlagsKernel");
  bytes = temp_bytes;
  SOK_CUDA_RETURN_IF_ERROR(
      cub::DeviceScan::InclusiveSum(temp, bytes, seg, seg, k, stream),
      "cub::DeviceScan::InclusiveSum");
  ScatterRunsKernel<Index, Key><<<blocks, 256, 0, stream>>>(
      keys_out, seg, k, indices, offsets, rows, info);
  SOK_LAUNCH_RETURN_IF_ERROR("sparse optimizer ScatterRunsKernel");

  int64_t host[3] = {0, 0, 0};
  SOK_RETURN_IF_ERROR(cu::CopyToHostSync(d, host, info, sizeof(host),
                                         "sparse optimizer dedup result"));
  out->bad_position = host[0] < 0 ? -1 : host[0];
  out->bad_value = host[1];
  out->num_unique = out->bad_position >= 0 ? 0 : host[2];
  if (out->bad_position < 0 && (out->num_unique < 1 || out->num_unique > k)) {
    return Status::Error("sparse optimizer dedup: bad unique count " +
                         std::to_string(out->num_unique) + " for " +
                         std::to_string(k) + " indices");
  }
  out->rows = rows;
  out->offsets = offsets;
  out->positions = pos_out;
  out->num_rows = num_rows;
  return Status::Ok();
}

template <typename Index>
Status DistinctRows(const GpuDevice& d, const Index* indices, int64_t k,
                    int64_t num_rows, DedupResult* out) {
  *out = DedupResult();
  if (k < 0 || num_rows < 0) {
    return Status::InvalidArgument("negative index count or row count");
  }
  out->num_rows = num_rows;
  if (k == 0) return Status::Ok();
  if constexpr (std::is_same<Index, int64_t>::value) {
    out->rows = indices;
  } else {
    int64_t* rows = nullptr;
    SOK_RETURN_IF_ERROR(cu::Scratch<int64_t>(d, k, &rows, "distinct rows"));
    WidenRowsKernel<Index><<<cu::BlocksFor(k), 256, 0, cu::StreamOf(d)>>>(
        indices, k, rows);
    SOK_LAUNCH_RETURN_IF_ERROR("sparse optimizer WidenRowsKernel");
    out->rows = rows;
  }
  out->num_unique = k;
  return Status::Ok();
}

template <typename T>
Status ApplyRule(const GpuDevice& d, Rule rule, const Hyper& h, T* var,
                 AccOf<T>* s1, AccOf<T>* s2, AccOf<T>* s3, int64_t dim,
                 const DedupResult& dedup, const T* grad) {
  // The hyperparameters and the host-side scalars are in A, as on the CPU.
  using A = AccOf<T>;
  if (dim < 0 || dedup.num_unique < 0) {
    return Status::InvalidArgument("negative size");
  }
  if (dedup.bad_position >= 0) {
    return Status::Error("ApplyRule called with an invalid index");
  }
  if (dedup.num_unique == 0 || dim == 0) return Status::Ok();
  if (var == nullptr) return MissingSlot("sparse optimizer", "var");
  if (dedup.rows == nullptr || grad == nullptr ||
      ((dedup.offsets == nullptr) != (dedup.positions == nullptr))) {
    return Status::Error("ApplyRule: missing dedup result or grad");
  }
  const A lr = static_cast<A>(h.lr);
  auto aligned = [](const void* p) {
    return p == nullptr || reinterpret_cast<uintptr_t>(p) % 16 == 0;
  };
  const bool vec4 = aligned(var) && aligned(s1) && aligned(s2) &&
                    aligned(s3) && aligned(grad);
  switch (rule) {
    case Rule::kSgd: {
      SgdFn<T> fn{var, lr};
      return LaunchApply<T>(d, fn, dim, dedup, grad, vec4);
    }
    case Rule::kMomentum: {
      if (s1 == nullptr) return MissingSlot("Momentum", "m");
      MomentumFn<T> fn{var, s1, lr, static_cast<A>(h.momentum), h.nesterov};
      return LaunchApply<T>(d, fn, dim, dedup, grad, vec4);
    }
    case Rule::kAdagrad: {
      if (s1 == nullptr) return MissingSlot("Adagrad", "accumulator");
      AdagradFn<T> fn{var, s1, lr, static_cast<A>(h.epsilon)};
      return LaunchApply<T>(d, fn, dim, dedup, grad, vec4);
    }
    case Rule::kAdam: {
      if (s1 == nullptr) return MissingSlot("Adam", "m");
      if (s2 == nullptr) return MissingSlot("Adam", "v");
      // Same host expressions as ApplyAdam.
      const A beta_1 = static_cast<A>(h.beta_1);
      const A beta_2 = static_cast<A>(h.beta_2);
      const A step = static_cast<A>(h.step);
      const A beta_1_power = std::pow(beta_1, step);
      const A beta_2_power = std::pow(beta_2, step);
      const A alpha =
          lr * std::sqrt(A(1) - beta_2_power) / (A(1) - beta_1_power);
      AdamFn<T> fn{var,
                   s1,
                   s2,
                   s3,
                   lr,
                   static_cast<A>(h.epsilon),
                   alpha,
                   A(1) - beta_1,
                   A(1) - beta_2,
                   h.apply_weight_decay ? static_cast<A>(h.weight_decay) : A(0),
                   h.apply_weight_decay};
      return LaunchApply<T>(d, fn, dim, dedup, grad, vec4);
    }
    case Rule::kFtrl: {
      if (s1 == nullptr) return MissingSlot("Ftrl", "accumulator");
      if (s2 == nullptr) return MissingSlot("Ftrl", "linear");
      // Same host expressions as ApplyFtrl.
      const A l2 = static_cast<A>(h.l2);
      const A beta = static_cast<A>(h.beta);
      const A l2_reg = l2 + beta / (A(2) * lr);
      const A two_l2_reg = A(2) * l2_reg;
      const A two_shrink = A(2) * static_cast<A>(h.l2_shrinkage);
      const A neg_power = -static_cast<A>(h.lr_power);
      FtrlFn<T> fn{var,        s1,         s2,        lr, static_cast<A>(h.l1),
                   two_l2_reg, two_shrink, neg_power};
      return LaunchApply<T>(d, fn, dim, dedup, grad, vec4);
    }
    case Rule::kRmsprop: {
      if (s1 == nullptr) return MissingSlot("RMSprop", "velocity");
      const A rho = static_cast<A>(h.rho);
      RmspropFn<T> fn{var, s1, s2, s3, lr, rho, A(1) - rho,
                      static_cast<A>(h.momentum), static_cast<A>(h.epsilon)};
      return LaunchApply<T>(d, fn, dim, dedup, grad, vec4);
    }
    case Rule::kAdamax: {
      if (s1 == nullptr) return MissingSlot("Adamax", "m");
      if (s2 == nullptr) return MissingSlot("Adamax", "u");
      // Same host expressions as ApplyAdamax.
      const A beta_1 = static_cast<A>(h.beta_1);
      const A one_minus_b1_power =
          A(1) - std::pow(beta_1, static_cast<A>(h.step));
      AdamaxFn<T> fn{var,
                     s1,
                     s2,
                     lr,
                     static_cast<A>(h.beta_2),
                     static_cast<A>(h.epsilon),
                     A(1) - beta_1,
                     one_minus_b1_power};
      return LaunchApply<T>(d, fn, dim, dedup, grad, vec4);
    }
    case Rule::kAdadelta: {
      if (s1 == nullptr) return MissingSlot("Adadelta", "accumulated_grad");
      if (s2 == nullptr) {
        return MissingSlot("Adadelta", "accumulated_delta_var");
      }
      const A rho = static_cast<A>(h.rho);
      AdadeltaFn<T> fn{var, s1, s2, lr, rho, A(1) - rho,
                       static_cast<A>(h.epsilon)};
      return LaunchApply<T>(d, fn, dim, dedup, grad, vec4);
    }
    case Rule::kLion: {
      if (s1 == nullptr) return MissingSlot("Lion", "m");
      const A beta_1 = static_cast<A>(h.beta_1);
      const A beta_2 = static_cast<A>(h.beta_2);
      LionFn<T> fn{var, s1, lr, beta_1, beta_2, A(1) - beta_1, A(1) - beta_2};
      return LaunchApply<T>(d, fn, dim, dedup, grad, vec4);
    }
    case Rule::kNadam: {
      if (s1 == nullptr) return MissingSlot("Nadam", "m");
      if (s2 == nullptr) return MissingSlot("Nadam", "v");
      // Same host expressions as ApplyNadam.
      const A u_t_1 = static_cast<A>(h.u_t_1);
      const A u_product = static_cast<A>(h.u_product);
      NadamFn<T> fn{var,
                    s1,
                    s2,
                    lr,
                    static_cast<A>(h.epsilon),
                    u_t_1,
                    A(1) - static_cast<A>(h.beta_1),
                    A(1) - static_cast<A>(h.beta_2),
                    A(1) - u_product * u_t_1,
                    A(1) - static_cast<A>(h.u_t),
                    A(1) - u_product,
                    A(1) - static_cast<A>(h.beta_2_power)};
      return LaunchApply<T>(d, fn, dim, dedup, grad, vec4);
    }
  }
  return Status::Error("unknown sparse optimizer rule " +
                       std::to_string(static_cast<int>(rule)));
}

Status CopyDevice(const GpuDevice& d, void* dst, const void* src,
                  int64_t bytes) {
  if (bytes < 0) return Status::InvalidArgument("negative copy size");
  if (bytes == 0 || dst == src) return Status::Ok();
  SOK_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(dst, src, static_cast<size_t>(bytes),
                      cudaMemcpyDeviceToDevice, cu::StreamOf(d)),
      "cudaMemcpyAsync (copy-on-write of a variable)");
  return Status::Ok();
}

#define SOK_INSTANTIATE_INDEX(Index)                                         \
  template Status Dedup<Index>(const GpuDevice&, const Index*, int64_t,     \
                               int64_t, DedupResult*);                 \
  template Status DistinctRows<Index>(const GpuDevice&, const Index*,      \
                                      int64_t, int64_t, DedupResult*);
SOK_INSTANTIATE_INDEX(int32_t)
SOK_INSTANTIATE_INDEX(int64_t)
#undef SOK_INSTANTIATE_INDEX

#define SOK_INSTANTIATE(T)                                                  \
  template Status ApplyRule<T>(const GpuDevice&, Rule, const Hyper&, T*,     \
                               AccOf<T>*, AccOf<T>*, AccOf<T>*, int64_t,     \
                               const DedupResult&, const T*);
SOK_INSTANTIATE(float)
SOK_INSTANTIATE(double)
SOK_INSTANTIATE(Half)
SOK_INSTANTIATE(BFloat16)
#undef SOK_INSTANTIATE

}  // namespace gpu
}  // namespace sparse_opt
}  // namespace sok
