// Elementwise reductions and scaling of the ring's segments and the pre/postscale.
//
//   reduce<T, OP, SCALED>: dst[i] = a[i] <OP> b[i], then (SCALED) times the factor;
//                          dst may alias a or b. The fused form finishes Average (and
//                          any postscale) in the same pass as the last reduction.
//   scale<T>:              dst[i] = src[i] * factor; dst may be src (in place) or a
//                          different buffer (prescale fused with the copy).
#include "common.cuh"

template <typename T, int OP, bool SCALED>
__global__ void reduce(T* dst, const T* a, const T* b, long long n, double factor,
                       long long divisor) {
  for (long long i = mpitrain::first_index(); i < n; i += mpitrain::grid_stride()) {
    T r = mpitrain::narrow<T>(mpitrain::apply<OP>(mpitrain::widen(a[i]), mpitrain::widen(b[i])));
    dst[i] = SCALED ? mpitrain::Scale<T>::apply(r, factor, divisor) : r;
  }
}

template <typename T>
__global__ void scale(T* dst, const T* src, long long n, double factor, long long divisor) {
  for (long long i = mpitrain::first_index(); i < n; i += mpitrain::grid_stride()) {
    dst[i] = mpitrain::Scale<T>::apply(src[i], factor, divisor);
  }
}
