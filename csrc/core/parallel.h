// The one parallel-for type of core/: kernels take it as an argument so that
// the framework adapter decides where work runs (TF's CPU pool, a test's
// single thread). TensorFlow-free.
#ifndef SOK_CORE_PARALLEL_H_
#define SOK_CORE_PARALLEL_H_

#include <cstdint>
#include <functional>

namespace sok {

// fn(begin, end) over a sub-range of [0, n).
using WorkFn = std::function<void(int64_t, int64_t)>;

// Runs fn over disjoint ranges that cover [0, n). `cost_per_unit` is a rough
// cost estimate of one unit of work (in cycles).
using ParallelFor =
    std::function<void(int64_t n, int64_t cost_per_unit, const WorkFn& fn)>;

// Runs fn(0, n) on the calling thread (tests, tiny inputs).
inline void SerialFor(int64_t n, int64_t /*cost_per_unit*/, const WorkFn& fn) {
  if (n > 0) fn(0, n);
}

// SerialFor as a ParallelFor value.
inline ParallelFor SerialParallelFor() { return SerialFor; }

}  // namespace sok

#endif  // SOK_CORE_PARALLEL_H_
