// The CUresult codes the stand-in knows, with the CUDA version whose cuda.h introduced
// each (cudarc 0.19.10 lists them per version: src/driver/sys/mod.rs, `cudaError_enum` of
// each `cuda-XXXXX` feature; codes already in CUDA 12.0 are marked 12000). A driver of
// version V defines the codes introduced at or before V: cuGetErrorName and
// cuGetErrorString answer CUDA_ERROR_INVALID_VALUE (and a null string) for any other, as
// the real driver does, and CELER_CUDA_STANDIN_RETURN refuses to inject a code newer than
// V (such a driver never returns it) while taking a code no CUDA defines (a driver newer
// than every header: e.g. 1000).
//
// The descriptions are the real driver's where known, else a paraphrase of cuda.h's.
// `lost`: the context's error is sticky after it (celer's driver layer classifies the
// same codes as a lost device); the stand-in makes an injected lost code sticky, and any
// code it does not know too (conservatively, as celer does).
#include <stdio.h>

#include "standin.h"

namespace standin {
namespace {

struct CodeInfo {
    int code;
    const char* name;
    const char* text;
    int since;
    bool lost;
};

const CodeInfo kCodes[] = {
    {0, "CUDA_SUCCESS", "no error", 12000, false},
    {1, "CUDA_ERROR_INVALID_VALUE", "invalid argument", 12000, false},
    {2, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory", 12000, false},
    {3, "CUDA_ERROR_NOT_INITIALIZED", "initialization error", 12000, false},
    {4, "CUDA_ERROR_DEINITIALIZED", "driver shutting down", 12000, false},
    {5, "CUDA_ERROR_PROFILER_DISABLED", "profiler disabled while using external profiling tool", 12000, false},
    {6, "CUDA_ERROR_PROFILER_NOT_INITIALIZED", "profiler not initialized", 12000, false},
    {7, "CUDA_ERROR_PROFILER_ALREADY_STARTED", "profiler already started", 12000, false},
    {8, "CUDA_ERROR_PROFILER_ALREADY_STOPPED", "profiler already stopped", 12000, false},
    {34, "CUDA_ERROR_STUB_LIBRARY", "CUDA driver is a stub library", 12000, false},
    {36, "CUDA_ERROR_CALL_REQUIRES_NEWER_DRIVER", "the call requires a newer CUDA driver", 13000, false},
    {46, "CUDA_ERROR_DEVICE_UNAVAILABLE", "CUDA-capable device(s) is/are busy or unavailable", 12000, false},
    {47, "CUDA_ERROR_MULTICAST_RESOURCE_FULL", "the multicast object has no room for more devices", 13040, false},
    {100, "CUDA_ERROR_NO_DEVICE", "no CUDA-capable device is detected", 12000, false},
    {101, "CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal", 12000, false},
    {102, "CUDA_ERROR_DEVICE_NOT_LICENSED", "device doesn't have valid Grid license", 12000, false},
    {200, "CUDA_ERROR_INVALID_IMAGE", "device kernel image is invalid", 12000, false},
    {201, "CUDA_ERROR_INVALID_CONTEXT", "invalid device context", 12000, false},
    {202, "CUDA_ERROR_CONTEXT_ALREADY_CURRENT", "context already current", 12000, false},
    {205, "CUDA_ERROR_MAP_FAILED", "mapping of buffer object failed", 12000, false},
    {206, "CUDA_ERROR_UNMAP_FAILED", "unmapping of buffer object failed", 12000, false},
    {207, "CUDA_ERROR_ARRAY_IS_MAPPED", "array is mapped", 12000, false},
    {208, "CUDA_ERROR_ALREADY_MAPPED", "resource already mapped", 12000, false},
    {209, "CUDA_ERROR_NO_BINARY_FOR_GPU", "no kernel image is available for execution on the device", 12000, false},
    {210, "CUDA_ERROR_ALREADY_ACQUIRED", "resource already acquired", 12000, false},
    {211, "CUDA_ERROR_NOT_MAPPED", "resource not mapped", 12000, false},
    {212, "CUDA_ERROR_NOT_MAPPED_AS_ARRAY", "resource not mapped as array", 12000, false},
    {213, "CUDA_ERROR_NOT_MAPPED_AS_POINTER", "resource not mapped as pointer", 12000, false},
    {214, "CUDA_ERROR_ECC_UNCORRECTABLE", "uncorrectable ECC error encountered", 12000, true},
    {215, "CUDA_ERROR_UNSUPPORTED_LIMIT", "limit is not supported on this architecture", 12000, false},
    {216, "CUDA_ERROR_CONTEXT_ALREADY_IN_USE", "exclusive-thread device already in use by a different thread", 12000,
     false},
    {217, "CUDA_ERROR_PEER_ACCESS_UNSUPPORTED", "peer access is not supported between these two devices", 12000, false},
    {218, "CUDA_ERROR_INVALID_PTX", "a PTX JIT compilation failed", 12000, false},
    {219, "CUDA_ERROR_INVALID_GRAPHICS_CONTEXT", "invalid OpenGL or DirectX context", 12000, false},
    {220, "CUDA_ERROR_NVLINK_UNCORRECTABLE", "uncorrectable NVLink error detected during the execution", 12000, true},
    {221, "CUDA_ERROR_JIT_COMPILER_NOT_FOUND", "PTX JIT compiler library not found", 12000, false},
    {222, "CUDA_ERROR_UNSUPPORTED_PTX_VERSION", "the provided PTX was compiled with an unsupported toolchain.", 12000,
     false},
    {223, "CUDA_ERROR_JIT_COMPILATION_DISABLED", "PTX JIT compilation was disabled", 12000, false},
    {224, "CUDA_ERROR_UNSUPPORTED_EXEC_AFFINITY", "the provided execution affinity is not supported", 12000, false},
    {225, "CUDA_ERROR_UNSUPPORTED_DEVSIDE_SYNC", "the provided PTX contains unsupported call to cudaDeviceSynchronize",
     12010, false},
    {226, "CUDA_ERROR_CONTAINED",
     "an exception on the device was contained by the GPU's error containment: the process must be terminated and "
     "relaunched",
     12080, true},
    {227, "CUDA_ERROR_INSUFFICIENT_LOADER_VERSION", "the CUDA loader is older than the driver needs", 13040, false},
    {300, "CUDA_ERROR_INVALID_SOURCE", "invalid source", 12000, false},
    {301, "CUDA_ERROR_FILE_NOT_FOUND", "file not found", 12000, false},
    {302, "CUDA_ERROR_SHARED_OBJECT_SYMBOL_NOT_FOUND", "shared object symbol not found", 12000, false},
    {303, "CUDA_ERROR_SHARED_OBJECT_INIT_FAILED", "shared object initialization failed", 12000, false},
    {304, "CUDA_ERROR_OPERATING_SYSTEM", "OS call failed or operation not supported on this OS", 12000, false},
    {400, "CUDA_ERROR_INVALID_HANDLE", "invalid resource handle", 12000, false},
    {401, "CUDA_ERROR_ILLEGAL_STATE", "the operation cannot be performed in the present state", 12000, false},
    {402, "CUDA_ERROR_LOSSY_QUERY", "attempted introspection would be semantically lossy", 12030, false},
    {500, "CUDA_ERROR_NOT_FOUND", "named symbol not found", 12000, false},
    {600, "CUDA_ERROR_NOT_READY", "device not ready", 12000, false},
    {700, "CUDA_ERROR_ILLEGAL_ADDRESS", "an illegal memory access was encountered", 12000, true},
    {701, "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES", "too many resources requested for launch", 12000, false},
    {702, "CUDA_ERROR_LAUNCH_TIMEOUT", "the launch timed out and was terminated", 12000, true},
    {703, "CUDA_ERROR_LAUNCH_INCOMPATIBLE_TEXTURING", "launch uses incompatible texturing mode", 12000, false},
    {704, "CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED", "peer access is already enabled", 12000, false},
    {705, "CUDA_ERROR_PEER_ACCESS_NOT_ENABLED", "peer access has not been enabled", 12000, false},
    {708, "CUDA_ERROR_PRIMARY_CONTEXT_ACTIVE", "cannot set while device is active in this process", 12000, false},
    {709, "CUDA_ERROR_CONTEXT_IS_DESTROYED", "context is destroyed", 12000, true},
    {710, "CUDA_ERROR_ASSERT", "device-side assert triggered", 12000, false},
    {711, "CUDA_ERROR_TOO_MANY_PEERS", "peer mapping resources exhausted", 12000, false},
    {712, "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED", "part or all of the requested memory range is already mapped",
     12000, false},
    {713, "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED", "pointer does not correspond to a registered memory region", 12000,
     false},
    {714, "CUDA_ERROR_HARDWARE_STACK_ERROR", "hardware stack error", 12000, true},
    {715, "CUDA_ERROR_ILLEGAL_INSTRUCTION", "an illegal instruction was encountered", 12000, true},
    {716, "CUDA_ERROR_MISALIGNED_ADDRESS", "misaligned address", 12000, true},
    {717, "CUDA_ERROR_INVALID_ADDRESS_SPACE", "operation not supported on global/shared address space", 12000, true},
    {718, "CUDA_ERROR_INVALID_PC", "invalid program counter", 12000, true},
    {719, "CUDA_ERROR_LAUNCH_FAILED", "unspecified launch failure", 12000, true},
    {720, "CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE", "too many blocks in cooperative launch", 12000, false},
    {721, "CUDA_ERROR_TENSOR_MEMORY_LEAK", "tensor memory was not completely freed by the kernel", 12080, false},
    {800, "CUDA_ERROR_NOT_PERMITTED", "operation not permitted", 12000, false},
    {801, "CUDA_ERROR_NOT_SUPPORTED", "operation not supported", 12000, false},
    {802, "CUDA_ERROR_SYSTEM_NOT_READY", "system not yet initialized", 12000, false},
    {803, "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH", "system has unsupported display driver / cuda driver combination",
     12000, false},
    {804, "CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE", "forward compatibility was attempted on non supported HW",
     12000, false},
    {805, "CUDA_ERROR_MPS_CONNECTION_FAILED", "MPS client failed to connect to the MPS control daemon or the MPS server",
     12000, false},
    {806, "CUDA_ERROR_MPS_RPC_FAILURE", "the remote procedural call between the MPS server and the MPS client failed",
     12000, false},
    {807, "CUDA_ERROR_MPS_SERVER_NOT_READY", "MPS server is not ready to accept new MPS client requests", 12000, false},
    {808, "CUDA_ERROR_MPS_MAX_CLIENTS_REACHED", "the hardware resources required to create MPS client have been exhausted",
     12000, false},
    {809, "CUDA_ERROR_MPS_MAX_CONNECTIONS_REACHED",
     "the hardware resources required to support device connections have been exhausted", 12000, false},
    {810, "CUDA_ERROR_MPS_CLIENT_TERMINATED", "the MPS client has been terminated by the server", 12000, false},
    {811, "CUDA_ERROR_CDP_NOT_SUPPORTED", "the module uses CUDA Dynamic Parallelism, which this configuration does not support",
     12000, false},
    {812, "CUDA_ERROR_CDP_VERSION_MISMATCH", "the module mixes versions of CUDA Dynamic Parallelism", 12000, false},
    {900, "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED", "operation not permitted when stream is capturing", 12000, false},
    {901, "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED", "operation failed due to a previous error during capture", 12000,
     false},
    {902, "CUDA_ERROR_STREAM_CAPTURE_MERGE", "operation would result in a merge of separate capture sequences", 12000,
     false},
    {903, "CUDA_ERROR_STREAM_CAPTURE_UNMATCHED", "capture was not ended in the same stream as it began", 12000, false},
    {904, "CUDA_ERROR_STREAM_CAPTURE_UNJOINED", "capturing stream has unjoined work", 12000, false},
    {905, "CUDA_ERROR_STREAM_CAPTURE_ISOLATION", "dependency created on uncaptured work in another stream", 12000, false},
    {906, "CUDA_ERROR_STREAM_CAPTURE_IMPLICIT",
     "operation would make the legacy stream depend on a capturing blocking stream", 12000, false},
    {907, "CUDA_ERROR_CAPTURED_EVENT", "operation not permitted on an event last recorded in a capturing stream", 12000,
     false},
    {908, "CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD",
     "attempt to terminate a thread-local capture sequence from another thread", 12000, false},
    {909, "CUDA_ERROR_TIMEOUT", "wait operation timed out", 12000, false},
    {910, "CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE", "the graph update was not performed because it included changes which "
     "violated constraints specific to instantiated graph update", 12000, false},
    {911, "CUDA_ERROR_EXTERNAL_DEVICE", "an async error has occurred in a external entity outside of CUDA", 12000,
     false},
    {912, "CUDA_ERROR_INVALID_CLUSTER_SIZE", "a kernel launch error has occurred due to cluster misconfiguration", 12000,
     false},
    {913, "CUDA_ERROR_FUNCTION_NOT_LOADED", "the function handle is not loaded", 12040, false},
    {914, "CUDA_ERROR_INVALID_RESOURCE_TYPE", "a resource passed in is not of a valid type for the operation", 12040,
     false},
    {915, "CUDA_ERROR_INVALID_RESOURCE_CONFIGURATION", "a resource passed in is insufficient or non-applicable", 12040,
     false},
    {916, "CUDA_ERROR_KEY_ROTATION", "an error happened during the key rotation sequence", 12080, false},
    {917, "CUDA_ERROR_STREAM_DETACHED", "the stream is detached", 13010, false},
    {918, "CUDA_ERROR_GRAPH_RECAPTURE_FAILURE", "the graph could not be recaptured", 13030, false},
    {919, "CUDA_ERROR_FABRIC_NOT_READY", "the fabric is not ready", 13040, false},
    {999, "CUDA_ERROR_UNKNOWN", "unknown error", 12000, false},
};

const CodeInfo* find_code(int result) {
    for (const CodeInfo& c : kCodes) {
        if (c.code == result) return &c;
    }
    return nullptr;
}

}  // namespace

bool code_defined(int result) {
    const CodeInfo* c = find_code(result);
    return c != nullptr && c->since <= driver_version();
}

int code_since(int result) {
    const CodeInfo* c = find_code(result);
    return c == nullptr ? 0 : c->since;
}

bool code_is_lost(int result) {
    const CodeInfo* c = find_code(result);
    return c == nullptr || c->lost;
}

const char* result_name(int result) {
    const CodeInfo* c = find_code(result);
    if (c != nullptr) return c->name;
    static thread_local char text[64];
    snprintf(text, sizeof(text), "CUresult %d (in no cuda.h)", result);
    return text;
}

const char* result_string(int result) {
    const CodeInfo* c = find_code(result);
    return c != nullptr ? c->text : "unknown error";
}

}  // namespace standin
