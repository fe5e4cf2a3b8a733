// celer_trt.cpp: celer's TensorRT shim, behind the C interface of celer_trt.h.
//
// It owns the run-time loading of libnvinfer / libnvonnxparser and the translation of
// TensorRT's C++ objects into C handles. It must never reference a TensorRT or CUDA
// symbol directly: TensorRT is reached only through the extern "C" factories found with
// dlsym, and everything else is a virtual call on the objects they return (the headers'
// inline wrappers are exactly that). Never call the headers' create* helpers: they
// reference the _INTERNAL symbols and would bring back the link-time dependency.
// scripts/check-tensorrt verifies this with `nm -u` on the object file.

#include "celer_trt.h"

#include <NvInfer.h>
#include <NvOnnxParser.h>

#include <dirent.h>
#include <dlfcn.h>

#include <atomic>
#include <cstring>
#include <exception>
#include <memory>
#include <stdexcept>
#include <string>

#if NV_TENSORRT_MAJOR < 10
#error "celer's TensorRT shim needs TensorRT 10 or newer headers (named I/O tensors, enqueueV3, Dims64)"
#endif

// setDeviceMemoryV2 / getDeviceMemorySizeV2 arrived in 10.1.
#define CELER_TRT_HAS_MEMORY_V2 (NV_TENSORRT_MAJOR > 10 || NV_TENSORRT_MINOR >= 1)

static_assert(CELER_TRT_MAX_DIMS == nvinfer1::Dims::MAX_DIMS, "celer_trt_dims must mirror nvinfer1::Dims");

namespace {

using nvinfer1::Dims;

constexpr int32_t kCompiledVersion = static_cast<int32_t>(NV_TENSORRT_VERSION);
constexpr int32_t kCompiledParserVersion = static_cast<int32_t>(NV_ONNX_PARSER_VERSION);

// ---- errors ----

// The message returned by celer_trt_last_error(), per thread.
thread_local std::string t_last_error;
// The last error TensorRT logged on this thread: TensorRT reports most failures through
// the logger and returns only false or null, so failures quote it.
thread_local std::string t_last_logged_error;

struct Failure : std::runtime_error {
    using std::runtime_error::runtime_error;
};

// A library that dlopen could not open: reported as CELER_TRT_NOT_FOUND so that callers
// can tell "TensorRT is not installed" from "TensorRT is broken".
struct NotFound : Failure {
    using Failure::Failure;
};

[[noreturn]] void fail(std::string message)
{
    if (!t_last_logged_error.empty())
    {
        message += " (TensorRT: " + t_last_logged_error + ")";
    }
    throw Failure(message);
}

void set_last_error(char const* message) noexcept
{
    try
    {
        t_last_error = message;
    }
    catch (...)
    {
        // Out of memory while recording an error: keep the previous message.
    }
}

// Runs `body`, turning every C++ exception into CELER_TRT_ERROR and a message.
template <typename Body>
celer_trt_status guarded(Body&& body) noexcept
{
    try
    {
        t_last_logged_error.clear();
        body();
        return CELER_TRT_OK;
    }
    catch (NotFound const& e)
    {
        set_last_error(e.what());
        return CELER_TRT_NOT_FOUND;
    }
    catch (std::exception const& e)
    {
        set_last_error(e.what());
    }
    catch (...)
    {
        set_last_error("unknown C++ exception in the TensorRT shim");
    }
    return CELER_TRT_ERROR;
}

void require(void const* pointer, char const* what)
{
    if (pointer == nullptr)
    {
        throw Failure(std::string("null argument: ") + what);
    }
}

// ---- logging ----

std::atomic<celer_trt_log_fn> g_log_fn{nullptr};

// TensorRT keeps one logger per process and calls it from its worker threads too, so
// this is a single immortal object that only reads an atomic.
class Logger final : public nvinfer1::ILogger
{
public:
    void log(Severity severity, nvinfer1::AsciiChar const* message) noexcept override
    {
        char const* text = message != nullptr ? message : "";
        if (severity <= Severity::kERROR)
        {
            try
            {
                t_last_logged_error = text;
            }
            catch (...)
            {
            }
        }
        if (celer_trt_log_fn fn = g_log_fn.load())
        {
            fn(static_cast<int32_t>(severity), text);
        }
    }
};

nvinfer1::ILogger* logger()
{
    // Leaked on purpose: TensorRT may log during its own static destruction.
    static Logger* instance = new Logger();
    return instance;
}

void log_warning(std::string const& message)
{
    if (celer_trt_log_fn fn = g_log_fn.load())
    {
        fn(CELER_TRT_SEVERITY_WARNING, message.c_str());
    }
}

// ---- versions ----

struct Version
{
    int32_t major;
    int32_t minor;
    int32_t patch;
};

// TensorRT 10+ encodes major * 10000 + minor * 100 + patch; 8.x and older used
// major * 1000 + minor * 100 + patch. Decoding both lets an old library be named exactly.
Version decode_version(int32_t v)
{
    if (v >= 10000)
    {
        return {v / 10000, (v / 100) % 100, v % 100};
    }
    return {v / 1000, (v / 100) % 10, v % 100};
}

std::string version_string(Version v)
{
    return std::to_string(v.major) + "." + std::to_string(v.minor) + "." + std::to_string(v.patch);
}

// Vtable slots move between major versions and methods are only appended within one, so
// the library must have the headers' major and at least their minor.
void check_version(std::string const& what, std::string const& file, int32_t found, int32_t compiled)
{
    Version f = decode_version(found);
    Version c = decode_version(compiled);
    if (f.major == c.major && f.minor >= c.minor)
    {
        return;
    }
    throw Failure(file + " is " + what + " " + version_string(f) + ", but celer was compiled against the " + what
        + " " + version_string(c) + " headers: it needs version " + std::to_string(c.major) + "."
        + std::to_string(c.minor) + " or a newer " + std::to_string(c.major)
        + ".x (the C++ interface changes across major versions). Install a matching TensorRT, point "
          "CELER_NVINFER_PATH / CELER_NVONNXPARSER_PATH at one, or rebuild celer with TENSORRT_INCLUDE_DIR set "
          "to the installed version's headers");
}

// ---- dynamic loading ----

using CreateFn = void* (*) (void* logger, int32_t version);
using CreateParserFn = void* (*) (void* network, void* logger, int version);
using VersionFn = int32_t (*)();
using ParserVersionFn = int (*)();
using SetInternalLibraryPathFn = bool (*)(char const* path);

void* open_library(char const* path)
{
    dlerror();
    // RTLD_NODELETE: TensorRT and the CUDA runtime inside it register exit handlers and
    // keep worker threads; unmapping their code while those exist would crash, so
    // closing a handle only drops the reference.
    void* handle = dlopen(path, RTLD_NOW | RTLD_LOCAL | RTLD_NODELETE);
    if (handle == nullptr)
    {
        char const* error = dlerror();
        std::string reason = error != nullptr ? error : "unknown error";
        // glibc's message usually starts with the name already.
        if (reason.find(path) == std::string::npos)
        {
            reason = std::string(path) + ": " + reason;
        }
        throw NotFound("cannot open " + reason);
    }
    return handle;
}

template <typename Fn>
Fn find_symbol(void* handle, char const* name, std::string const& file)
{
    dlerror();
    void* address = dlsym(handle, name);
    if (address == nullptr)
    {
        throw Failure(file + " has no entry point " + name + ": it is not a TensorRT " + std::to_string(NV_TENSORRT_MAJOR)
            + ".x library, or it is incomplete");
    }
    return reinterpret_cast<Fn>(address);
}

// The file the dynamic loader picked for the object holding `address`.
std::string resolved_path(void const* address, char const* fallback)
{
    Dl_info info{};
    if (dladdr(address, &info) != 0 && info.dli_fname != nullptr && info.dli_fname[0] != '\0')
    {
        return info.dli_fname;
    }
    return fallback;
}

std::string directory_of(std::string const& file)
{
    std::size_t slash = file.rfind('/');
    return slash == std::string::npos ? std::string() : file.substr(0, slash);
}

bool has_builder_resource(std::string const& dir)
{
    DIR* d = opendir(dir.c_str());
    if (d == nullptr)
    {
        return false;
    }
    bool found = false;
    while (dirent* entry = readdir(d))
    {
        if (std::strncmp(entry->d_name, "libnvinfer_builder_resource", 27) == 0)
        {
            found = true;
            break;
        }
    }
    closedir(d);
    return found;
}

// ---- conversions ----

celer_trt_dims to_c(Dims const& dims)
{
    celer_trt_dims out{};
    out.nb_dims = dims.nbDims;
    for (int32_t i = 0; i < CELER_TRT_MAX_DIMS; ++i)
    {
        out.d[i] = (i < dims.nbDims) ? dims.d[i] : 0;
    }
    return out;
}

Dims to_trt(celer_trt_dims const& dims, char const* what)
{
    if (dims.nb_dims < 0 || dims.nb_dims > CELER_TRT_MAX_DIMS)
    {
        throw Failure(std::string(what) + ": a shape needs 0 to " + std::to_string(CELER_TRT_MAX_DIMS)
            + " dimensions, got " + std::to_string(dims.nb_dims));
    }
    Dims out{};
    out.nbDims = dims.nb_dims;
    for (int32_t i = 0; i < dims.nb_dims; ++i)
    {
        out.d[i] = dims.d[i];
    }
    return out;
}

// nvinfer1::DataType has the same values 0..11 in TensorRT 10 and 11 (celer_trt.h
// mirrors them); anything newer is reported as unknown rather than guessed.
int32_t to_c(nvinfer1::DataType type)
{
    auto value = static_cast<int32_t>(type);
    return (value >= CELER_TRT_FLOAT && value <= CELER_TRT_E8M0) ? value : CELER_TRT_UNKNOWN_TYPE;
}

std::string shape_string(celer_trt_dims const& dims)
{
    std::string s = "[";
    for (int32_t i = 0; i < dims.nb_dims && i < CELER_TRT_MAX_DIMS; ++i)
    {
        s += (i ? "x" : "") + std::to_string(dims.d[i]);
    }
    return s + "]";
}

// Reports IProgressMonitor callbacks to a C function.
class ProgressMonitor final : public nvinfer1::IProgressMonitor
{
public:
    ProgressMonitor(celer_trt_progress_fn fn, void* user)
        : mFn(fn)
        , mUser(user)
    {
    }

    void phaseStart(char const* phase, char const* parent, int32_t nbSteps) noexcept override
    {
        mFn(mUser, CELER_TRT_PHASE_START, phase, parent, 0, nbSteps);
    }

    bool stepComplete(char const* phase, int32_t step) noexcept override
    {
        return mFn(mUser, CELER_TRT_PHASE_STEP, phase, nullptr, step, 0) != 0;
    }

    void phaseFinish(char const* phase) noexcept override
    {
        mFn(mUser, CELER_TRT_PHASE_FINISH, phase, nullptr, 0, 0);
    }

private:
    celer_trt_progress_fn mFn;
    void* mUser;
};

} // namespace

// ---- the handles behind the C interface ----

struct celer_trt_library
{
    void* nvinfer = nullptr;
    void* nvonnxparser = nullptr;
    int32_t version = 0;
    int32_t parser_version = -1;
    std::string resolved;
    CreateFn create_runtime = nullptr;
    CreateFn create_builder = nullptr;
    CreateParserFn create_parser = nullptr;

    ~celer_trt_library()
    {
        if (nvonnxparser != nullptr)
        {
            dlclose(nvonnxparser);
        }
        if (nvinfer != nullptr)
        {
            dlclose(nvinfer);
        }
    }
};

struct celer_trt_runtime
{
    std::unique_ptr<nvinfer1::IRuntime> runtime;
};

struct celer_trt_engine
{
    std::unique_ptr<nvinfer1::ICudaEngine> engine;
};

struct celer_trt_context
{
    std::unique_ptr<nvinfer1::IExecutionContext> context;
};

struct celer_trt_network
{
    // Members are destroyed in reverse order: the parser before the network (it holds
    // it), the network before its builder, and the timing cache after every builder
    // that used it.
    std::unique_ptr<nvinfer1::ITimingCache> timing_cache;
    std::unique_ptr<nvinfer1::IBuilder> builder;
    std::unique_ptr<nvinfer1::INetworkDefinition> network;
    std::unique_ptr<nvonnxparser::IParser> parser;
};

struct celer_trt_blob
{
    std::unique_ptr<nvinfer1::IHostMemory> memory;
};

// ---- the C interface ----

extern "C" {

char const* celer_trt_last_error(void)
{
    return t_last_error.c_str();
}

int32_t celer_trt_compiled_version(void)
{
    return kCompiledVersion;
}

int32_t celer_trt_compiled_parser_version(void)
{
    return kCompiledParserVersion;
}

celer_trt_status celer_trt_library_open(char const* path, celer_trt_log_fn log, celer_trt_library** out)
{
    return guarded([&] {
        require(path, "path");
        require(out, "out");
        *out = nullptr;
        auto lib = std::make_unique<celer_trt_library>();
        lib->nvinfer = open_library(path);
        auto get_version = find_symbol<VersionFn>(lib->nvinfer, "getInferLibVersion", path);
        lib->resolved = resolved_path(reinterpret_cast<void const*>(get_version), path);
        lib->version = get_version();
        check_version("TensorRT", lib->resolved, lib->version, kCompiledVersion);
        lib->create_runtime = find_symbol<CreateFn>(lib->nvinfer, "createInferRuntime_INTERNAL", lib->resolved);
        lib->create_builder = find_symbol<CreateFn>(lib->nvinfer, "createInferBuilder_INTERNAL", lib->resolved);
        g_log_fn.store(log);
        // From 10.16 the builder can be told where libnvinfer_builder_resource lives;
        // without it that library must be on the loader's path, which a library opened
        // by file path (CELER_NVINFER_PATH) does not guarantee.
        std::string dir = directory_of(lib->resolved);
        dlerror();
        if (auto set_path = reinterpret_cast<SetInternalLibraryPathFn>(dlsym(lib->nvinfer, "setInternalLibraryPath")))
        {
            if (!dir.empty() && has_builder_resource(dir) && !set_path(dir.c_str()))
            {
                log_warning("setInternalLibraryPath(" + dir + ") failed");
            }
        }
        *out = lib.release();
    });
}

celer_trt_status celer_trt_library_open_parser(celer_trt_library* lib, char const* path)
{
    return guarded([&] {
        require(lib, "lib");
        require(path, "path");
        if (lib->nvonnxparser != nullptr)
        {
            return;
        }
        void* handle = open_library(path);
        std::unique_ptr<void, int (*)(void*)> guard(handle, dlclose);
        auto get_version = find_symbol<ParserVersionFn>(handle, "getNvOnnxParserVersion", path);
        std::string resolved = resolved_path(reinterpret_cast<void const*>(get_version), path);
        int32_t version = get_version();
        check_version("ONNX parser", resolved, version, kCompiledParserVersion);
        auto create = find_symbol<CreateParserFn>(handle, "createNvOnnxParser_INTERNAL", resolved);
        // The parser calls into the libnvinfer it was linked with (by soname). It must be
        // the one opened here, or two TensorRTs would share objects.
        dlerror();
        void* its_version_fn = dlsym(handle, "getInferLibVersion");
        void* our_version_fn = dlsym(lib->nvinfer, "getInferLibVersion");
        if (its_version_fn == nullptr)
        {
            throw Failure(resolved + " does not link libnvinfer: it is not TensorRT's ONNX parser");
        }
        if (its_version_fn != our_version_fn)
        {
            throw Failure(resolved + " is linked with " + resolved_path(its_version_fn, "another libnvinfer")
                + ", not with the opened " + lib->resolved + "; use the ONNX parser of the same TensorRT installation");
        }
        lib->nvonnxparser = guard.release();
        lib->parser_version = version;
        lib->create_parser = create;
    });
}

int32_t celer_trt_library_version(celer_trt_library const* lib)
{
    return lib != nullptr ? lib->version : -1;
}

int32_t celer_trt_library_parser_version(celer_trt_library const* lib)
{
    return lib != nullptr ? lib->parser_version : -1;
}

char const* celer_trt_library_resolved_path(celer_trt_library const* lib)
{
    return lib != nullptr ? lib->resolved.c_str() : "";
}

void celer_trt_library_close(celer_trt_library* lib)
{
    delete lib;
}

// ---- running engines ----

celer_trt_status celer_trt_runtime_create(celer_trt_library* lib, celer_trt_runtime** out)
{
    return guarded([&] {
        require(lib, "lib");
        require(out, "out");
        *out = nullptr;
        auto* runtime = static_cast<nvinfer1::IRuntime*>(lib->create_runtime(logger(), kCompiledVersion));
        if (runtime == nullptr)
        {
            fail("createInferRuntime_INTERNAL in " + lib->resolved + " returned no runtime");
        }
        auto handle = std::make_unique<celer_trt_runtime>();
        handle->runtime.reset(runtime);
        *out = handle.release();
    });
}

void celer_trt_runtime_destroy(celer_trt_runtime* runtime)
{
    delete runtime;
}

celer_trt_status celer_trt_engine_deserialize(
    celer_trt_runtime* runtime, void const* plan, size_t plan_size, celer_trt_engine** out)
{
    return guarded([&] {
        require(runtime, "runtime");
        require(plan, "plan");
        require(out, "out");
        *out = nullptr;
        nvinfer1::ICudaEngine* engine = runtime->runtime->deserializeCudaEngine(plan, plan_size);
        if (engine == nullptr)
        {
            fail("TensorRT could not deserialize the plan (" + std::to_string(plan_size)
                + " bytes): built by another TensorRT version or for another GPU, or no CUDA device is current");
        }
        auto handle = std::make_unique<celer_trt_engine>();
        handle->engine.reset(engine);
        *out = handle.release();
    });
}

void celer_trt_engine_destroy(celer_trt_engine* engine)
{
    delete engine;
}

celer_trt_status celer_trt_engine_io_count(celer_trt_engine const* engine, int32_t* out)
{
    return guarded([&] {
        require(engine, "engine");
        require(out, "out");
        *out = engine->engine->getNbIOTensors();
    });
}

celer_trt_status celer_trt_engine_io_tensor(celer_trt_engine const* engine, int32_t index, celer_trt_tensor_desc* out)
{
    return guarded([&] {
        require(engine, "engine");
        require(out, "out");
        nvinfer1::ICudaEngine& e = *engine->engine;
        if (index < 0 || index >= e.getNbIOTensors())
        {
            throw Failure("no I/O tensor at index " + std::to_string(index));
        }
        char const* name = e.getIOTensorName(index);
        if (name == nullptr)
        {
            fail("getIOTensorName(" + std::to_string(index) + ") returned null");
        }
        out->name = name;
        out->is_input = e.getTensorIOMode(name) == nvinfer1::TensorIOMode::kINPUT ? 1 : 0;
        out->data_type = to_c(e.getTensorDataType(name));
        out->shape = to_c(e.getTensorShape(name));
    });
}

celer_trt_status celer_trt_engine_profile_count(celer_trt_engine const* engine, int32_t* out)
{
    return guarded([&] {
        require(engine, "engine");
        require(out, "out");
        *out = engine->engine->getNbOptimizationProfiles();
    });
}

celer_trt_status celer_trt_engine_profile_shape(celer_trt_engine const* engine, char const* name, int32_t profile,
    celer_trt_dims* min, celer_trt_dims* opt, celer_trt_dims* max)
{
    return guarded([&] {
        require(engine, "engine");
        require(name, "name");
        require(min, "min");
        require(opt, "opt");
        require(max, "max");
        nvinfer1::ICudaEngine& e = *engine->engine;
        *min = to_c(e.getProfileShape(name, profile, nvinfer1::OptProfileSelector::kMIN));
        *opt = to_c(e.getProfileShape(name, profile, nvinfer1::OptProfileSelector::kOPT));
        *max = to_c(e.getProfileShape(name, profile, nvinfer1::OptProfileSelector::kMAX));
        if (min->nb_dims < 0)
        {
            fail(std::string("no profile shape for input ") + name + " in profile " + std::to_string(profile));
        }
    });
}

celer_trt_status celer_trt_engine_device_memory_size(celer_trt_engine const* engine, int64_t* out)
{
    return guarded([&] {
        require(engine, "engine");
        require(out, "out");
#if CELER_TRT_HAS_MEMORY_V2
        *out = engine->engine->getDeviceMemorySizeV2();
#else
        *out = static_cast<int64_t>(engine->engine->getDeviceMemorySize());
#endif
    });
}

celer_trt_status celer_trt_context_create(celer_trt_engine* engine, int32_t user_managed_memory, celer_trt_context** out)
{
    return guarded([&] {
        require(engine, "engine");
        require(out, "out");
        *out = nullptr;
        auto strategy = user_managed_memory != 0 ? nvinfer1::ExecutionContextAllocationStrategy::kUSER_MANAGED
                                                 : nvinfer1::ExecutionContextAllocationStrategy::kSTATIC;
        nvinfer1::IExecutionContext* context = engine->engine->createExecutionContext(strategy);
        if (context == nullptr)
        {
            fail("createExecutionContext failed (out of device memory?)");
        }
        auto handle = std::make_unique<celer_trt_context>();
        handle->context.reset(context);
        *out = handle.release();
    });
}

void celer_trt_context_destroy(celer_trt_context* context)
{
    delete context;
}

celer_trt_status celer_trt_context_set_device_memory(celer_trt_context* context, void* memory, int64_t size)
{
    return guarded([&] {
        require(context, "context");
#if CELER_TRT_HAS_MEMORY_V2
        context->context->setDeviceMemoryV2(memory, size);
#else
        int64_t needed = static_cast<int64_t>(context->context->getEngine().getDeviceMemorySize());
        if (size < needed)
        {
            throw Failure("device memory of " + std::to_string(size) + " bytes given, the engine needs "
                + std::to_string(needed));
        }
        context->context->setDeviceMemory(memory);
#endif
        if (!t_last_logged_error.empty())
        {
            fail("setDeviceMemory failed");
        }
    });
}

celer_trt_status celer_trt_context_set_optimization_profile(celer_trt_context* context, int32_t profile, void* cuda_stream)
{
    return guarded([&] {
        require(context, "context");
        if (!context->context->setOptimizationProfileAsync(profile, static_cast<cudaStream_t>(cuda_stream)))
        {
            fail("setOptimizationProfileAsync(" + std::to_string(profile) + ") failed");
        }
    });
}

celer_trt_status celer_trt_context_set_input_shape(celer_trt_context* context, char const* name, celer_trt_dims const* shape)
{
    return guarded([&] {
        require(context, "context");
        require(name, "name");
        require(shape, "shape");
        if (!context->context->setInputShape(name, to_trt(*shape, name)))
        {
            fail(std::string("setInputShape(") + name + ", " + shape_string(*shape) + ") failed");
        }
    });
}

celer_trt_status celer_trt_context_tensor_shape(celer_trt_context const* context, char const* name, celer_trt_dims* out)
{
    return guarded([&] {
        require(context, "context");
        require(name, "name");
        require(out, "out");
        *out = to_c(context->context->getTensorShape(name));
        if (out->nb_dims < 0)
        {
            fail(std::string("no tensor named ") + name + " (or its shape depends on unset input shapes)");
        }
    });
}

celer_trt_status celer_trt_context_set_tensor_address(celer_trt_context* context, char const* name, void* address)
{
    return guarded([&] {
        require(context, "context");
        require(name, "name");
        if (!context->context->setTensorAddress(name, address))
        {
            fail(std::string("setTensorAddress(") + name + ") failed");
        }
    });
}

celer_trt_status celer_trt_context_enqueue(celer_trt_context* context, void* cuda_stream)
{
    return guarded([&] {
        require(context, "context");
        if (!context->context->enqueueV3(static_cast<cudaStream_t>(cuda_stream)))
        {
            fail("enqueueV3 failed");
        }
    });
}

// ---- building engines ----

celer_trt_status celer_trt_network_parse(celer_trt_library* lib, char const* onnx_path, celer_trt_network** out)
{
    return guarded([&] {
        require(lib, "lib");
        require(onnx_path, "onnx_path");
        require(out, "out");
        *out = nullptr;
        if (lib->create_parser == nullptr)
        {
            throw Failure("the ONNX parser library is not open (celer_trt_library_open_parser)");
        }
        auto handle = std::make_unique<celer_trt_network>();
        handle->builder.reset(static_cast<nvinfer1::IBuilder*>(lib->create_builder(logger(), kCompiledVersion)));
        if (!handle->builder)
        {
            fail("createInferBuilder_INTERNAL in " + lib->resolved + " returned no builder (is a CUDA device present?)");
        }
        // Flags 0: networks are explicit-batch in 10.x (the flag is deprecated and ignored)
        // and always strongly typed in 11.x.
        handle->network.reset(handle->builder->createNetworkV2(0));
        if (!handle->network)
        {
            fail("createNetworkV2 failed");
        }
        handle->parser.reset(
            static_cast<nvonnxparser::IParser*>(lib->create_parser(handle->network.get(), logger(), kCompiledParserVersion)));
        if (!handle->parser)
        {
            fail("createNvOnnxParser_INTERNAL returned no parser");
        }
        if (!handle->parser->parseFromFile(onnx_path, static_cast<int>(nvinfer1::ILogger::Severity::kWARNING)))
        {
            std::string message = std::string("cannot parse ") + onnx_path + " into a TensorRT network";
            int32_t n = handle->parser->getNbErrors();
            for (int32_t i = 0; i < n; ++i)
            {
                if (nvonnxparser::IParserError const* error = handle->parser->getError(i))
                {
                    message += (i == 0 ? ": " : "; ");
                    message += error->desc() != nullptr ? error->desc() : "?";
                    if (error->nodeName() != nullptr && error->nodeName()[0] != '\0')
                    {
                        message += std::string(" (node ") + error->nodeName() + ")";
                    }
                }
            }
            throw Failure(message);
        }
        *out = handle.release();
    });
}

void celer_trt_network_destroy(celer_trt_network* network)
{
    delete network;
}

celer_trt_status celer_trt_network_io_count(celer_trt_network const* network, int32_t* inputs, int32_t* outputs)
{
    return guarded([&] {
        require(network, "network");
        require(inputs, "inputs");
        require(outputs, "outputs");
        *inputs = network->network->getNbInputs();
        *outputs = network->network->getNbOutputs();
    });
}

celer_trt_status celer_trt_network_io_tensor(
    celer_trt_network const* network, int32_t is_input, int32_t index, celer_trt_tensor_desc* out)
{
    return guarded([&] {
        require(network, "network");
        require(out, "out");
        nvinfer1::INetworkDefinition& n = *network->network;
        int32_t count = is_input != 0 ? n.getNbInputs() : n.getNbOutputs();
        if (index < 0 || index >= count)
        {
            throw Failure(std::string("no network ") + (is_input != 0 ? "input" : "output") + " at index "
                + std::to_string(index));
        }
        nvinfer1::ITensor* tensor = is_input != 0 ? n.getInput(index) : n.getOutput(index);
        if (tensor == nullptr)
        {
            fail("the network returned no tensor at index " + std::to_string(index));
        }
        out->name = tensor->getName();
        out->is_input = is_input != 0 ? 1 : 0;
        out->data_type = to_c(tensor->getType());
        out->shape = to_c(tensor->getDimensions());
    });
}

celer_trt_status celer_trt_network_build(celer_trt_network* network, celer_trt_build_options const* options,
    celer_trt_profile_entry const* profile, size_t profile_len, celer_trt_blob** plan, celer_trt_blob** timing_cache)
{
    return guarded([&] {
        require(network, "network");
        require(options, "options");
        require(plan, "plan");
        require(timing_cache, "timing_cache");
        if (profile_len > 0)
        {
            require(profile, "profile");
        }
        *plan = nullptr;
        *timing_cache = nullptr;
        nvinfer1::IBuilder& builder = *network->builder;
        // Declared before the config: the config refers to it until it is destroyed.
        ProgressMonitor monitor(options->progress, options->progress_user);
        std::unique_ptr<nvinfer1::IBuilderConfig> config(builder.createBuilderConfig());
        if (!config)
        {
            fail("createBuilderConfig failed");
        }
        if (options->workspace_bytes > 0)
        {
            config->setMemoryPoolLimit(nvinfer1::MemoryPoolType::kWORKSPACE, static_cast<std::size_t>(options->workspace_bytes));
        }
#if NV_TENSORRT_MAJOR >= 11
        if (options->precision != CELER_TRT_PRECISION_FROM_MODEL)
        {
            throw Failure("TensorRT 11 builds strongly typed networks: the precision comes from the ONNX model's "
                          "types and cannot be set by a builder flag");
        }
#else
        switch (options->precision)
        {
        case CELER_TRT_PRECISION_FP32: break;
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
        // Deprecated in 10.16 in favour of strongly typed networks, still honoured in 10.x.
        case CELER_TRT_PRECISION_FP16: config->setFlag(nvinfer1::BuilderFlag::kFP16); break;
        case CELER_TRT_PRECISION_BF16: config->setFlag(nvinfer1::BuilderFlag::kBF16); break;
#pragma GCC diagnostic pop
        default:
            throw Failure("TensorRT 10 needs an explicit precision (fp32, fp16 or bf16), got "
                + std::to_string(options->precision));
        }
#endif
        if (profile_len > 0)
        {
            nvinfer1::IOptimizationProfile* p = builder.createOptimizationProfile();
            if (p == nullptr)
            {
                fail("createOptimizationProfile failed");
            }
            for (size_t i = 0; i < profile_len; ++i)
            {
                celer_trt_profile_entry const& entry = profile[i];
                require(entry.name, "profile entry name");
                std::string range = shape_string(entry.min) + " / " + shape_string(entry.opt) + " / " + shape_string(entry.max);
                if (!p->setDimensions(entry.name, nvinfer1::OptProfileSelector::kMIN, to_trt(entry.min, entry.name))
                    || !p->setDimensions(entry.name, nvinfer1::OptProfileSelector::kOPT, to_trt(entry.opt, entry.name))
                    || !p->setDimensions(entry.name, nvinfer1::OptProfileSelector::kMAX, to_trt(entry.max, entry.name)))
                {
                    fail(std::string("invalid optimisation profile for input ") + entry.name + " (min/opt/max " + range + ")");
                }
            }
            if (config->addOptimizationProfile(p) < 0)
            {
                fail("addOptimizationProfile failed");
            }
        }
        // A cache from another GPU or TensorRT version is refused by setTimingCache; the
        // build then starts from an empty one rather than failing.
        bool restored = false;
        if (options->timing_cache != nullptr && options->timing_cache_size > 0)
        {
            std::unique_ptr<nvinfer1::ITimingCache> cache(
                config->createTimingCache(options->timing_cache, options->timing_cache_size));
            if (cache && config->setTimingCache(*cache, false))
            {
                network->timing_cache = std::move(cache);
                restored = true;
            }
            else
            {
                log_warning("the saved timing cache does not fit this GPU or TensorRT version; starting a new one");
                t_last_logged_error.clear();
            }
        }
        if (!restored)
        {
            std::unique_ptr<nvinfer1::ITimingCache> cache(config->createTimingCache(nullptr, 0));
            if (!cache || !config->setTimingCache(*cache, false))
            {
                fail("cannot create a timing cache");
            }
            network->timing_cache = std::move(cache);
        }
        if (options->progress != nullptr)
        {
            config->setProgressMonitor(&monitor);
        }
        std::unique_ptr<nvinfer1::IHostMemory> serialized(builder.buildSerializedNetwork(*network->network, *config));
        config->setProgressMonitor(nullptr);
        if (!serialized || serialized->size() == 0)
        {
            fail("buildSerializedNetwork failed");
        }
        auto cache_blob = std::make_unique<celer_trt_blob>();
        if (nvinfer1::ITimingCache const* used = config->getTimingCache())
        {
            cache_blob->memory.reset(used->serialize());
        }
        auto plan_blob = std::make_unique<celer_trt_blob>();
        plan_blob->memory = std::move(serialized);
        *plan = plan_blob.release();
        *timing_cache = cache_blob->memory ? cache_blob.release() : nullptr;
    });
}

void const* celer_trt_blob_data(celer_trt_blob const* blob)
{
    return (blob != nullptr && blob->memory) ? blob->memory->data() : nullptr;
}

size_t celer_trt_blob_size(celer_trt_blob const* blob)
{
    return (blob != nullptr && blob->memory) ? blob->memory->size() : 0;
}

void celer_trt_blob_destroy(celer_trt_blob* blob)
{
    delete blob;
}

} // extern "C"
