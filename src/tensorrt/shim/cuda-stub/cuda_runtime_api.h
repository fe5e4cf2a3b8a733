/*
 * Stand-in for CUDA's cuda_runtime_api.h, used by build.rs when CUDA_INCLUDE_DIR is not
 * set. TensorRT's public headers include that file only for these two types, which they
 * pass by value as opaque pointers: the declarations below are the ones CUDA itself
 * makes (driver_types.h), so the ABI is identical. Do not add anything else here: a
 * TensorRT header that needs more must be compiled against the real CUDA headers.
 */
#ifndef CELER_CUDA_RUNTIME_API_STUB_H
#define CELER_CUDA_RUNTIME_API_STUB_H

struct CUstream_st;
typedef struct CUstream_st* cudaStream_t;

struct CUevent_st;
typedef struct CUevent_st* cudaEvent_t;

#endif
