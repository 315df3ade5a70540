#include "core/pooled_lookup.h"

#include <algorithm>
#include <atomic>
#include <cmath>

namespace sok {
namespace lookup {

template <typename Device, typename T, typename Tid>
Status PooledLookupFunctor<Device, T, Tid>::operator()(
    const Device& d, const T* table, int64_t vocab_size, int64_t dim,
    const Tid* ids, int64_t nnz, const int64_t* splits, int64_t batch,
    int64_t bag_width, const T* weights, Combiner combiner, T* out,
    PooledLookupError* error) {
  (void)bag_width;  // the splits say the same; one loop serves every width
  *error = PooledLookupError();
  for (int64_t b = 0; b < batch; ++b) {  // cheap, and first-bad by order
    const int64_t begin = splits[b];
    const int64_t end = splits[b + 1];
    if (begin < 0 || end < begin || end > nnz || (b == 0 && begin != 0) ||
        (b == batch - 1 && end != nnz)) {
      error->bad_bag = b;
      return Status::Ok();
    }
  }
  if (batch == 0 && nnz != 0) {
    error->bad_bag = 0;
    return Status::Ok();
  }
  for (int64_t i = 0; i < nnz; ++i) {
    const int64_t id = static_cast<int64_t>(ids[i]);
    if (id != -1 && (id < 0 || id >= vocab_size)) {
      error->position = i;
      error->value = id;
      return Status::Ok();
    }
  }
  const int64_t cost = (nnz / std::max<int64_t>(batch, 1) + 1) * (dim * 2 + 8);
  d.parallel_for(batch, cost, [&](int64_t first, int64_t last) {
    for (int64_t b = first; b < last; ++b) {
      RowPooler<T> pooler(out + b * dim, dim);
      for (int64_t i = splits[b]; i < splits[b + 1]; ++i) {
        const int64_t id = static_cast<int64_t>(ids[i]);
        if (id == -1) continue;
        if (weights == nullptr) {
          pooler.Add(table + id * dim);
        } else {
          pooler.Add(table + id * dim, weights[i]);
        }
      }
      pooler.Finish(combiner);
    }
  });
  return Status::Ok();
}

template <typename Device>
Status UniformSplitsFunctor<Device>::operator()(const Device& d,
                                                int64_t width, int64_t batch,
                                                int64_t* splits) {
  d.parallel_for(batch + 1, 1, [&](int64_t first, int64_t last) {
    for (int64_t b = first; b < last; ++b) splits[b] = b * width;
  });
  return Status::Ok();
}

template struct UniformSplitsFunctor<CpuDevice>;
template struct PooledLookupFunctor<CpuDevice, float, int32_t>;
template struct PooledLookupFunctor<CpuDevice, float, int64_t>;
template struct PooledLookupFunctor<CpuDevice, double, int32_t>;
template struct PooledLookupFunctor<CpuDevice, double, int64_t>;

}  // namespace lookup
}  // namespace sok
