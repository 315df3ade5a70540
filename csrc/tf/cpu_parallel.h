// Adapts TensorFlow's CPU worker pool to core's ParallelFor.
#ifndef SOK_TF_CPU_PARALLEL_H_
#define SOK_TF_CPU_PARALLEL_H_

#include "core/parallel.h"
#include "tensorflow/core/framework/op_kernel.h"

namespace sok {

inline ParallelFor CpuParallelFor(::tensorflow::OpKernelContext* ctx) {
  auto* workers = ctx->device()->tensorflow_cpu_worker_threads()->workers;
  return [workers](int64_t n, int64_t cost_per_unit, const WorkFn& fn) {
    if (n <= 0) return;
    workers->ParallelFor(n, cost_per_unit, fn);
  };
}

}  // namespace sok

#endif  // SOK_TF_CPU_PARALLEL_H_
