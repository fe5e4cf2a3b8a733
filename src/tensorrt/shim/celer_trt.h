/*
 * celer_trt.h: the plain C interface of celer's TensorRT shim (celer_trt.cpp).
 *
 * The shim opens libnvinfer / libnvonnxparser at run time and reaches TensorRT only
 * through their exported factory functions, so nothing here (or in the object file)
 * depends on TensorRT or CUDA at link time. No C++ type and no C++ exception crosses this
 * interface: every function that can fail returns a status, and the message of the last
 * failure on the calling thread is kept for celer_trt_last_error().
 *
 * Ownership: every object returned through an `out` pointer is owned by the caller and
 * released with its _destroy function. An object must be destroyed before the object it
 * was created from (context before engine, engine before runtime, everything before the
 * library). Strings returned by the shim live as long as the object they came from.
 */
#ifndef CELER_TRT_H
#define CELER_TRT_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The most dimensions a tensor may have (TensorRT's Dims64::MAX_DIMS). */
#define CELER_TRT_MAX_DIMS 8

typedef enum celer_trt_status {
    CELER_TRT_OK = 0,
    CELER_TRT_ERROR = 1,
    /* A library could not be opened (not installed, not on the loader's path). */
    CELER_TRT_NOT_FOUND = 2
} celer_trt_status;

/* Element types, numbered as TensorRT 10 and 11 number nvinfer1::DataType. */
enum celer_trt_data_type {
    CELER_TRT_FLOAT = 0, CELER_TRT_HALF = 1, CELER_TRT_INT8 = 2, CELER_TRT_INT32 = 3,
    CELER_TRT_BOOL = 4, CELER_TRT_UINT8 = 5, CELER_TRT_FP8 = 6, CELER_TRT_BF16 = 7,
    CELER_TRT_INT64 = 8, CELER_TRT_INT4 = 9, CELER_TRT_FP4 = 10, CELER_TRT_E8M0 = 11,
    CELER_TRT_UNKNOWN_TYPE = 255
};

/* Builder precision. On TensorRT 11 only CELER_TRT_PRECISION_FROM_MODEL is accepted:
 * networks are strongly typed and take their types from the ONNX model. */
enum celer_trt_precision {
    CELER_TRT_PRECISION_FP32 = 0,
    CELER_TRT_PRECISION_FP16 = 1,
    CELER_TRT_PRECISION_BF16 = 2,
    CELER_TRT_PRECISION_FROM_MODEL = 3
};

/* ILogger severities (nvinfer1::ILogger::Severity). */
enum celer_trt_severity {
    CELER_TRT_SEVERITY_INTERNAL_ERROR = 0,
    CELER_TRT_SEVERITY_ERROR = 1,
    CELER_TRT_SEVERITY_WARNING = 2,
    CELER_TRT_SEVERITY_INFO = 3,
    CELER_TRT_SEVERITY_VERBOSE = 4
};

/* Build progress events (IProgressMonitor). */
enum celer_trt_progress_event {
    CELER_TRT_PHASE_START = 0,
    CELER_TRT_PHASE_STEP = 1,
    CELER_TRT_PHASE_FINISH = 2
};

/* A shape; nb_dims == -1 means unknown rank, d[i] == -1 a dynamic dimension. */
typedef struct celer_trt_dims {
    int32_t nb_dims;
    int64_t d[CELER_TRT_MAX_DIMS];
} celer_trt_dims;

/* One input or output tensor of an engine or a parsed network. */
typedef struct celer_trt_tensor_desc {
    const char* name;
    int32_t is_input;
    int32_t data_type; /* enum celer_trt_data_type */
    celer_trt_dims shape;
} celer_trt_tensor_desc;

/* Called for every TensorRT log message, from any thread. Must not unwind. */
typedef void (*celer_trt_log_fn)(int32_t severity, const char* message);

/* Called by the builder for progress; `parent` is null except for phase starts, `nb_steps`
 * is set only for phase starts. Return 0 to cancel the build. Must not unwind. */
typedef int32_t (*celer_trt_progress_fn)(
    void* user, int32_t event, const char* phase, const char* parent, int32_t step, int32_t nb_steps);

/* One input's range in the (single) optimisation profile of a build. */
typedef struct celer_trt_profile_entry {
    const char* name;
    celer_trt_dims min;
    celer_trt_dims opt;
    celer_trt_dims max;
} celer_trt_profile_entry;

typedef struct celer_trt_build_options {
    int32_t precision;        /* enum celer_trt_precision */
    uint64_t workspace_bytes; /* 0: TensorRT's default (the device's memory) */
    const void* timing_cache; /* a serialized timing cache to start from, or null */
    size_t timing_cache_size;
    celer_trt_progress_fn progress; /* may be null */
    void* progress_user;
} celer_trt_build_options;

typedef struct celer_trt_library celer_trt_library;
typedef struct celer_trt_runtime celer_trt_runtime;
typedef struct celer_trt_engine celer_trt_engine;
typedef struct celer_trt_context celer_trt_context;
typedef struct celer_trt_network celer_trt_network;
typedef struct celer_trt_blob celer_trt_blob;

/* The message of the last failed call on this thread ("" if none). Valid until the next
 * shim call on this thread. */
const char* celer_trt_last_error(void);

/* The TensorRT version of the headers the shim was compiled against, as
 * major * 10000 + minor * 100 + patch; and the ONNX parser's, encoded the same way. */
int32_t celer_trt_compiled_version(void);
int32_t celer_trt_compiled_parser_version(void);

/* Opens libnvinfer (`path`: a file path or a soname for the dynamic loader), checks its
 * version against the headers' (same major, same or newer minor) and resolves the
 * factories. `log` receives every TensorRT message; the last library opened sets it. */
celer_trt_status celer_trt_library_open(const char* path, celer_trt_log_fn log, celer_trt_library** out);
/* Opens libnvonnxparser for building, after libnvinfer (its DT_NEEDED resolves by soname). */
celer_trt_status celer_trt_library_open_parser(celer_trt_library* lib, const char* path);
/* getInferLibVersion() of the opened library; the parser's version or -1 if not opened. */
int32_t celer_trt_library_version(const celer_trt_library* lib);
int32_t celer_trt_library_parser_version(const celer_trt_library* lib);
/* The file the dynamic loader resolved libnvinfer to (for messages). */
const char* celer_trt_library_resolved_path(const celer_trt_library* lib);
void celer_trt_library_close(celer_trt_library* lib);

/* ---- running engines ---- */
celer_trt_status celer_trt_runtime_create(celer_trt_library* lib, celer_trt_runtime** out);
void celer_trt_runtime_destroy(celer_trt_runtime* runtime);

/* Needs a current CUDA device: the plan's weights are copied to it. */
celer_trt_status celer_trt_engine_deserialize(
    celer_trt_runtime* runtime, const void* plan, size_t plan_size, celer_trt_engine** out);
void celer_trt_engine_destroy(celer_trt_engine* engine);
celer_trt_status celer_trt_engine_io_count(const celer_trt_engine* engine, int32_t* out);
celer_trt_status celer_trt_engine_io_tensor(const celer_trt_engine* engine, int32_t index, celer_trt_tensor_desc* out);
celer_trt_status celer_trt_engine_profile_count(const celer_trt_engine* engine, int32_t* out);
celer_trt_status celer_trt_engine_profile_shape(const celer_trt_engine* engine, const char* name, int32_t profile,
    celer_trt_dims* min, celer_trt_dims* opt, celer_trt_dims* max);
/* Device memory an execution context needs for its activations, bytes. */
celer_trt_status celer_trt_engine_device_memory_size(const celer_trt_engine* engine, int64_t* out);

/* user_managed_memory == 0: TensorRT allocates the context's activation memory.
 * Otherwise the caller must give it with celer_trt_context_set_device_memory. */
celer_trt_status celer_trt_context_create(
    celer_trt_engine* engine, int32_t user_managed_memory, celer_trt_context** out);
void celer_trt_context_destroy(celer_trt_context* context);
celer_trt_status celer_trt_context_set_device_memory(celer_trt_context* context, void* memory, int64_t size);
celer_trt_status celer_trt_context_set_optimization_profile(
    celer_trt_context* context, int32_t profile, void* cuda_stream);
celer_trt_status celer_trt_context_set_input_shape(
    celer_trt_context* context, const char* name, const celer_trt_dims* shape);
celer_trt_status celer_trt_context_tensor_shape(
    const celer_trt_context* context, const char* name, celer_trt_dims* out);
celer_trt_status celer_trt_context_set_tensor_address(celer_trt_context* context, const char* name, void* address);
/* enqueueV3 on `cuda_stream` (a cudaStream_t / CUstream; null is the legacy default stream). */
celer_trt_status celer_trt_context_enqueue(celer_trt_context* context, void* cuda_stream);

/* ---- building engines (needs celer_trt_library_open_parser) ---- */
/* Creates a builder and a network and parses the ONNX file into it. */
celer_trt_status celer_trt_network_parse(celer_trt_library* lib, const char* onnx_path, celer_trt_network** out);
void celer_trt_network_destroy(celer_trt_network* network);
celer_trt_status celer_trt_network_io_count(const celer_trt_network* network, int32_t* inputs, int32_t* outputs);
celer_trt_status celer_trt_network_io_tensor(
    const celer_trt_network* network, int32_t is_input, int32_t index, celer_trt_tensor_desc* out);
/* Builds a serialized engine on the current CUDA device with one optimisation profile made
 * of `profile` (empty when every input is static). On success `*plan` holds the plan and
 * `*timing_cache` the updated timing cache (null if TensorRT had none to give). */
celer_trt_status celer_trt_network_build(celer_trt_network* network, const celer_trt_build_options* options,
    const celer_trt_profile_entry* profile, size_t profile_len, celer_trt_blob** plan, celer_trt_blob** timing_cache);

const void* celer_trt_blob_data(const celer_trt_blob* blob);
size_t celer_trt_blob_size(const celer_trt_blob* blob);
void celer_trt_blob_destroy(celer_trt_blob* blob);

#ifdef __cplusplus
}
#endif

#endif /* CELER_TRT_H */
