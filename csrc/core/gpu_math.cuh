// Correctly rounded device arithmetic, never contracted into FMA: the CUDA
// kernels of core/ use these so that their sums and products round exactly
// as the CPU kernels' do (the CPU build has no FMA contraction).
#ifndef SOK_CORE_GPU_MATH_CUH_
#define SOK_CORE_GPU_MATH_CUH_

namespace sok {
namespace gpu {

__device__ __forceinline__ float Add(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ double Add(double a, double b) {
  return __dadd_rn(a, b);
}
__device__ __forceinline__ float Sub(float a, float b) { return __fsub_rn(a, b); }
__device__ __forceinline__ double Sub(double a, double b) {
  return __dsub_rn(a, b);
}
__device__ __forceinline__ float Mul(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double Mul(double a, double b) {
  return __dmul_rn(a, b);
}
__device__ __forceinline__ float Div(float a, float b) { return __fdiv_rn(a, b); }
__device__ __forceinline__ double Div(double a, double b) {
  return __ddiv_rn(a, b);
}
__device__ __forceinline__ float Sqrt(float a) { return __fsqrt_rn(a); }
__device__ __forceinline__ double Sqrt(double a) { return __dsqrt_rn(a); }

}  // namespace gpu
}  // namespace sok

#endif  // SOK_CORE_GPU_MATH_CUH_
