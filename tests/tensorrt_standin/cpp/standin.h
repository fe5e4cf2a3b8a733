// The stand-in TensorRT's internal declarations: what its files share. Nothing here is
// TensorRT's API; the API is the classes of NvInfer.h, implemented in runtime.cpp,
// builder.cpp and parser.cpp over the generated stubs (stubs.h).
#pragma once

#include <NvInfer.h>
#include <NvOnnxParser.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

#include "stubs.h"

namespace standin {

using nvinfer1::DataType;
using nvinfer1::Dims;
using nvinfer1::ILogger;
using Severity = nvinfer1::ILogger::Severity;

// ---- versions (common.cpp) ------------------------------------------------------------

// What getInferLibVersion reports: the headers' version, or CELER_TRT_STANDIN_VERSION
// ("10.17.0") to play another TensorRT release.
int32_t library_version();
std::string version_string(int32_t encoded);
// Whether a factory may serve a caller compiled against TensorRT `headers` (same major,
// not newer than this library, as the real factories require); refused (logged) if not.
bool caller_version_ok(ILogger* logger, char const* factory, int32_t headers);

// ---- messages and rules (common.cpp) ------------------------------------------------

// Logs through `logger` (may be null: then to stderr).
void log(ILogger* logger, Severity severity, std::string const& message);

// A call that breaks a documented rule, refused as real TensorRT refuses it: an error
// logged (naming the rule) and false/null returned by the caller. Counted.
void refuse(ILogger* logger, std::string const& message);

// A rule broken where nothing can be returned (a destructor): logged as an internal
// error, counted, then the process aborts, unless CELER_TRT_STANDIN_ON_VIOLATION=log
// (the stand-in's own tests read the count instead).
void violation(ILogger* logger, std::string const& message);

// Whether `call` ("deserialize", "enqueue", "enqueue-sticky") is armed to fail:
// CELER_TRT_STANDIN_FAULT_FILE names a file; when it exists and holds that word, the call
// fails and the file is removed.
bool fault_armed(char const* call);

// Holds an engine build until CELER_TRT_STANDIN_BUILD_GATE names a file that exists (at
// most ten minutes), so that a test can serve while engines build for as long as it
// needs, as a real build's minutes would; returns at once when it is not set.
void wait_for_build_gate();

// Objects alive, so that a child whose parent broke a lifetime rule (and so is gone, in
// log mode) does not touch it.
void register_live(void const* object);
void unregister_live(void const* object);
bool is_live(void const* object);

// ---- shapes and types (common.cpp) --------------------------------------------------

std::string dims_string(Dims const& dims);
bool dims_equal(Dims const& a, Dims const& b);
int64_t volume(Dims const& dims);
bool has_dynamic(Dims const& dims);
// Bytes of one element; 0 for a type the stand-in does not run.
size_t element_bytes(DataType type);
char const* type_name(DataType type);

// One input or output of a network or an engine.
struct TensorInfo {
    std::string name;
    bool is_input = false;
    DataType type = DataType::kFLOAT;
    // -1 for a dynamic dimension.
    Dims dims{};
    // Outputs: bit i set when dimension i is data-dependent (known only when the engine
    // runs, as NonZero's count), not from the input shapes (builder.cpp finds them).
    uint32_t data_dependent = 0;
};

// Whether `t` is an output with a data-dependent dimension.
inline bool is_data_dependent(TensorInfo const& t) { return !t.is_input && t.data_dependent != 0; }

// One input's range in an optimisation profile.
struct ProfileRange {
    std::string name;
    Dims min{};
    Dims opt{};
    Dims max{};
};

// ---- the CUDA driver (cuda.cpp) -----------------------------------------------------
//
// The stand-in runs on celer's stand-in CUDA driver: it reaches it as the real
// libnvinfer's CUDA runtime does, by opening libcuda.so.1, and it queues each engine's
// execution there with celer_standin_enqueue_work (so that it runs in stream order,
// against device memory checked as a kernel's is).

struct CudaContextInfo {
    void* context = nullptr;
    int device = -1;
    int compute_capability = 0;  // major * 10 + minor
};

// The context current on this thread; false (and `why`) when there is none.
bool current_context(CudaContextInfo* out, std::string* why);
// The rule that an object TensorRT made in a CUDA context is destroyed with that context
// current (TensorRT frees its device memory through the current context: with none, or
// another GPU's, it would leak or free in the wrong place): `what` ("ICudaEngine `x`"),
// made (`made`: "deserialized", "created") in `home`, is being destroyed; a violation
// naming the rule when another context, or none, is current.
void check_destroyed_in(ILogger* logger, std::string const& what, char const* made, CudaContextInfo const& home);
// The rule that the process must be relaunched once a device's context is lost: after a
// context of `device` hit a sticky error or was reset (the stand-in driver records each
// loss) since TensorRT first worked on the device, a TensorRT call that touches the device
// (`what`: "enqueueV3 on a context of `x`", "ICudaEngine `x` destroyed: it") is a
// violation naming the rule ("the process must be terminated and relaunched to use CUDA
// again"), as the CUDA runtime inside TensorRT keeps state in that context. `Always`: any
// such call (making, deserializing, building, destroying). `Request`: a call of a run
// (enqueueV3, setting a shape, an address, memory or a profile) only once the calling
// thread has been told of the loss (the driver answered it the sticky error, or an
// enqueueV3 of it failed with it) or after a reset (which the caller made): before that it
// is how a run that began before the loss discovers it. True when the call may go on;
// false after the violation (log mode), when the call must do nothing more on the device.
enum class Touch { Always, Request };
bool device_usable(ILogger* logger, int device, std::string const& what, Touch touch = Touch::Always);
// An enqueueV3 of the calling thread has just reported `device`'s sticky error.
void told_of_loss(int device);
// Retains `device`'s primary context for the life of the process, once, as the CUDA
// runtime inside the real libnvinfer does (so that dropping the caller's references
// alone does not destroy a context TensorRT has used).
void hold_primary_context(int device);
// Device memory in the current context.
bool device_alloc(size_t bytes, uint64_t* out, std::string* why);
void device_free(uint64_t pointer);
bool copy_to_device(uint64_t destination, void const* source, size_t bytes, std::string* why);

struct WorkRange {
    uint64_t address;
    size_t bytes;
    bool writes;
    std::string what;
};
// Queues `run` on `stream` (see celer_standin_work.h). `run` returns "" on success or
// why it failed. `done` runs once after it, or when it is dropped. When the driver refuses
// it, `code` (if given) receives its CUresult: the context's sticky error, when it has one.
bool enqueue_work(void* stream, std::string const& label, std::vector<WorkRange> const& ranges,
                  std::function<std::string()> run, std::function<void()> done, std::string* why,
                  int* code = nullptr);
// Makes `context`'s error sticky with `code`, as a fault of a kernel launched there does
// (celer_standin_make_sticky).
bool make_sticky(void* context, int code, std::string const& message, std::string* why);
// cuStreamSynchronize: runs `stream`'s queued work; its CUresult.
int synchronize(void* stream);
// A CUresult's name (CUDA_ERROR_ILLEGAL_ADDRESS); as the CUDA runtime inside TensorRT
// reports a failed launch in its log ("Error Code 1: Cuda Runtime (an illegal memory access
// was encountered)"); whether it is one of the faults that make a context's error sticky.
std::string result_text(int code);
std::string cuda_runtime_error(int code);
bool is_sticky_error(int code);
constexpr int kCudaErrorIllegalAddress = 700;

// ---- ONNX Runtime (model.rs, through the C interface below) -------------------------

// A model loaded into ONNX Runtime by the Rust half of the stand-in.
class OrtModel {
public:
    // Loads `onnx`; null (and `why`) when ONNX Runtime refuses it.
    static OrtModel* load(std::vector<uint8_t> const& onnx, std::string* why);
    ~OrtModel();
    std::vector<TensorInfo> const& io() const { return io_; }
    // Runs the model. Inputs: `data` may be null (zeros, for shape inference). Outputs:
    // `dims` is filled with the shape found; `data` (when not null) receives the values and
    // must hold exactly the output's bytes.
    struct Binding {
        std::string name;
        DataType type;
        Dims dims;
        void* data;
        size_t bytes;
    };
    bool run(std::vector<Binding> const& inputs, std::vector<Binding>* outputs, std::string* why);

private:
    explicit OrtModel(void* handle) : handle_(handle) {}
    void* handle_;
    std::vector<TensorInfo> io_;
};

// ---- plans and timing caches (plan.cpp) ---------------------------------------------

// What a serialized engine records: what real plans are bound to (the TensorRT version,
// the compute capability), how it was built, and the network (the ONNX model itself).
struct Plan {
    // The network's name (the ONNX file's stem), for messages.
    std::string name;
    int32_t tensorrt_version = 0;
    int compute_capability = 0;
    uint32_t builder_flags = 0;  // BuilderFlags bits (kFP16, kBF16, ...)
    std::vector<TensorInfo> io;
    std::vector<std::vector<ProfileRange>> profiles;
    std::vector<uint8_t> onnx;
};

std::vector<uint8_t> serialize_plan(Plan const& plan);
// False, with `why`, for bytes that are not a stand-in plan.
bool parse_plan(void const* data, size_t size, Plan* out, std::string* why);

// The timing cache's contents: whose device and TensorRT, and the layers "timed" (one
// entry per model built, by its ONNX hash).
struct TimingCacheData {
    int32_t tensorrt_version = 0;
    int compute_capability = 0;
    std::vector<std::string> entries;
};
std::vector<uint8_t> serialize_timing_cache(TimingCacheData const& cache);
bool parse_timing_cache(void const* data, size_t size, TimingCacheData* out, std::string* why);

uint64_t fnv1a(void const* data, size_t bytes);

// ---- objects shared between files ---------------------------------------------------

// IHostMemory over bytes it owns (plans, serialized timing caches).
nvinfer1::IHostMemory* host_memory(std::vector<uint8_t> bytes);

// The network a parser fills (builder.cpp); the parser (parser.cpp) needs these.
class Network;
void network_attach_parser(Network* network);
void network_detach_parser(Network* network);
// Gives the network the model's inputs and outputs and its bytes.
void network_set_model(Network* network, std::string name, std::vector<TensorInfo> io, std::vector<uint8_t> onnx);
bool network_has_model(Network* network);
Network* as_network(nvinfer1::INetworkDefinition* network);

}  // namespace standin

// Entry points, called by the Rust half's exported factories (src/lib.rs), which are
// what the library exports: a Rust cdylib exports only Rust's own symbols.
extern "C" {
int32_t standin_cpp_library_version(void);
void* standin_cpp_create_runtime(void* logger, int32_t version);
void* standin_cpp_create_builder(void* logger, int32_t version);
void* standin_cpp_create_parser(void* network, void* logger, int32_t version);
int32_t standin_cpp_parser_version(void);
uint64_t standin_cpp_violations(void);
uint64_t standin_cpp_refusals(void);
}
