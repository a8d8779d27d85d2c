// Compression casts: float32/float64 to float16/bfloat16 and back, rounding like numpy
// and ml_dtypes (to nearest even) so a compressed tensor is the same on host and device.
#include "common.cuh"

namespace mpitrain {
template <typename From, typename To> struct Convert {
  static __device__ __forceinline__ To apply(From x) { return (To)widen(x); }
};
template <> struct Convert<float, __half> {
  static __device__ __forceinline__ __half apply(float x) { return __float2half_rn(x); }
};
template <> struct Convert<double, __half> {
  static __device__ __forceinline__ __half apply(double x) { return from_double<__half>(x); }
};
template <> struct Convert<float, __nv_bfloat16> {
  static __device__ __forceinline__ __nv_bfloat16 apply(float x) { return __float2bfloat16_rn(x); }
};
template <> struct Convert<double, __nv_bfloat16> {
  static __device__ __forceinline__ __nv_bfloat16 apply(double x) {
    return from_double<__nv_bfloat16>(x);
  }
};
}  // namespace mpitrain

template <typename From, typename To>
__global__ void cast(To* dst, const From* src, long long n) {
  for (long long i = mpitrain::first_index(); i < n; i += mpitrain::grid_stride()) {
    dst[i] = mpitrain::Convert<From, To>::apply(src[i]);
  }
}
