// The fusion buffer: pack gathers `count` arrays into one flat buffer and unpack
// scatters it back. `offsets[s]` is where array s starts in the buffer (in elements)
// and offsets[count] is the buffer's length; `parts[s]` points at array s. T is an
// unsigned type of the element size, so one instantiation serves every dtype of it.
// blockIdx.y walks the arrays and blockIdx.x/threadIdx.x the elements of one array.
#include "common.cuh"

template <typename T>
__global__ void pack(T* dst, const T* const* parts, const long long* offsets, int count) {
  for (int s = blockIdx.y; s < count; s += gridDim.y) {
    const T* src = parts[s];
    T* out = dst + offsets[s];
    long long n = offsets[s + 1] - offsets[s];
    for (long long i = mpitrain::first_index(); i < n; i += mpitrain::grid_stride()) out[i] = src[i];
  }
}

template <typename T>
__global__ void unpack(T* const* parts, const T* src, const long long* offsets, int count) {
  for (int s = blockIdx.y; s < count; s += gridDim.y) {
    T* out = parts[s];
    const T* in = src + offsets[s];
    long long n = offsets[s + 1] - offsets[s];
    for (long long i = mpitrain::first_index(); i < n; i += mpitrain::grid_stride()) out[i] = in[i];
  }
}
