// Running engines: IRuntime, ICudaEngine, IExecutionContext. An engine's network runs
// with ONNX Runtime (its ONNX model travels in the plan) on the stand-in CUDA driver's
// device memory, queued on the caller's stream, so it runs when the stream runs. Every
// rule the headers document for these classes is checked, and a broken one is refused
// (an error logged, false or null returned) or, where nothing can be returned (a
// destructor), reported as a violation (see common.cpp). An engine and an execution
// context are destroyed with the CUDA context they were made in current (TensorRT frees
// their device memory through the current context); the runtime has no such rule: it holds
// no device memory and deserializes into whichever context is current at each call. A CUDA
// fault at an engine's launch (injected, or a context already sticky) fails enqueueV3 as the
// CUDA runtime inside TensorRT reports it. Once a device's context is lost (a sticky error,
// a reset), no call may touch the device again (cuda.cpp, device_usable): the process must
// be relaunched; only a run that began before the loss may still discover it.
#include "standin.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <map>
#include <memory>
#include <set>

namespace standin {

namespace {

using nvinfer1::ExecutionContextAllocationStrategy;
using nvinfer1::OptProfileSelector;
using nvinfer1::TensorIOMode;

constexpr uint64_t kAlignment = 256;
// What an engine needs beyond its outputs' staging, so that the activation memory is never
// trivially small.
constexpr int64_t kActivationBaseBytes = int64_t(1) << 20;

int64_t round_up(int64_t v) { return (v + int64_t(kAlignment) - 1) / int64_t(kAlignment) * int64_t(kAlignment); }

std::string pointer_text(void const* p) {
    char buffer[32];
    std::snprintf(buffer, sizeof buffer, "%p", p);
    return buffer;
}

Dims unknown_rank() {
    Dims d{};
    d.nbDims = -1;
    return d;
}

// Device memory that enqueued work is using: two contexts must not run in one region at
// once (two streams, neither waiting for the other).
struct Flight {
    uint64_t begin;
    uint64_t end;
    void const* context;
    void* stream;
};
std::mutex g_flights_mutex;
std::vector<Flight>& flights() {
    static auto* list = new std::vector<Flight>();
    return *list;
}

class Runtime;
class Engine;
class Context;

// The outputs' largest total bytes over the plan's profiles: their static shapes, or, for
// dynamic ones, what ONNX Runtime gives at each profile's largest input shapes (as
// TensorRT sizes an engine's memory for its profiles' maxima).
bool largest_outputs(Plan const& plan, OrtModel& model, int64_t* out, std::string* why) {
    std::vector<OrtModel::Binding> outputs;
    bool dynamic = false;
    int64_t static_bytes = 0;
    for (TensorInfo const& t : plan.io) {
        // A data-dependent output is written where its IOutputAllocator puts it, not staged.
        if (t.is_input || is_data_dependent(t)) continue;
        outputs.push_back(OrtModel::Binding{t.name, t.type, t.dims, nullptr, 0});
        dynamic = dynamic || has_dynamic(t.dims);
        static_bytes += round_up(volume(t.dims) * int64_t(element_bytes(t.type)));
    }
    if (!dynamic) {
        *out = static_bytes;
        return true;
    }
    int64_t largest = 0;
    // No profiles: every input is static; its shapes are the one "profile".
    std::vector<std::vector<ProfileRange>> profiles = plan.profiles;
    if (profiles.empty()) profiles.emplace_back();
    for (auto const& profile : profiles) {
        std::vector<OrtModel::Binding> inputs;
        for (TensorInfo const& t : plan.io) {
            if (!t.is_input) continue;
            Dims dims = t.dims;
            for (ProfileRange const& r : profile) {
                if (r.name == t.name) dims = r.max;
            }
            inputs.push_back(OrtModel::Binding{t.name, t.type, dims, nullptr, 0});
        }
        std::vector<OrtModel::Binding> shapes = outputs;
        if (!model.run(inputs, &shapes, why)) return false;
        int64_t total = 0;
        for (auto const& b : shapes) {
            total += round_up(volume(b.dims) * int64_t(element_bytes(b.type)));
        }
        largest = std::max(largest, total);
    }
    *out = largest;
    return true;
}

// ---- runtime -------------------------------------------------------------------------

class RuntimeImpl final : public nvinfer1::apiv::StubVRuntime {
public:
    RuntimeImpl(Runtime& owner, ILogger* logger) : owner_(owner), logger_(logger) {}
    nvinfer1::IRuntime* getPImpl() noexcept override;
    nvinfer1::ICudaEngine* deserializeCudaEngine(void const* blob, std::size_t size) noexcept override;
    ILogger* getLogger() const noexcept override { return logger_; }
    int32_t getNbDLACores() const noexcept override { return 0; }
    int32_t getDLACore() const noexcept override { return -1; }
    bool setMaxThreads(int32_t) noexcept override { return true; }
    int32_t getMaxThreads() const noexcept override { return 1; }

    ILogger* logger() const { return logger_; }
    std::atomic<int> engines{0};

    // The devices it deserialized engines on (its state lives in their contexts).
    void note_device(int device) {
        std::lock_guard<std::mutex> lock(devices_mutex_);
        devices_.insert(device);
    }
    std::set<int> devices() const {
        std::lock_guard<std::mutex> lock(devices_mutex_);
        return devices_;
    }

private:
    Runtime& owner_;
    ILogger* logger_;
    mutable std::mutex devices_mutex_;
    std::set<int> devices_;
};

class Runtime final : public nvinfer1::IRuntime {
public:
    explicit Runtime(ILogger* logger) : impl_(*this, logger) {
        mImpl = &impl_;
        register_live(this);
    }
    ~Runtime() noexcept override {
        unregister_live(this);
        for (int device : impl_.devices()) device_usable(impl_.logger(), device, "IRuntime destroyed: it");
        if (int n = impl_.engines.load()) {
            violation(impl_.logger(), "IRuntime destroyed while " + std::to_string(n) +
                                          " engine(s) it deserialized are alive: the runtime must outlive every "
                                          "engine it deserialized");
        }
    }
    RuntimeImpl& impl() { return impl_; }

private:
    RuntimeImpl impl_;
};

nvinfer1::IRuntime* RuntimeImpl::getPImpl() noexcept { return &owner_; }

// ---- engine --------------------------------------------------------------------------

class EngineImpl final : public nvinfer1::apiv::StubVCudaEngine {
public:
    EngineImpl(Engine& owner) : owner_(owner) {}
    nvinfer1::ICudaEngine* getPImpl() noexcept override;
    int32_t getNbIOTensors() const noexcept override;
    char const* getIOTensorName(int32_t index) const noexcept override;
    TensorIOMode getTensorIOMode(char const* name) const noexcept override;
    DataType getTensorDataType(char const* name) const noexcept override;
    Dims getTensorShape(char const* name) const noexcept override;
    nvinfer1::TensorLocation getTensorLocation(char const*) const noexcept override {
        return nvinfer1::TensorLocation::kDEVICE;
    }
    bool isShapeInferenceIO(char const*) const noexcept override { return false; }
    nvinfer1::TensorFormat getTensorFormat(char const*) const noexcept override {
        return nvinfer1::TensorFormat::kLINEAR;
    }
    int32_t getNbOptimizationProfiles() const noexcept override;
    Dims getProfileShape(char const* name, int32_t profile, OptProfileSelector select) const noexcept override;
    size_t getDeviceMemorySize() const noexcept override;
    int64_t getDeviceMemorySizeV2() const noexcept override;
    size_t getDeviceMemorySizeForProfile(int32_t) const noexcept override { return getDeviceMemorySize(); }
    int64_t getDeviceMemorySizeForProfileV2(int32_t) const noexcept override { return getDeviceMemorySizeV2(); }
    nvinfer1::IExecutionContext* createExecutionContext(ExecutionContextAllocationStrategy strategy) noexcept override;
    char const* getName() const noexcept override;
    int32_t getNbLayers() const noexcept override { return 1; }
    bool hasImplicitBatchDimension() const noexcept override { return false; }
    nvinfer1::EngineCapability getEngineCapability() const noexcept override {
        return nvinfer1::EngineCapability::kSTANDARD;
    }
    nvinfer1::HardwareCompatibilityLevel getHardwareCompatibilityLevel() const noexcept override {
        return nvinfer1::HardwareCompatibilityLevel::kNONE;
    }
    int32_t getNbAuxStreams() const noexcept override { return 0; }

private:
    Engine& owner_;
};

class Engine final : public nvinfer1::ICudaEngine {
public:
    // `output_bytes`: the outputs' largest total size over the profiles (they are staged
    // in the activation memory).
    Engine(Runtime& runtime, Plan plan, std::unique_ptr<OrtModel> model, CudaContextInfo context, uint64_t weights,
           int64_t output_bytes)
        : impl_(*this), runtime_(runtime), plan_(std::move(plan)), model_(std::move(model)), context_(context),
          weights_(weights) {
        mImpl = &impl_;
        runtime_.impl().engines++;
        weights_fnv_ = weights_check(plan_.onnx.data());
        memory_bytes_ = round_up(kActivationBaseBytes + output_bytes);
        register_live(this);
    }

    ~Engine() noexcept override {
        unregister_live(this);
        // First: on a lost device nothing more is done there (the other rules would only
        // report what the loss already explains).
        if (device_usable(logger(), context_.device, "ICudaEngine `" + plan_.name + "` destroyed: it")) {
            check_destroyed_in(logger(), "ICudaEngine `" + plan_.name + "`", "deserialized", context_);
            if (int n = contexts.load()) {
                violation(logger(), "ICudaEngine `" + plan_.name + "` destroyed while " + std::to_string(n) +
                                        " execution context(s) are alive: an engine must outlive its execution "
                                        "contexts");
            }
            device_free(weights_);
        }
        if (is_live(&runtime_)) runtime_.impl().engines--;
    }

    ILogger* logger() const { return runtime_.impl().logger(); }
    Plan const& plan() const { return plan_; }
    CudaContextInfo const& cuda() const { return context_; }
    int64_t memory_bytes() const { return memory_bytes_; }
    uint64_t weights() const { return weights_; }
    std::atomic<int> contexts{0};

    TensorInfo const* tensor(char const* name) const {
        if (name == nullptr) return nullptr;
        for (TensorInfo const& t : plan_.io) {
            if (t.name == name) return &t;
        }
        return nullptr;
    }

    // Profile `index`'s range of input `name` (profile 0 of an engine without dynamic
    // inputs is its static shapes, as TensorRT reports it).
    bool profile_range(std::string const& name, int32_t index, ProfileRange* out) const {
        TensorInfo const* t = tensor(name.c_str());
        if (t == nullptr || !t->is_input) return false;
        if (plan_.profiles.empty()) {
            if (index != 0) return false;
            *out = ProfileRange{name, t->dims, t->dims, t->dims};
            return true;
        }
        if (index < 0 || size_t(index) >= plan_.profiles.size()) return false;
        for (ProfileRange const& r : plan_.profiles[size_t(index)]) {
            if (r.name == name) {
                *out = r;
                return true;
            }
        }
        if (has_dynamic(t->dims)) return false;
        *out = ProfileRange{name, t->dims, t->dims, t->dims};
        return true;
    }

    int32_t profile_count() const {
        return plan_.profiles.empty() ? 1 : static_cast<int32_t>(plan_.profiles.size());
    }

    // The outputs' shapes for these input shapes: the network's own where static, else
    // from ONNX Runtime run once on zeros of these shapes (cached per shape set).
    bool output_shapes(std::map<std::string, Dims> const& inputs, std::map<std::string, Dims>* out,
                       std::string* why) {
        bool dynamic = false;
        for (TensorInfo const& t : plan_.io) {
            if (!t.is_input) {
                (*out)[t.name] = t.dims;
                dynamic = dynamic || has_dynamic(t.dims);
            }
        }
        if (!dynamic) return true;
        if (!inferred_shapes(inputs, out, why)) return false;
        // Known only when the engine runs: TensorRT reports -1 until then.
        for (TensorInfo const& t : plan_.io) {
            if (!is_data_dependent(t)) continue;
            Dims& d = (*out)[t.name];
            for (int32_t i = 0; i < d.nbDims && i < 32; ++i) {
                if (t.data_dependent & (1u << i)) d.d[i] = -1;
            }
        }
        return true;
    }

    // What ONNX Runtime gives as the outputs' shapes for these input shapes, run once on
    // zeros (cached per shape set).
    bool inferred_shapes(std::map<std::string, Dims> const& inputs, std::map<std::string, Dims>* out,
                         std::string* why) {
        std::string key;
        std::vector<OrtModel::Binding> bindings;
        for (auto const& [name, dims] : inputs) {
            key += name + dims_string(dims) + ";";
            TensorInfo const* t = tensor(name.c_str());
            bindings.push_back(OrtModel::Binding{name, t->type, dims, nullptr, 0});
        }
        std::lock_guard<std::mutex> lock(model_mutex_);
        auto cached = inferred_.find(key);
        if (cached == inferred_.end()) {
            std::vector<OrtModel::Binding> outputs;
            for (TensorInfo const& t : plan_.io) {
                if (!t.is_input) outputs.push_back(OrtModel::Binding{t.name, t.type, t.dims, nullptr, 0});
            }
            if (!model_->run(bindings, &outputs, why)) return false;
            std::map<std::string, Dims> shapes;
            for (auto const& b : outputs) shapes[b.name] = b.dims;
            cached = inferred_.emplace(key, shapes).first;
        }
        *out = cached->second;
        return true;
    }

    // Runs the network (on the stream's turn). Outputs go through `staging` (the
    // context's activation memory) as a real engine's intermediate tensors do; a
    // data-dependent one straight into the memory its output allocator gave.
    std::string execute(std::vector<OrtModel::Binding> const& inputs, std::vector<OrtModel::Binding> outputs,
                        uint8_t* staging, int64_t staging_bytes) {
        if (weights_check(reinterpret_cast<uint8_t const*>(weights_)) != weights_fnv_) {
            return "the engine's weights on the device were overwritten";
        }
        std::vector<void*> destinations;
        int64_t offset = 0;
        for (auto& o : outputs) {
            destinations.push_back(o.data);
            TensorInfo const* t = tensor(o.name.c_str());
            // Written where its output allocator put it (sized for what it came out as).
            if (t != nullptr && is_data_dependent(*t)) continue;
            if (offset + int64_t(o.bytes) > staging_bytes) {
                return "the activation memory is too small for the outputs (a stand-in sizing bug)";
            }
            o.data = staging + offset;
            offset += round_up(int64_t(o.bytes));
        }
        std::string why;
        {
            std::lock_guard<std::mutex> lock(model_mutex_);
            std::vector<OrtModel::Binding> ran = outputs;
            if (!model_->run(inputs, &ran, &why)) return "ONNX Runtime: " + why;
        }
        for (size_t i = 0; i < outputs.size(); ++i) {
            if (outputs[i].data != destinations[i]) std::memcpy(destinations[i], outputs[i].data, outputs[i].bytes);
        }
        return "";
    }

    // The outputs' shapes as the network gives them for these inputs' values (read from
    // the device on the stream's turn), for the outputs of data-dependent shape.
    std::string shapes_for(std::vector<OrtModel::Binding> const& inputs, std::map<std::string, Dims>* out) {
        std::vector<OrtModel::Binding> outputs;
        for (TensorInfo const& t : plan_.io) {
            if (!t.is_input) outputs.push_back(OrtModel::Binding{t.name, t.type, t.dims, nullptr, 0});
        }
        std::string why;
        {
            std::lock_guard<std::mutex> lock(model_mutex_);
            if (!model_->run(inputs, &outputs, &why)) return "ONNX Runtime: " + why;
        }
        for (auto const& b : outputs) (*out)[b.name] = b.dims;
        return "";
    }

private:
    // A checksum of the weights' first and last pages, as stored on the device.
    uint64_t weights_check(uint8_t const* weights) const {
        size_t n = plan_.onnx.size();
        size_t page = std::min<size_t>(n, 4096);
        return fnv1a(weights, page) ^ (fnv1a(weights + n - page, page) * 31);
    }

    EngineImpl impl_;
    Runtime& runtime_;
    Plan plan_;
    std::unique_ptr<OrtModel> model_;
    std::mutex model_mutex_;
    std::map<std::string, std::map<std::string, Dims>> inferred_;
    CudaContextInfo context_;
    uint64_t weights_;
    uint64_t weights_fnv_ = 0;
    int64_t memory_bytes_ = 0;
};

nvinfer1::ICudaEngine* EngineImpl::getPImpl() noexcept { return &owner_; }

int32_t EngineImpl::getNbIOTensors() const noexcept { return static_cast<int32_t>(owner_.plan().io.size()); }

char const* EngineImpl::getIOTensorName(int32_t index) const noexcept {
    auto const& io = owner_.plan().io;
    if (index < 0 || size_t(index) >= io.size()) {
        refuse(owner_.logger(), "getIOTensorName(" + std::to_string(index) + "): the engine has " +
                                    std::to_string(io.size()) + " I/O tensors");
        return nullptr;
    }
    return io[size_t(index)].name.c_str();
}

TensorIOMode EngineImpl::getTensorIOMode(char const* name) const noexcept {
    TensorInfo const* t = owner_.tensor(name);
    if (t == nullptr) return TensorIOMode::kNONE;
    return t->is_input ? TensorIOMode::kINPUT : TensorIOMode::kOUTPUT;
}

DataType EngineImpl::getTensorDataType(char const* name) const noexcept {
    TensorInfo const* t = owner_.tensor(name);
    return t != nullptr ? t->type : DataType::kFLOAT;
}

Dims EngineImpl::getTensorShape(char const* name) const noexcept {
    TensorInfo const* t = owner_.tensor(name);
    return t != nullptr ? t->dims : unknown_rank();
}

int32_t EngineImpl::getNbOptimizationProfiles() const noexcept { return owner_.profile_count(); }

Dims EngineImpl::getProfileShape(char const* name, int32_t profile, OptProfileSelector select) const noexcept {
    ProfileRange range;
    if (name == nullptr || !owner_.profile_range(name, profile, &range)) return unknown_rank();
    switch (select) {
        case OptProfileSelector::kMIN: return range.min;
        case OptProfileSelector::kOPT: return range.opt;
        default: return range.max;
    }
}

size_t EngineImpl::getDeviceMemorySize() const noexcept { return size_t(owner_.memory_bytes()); }
int64_t EngineImpl::getDeviceMemorySizeV2() const noexcept { return owner_.memory_bytes(); }
char const* EngineImpl::getName() const noexcept { return owner_.plan().name.c_str(); }

// ---- execution context ---------------------------------------------------------------

class ContextImpl final : public nvinfer1::apiv::StubVExecutionContext {
public:
    explicit ContextImpl(Context& owner) : owner_(owner) {}
    nvinfer1::IExecutionContext* getPImpl() noexcept override;
    nvinfer1::ICudaEngine const& getEngine() const noexcept override;
    void setName(char const* name) noexcept override { name_ = name != nullptr ? name : ""; }
    char const* getName() const noexcept override { return name_.c_str(); }
    void setDeviceMemory(void* memory) noexcept override;
    void setDeviceMemoryV2(void* memory, int64_t size) noexcept override;
    size_t updateDeviceMemorySizeForShapes() noexcept override;
    int32_t getOptimizationProfile() const noexcept override;
    bool setOptimizationProfileAsync(int32_t profile, cudaStream_t stream) noexcept override;
    bool allInputDimensionsSpecified() const noexcept override;
    bool allInputShapesSpecified() const noexcept override { return allInputDimensionsSpecified(); }
    bool setInputShape(char const* name, Dims const& dims) noexcept override;
    Dims getTensorShape(char const* name) const noexcept override;
    bool setTensorAddress(char const* name, void* data) noexcept override;
    void const* getTensorAddress(char const* name) const noexcept override;
    bool setInputTensorAddress(char const* name, void const* data) noexcept override;
    bool setOutputTensorAddress(char const* name, void* data) noexcept override;
    void* getOutputTensorAddress(char const* name) const noexcept override;
    bool setOutputAllocator(char const* name, nvinfer1::IOutputAllocator* allocator) noexcept override;
    nvinfer1::IOutputAllocator* getOutputAllocator(char const* name) noexcept override;
    bool enqueueV3(cudaStream_t stream) noexcept override;

private:
    Context& owner_;
    std::string name_;
};

class Context final : public nvinfer1::IExecutionContext {
public:
    Context(Engine& engine, ExecutionContextAllocationStrategy strategy, uint64_t own_memory)
        : user_managed_(strategy == ExecutionContextAllocationStrategy::kUSER_MANAGED), own_memory_(own_memory),
          impl_(*this), engine_(engine) {
        mImpl = &impl_;
        if (own_memory_ != 0) {
            memory_ = own_memory_;
            memory_bytes_ = engine_.memory_bytes();
        }
        engine_.contexts++;
        register_live(this);
    }

    ~Context() noexcept override {
        unregister_live(this);
        std::string what = "IExecutionContext of `" + engine_.plan().name + "`";
        if (device_usable(logger(), engine_.cuda().device, what + " destroyed: it")) {
            check_destroyed_in(logger(), what, "created", engine_.cuda());
            if (int n = pending.load()) {
                violation(logger(), what + " destroyed while " + std::to_string(n) +
                                        " enqueueV3 of it has not completed: synchronise its stream before "
                                        "destroying the context (the work still uses it)");
            }
            device_free(own_memory_);
        }
        if (is_live(&engine_)) engine_.contexts--;
    }

    // Whether `call` may touch the engine's device (the relaunch rule, device_usable).
    bool device_usable_for(std::string const& call) const {
        return device_usable(logger(), engine_.cuda().device, call + " on a context of `" + engine_.plan().name + "`",
                             Touch::Request);
    }

    ILogger* logger() const { return engine_.logger(); }
    Engine& engine() { return engine_; }
    std::string const& label() const { return engine_.plan().name; }
    std::atomic<int> pending{0};

    // What the ContextImpl methods share.
    bool user_managed_;
    uint64_t own_memory_;
    uint64_t memory_ = 0;
    int64_t memory_bytes_ = 0;
    int32_t profile_ = 0;
    std::map<std::string, Dims> shapes_;
    std::map<std::string, void*> addresses_;
    std::map<std::string, nvinfer1::IOutputAllocator*> allocators_;

    // The shape input `t` runs with: the one set, or its static one.
    bool input_shape(TensorInfo const& t, Dims* out) const {
        auto set = shapes_.find(t.name);
        if (set != shapes_.end()) {
            *out = set->second;
            return true;
        }
        if (has_dynamic(t.dims)) return false;
        *out = t.dims;
        return true;
    }

    // Every input's shape, or the rule broken (for `call`).
    bool input_shapes(char const* call, std::map<std::string, Dims>* out, std::string* why) const {
        for (TensorInfo const& t : engine_.plan().io) {
            if (!t.is_input) continue;
            Dims d;
            if (!input_shape(t, &d)) {
                *why = std::string(call) + ": input `" + t.name + "` of `" + label() + "` has dynamic shape " +
                       dims_string(t.dims) +
                       " and none was set: set every dynamic input's shape with setInputShape before output shapes "
                       "are read or enqueueV3 runs";
                return false;
            }
            (*out)[t.name] = d;
        }
        return true;
    }

private:
    ContextImpl impl_;
    Engine& engine_;
};

nvinfer1::IExecutionContext* ContextImpl::getPImpl() noexcept { return &owner_; }
nvinfer1::ICudaEngine const& ContextImpl::getEngine() const noexcept { return owner_.engine(); }

void ContextImpl::setDeviceMemory(void* memory) noexcept {
    setDeviceMemoryV2(memory, owner_.engine().memory_bytes());
}

void ContextImpl::setDeviceMemoryV2(void* memory, int64_t size) noexcept {
    if (!owner_.device_usable_for("setDeviceMemoryV2")) return;
    Engine& engine = owner_.engine();
    std::string head = "setDeviceMemoryV2(" + pointer_text(memory) + ", " + std::to_string(size) + ") on a context of `" +
                       owner_.label() + "`: ";
    if (!owner_.user_managed_) {
        refuse(owner_.logger(), head +
                                    "the context was not created with kUSER_MANAGED: it has its own memory (created "
                                    "with kSTATIC)");
        return;
    }
    if (size < engine.memory_bytes()) {
        refuse(owner_.logger(), head + "user device memory must be at least getDeviceMemorySizeV2() = " +
                                    std::to_string(engine.memory_bytes()) + " bytes");
        return;
    }
    if (memory == nullptr || reinterpret_cast<uintptr_t>(memory) % kAlignment != 0) {
        refuse(owner_.logger(), head + "the memory must be device memory aligned to 256 bytes");
        return;
    }
    owner_.memory_ = reinterpret_cast<uint64_t>(memory);
    owner_.memory_bytes_ = size;
}

size_t ContextImpl::updateDeviceMemorySizeForShapes() noexcept { return size_t(owner_.engine().memory_bytes()); }

int32_t ContextImpl::getOptimizationProfile() const noexcept { return owner_.profile_; }

bool ContextImpl::setOptimizationProfileAsync(int32_t profile, cudaStream_t) noexcept {
    if (!owner_.device_usable_for("setOptimizationProfileAsync")) return false;
    int32_t count = owner_.engine().profile_count();
    if (profile < 0 || profile >= count) {
        refuse(owner_.logger(), "setOptimizationProfileAsync(" + std::to_string(profile) + "): `" + owner_.label() +
                                    "` has " + std::to_string(count) + " optimisation profile(s)");
        return false;
    }
    if (profile != owner_.profile_) owner_.shapes_.clear();
    owner_.profile_ = profile;
    return true;
}

bool ContextImpl::allInputDimensionsSpecified() const noexcept {
    std::map<std::string, Dims> shapes;
    std::string why;
    return owner_.input_shapes("allInputDimensionsSpecified", &shapes, &why);
}

bool ContextImpl::setInputShape(char const* name, Dims const& dims) noexcept {
    if (!owner_.device_usable_for("setInputShape")) return false;
    Engine& engine = owner_.engine();
    std::string head = std::string("setInputShape(`") + (name != nullptr ? name : "(null)") + "`, " +
                       dims_string(dims) + "): ";
    TensorInfo const* t = engine.tensor(name);
    if (t == nullptr || !t->is_input) {
        refuse(owner_.logger(), head + "`" + owner_.label() + "` has no input of that name");
        return false;
    }
    ProfileRange range;
    if (!engine.profile_range(t->name, owner_.profile_, &range)) {
        refuse(owner_.logger(), head + "optimisation profile " + std::to_string(owner_.profile_) +
                                    " has no range for this input");
        return false;
    }
    bool inside = dims.nbDims == t->dims.nbDims;
    for (int32_t i = 0; inside && i < dims.nbDims; ++i) {
        inside = dims.d[i] >= range.min.d[i] && dims.d[i] <= range.max.d[i] &&
                 (t->dims.d[i] < 0 || dims.d[i] == t->dims.d[i]);
    }
    if (!inside) {
        refuse(owner_.logger(), head + "outside the active optimisation profile " + std::to_string(owner_.profile_) +
                                    " (" + dims_string(range.min) + " to " + dims_string(range.max) +
                                    "): an input's shape must lie within the active profile");
        return false;
    }
    owner_.shapes_[t->name] = dims;
    return true;
}

Dims ContextImpl::getTensorShape(char const* name) const noexcept {
    Engine& engine = owner_.engine();
    TensorInfo const* t = engine.tensor(name);
    if (t == nullptr) {
        refuse(owner_.logger(), std::string("getTensorShape(`") + (name != nullptr ? name : "(null)") + "`): `" +
                                    owner_.label() + "` has no tensor of that name");
        return unknown_rank();
    }
    if (t->is_input) {
        Dims d;
        return owner_.input_shape(*t, &d) ? d : t->dims;
    }
    std::map<std::string, Dims> inputs, outputs;
    std::string why;
    std::string call = "getTensorShape(`" + t->name + "`)";
    if (!owner_.input_shapes(call.c_str(), &inputs, &why) || !engine.output_shapes(inputs, &outputs, &why)) {
        refuse(owner_.logger(), why);
        return unknown_rank();
    }
    return outputs[t->name];
}

bool ContextImpl::setTensorAddress(char const* name, void* data) noexcept {
    if (!owner_.device_usable_for("setTensorAddress")) return false;
    std::string head = std::string("setTensorAddress(`") + (name != nullptr ? name : "(null)") + "`, " +
                       pointer_text(data) + "): ";
    if (owner_.engine().tensor(name) == nullptr) {
        refuse(owner_.logger(), head + "`" + owner_.label() + "` has no I/O tensor of that name");
        return false;
    }
    if (reinterpret_cast<uintptr_t>(data) % kAlignment != 0) {
        refuse(owner_.logger(), head +
                                    "not 256-byte aligned: every I/O tensor's address must have at least 256-byte "
                                    "alignment");
        return false;
    }
    owner_.addresses_[name] = data;
    return true;
}

void const* ContextImpl::getTensorAddress(char const* name) const noexcept {
    auto found = owner_.addresses_.find(name != nullptr ? name : "");
    return found != owner_.addresses_.end() ? found->second : nullptr;
}

bool ContextImpl::setInputTensorAddress(char const* name, void const* data) noexcept {
    TensorInfo const* t = owner_.engine().tensor(name);
    if (t != nullptr && !t->is_input) {
        refuse(owner_.logger(), std::string("setInputTensorAddress(`") + name + "`): not an input");
        return false;
    }
    return setTensorAddress(name, const_cast<void*>(data));
}

bool ContextImpl::setOutputTensorAddress(char const* name, void* data) noexcept {
    TensorInfo const* t = owner_.engine().tensor(name);
    if (t != nullptr && t->is_input) {
        refuse(owner_.logger(), std::string("setOutputTensorAddress(`") + name + "`): not an output");
        return false;
    }
    return setTensorAddress(name, data);
}

void* ContextImpl::getOutputTensorAddress(char const* name) const noexcept {
    return const_cast<void*>(getTensorAddress(name));
}

bool ContextImpl::setOutputAllocator(char const* name, nvinfer1::IOutputAllocator* allocator) noexcept {
    TensorInfo const* t = owner_.engine().tensor(name);
    if (t == nullptr || t->is_input) {
        refuse(owner_.logger(), std::string("setOutputAllocator(`") + (name != nullptr ? name : "(null)") + "`): `" +
                                    owner_.label() + "` has no output of that name");
        return false;
    }
    if (allocator == nullptr) {
        owner_.allocators_.erase(t->name);
    } else {
        owner_.allocators_[t->name] = allocator;
    }
    return true;
}

nvinfer1::IOutputAllocator* ContextImpl::getOutputAllocator(char const* name) noexcept {
    auto found = owner_.allocators_.find(name != nullptr ? name : "");
    return found != owner_.allocators_.end() ? found->second : nullptr;
}

namespace {

// One enqueue's I/O, checked: the device ranges its work touches and the bindings it runs
// with; and the outputs of data-dependent shape, which get their memory from their output
// allocators once their shapes are known (`place_data_dependent`).
struct Launch {
    std::vector<WorkRange> ranges;
    std::vector<OrtModel::Binding> in, out;
    std::vector<TensorInfo const*> data_dependent;
    // Told to each data-dependent output's allocator before enqueueV3 returns.
    std::vector<std::pair<nvinfer1::IOutputAllocator*, OrtModel::Binding>> notify;
};

// A launch of the engine's work that the driver refused: a sticky context's error is a
// CUDA error, reported as the CUDA runtime inside TensorRT reports a failed launch (no rule
// was broken); anything else is a refusal.
void launch_failed(ILogger* logger, std::string const& head, std::string const& why, int code, int device) {
    if (is_sticky_error(code)) {
        log(logger, Severity::kERROR,
            head + cuda_runtime_error(code) + " (" + result_text(code) +
                ": the CUDA context's error is sticky: every later call in it fails; " + why + ")");
        // The caller has been told now: from here the relaunch rule holds for its thread.
        told_of_loss(device);
        return;
    }
    refuse(logger, head + why);
}

// Every I/O tensor of `owner` for these shapes: an input or a shaped output needs an
// address; an output of data-dependent shape needs an output allocator (the rule the
// headers give: its -1 dimensions are known only when the engine runs, so an address alone
// has no size the engine could be held to). False (refused) when one is missing.
bool bind_io(Context& owner, std::map<std::string, Dims>& inputs, std::map<std::string, Dims>& outputs,
             std::string const& head, Launch* launch) {
    ILogger* logger = owner.logger();
    for (TensorInfo const& t : owner.engine().plan().io) {
        if (element_bytes(t.type) == 0) {
            refuse(logger, head + "`" + t.name + "` is " + type_name(t.type));
            return false;
        }
        if (is_data_dependent(t)) {
            if (owner.allocators_.count(t.name) == 0) {
                refuse(logger, head + "output `" + t.name + "` has the data-dependent shape " +
                                   dims_string(outputs[t.name]) +
                                   " (known only when the engine runs) and no output allocator: an output whose "
                                   "getTensorShape has -1 after every input shape is set needs an IOutputAllocator "
                                   "(setOutputAllocator), which is given memory of the size it comes out; an address "
                                   "set with setTensorAddress has no size, and the engine would write past it");
                return false;
            }
            launch->data_dependent.push_back(&t);
            continue;
        }
        auto address = owner.addresses_.find(t.name);
        Dims dims = t.is_input ? inputs[t.name] : outputs[t.name];
        size_t bytes = size_t(volume(dims)) * element_bytes(t.type);
        if (address == owner.addresses_.end() || (address->second == nullptr && bytes > 0)) {
            refuse(logger, head + (t.is_input ? "input" : "output") + " `" + t.name +
                               "` has no address: every I/O tensor's address must be set with setTensorAddress "
                               "before enqueueV3");
            return false;
        }
        auto pointer = reinterpret_cast<uint64_t>(address->second);
        std::string what = std::string(t.is_input ? "input" : "output") + " `" + t.name + "` " + dims_string(dims);
        launch->ranges.push_back(WorkRange{pointer, bytes, !t.is_input, what});
        (t.is_input ? launch->in : launch->out).push_back(OrtModel::Binding{t.name, t.type, dims, address->second, bytes});
    }
    return true;
}

// The outputs of data-dependent shape, placed: TensorRT learns their shapes on the device
// and waits for them inside enqueueV3 (their allocators' reallocateOutputAsync and
// notifyShape are called before it returns). Here the network runs once on the stream's
// turn for the shapes alone (reading the inputs), the stream is synchronised, and each
// allocator is asked for its output's bytes; the engine's work then writes there.
bool place_data_dependent(Context& owner, void* stream, std::string const& head, Launch* launch) {
    Engine& engine = owner.engine();
    ILogger* logger = owner.logger();
    auto shapes = std::make_shared<std::map<std::string, Dims>>();
    std::vector<WorkRange> reads;
    for (WorkRange const& r : launch->ranges) {
        if (!r.writes) reads.push_back(r);
    }
    reads.push_back(WorkRange{engine.weights(), engine.plan().onnx.size(), false, "the engine's weights"});
    Engine* e = &engine;
    std::vector<OrtModel::Binding> in = launch->in;
    auto run = [e, in, shapes]() { return e->shapes_for(in, shapes.get()); };
    std::string why;
    int code = 0;
    std::string label = "TensorRT engine `" + owner.label() + "` (data-dependent shapes)";
    if (!enqueue_work(stream, label, reads, run, nullptr, &why, &code)) {
        launch_failed(logger, head, why, code, engine.cuda().device);
        return false;
    }
    if (int r = synchronize(stream)) {
        launch_failed(logger, head, "waiting for the data-dependent shapes: " + result_text(r), r,
                      engine.cuda().device);
        return false;
    }
    for (TensorInfo const* t : launch->data_dependent) {
        Dims dims = (*shapes)[t->name];
        uint64_t bytes = uint64_t(volume(dims)) * element_bytes(t->type);
        nvinfer1::IOutputAllocator* allocator = owner.allocators_[t->name];
        auto address = owner.addresses_.find(t->name);
        void* current = address != owner.addresses_.end() ? address->second : nullptr;
        void* memory = allocator->reallocateOutputAsync(t->name.c_str(), current, std::max<uint64_t>(bytes, 1),
                                                        kAlignment, static_cast<cudaStream_t>(stream));
        if (memory == nullptr || reinterpret_cast<uintptr_t>(memory) % kAlignment != 0) {
            refuse(logger, head + "the output allocator of `" + t->name + "` gave " +
                               (memory == nullptr ? "no memory" : "memory not 256-byte aligned") + " for its " +
                               std::to_string(bytes) + " bytes " + dims_string(dims));
            return false;
        }
        std::string what = "output `" + t->name + "` " + dims_string(dims) + " (from its output allocator)";
        launch->ranges.push_back(WorkRange{reinterpret_cast<uint64_t>(memory), size_t(bytes), true, what});
        OrtModel::Binding binding{t->name, t->type, dims, memory, size_t(bytes)};
        launch->out.push_back(binding);
        launch->notify.emplace_back(allocator, binding);
    }
    return true;
}

}  // namespace

bool ContextImpl::enqueueV3(cudaStream_t stream) noexcept {
    Engine& engine = owner_.engine();
    ILogger* logger = owner_.logger();
    std::string head = "enqueueV3 of `" + owner_.label() + "`: ";
    if (!owner_.device_usable_for("enqueueV3")) return false;
    if (fault_armed("enqueue")) {
        refuse(logger, head + "injected fault (CELER_TRT_STANDIN_FAULT_FILE)");
        return false;
    }
    CudaContextInfo cuda;
    std::string why;
    if (!current_context(&cuda, &why)) {
        refuse(logger, head + why + ": TensorRT runs in the CUDA context current on the calling thread");
        return false;
    }
    if (cuda.context != engine.cuda().context) {
        refuse(logger, head +
                           "the current CUDA context is not the one the engine was deserialized in (device " +
                           std::to_string(cuda.device) + " against " + std::to_string(engine.cuda().device) + ")");
        return false;
    }
    if (owner_.memory_ == 0) {
        refuse(logger, head +
                           "the context was created with kUSER_MANAGED and has no device memory: call "
                           "setDeviceMemoryV2 before enqueueV3");
        return false;
    }
    std::map<std::string, Dims> inputs, outputs;
    if (!owner_.input_shapes("enqueueV3", &inputs, &why)) {
        refuse(logger, why);
        return false;
    }
    if (!engine.output_shapes(inputs, &outputs, &why)) {
        refuse(logger, head + why);
        return false;
    }
    Launch launch;
    if (!bind_io(owner_, inputs, outputs, head, &launch)) return false;
    if (fault_armed("enqueue-sticky")) {
        // A kernel of the engine meets an illegal address at its launch: the context's
        // error becomes sticky, and the CUDA runtime inside TensorRT reports it.
        std::string what = "TensorRT engine `" + owner_.label() +
                           "`: a kernel of enqueueV3 hit an illegal address (injected fault: "
                           "CELER_TRT_STANDIN_FAULT_FILE enqueue-sticky)";
        if (!make_sticky(engine.cuda().context, kCudaErrorIllegalAddress, what, &why)) {
            refuse(logger, head + why);
            return false;
        }
        launch_failed(logger, head, what, kCudaErrorIllegalAddress, engine.cuda().device);
        return false;
    }
    if (!launch.data_dependent.empty() && !place_data_dependent(owner_, stream, head, &launch)) return false;
    uint64_t memory = owner_.memory_;
    int64_t memory_bytes = owner_.memory_bytes_;
    launch.ranges.push_back(WorkRange{memory, size_t(memory_bytes), true, "the context's activation memory"});
    launch.ranges.push_back(WorkRange{engine.weights(), engine.plan().onnx.size(), false, "the engine's weights"});
    {
        std::lock_guard<std::mutex> lock(g_flights_mutex);
        for (Flight const& f : flights()) {
            bool overlaps = f.begin < memory + uint64_t(memory_bytes) && memory < f.end;
            if (overlaps && f.context != &owner_ && f.stream != stream) {
                refuse(logger, head + "its device memory [" + pointer_text(reinterpret_cast<void*>(memory)) + ", +" +
                                   std::to_string(memory_bytes) +
                                   ") is in use by another execution context's enqueue that has not completed, on "
                                   "another stream: contexts running at once must not share device memory");
                return false;
            }
        }
        flights().push_back(Flight{memory, memory + uint64_t(memory_bytes), &owner_, stream});
    }
    Context* context = &owner_;
    auto* staging = reinterpret_cast<uint8_t*>(memory);
    auto run = [context, in = launch.in, out = launch.out, staging, memory_bytes]() {
        return context->engine().execute(in, out, staging, memory_bytes);
    };
    auto done = [context, memory, stream]() {
        {
            std::lock_guard<std::mutex> lock(g_flights_mutex);
            auto& list = flights();
            auto it = std::find_if(list.begin(), list.end(), [&](Flight const& f) {
                return f.context == context && f.begin == memory && f.stream == stream;
            });
            if (it != list.end()) list.erase(it);
        }
        context->pending--;
    };
    owner_.pending++;
    int code = 0;
    if (!enqueue_work(stream, "TensorRT engine `" + owner_.label() + "`", launch.ranges, run, done, &why, &code)) {
        launch_failed(logger, head, why, code, engine.cuda().device);
        return false;
    }
    for (auto const& [allocator, binding] : launch.notify) allocator->notifyShape(binding.name.c_str(), binding.dims);
    return true;
}

nvinfer1::IExecutionContext* EngineImpl::createExecutionContext(ExecutionContextAllocationStrategy strategy) noexcept {
    std::string why;
    CudaContextInfo cuda;
    std::string head = "createExecutionContext of `" + owner_.plan().name + "`: ";
    if (!device_usable(owner_.logger(), owner_.cuda().device, "createExecutionContext of `" + owner_.plan().name + "`")) {
        return nullptr;
    }
    if (!current_context(&cuda, &why)) {
        refuse(owner_.logger(), head + why + ": TensorRT works in the CUDA context current on the calling thread");
        return nullptr;
    }
    if (cuda.context != owner_.cuda().context) {
        refuse(owner_.logger(), head + "the current CUDA context is not the one the engine was deserialized in");
        return nullptr;
    }
    uint64_t memory = 0;
    if (strategy != ExecutionContextAllocationStrategy::kUSER_MANAGED &&
        !device_alloc(size_t(owner_.memory_bytes()), &memory, &why)) {
        refuse(owner_.logger(), head + why);
        return nullptr;
    }
    return new Context(owner_, strategy, memory);
}

nvinfer1::ICudaEngine* RuntimeImpl::deserializeCudaEngine(void const* blob, std::size_t size) noexcept {
    std::string head = "deserializeCudaEngine(" + std::to_string(size) + " bytes): ";
    if (fault_armed("deserialize")) {
        refuse(logger_, head + "injected fault (CELER_TRT_STANDIN_FAULT_FILE)");
        return nullptr;
    }
    CudaContextInfo cuda;
    std::string why;
    if (!current_context(&cuda, &why)) {
        refuse(logger_, head + why + ": TensorRT deserializes into the CUDA context current on the calling thread");
        return nullptr;
    }
    if (!device_usable(logger_, cuda.device, "deserializeCudaEngine")) return nullptr;
    note_device(cuda.device);
    Plan plan;
    if (!parse_plan(blob, size, &plan, &why)) {
        refuse(logger_, head + why);
        return nullptr;
    }
    if (plan.tensorrt_version != library_version()) {
        refuse(logger_, head + "the plan was built by TensorRT " + version_string(plan.tensorrt_version) +
                            " and this is TensorRT " + version_string(library_version()) +
                            ": a plan runs only on the TensorRT version that built it");
        return nullptr;
    }
    if (plan.compute_capability != cuda.compute_capability) {
        refuse(logger_, head + "the plan was built for compute capability " +
                            std::to_string(plan.compute_capability / 10) + "." +
                            std::to_string(plan.compute_capability % 10) + " and the current device (" +
                            std::to_string(cuda.device) + ") has " + std::to_string(cuda.compute_capability / 10) +
                            "." + std::to_string(cuda.compute_capability % 10) +
                            ": a plan runs only on the GPU model it was built for");
        return nullptr;
    }
    hold_primary_context(cuda.device);
    std::unique_ptr<OrtModel> model(OrtModel::load(plan.onnx, &why));
    if (!model) {
        refuse(logger_, head + "the plan's network does not load: " + why);
        return nullptr;
    }
    uint64_t weights = 0;
    if (!device_alloc(plan.onnx.size(), &weights, &why) ||
        !copy_to_device(weights, plan.onnx.data(), plan.onnx.size(), &why)) {
        device_free(weights);
        refuse(logger_, head + "copying the weights to the device: " + why);
        return nullptr;
    }
    int64_t output_bytes = 0;
    if (!largest_outputs(plan, *model, &output_bytes, &why)) {
        device_free(weights);
        refuse(logger_, head + "inferring the outputs' largest shapes: " + why);
        return nullptr;
    }
    return new Engine(owner_, std::move(plan), std::move(model), cuda, weights, output_bytes);
}

}  // namespace

}  // namespace standin

extern "C" void* standin_cpp_create_runtime(void* logger, int32_t version) {
    auto* log = static_cast<nvinfer1::ILogger*>(logger);
    if (!standin::caller_version_ok(log, "createInferRuntime", version)) return nullptr;
    try {
        return static_cast<nvinfer1::IRuntime*>(new standin::Runtime(log));
    } catch (...) {
        return nullptr;
    }
}
