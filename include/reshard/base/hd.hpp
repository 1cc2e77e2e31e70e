#pragma once
// RESHARD_HD marks the pure functions that host and CUDA device code share
// (quantize.hpp's E4M3 encoder, delta.hpp's chunk sizes, cuda/box_batch.hpp's
// kernel body): __host__ __device__ under nvcc, nothing for a host compiler.
#ifndef RESHARD_HD
#if defined(__CUDACC__)
#define RESHARD_HD __host__ __device__
#else
#define RESHARD_HD
#endif
#endif
