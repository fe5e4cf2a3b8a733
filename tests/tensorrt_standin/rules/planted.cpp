// A test harness of planted misuses: each scenario runs the TensorRT life of an engine as
// the headers document it (build a network from an ONNX model, deserialize the plan, run
// a context on a stream, destroy everything child first) with one rule broken, so that
// tests/tensorrt_standin_rules.rs can see the stand-in TensorRT catch each one; the
// scenario `ok` breaks none and must pass. Compiled by that test against the same
// TensorRT headers as the stand-in; it reaches TensorRT through the factories (dlopen),
// as celer's shim does, and the CUDA driver through dlopen too.
//
// The scenarios `data-dependent-*` run MODEL.onnx = onnx/fixtures/prob-nonzero.onnx (an
// output of data-dependent shape) instead of seg3.onnx; `enqueue-sticky` is `ok` with the
// stand-in's fault file armed by the test. Once the context is lost (`enqueue-sticky`,
// `sticky-context`) the harness makes no TensorRT call again, as a process must that will
// be relaunched: it leaves its objects alive and exits; `told-then-enqueue`,
// `sticky-then-destroy` and `reset-then-deserialize` break that rule.
//
// Usage: planted SCENARIO LIBCUDA LIBNVINFER LIBNVONNXPARSER MODEL.onnx [PLAN]
// Prints every TensorRT log message as "LOG <severity> <message>" and each failed call as
// "FAILED <call>"; exits 0 when every call succeeded, 3 when one failed (the stand-in
// aborts the process itself on a broken lifetime rule).
#include <NvInfer.h>
#include <NvOnnxParser.h>

#include <dlfcn.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <iterator>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace {

using CUresult = int;
using CUdeviceptr = unsigned long long;

struct Cuda {
    CUresult (*init)(unsigned);
    CUresult (*retain)(void**, int);
    CUresult (*reset)(int);
    CUresult (*set_current)(void*);
    CUresult (*stream_create)(void**, unsigned);
    CUresult (*stream_sync)(void*);
    CUresult (*mem_alloc)(CUdeviceptr*, size_t);
    CUresult (*mem_free)(CUdeviceptr);
    CUresult (*htod)(CUdeviceptr, void const*, size_t);
    CUresult (*dtoh)(void*, CUdeviceptr, size_t);
    int (*set_hazards)(int);  // the stand-in's controls (driver.cpp)
    int (*make_sticky)(void*, int, char const*);
};

void* symbol(void* lib, char const* name) {
    void* s = dlsym(lib, name);
    if (s == nullptr) {
        std::printf("harness: no %s\n", name);
        std::exit(2);
    }
    return s;
}

template <typename Fn>
void bind(Fn*& slot, void* lib, char const* name) {
    slot = reinterpret_cast<Fn*>(symbol(lib, name));
}

class Logger : public nvinfer1::ILogger {
public:
    void log(Severity severity, char const* message) noexcept override {
        static char const* names[] = {"INTERNAL_ERROR", "ERROR", "WARNING", "INFO", "VERBOSE"};
        if (severity <= Severity::kWARNING) std::printf("LOG %s %s\n", names[int(severity)], message);
        std::fflush(stdout);
    }
};

int g_failed = 0;

bool check(bool ok, char const* call) {
    if (!ok) {
        std::printf("FAILED %s\n", call);
        std::fflush(stdout);
        g_failed = 1;
    }
    return ok;
}

// Destroys `objects` in the order given (child first, as TensorRT documents), except that
// the one named `late` goes after the one that follows it: the planted misuse.
void destroy_in_order(std::vector<std::pair<std::string, std::function<void()>>> objects, std::string const& late) {
    for (size_t i = 0; i + 1 < objects.size(); ++i) {
        if (objects[i].first == late) std::swap(objects[i], objects[i + 1]);
    }
    for (auto& object : objects) object.second();
}

nvinfer1::Dims dims4(int64_t n) {
    nvinfer1::Dims d{};
    d.nbDims = 4;
    d.d[0] = n;
    d.d[1] = 3;
    d.d[2] = 64;
    d.d[3] = 64;
    return d;
}

// An IOutputAllocator as the headers describe it: memory of the size asked for (kept, and
// reused while big enough), and the shape TensorRT reports.
class OutputAllocator : public nvinfer1::IOutputAllocator {
public:
    explicit OutputAllocator(Cuda& cu) : cu_(cu) {}
    ~OutputAllocator() override {
        if (memory != 0) cu_.mem_free(memory);
    }
    void* reallocateOutputAsync(char const*, void*, uint64_t size, uint64_t, cudaStream_t) noexcept override {
        if (size > bytes) {
            if (memory != 0) cu_.mem_free(memory);
            memory = 0;
            bytes = 0;
            if (cu_.mem_alloc(&memory, size) != 0) return nullptr;
            bytes = size;
        }
        return reinterpret_cast<void*>(memory);
    }
    void notifyShape(char const*, nvinfer1::Dims const& dims) noexcept override { shape = dims; }

    CUdeviceptr memory = 0;
    uint64_t bytes = 0;
    nvinfer1::Dims shape{};

private:
    Cuda& cu_;
};

// prob-nonzero.onnx's engine (`mask`, and `foreground`: the indices of the pixels whose
// mask is over 0.5, of data-dependent shape [4, n]) on an image bright in its left half:
// n = 64 * 32. `data-dependent-no-allocator` binds `foreground` to a buffer by address
// alone (planted: the engine would write past it); `data-dependent-allocator` gives it an
// output allocator, as the headers ask.
int data_dependent(std::string const& scenario, Cuda& cu, nvinfer1::IRuntime* runtime, std::vector<char> const& plan,
                   void* stream) {
    nvinfer1::ICudaEngine* engine = runtime->deserializeCudaEngine(plan.data(), plan.size());
    if (!check(engine != nullptr, "deserializeCudaEngine")) return 3;
    auto* context = engine->createExecutionContext(nvinfer1::ExecutionContextAllocationStrategy::kUSER_MANAGED);
    if (!check(context != nullptr, "createExecutionContext")) return 3;
    int64_t memory_bytes = engine->getDeviceMemorySizeV2();
    int const n = 64 * 32;
    CUdeviceptr memory = 0, image = 0, mask = 0, buffer = 0;
    cu.mem_alloc(&memory, size_t(memory_bytes));
    cu.mem_alloc(&image, 3 * 64 * 64 * sizeof(float));
    cu.mem_alloc(&mask, 64 * 64 * sizeof(float));
    cu.mem_alloc(&buffer, 256);
    context->setDeviceMemoryV2(reinterpret_cast<void*>(memory), memory_bytes);
    check(context->setInputShape("image", dims4(1)), "setInputShape");
    nvinfer1::Dims shape = context->getTensorShape("foreground");
    std::printf("SHAPE foreground %d dims: %lld x %lld\n", shape.nbDims, (long long)shape.d[0], (long long)shape.d[1]);
    check(shape.nbDims == 2 && shape.d[0] == 4 && shape.d[1] == -1, "getTensorShape(foreground) is [4x-1]");
    std::vector<float> pixels(3 * 64 * 64);
    for (size_t i = 0; i < pixels.size(); ++i) pixels[i] = (i % 64) < 32 ? 0.9f : 0.1f;
    cu.htod(image, pixels.data(), pixels.size() * sizeof(float));
    check(context->setTensorAddress("image", reinterpret_cast<void*>(image)), "setTensorAddress(image)");
    check(context->setTensorAddress("mask", reinterpret_cast<void*>(mask)), "setTensorAddress(mask)");
    OutputAllocator allocator(cu);
    if (scenario == "data-dependent-no-allocator") {
        // Planted: 256 bytes bound by address alone; the output comes out 64 KiB.
        check(context->setTensorAddress("foreground", reinterpret_cast<void*>(buffer)), "setTensorAddress(foreground)");
    } else {
        check(context->setOutputAllocator("foreground", &allocator), "setOutputAllocator(foreground)");
    }
    check(context->enqueueV3(static_cast<cudaStream_t>(stream)), "enqueueV3");
    check(cu.stream_sync(stream) == 0, "cuStreamSynchronize");
    if (!g_failed) {
        check(allocator.shape.nbDims == 2 && allocator.shape.d[0] == 4 && allocator.shape.d[1] == n,
              "notifyShape(foreground) is [4x2048]");
        std::vector<int64_t> indices(4 * size_t(n), -1);
        cu.dtoh(indices.data(), allocator.memory, indices.size() * sizeof(int64_t));
        // Row 2 is each pixel's y, row 3 its x: (0, 0), (0, 1), ... (0, 31), (1, 0), ...
        check(indices[0] == 0 && indices[2 * n + 33] == 1 && indices[3 * n + 33] == 1 && indices[3 * n + 31] == 31,
              "the foreground's indices");
    }
    delete context;
    delete engine;
    for (CUdeviceptr p : {memory, image, mask, buffer}) cu.mem_free(p);
    std::printf("DONE %s\n", g_failed ? "with failures" : "ok");
    return g_failed ? 3 : 0;
}

}  // namespace

int main(int argc, char** argv) {
    if (argc < 6) {
        std::printf("usage: planted SCENARIO LIBCUDA LIBNVINFER LIBNVONNXPARSER MODEL.onnx [PLAN]\n");
        return 2;
    }
    std::string scenario = argv[1];
    char const* plan_file = argc > 6 ? argv[6] : nullptr;
    void* libcuda = dlopen(argv[2], RTLD_NOW | RTLD_GLOBAL);
    void* nvinfer = dlopen(argv[3], RTLD_NOW | RTLD_LOCAL);
    void* nvonnxparser = dlopen(argv[4], RTLD_NOW | RTLD_LOCAL);
    if (libcuda == nullptr || nvinfer == nullptr || nvonnxparser == nullptr) {
        std::printf("harness: dlopen: %s\n", dlerror());
        return 2;
    }
    Cuda cu{};
    bind(cu.init, libcuda, "cuInit");
    bind(cu.retain, libcuda, "cuDevicePrimaryCtxRetain");
    bind(cu.reset, libcuda, "cuDevicePrimaryCtxReset_v2");
    bind(cu.set_current, libcuda, "cuCtxSetCurrent");
    bind(cu.stream_create, libcuda, "cuStreamCreate");
    bind(cu.stream_sync, libcuda, "cuStreamSynchronize");
    bind(cu.mem_alloc, libcuda, "cuMemAlloc_v2");
    bind(cu.mem_free, libcuda, "cuMemFree_v2");
    bind(cu.htod, libcuda, "cuMemcpyHtoD_v2");
    bind(cu.dtoh, libcuda, "cuMemcpyDtoH_v2");
    bind(cu.set_hazards, libcuda, "celer_standin_set_hazards");
    bind(cu.make_sticky, libcuda, "celer_standin_make_sticky");
    using Create = void* (*) (void*, int32_t);
    using CreateParser = void* (*) (void*, void*, int32_t);
    auto create_runtime = reinterpret_cast<Create>(symbol(nvinfer, "createInferRuntime_INTERNAL"));
    auto create_builder = reinterpret_cast<Create>(symbol(nvinfer, "createInferBuilder_INTERNAL"));
    auto create_parser = reinterpret_cast<CreateParser>(symbol(nvonnxparser, "createNvOnnxParser_INTERNAL"));

    Logger logger;
    cu.init(0);
    void* ctx0 = nullptr;
    void* ctx1 = nullptr;
    cu.retain(&ctx0, 0);
    cu.set_current(ctx0);
    void* stream = nullptr;
    void* other_stream = nullptr;
    cu.stream_create(&stream, 1);
    cu.stream_create(&other_stream, 1);

    // ---- build (or read) the plan ----
    std::vector<char> plan;
    if (scenario == "deserialize-plan") {
        std::ifstream in(plan_file, std::ios::binary);
        plan.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
    } else {
        auto* builder = static_cast<nvinfer1::IBuilder*>(create_builder(&logger, NV_TENSORRT_VERSION));
        if (!check(builder != nullptr, "createInferBuilder")) return 3;
        nvinfer1::INetworkDefinition* network = builder->createNetworkV2(0);
        auto* parser = static_cast<nvonnxparser::IParser*>(create_parser(network, &logger, NV_ONNX_PARSER_VERSION));
        check(parser != nullptr && parser->parseFromFile(argv[5], 2), "parseFromFile");
        nvinfer1::IBuilderConfig* config = builder->createBuilderConfig();
        nvinfer1::IOptimizationProfile* profile = builder->createOptimizationProfile();
        char const* input = network->getInput(0)->getName();
        profile->setDimensions(input, nvinfer1::OptProfileSelector::kMIN, dims4(1));
        profile->setDimensions(input, nvinfer1::OptProfileSelector::kOPT, dims4(1));
        profile->setDimensions(input, nvinfer1::OptProfileSelector::kMAX, dims4(2));
        if (scenario != "no-profile") config->addOptimizationProfile(profile);
        nvinfer1::ITimingCache* cache = config->createTimingCache(nullptr, 0);
        check(config->setTimingCache(*cache, false), "setTimingCache");
        nvinfer1::IHostMemory* serialized = builder->buildSerializedNetwork(*network, *config);
        if (check(serialized != nullptr, "buildSerializedNetwork")) {
            auto const* bytes = static_cast<char const*>(serialized->data());
            plan.assign(bytes, bytes + serialized->size());
            delete serialized;
        }
        delete config;
        // Planted: the builder destroyed with no CUDA context current.
        if (scenario == "builder-without-context") cu.set_current(nullptr);
        // Planted: the network before its parser, the builder before its network, the
        // timing cache before the builder that uses it.
        std::string late = scenario == "network-before-parser"    ? "parser"
                           : scenario == "builder-before-network" ? "network"
                           : scenario == "cache-before-builder"   ? "builder"
                                                                  : "";
        destroy_in_order({{"parser", [&] { delete parser; }},
                          {"network", [&] { delete network; }},
                          {"builder", [&] { delete builder; }},
                          {"cache", [&] { delete cache; }}},
                         late);
        if (plan.empty()) return 3;
        if (scenario == "build-plan") {
            std::ofstream out(plan_file, std::ios::binary);
            out.write(plan.data(), std::streamsize(plan.size()));
            return g_failed ? 3 : 0;
        }
    }

    // ---- run it ----
    if (scenario == "plan-other-gpu") {
        cu.retain(&ctx1, 1);
        cu.set_current(ctx1);  // planted: device 1 has another compute capability
    }
    auto* runtime = static_cast<nvinfer1::IRuntime*>(create_runtime(&logger, NV_TENSORRT_VERSION));
    if (scenario.rfind("data-dependent", 0) == 0) {
        int rc = data_dependent(scenario, cu, runtime, plan, stream);
        delete runtime;
        return rc;
    }
    if (scenario == "unimplemented") runtime->setDLACore(0);  // not modelled by the stand-in
    if (scenario == "no-cuda-context") cu.set_current(nullptr);  // planted
    nvinfer1::ICudaEngine* engine = runtime->deserializeCudaEngine(plan.data(), plan.size());
    if (!check(engine != nullptr, "deserializeCudaEngine")) return 3;
    if (scenario == "reset-then-deserialize") {
        // Planted: the context TensorRT works in is reset (as an in-process recovery would),
        // and TensorRT is asked to deserialize on the device again.
        cu.reset(0);
        cu.retain(&ctx0, 0);
        cu.set_current(ctx0);
        check(runtime->deserializeCudaEngine(plan.data(), plan.size()) != nullptr, "deserializeCudaEngine again");
        return 3;
    }
    auto strategy = nvinfer1::ExecutionContextAllocationStrategy::kUSER_MANAGED;
    nvinfer1::IExecutionContext* context = engine->createExecutionContext(strategy);
    nvinfer1::IExecutionContext* second = nullptr;
    if (!check(context != nullptr, "createExecutionContext")) return 3;
    int64_t memory_bytes = engine->getDeviceMemorySizeV2();
    CUdeviceptr memory = 0, input = 0, output = 0;
    cu.mem_alloc(&memory, size_t(memory_bytes));
    cu.mem_alloc(&input, 2 * 3 * 64 * 64 * sizeof(float));
    cu.mem_alloc(&output, 2 * 3 * 64 * 64 * sizeof(float));
    context->setDeviceMemoryV2(reinterpret_cast<void*>(memory),
                               scenario == "memory-too-small" ? memory_bytes - 256 : memory_bytes);
    char const* in_name = engine->getIOTensorName(0);
    char const* out_name = engine->getIOTensorName(1);
    if (scenario == "shape-outside-profile") {
        check(context->setInputShape(in_name, dims4(3)), "setInputShape");  // planted: max is 2
    } else if (scenario != "shape-unset") {
        check(context->setInputShape(in_name, dims4(1)), "setInputShape");
    }
    nvinfer1::Dims out_shape = context->getTensorShape(out_name);
    check(out_shape.nbDims == 4, "getTensorShape");
    std::vector<float> pixels(3 * 64 * 64, 0.5f);
    cu.htod(input, pixels.data(), pixels.size() * sizeof(float));
    CUdeviceptr input_address = scenario == "misaligned" ? input + 4 : input;  // planted
    check(context->setTensorAddress(in_name, reinterpret_cast<void*>(input_address)), "setTensorAddress(input)");
    if (scenario != "no-address") {
        check(context->setTensorAddress(out_name, reinterpret_cast<void*>(output)), "setTensorAddress(output)");
    }
    // The output holds a sentinel until the stream runs the engine: enqueueV3 only queues.
    std::vector<float> sentinel(3 * 64 * 64, -7.0f);
    cu.htod(output, sentinel.data(), sentinel.size() * sizeof(float));
    if (scenario == "sticky-context" || scenario == "told-then-enqueue") {
        // A kernel faulted in the context before the engine is launched there.
        cu.make_sticky(ctx0, 700, "planted: an earlier kernel's illegal address");
    }
    if (scenario == "told-then-enqueue") {
        // The caller is told of the loss (its synchronisation fails with it), and planted:
        // enqueues all the same.
        check(cu.stream_sync(stream) == 0, "cuStreamSynchronize");
    }
    check(context->enqueueV3(static_cast<cudaStream_t>(stream)), "enqueueV3");
    if (scenario == "enqueue-sticky" || scenario == "sticky-context") {
        // The context is lost (the enqueue failed with its sticky error, and so does the
        // stream's synchronisation): no TensorRT call touches the device again. The
        // execution context, the engine and the runtime are left alive, not destroyed, for
        // the process to end and be relaunched.
        check(cu.stream_sync(stream) == 0, "cuStreamSynchronize");
        std::printf("DONE %s\n", g_failed ? "with failures" : "ok");
        return g_failed ? 3 : 0;
    }
    if (scenario == "ok") {
        std::vector<float> early(3 * 64 * 64, 0.0f);
        // This read races the engine's stream on purpose (the null stream, with no event
        // after the enqueue): the stand-in's cross-stream hazard check, which would refuse
        // it, is off for it.
        int hazards = cu.set_hazards(0);
        cu.dtoh(early.data(), output, early.size() * sizeof(float));
        cu.set_hazards(hazards);
        check(early[0] == -7.0f, "the engine waits for its stream (it ran at enqueueV3)");
    }
    if (scenario == "memory-shared") {
        // Planted: a second context on the same memory, enqueued on another stream before
        // the first one's work has run.
        second = engine->createExecutionContext(strategy);
        second->setDeviceMemoryV2(reinterpret_cast<void*>(memory), memory_bytes);
        second->setInputShape(in_name, dims4(1));
        second->setTensorAddress(in_name, reinterpret_cast<void*>(input));
        second->setTensorAddress(out_name, reinterpret_cast<void*>(output));
        check(second->enqueueV3(static_cast<cudaStream_t>(other_stream)), "enqueueV3 (second context)");
    }
    if (scenario == "context-with-work-in-flight") {
        delete context;  // planted: its work has not run yet
        context = nullptr;
    }
    check(cu.stream_sync(stream) == 0, "cuStreamSynchronize");
    cu.stream_sync(other_stream);
    std::vector<float> scores(3 * 64 * 64, -1.0f);
    cu.dtoh(scores.data(), output, scores.size() * sizeof(float));
    if (!g_failed) {
        // The fixture's scores are w_c * m + b_c with w = [-3, 0, 3], b = [1, 0, -2], m the
        // pixel's mean: at m = 0.5, [-0.5, 0, -0.5] (scripts/make_fixtures.py).
        auto near = [](float v, float want) { return v > want - 1e-4f && v < want + 1e-4f; };
        check(near(scores[0], -0.5f) && near(scores[64 * 64], 0.0f) && near(scores[2 * 64 * 64], -0.5f),
              "the engine's output");
    }
    delete second;
    if (scenario == "sticky-then-destroy") {
        // Planted: the context is lost after the run, and the engine is destroyed (its
        // execution context left alive: the engine is the first TensorRT call after it).
        cu.make_sticky(ctx0, 700, "planted: a later kernel's illegal address");
        delete engine;
        return 3;
    }
    if (scenario == "context-in-another-gpus-context") {
        cu.retain(&ctx1, 1);
        cu.set_current(ctx1);  // planted: GPU 1's context current
        delete context;
        context = nullptr;
        cu.set_current(ctx0);
    }
    if (scenario == "engine-on-a-thread-without-context") {
        delete context;
        context = nullptr;
        std::thread([&] { delete engine; }).join();  // planted: a new thread has no current context
        engine = nullptr;
    }
    if (scenario == "destroyed-on-a-thread-that-binds") {
        // The twin: another thread, which makes the engine's context current first.
        std::thread([&] {
            cu.set_current(ctx0);
            delete context;
            delete engine;
        }).join();
        context = nullptr;
        engine = nullptr;
    }
    // Planted: the engine before its context, the runtime before its engine.
    std::string late = scenario == "engine-before-context" ? "context"
                       : scenario == "runtime-before-engine" ? "engine"
                                                             : "";
    destroy_in_order({{"context", [&] { delete context; }},
                      {"engine", [&] { delete engine; }},
                      {"runtime", [&] { delete runtime; }}},
                     late);
    cu.mem_free(memory);
    cu.mem_free(input);
    cu.mem_free(output);
    std::printf("DONE %s\n", g_failed ? "with failures" : "ok");
    return g_failed ? 3 : 0;
}
