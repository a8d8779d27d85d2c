// Shared by mpitrain's kernels: the element types, widening to the arithmetic type,
// rounding back, and the reduction operations. Every function mirrors what numpy
// (and ml_dtypes for bfloat16) computes, so device results equal host results.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace mpitrain {

// Reduction codes; the loader's table (mpitrain/backends/kernels.py) uses the same.
enum { OP_SUM = 0, OP_MIN = 1, OP_MAX = 2, OP_PRODUCT = 3 };

// The type arithmetic happens in: float for the 16-bit floats, else the type itself.
template <typename T> struct Arith { typedef T type; };
template <> struct Arith<__half> { typedef float type; };
template <> struct Arith<__nv_bfloat16> { typedef float type; };

// Integer sums and products wrap around like numpy's: compute them unsigned.
template <typename T> struct Wrap { typedef T type; };
template <> struct Wrap<int> { typedef unsigned int type; };
template <> struct Wrap<long long> { typedef unsigned long long type; };

template <typename T> __device__ __forceinline__ typename Arith<T>::type widen(T x) { return x; }
template <> __device__ __forceinline__ float widen<__half>(__half x) { return __half2float(x); }
template <> __device__ __forceinline__ float widen<__nv_bfloat16>(__nv_bfloat16 x) {
  return __bfloat162float(x);
}

// Round an arithmetic-type value back to T (to nearest even, as numpy does).
template <typename T> __device__ __forceinline__ T narrow(typename Arith<T>::type x) { return x; }
template <> __device__ __forceinline__ __half narrow<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 narrow<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// T from a double. float16 rounds once (numpy); bfloat16 rounds through float, as
// ml_dtypes' conversion does.
template <typename T> __device__ __forceinline__ T from_double(double x) { return (T)x; }
template <> __device__ __forceinline__ __half from_double<__half>(double x) {
  return __double2half(x);
}
template <> __device__ __forceinline__ __nv_bfloat16 from_double<__nv_bfloat16>(double x) {
  return __float2bfloat16_rn((float)x);
}

template <typename T> __device__ __forceinline__ double to_double(T x) { return (double)widen(x); }

// a <op> b in the arithmetic type. Min and Max propagate NaN like numpy.minimum/maximum.
template <int OP, typename A> __device__ __forceinline__ A apply(A a, A b) {
  if (OP == OP_MIN) return (a <= b || a != a) ? a : b;
  if (OP == OP_MAX) return (a >= b || a != a) ? a : b;
  typedef typename Wrap<A>::type U;
  if (OP == OP_SUM) return (A)((U)a + (U)b);
  return (A)((U)a * (U)b);
}

// Python's floor division (rounds toward minus infinity).
template <typename T> __device__ __forceinline__ T floor_divide(T a, T d) {
  T q = a / d;
  return (a % d != 0 && ((a < 0) != (d < 0))) ? q - 1 : q;
}

// x * factor the way mpitrain's numpy backend scales: integers are floor-divided by
// `divisor` when it is non-zero (factor == 1/divisor), else floor(x * factor) in
// double; float16 and float32 multiply by the factor rounded to T; bfloat16 (an
// ml_dtypes type, which numpy promotes to float64) multiplies in double.
template <typename T> struct Scale {
  static __device__ __forceinline__ T apply(T x, double factor, long long divisor) {
    if (divisor != 0) return floor_divide<T>(x, (T)divisor);
    return (T)floor((double)x * factor);
  }
};
template <> struct Scale<float> {
  static __device__ __forceinline__ float apply(float x, double factor, long long) {
    return x * (float)factor;
  }
};
template <> struct Scale<double> {
  static __device__ __forceinline__ double apply(double x, double factor, long long) {
    return x * factor;
  }
};
template <> struct Scale<__half> {
  static __device__ __forceinline__ __half apply(__half x, double factor, long long) {
    return narrow<__half>(widen(x) * widen(from_double<__half>(factor)));
  }
};
template <> struct Scale<__nv_bfloat16> {
  static __device__ __forceinline__ __nv_bfloat16 apply(__nv_bfloat16 x, double factor,
                                                        long long) {
    return from_double<__nv_bfloat16>(to_double(x) * factor);
  }
};

// Grid-stride loop bounds: every kernel covers [0, n) whatever grid it is launched with.
__device__ __forceinline__ long long first_index() {
  return (long long)blockIdx.x * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ long long grid_stride() { return (long long)gridDim.x * blockDim.x; }

}  // namespace mpitrain
