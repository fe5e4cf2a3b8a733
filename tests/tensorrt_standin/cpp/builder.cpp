// Building engines: IBuilder, IBuilderConfig, IOptimizationProfile, ITimingCache,
// INetworkDefinition (with its ITensors, filled by the ONNX parser) and IHostMemory. A
// build checks what TensorRT checks (a CUDA device current, every dynamic input covered by
// each optimisation profile, min <= opt <= max) and writes a plan (plan.cpp) bound to this
// TensorRT version and the current device's compute capability. Lifetime rules as
// TensorRT documents them: the parser goes before its network, every network before its
// builder, a timing cache after every builder that uses it; and the builder, which works on
// the device current when it was created, is destroyed with that CUDA context current (the
// network, config, profiles, timing cache and host memory are host objects: no context
// rule). A plan records which output dimensions are data-dependent (found by running the
// network on two inputs of the same shapes).
#include "standin.h"

#include <atomic>
#include <cstring>
#include <map>
#include <memory>
#include <set>

namespace standin {

using nvinfer1::BuilderFlag;
using nvinfer1::BuilderFlags;
using nvinfer1::MemoryPoolType;
using nvinfer1::OptProfileSelector;

class Builder;

// ---- host memory ------------------------------------------------------------------------

class HostMemoryImpl final : public nvinfer1::apiv::StubVHostMemory {
public:
    explicit HostMemoryImpl(std::vector<uint8_t> bytes) : bytes_(std::move(bytes)) {}
    void* data() const noexcept override { return const_cast<uint8_t*>(bytes_.data()); }
    std::size_t size() const noexcept override { return bytes_.size(); }
    DataType type() const noexcept override { return DataType::kUINT8; }

private:
    std::vector<uint8_t> bytes_;
};

class HostMemory final : public nvinfer1::IHostMemory {
public:
    explicit HostMemory(std::vector<uint8_t> bytes) : impl_(std::move(bytes)) { mImpl = &impl_; }

private:
    HostMemoryImpl impl_;
};

// ---- optimisation profiles ------------------------------------------------------------

class ProfileImpl final : public nvinfer1::apiv::StubVOptimizationProfile {
public:
    explicit ProfileImpl(ILogger* logger) : logger_(logger) {}
    bool setDimensions(char const* name, OptProfileSelector select, Dims const& dims) noexcept override {
        if (name == nullptr || dims.nbDims < 0 || dims.nbDims > Dims::MAX_DIMS) {
            refuse(logger_, "IOptimizationProfile::setDimensions: a name and a shape of 0 to 8 dimensions are needed");
            return false;
        }
        for (int32_t i = 0; i < dims.nbDims; ++i) {
            if (dims.d[i] < 0) {
                refuse(logger_, std::string("IOptimizationProfile::setDimensions(`") + name + "`, " +
                                    dims_string(dims) + "): a profile's dimensions must be known (no -1)");
                return false;
            }
        }
        Entry& e = entries_[name];
        e.dims[int(select)] = dims;
        e.set[int(select)] = true;
        return true;
    }
    Dims getDimensions(char const* name, OptProfileSelector select) const noexcept override {
        auto found = entries_.find(name != nullptr ? name : "");
        if (found == entries_.end() || !found->second.set[int(select)]) {
            Dims d{};
            d.nbDims = -1;
            return d;
        }
        return found->second.dims[int(select)];
    }
    bool isValid() const noexcept override {
        std::string why;
        return valid(&why);
    }

    // The profile as ranges, or why it is not one (an input lacking min, opt or max, ranks
    // that differ, min > opt or opt > max).
    bool valid(std::string* why) const {
        for (auto const& [name, e] : entries_) {
            if (!(e.set[0] && e.set[1] && e.set[2])) {
                *why = "input `" + name + "` lacks its kMIN, kOPT or kMAX shape";
                return false;
            }
            Dims const &min = e.dims[0], &opt = e.dims[1], &max = e.dims[2];
            if (min.nbDims != opt.nbDims || opt.nbDims != max.nbDims) {
                *why = "input `" + name + "` has shapes of different ranks";
                return false;
            }
            for (int32_t i = 0; i < min.nbDims; ++i) {
                if (!(min.d[i] <= opt.d[i] && opt.d[i] <= max.d[i])) {
                    *why = "input `" + name + "`: " + dims_string(min) + " / " + dims_string(opt) + " / " +
                           dims_string(max) + " is not min <= opt <= max";
                    return false;
                }
            }
        }
        return true;
    }

    std::vector<ProfileRange> ranges() const {
        std::vector<ProfileRange> out;
        for (auto const& [name, e] : entries_) out.push_back(ProfileRange{name, e.dims[0], e.dims[1], e.dims[2]});
        return out;
    }

private:
    struct Entry {
        Dims dims[3]{};
        bool set[3]{false, false, false};
    };
    ILogger* logger_;
    std::map<std::string, Entry> entries_;
};

class Profile final : public nvinfer1::IOptimizationProfile {
public:
    explicit Profile(ILogger* logger) : impl_(logger) { mImpl = &impl_; }
    ProfileImpl const& impl() const { return impl_; }

private:
    ProfileImpl impl_;
};

// ---- timing caches -----------------------------------------------------------------------

class TimingCache;

class TimingCacheImpl final : public nvinfer1::apiv::StubVTimingCache {
public:
    TimingCacheImpl(TimingCache& owner, ILogger* logger, TimingCacheData data)
        : owner_(owner), logger_(logger), data_(std::move(data)) {}
    nvinfer1::IHostMemory* serialize() const noexcept override {
        std::lock_guard<std::mutex> lock(mutex_);
        return new HostMemory(serialize_timing_cache(data_));
    }
    bool combine(nvinfer1::ITimingCache const& other, bool ignoreMismatch) noexcept override;
    bool reset() noexcept override {
        std::lock_guard<std::mutex> lock(mutex_);
        data_.entries.clear();
        return true;
    }

    // Whether it was made on this TensorRT for a device of `compute_capability`.
    bool fits(int compute_capability) const {
        std::lock_guard<std::mutex> lock(mutex_);
        return data_.tensorrt_version == library_version() && data_.compute_capability == compute_capability;
    }
    std::string origin() const {
        std::lock_guard<std::mutex> lock(mutex_);
        return "TensorRT " + version_string(data_.tensorrt_version) + ", compute capability " +
               std::to_string(data_.compute_capability / 10) + "." + std::to_string(data_.compute_capability % 10);
    }
    // Records a build's "timings"; true when they were already there (a cache hit).
    bool record(std::string const& entry) {
        std::lock_guard<std::mutex> lock(mutex_);
        for (std::string const& e : data_.entries) {
            if (e == entry) return true;
        }
        data_.entries.push_back(entry);
        return false;
    }
    TimingCacheData data() const {
        std::lock_guard<std::mutex> lock(mutex_);
        return data_;
    }
    ILogger* logger() const { return logger_; }

    // The builders whose configs use this cache (the cache must outlive them).
    std::set<Builder const*> users;

private:
    TimingCache& owner_;
    ILogger* logger_;
    mutable std::mutex mutex_;
    TimingCacheData data_;
};

class TimingCache final : public nvinfer1::ITimingCache {
public:
    TimingCache(ILogger* logger, TimingCacheData data) : impl_(*this, logger, std::move(data)) {
        mImpl = &impl_;
        register_live(this);
    }
    ~TimingCache() noexcept override;
    TimingCacheImpl& impl() { return impl_; }
    TimingCacheImpl const& impl() const { return impl_; }

private:
    TimingCacheImpl impl_;
};

bool TimingCacheImpl::combine(nvinfer1::ITimingCache const& other, bool ignoreMismatch) noexcept {
    auto const* theirs = dynamic_cast<TimingCache const*>(&other);
    if (theirs == nullptr) {
        refuse(logger_, "ITimingCache::combine: not a timing cache of this library");
        return false;
    }
    TimingCacheData them = theirs->impl().data();
    if (!ignoreMismatch && (them.tensorrt_version != data_.tensorrt_version ||
                            them.compute_capability != data_.compute_capability)) {
        refuse(logger_, "ITimingCache::combine: the caches come from different devices or TensorRT versions");
        return false;
    }
    for (std::string const& e : them.entries) record(e);
    return true;
}

// ---- the network ---------------------------------------------------------------------

class TensorImpl final : public nvinfer1::apiv::StubVTensor {
public:
    explicit TensorImpl(TensorInfo info) : info_(std::move(info)) {}
    char const* getName() const noexcept override { return info_.name.c_str(); }
    Dims getDimensions() const noexcept override { return info_.dims; }
    DataType getType() const noexcept override { return info_.type; }
    bool isNetworkInput() const noexcept override { return info_.is_input; }
    bool isNetworkOutput() const noexcept override { return !info_.is_input; }
    nvinfer1::TensorLocation getLocation() const noexcept override { return nvinfer1::TensorLocation::kDEVICE; }

private:
    TensorInfo info_;
};

class Tensor final : public nvinfer1::ITensor {
public:
    explicit Tensor(TensorInfo info) : impl_(std::move(info)) { mImpl = &impl_; }
    // ITensor's destructor is protected (the network owns its tensors): this one is not.
    ~Tensor() noexcept override = default;

private:
    TensorImpl impl_;
};

class NetworkImpl final : public nvinfer1::apiv::StubVNetworkDefinition {
public:
    NetworkImpl(Network& owner, Builder& builder, uint32_t flags) : owner_(owner), builder_(builder), flags_(flags) {}
    int32_t getNbInputs() const noexcept override { return static_cast<int32_t>(inputs.size()); }
    int32_t getNbOutputs() const noexcept override { return static_cast<int32_t>(outputs.size()); }
    nvinfer1::ITensor* getInput(int32_t index) const noexcept override {
        return index >= 0 && size_t(index) < inputs.size() ? inputs[size_t(index)].get() : nullptr;
    }
    nvinfer1::ITensor* getOutput(int32_t index) const noexcept override {
        return index >= 0 && size_t(index) < outputs.size() ? outputs[size_t(index)].get() : nullptr;
    }
    int32_t getNbLayers() const noexcept override { return onnx.empty() ? 0 : 1; }
    void setName(char const* text) noexcept override { name = text != nullptr ? text : ""; }
    char const* getName() const noexcept override { return name.c_str(); }
    nvinfer1::IBuilder& getBuilder() const noexcept override;
    nvinfer1::NetworkDefinitionCreationFlags getFlags() const noexcept override { return flags_; }
    bool getFlag(nvinfer1::NetworkDefinitionCreationFlag flag) const noexcept override {
        return (flags_ & (1U << static_cast<uint32_t>(flag))) != 0;
    }

    Builder& builder() const { return builder_; }

    std::string name;
    std::vector<TensorInfo> io;
    std::vector<std::unique_ptr<Tensor>> inputs, outputs;
    std::vector<uint8_t> onnx;
    std::atomic<int> parsers{0};

private:
    Network& owner_;
    Builder& builder_;
    uint32_t flags_;
};

class Network final : public nvinfer1::INetworkDefinition {
public:
    Network(Builder& builder, uint32_t flags);
    ~Network() noexcept override;
    NetworkImpl& impl() { return impl_; }

private:
    NetworkImpl impl_;
};

// ---- builder configs -------------------------------------------------------------------

class ConfigImpl final : public nvinfer1::apiv::StubVBuilderConfig {
public:
    ConfigImpl(Builder& builder, ILogger* logger) : builder_(builder), logger_(logger) {}
    void setFlags(BuilderFlags flags) noexcept override { flags_ = flags; }
    BuilderFlags getFlags() const noexcept override { return flags_; }
    void setFlag(BuilderFlag flag) noexcept override { flags_ |= 1U << static_cast<uint32_t>(flag); }
    void clearFlag(BuilderFlag flag) noexcept override { flags_ &= ~(1U << static_cast<uint32_t>(flag)); }
    bool getFlag(BuilderFlag flag) const noexcept override {
        return (flags_ & (1U << static_cast<uint32_t>(flag))) != 0;
    }
    void setMemoryPoolLimit(MemoryPoolType pool, std::size_t bytes) noexcept override { pools_[int(pool)] = bytes; }
    std::size_t getMemoryPoolLimit(MemoryPoolType pool) const noexcept override {
        auto found = pools_.find(int(pool));
        return found != pools_.end() ? found->second : 0;
    }
    int32_t addOptimizationProfile(nvinfer1::IOptimizationProfile const* profile) noexcept override;
    int32_t getNbOptimizationProfiles() const noexcept override { return static_cast<int32_t>(profiles_.size()); }
    nvinfer1::ITimingCache* createTimingCache(void const* blob, std::size_t size) const noexcept override;
    bool setTimingCache(nvinfer1::ITimingCache const& cache, bool ignoreMismatch) noexcept override;
    nvinfer1::ITimingCache const* getTimingCache() const noexcept override { return cache_; }
    void setProgressMonitor(nvinfer1::IProgressMonitor* monitor) noexcept override { monitor_ = monitor; }
    nvinfer1::IProgressMonitor* getProgressMonitor() const noexcept override { return monitor_; }

    Builder& builder() const { return builder_; }
    std::vector<Profile const*> const& profiles() const { return profiles_; }
    TimingCache* cache() const { return cache_; }

private:
    Builder& builder_;
    ILogger* logger_;
    BuilderFlags flags_ = 0;
    std::map<int, std::size_t> pools_;
    std::vector<Profile const*> profiles_;
    TimingCache* cache_ = nullptr;
    nvinfer1::IProgressMonitor* monitor_ = nullptr;
};

class Config final : public nvinfer1::IBuilderConfig {
public:
    Config(Builder& builder, ILogger* logger);
    ~Config() noexcept override;
    ConfigImpl& impl() { return impl_; }

private:
    ConfigImpl impl_;
};

// ---- the builder ---------------------------------------------------------------------

class BuilderImpl final : public nvinfer1::apiv::StubVBuilder {
public:
    BuilderImpl(Builder& owner, ILogger* logger) : owner_(owner), logger_(logger) {}
    bool platformHasFastFp16() const noexcept override { return true; }
    bool platformHasFastInt8() const noexcept override { return true; }
    bool platformHasTf32() const noexcept override { return true; }
    int32_t getNbDLACores() const noexcept override { return 0; }
    int32_t getMaxDLABatchSize() const noexcept override { return 1; }
    nvinfer1::IBuilderConfig* createBuilderConfig() noexcept override;
    nvinfer1::INetworkDefinition* createNetworkV2(nvinfer1::NetworkDefinitionCreationFlags flags) noexcept override;
    nvinfer1::IOptimizationProfile* createOptimizationProfile() noexcept override;
    nvinfer1::IHostMemory* buildSerializedNetwork(nvinfer1::INetworkDefinition& network,
                                                  nvinfer1::IBuilderConfig& config) noexcept override;
    ILogger* getLogger() const noexcept override { return logger_; }
    bool setMaxThreads(int32_t) noexcept override { return true; }
    int32_t getMaxThreads() const noexcept override { return 1; }

    ILogger* logger() const { return logger_; }
    std::atomic<int> networks{0};
    std::atomic<int> configs{0};
    std::set<TimingCache*> caches;
    std::vector<std::unique_ptr<Profile>> profiles;

private:
    Builder& owner_;
    ILogger* logger_;
};

class Builder final : public nvinfer1::IBuilder {
public:
    // `cuda`: the context current at createInferBuilder, the one it builds in.
    Builder(ILogger* logger, CudaContextInfo cuda) : impl_(*this, logger), cuda_(cuda) {
        mImpl = &impl_;
        register_live(this);
    }
    ~Builder() noexcept override {
        unregister_live(this);
        if (device_usable(impl_.logger(), cuda_.device, "IBuilder destroyed: it")) {
            check_destroyed_in(impl_.logger(), "IBuilder", "created", cuda_);
        }
        int networks = impl_.networks.load();
        int configs = impl_.configs.load();
        if (networks > 0 || configs > 0) {
            violation(impl_.logger(), "IBuilder destroyed while " + std::to_string(networks) + " network(s) and " +
                                          std::to_string(configs) +
                                          " builder config(s) it created are alive: a network and a config must be "
                                          "destroyed before their builder");
        }
        for (TimingCache* cache : impl_.caches) {
            if (is_live(cache)) cache->impl().users.erase(this);
        }
    }
    BuilderImpl& impl() { return impl_; }

private:
    BuilderImpl impl_;
    CudaContextInfo cuda_;
};

nvinfer1::IBuilder& NetworkImpl::getBuilder() const noexcept { return builder_; }

Network::Network(Builder& builder, uint32_t flags) : impl_(*this, builder, flags) {
    mImpl = &impl_;
    builder.impl().networks++;
    register_live(this);
}

Network::~Network() noexcept {
    unregister_live(this);
    if (impl_.parsers.load() > 0) {
        violation(impl_.builder().impl().logger(),
                  "INetworkDefinition `" + impl_.name +
                      "` destroyed while its ONNX parser is alive: the parser must be destroyed before its network");
    }
    if (is_live(&impl_.builder())) impl_.builder().impl().networks--;
}

Config::Config(Builder& builder, ILogger* logger) : impl_(builder, logger) {
    mImpl = &impl_;
    builder.impl().configs++;
    register_live(this);
}

Config::~Config() noexcept {
    unregister_live(this);
    if (is_live(&impl_.builder())) impl_.builder().impl().configs--;
}

TimingCache::~TimingCache() noexcept {
    unregister_live(this);
    std::set<Builder const*> users;
    for (Builder const* b : impl_.users) {
        if (is_live(b)) users.insert(b);
    }
    if (!users.empty()) {
        violation(impl_.logger(), "ITimingCache destroyed while " + std::to_string(users.size()) +
                                      " builder(s) that use it are alive: the timing cache must outlive every "
                                      "builder that uses it");
    }
}

int32_t ConfigImpl::addOptimizationProfile(nvinfer1::IOptimizationProfile const* profile) noexcept {
    auto const* ours = dynamic_cast<Profile const*>(profile);
    if (ours == nullptr) {
        refuse(logger_, "addOptimizationProfile: not a profile made by this library's createOptimizationProfile");
        return -1;
    }
    std::string why;
    if (!ours->impl().valid(&why)) {
        refuse(logger_, "addOptimizationProfile: invalid profile: " + why);
        return -1;
    }
    profiles_.push_back(ours);
    return static_cast<int32_t>(profiles_.size()) - 1;
}

nvinfer1::ITimingCache* ConfigImpl::createTimingCache(void const* blob, std::size_t size) const noexcept {
    CudaContextInfo cuda;
    std::string why;
    if (!current_context(&cuda, &why)) {
        refuse(logger_, "createTimingCache: " + why);
        return nullptr;
    }
    TimingCacheData data;
    if (blob == nullptr || size == 0) {
        data.tensorrt_version = library_version();
        data.compute_capability = cuda.compute_capability;
    } else if (!parse_timing_cache(blob, size, &data, &why)) {
        refuse(logger_, "createTimingCache(" + std::to_string(size) + " bytes): " + why);
        return nullptr;
    }
    return new TimingCache(logger_, std::move(data));
}

bool ConfigImpl::setTimingCache(nvinfer1::ITimingCache const& cache, bool ignoreMismatch) noexcept {
    auto const* ours = dynamic_cast<TimingCache const*>(&cache);
    if (ours == nullptr) {
        refuse(logger_, "setTimingCache: not a timing cache of this library");
        return false;
    }
    auto* mine = const_cast<TimingCache*>(ours);
    CudaContextInfo cuda;
    std::string why;
    if (!current_context(&cuda, &why)) {
        refuse(logger_, "setTimingCache: " + why);
        return false;
    }
    if (!ignoreMismatch && !mine->impl().fits(cuda.compute_capability)) {
        log(logger_, Severity::kWARNING,
            "setTimingCache: the cache was made with " + mine->impl().origin() +
                ", which is not this device or TensorRT version: refused (ignoreMismatch is false)");
        return false;
    }
    cache_ = mine;
    mine->impl().users.insert(&builder_);
    builder_.impl().caches.insert(mine);
    return true;
}

nvinfer1::IBuilderConfig* BuilderImpl::createBuilderConfig() noexcept { return new Config(owner_, logger_); }

nvinfer1::INetworkDefinition* BuilderImpl::createNetworkV2(nvinfer1::NetworkDefinitionCreationFlags flags) noexcept {
    return new Network(owner_, flags);
}

nvinfer1::IOptimizationProfile* BuilderImpl::createOptimizationProfile() noexcept {
    // Owned by the builder, as TensorRT's are: the caller never destroys a profile.
    profiles.push_back(std::make_unique<Profile>(logger_));
    return profiles.back().get();
}

namespace {

// `count` elements of `type` that each hold one.
std::vector<uint8_t> ones(DataType type, size_t count) {
    size_t size = element_bytes(type);
    std::vector<uint8_t> bytes(count * size, 0);
    for (size_t i = 0; i < count; ++i) {
        uint8_t* at = bytes.data() + i * size;
        switch (type) {
            case DataType::kFLOAT: {
                float one = 1.0f;
                std::memcpy(at, &one, sizeof one);
                break;
            }
            case DataType::kHALF: at[1] = 0x3C; break;  // 1.0 in binary16, little-endian
            default: at[0] = 1; break;                   // integers and bool, little-endian
        }
    }
    return bytes;
}

// Marks the outputs' data-dependent dimensions in `io`: the network runs (ONNX Runtime) at
// each input's optimum shape of the first profile (its static shape without one), once on
// zeros and once on ones, and a dynamic output dimension that comes out different is fixed
// by the values, not the shapes (NonZero's count, say). A data-dependent dimension that
// happens to agree for both inputs goes unseen (the engine then fails when it runs).
bool find_data_dependent(std::vector<uint8_t> const& onnx, std::vector<std::vector<ProfileRange>> const& profiles,
                         std::vector<TensorInfo>* io, std::string* why) {
    bool dynamic = false;
    for (TensorInfo const& t : *io) dynamic = dynamic || (!t.is_input && has_dynamic(t.dims));
    if (!dynamic) return true;
    std::unique_ptr<OrtModel> model(OrtModel::load(onnx, why));
    if (!model) return false;
    std::vector<std::vector<uint8_t>> filled;
    filled.reserve(io->size());
    std::vector<OrtModel::Binding> zeros, filled_with_ones, at_zeros;
    for (TensorInfo const& t : *io) {
        if (!t.is_input) {
            at_zeros.push_back(OrtModel::Binding{t.name, t.type, t.dims, nullptr, 0});
            continue;
        }
        Dims dims = t.dims;
        if (!profiles.empty()) {
            for (ProfileRange const& r : profiles[0]) {
                if (r.name == t.name) dims = r.opt;
            }
        }
        filled.push_back(ones(t.type, size_t(volume(dims))));
        zeros.push_back(OrtModel::Binding{t.name, t.type, dims, nullptr, 0});
        filled_with_ones.push_back(OrtModel::Binding{t.name, t.type, dims, filled.back().data(), filled.back().size()});
    }
    std::vector<OrtModel::Binding> at_ones = at_zeros;
    if (!model->run(zeros, &at_zeros, why) || !model->run(filled_with_ones, &at_ones, why)) return false;
    size_t k = 0;
    for (TensorInfo& t : *io) {
        if (t.is_input) continue;
        Dims const& a = at_zeros[k].dims;
        Dims const& b = at_ones[k].dims;
        ++k;
        for (int32_t i = 0; i < t.dims.nbDims && i < 32; ++i) {
            bool differs = a.nbDims != b.nbDims || i >= a.nbDims || a.d[i] != b.d[i];
            if (t.dims.d[i] < 0 && differs) t.data_dependent |= 1u << i;
        }
    }
    return true;
}

}  // namespace

nvinfer1::IHostMemory* BuilderImpl::buildSerializedNetwork(nvinfer1::INetworkDefinition& network_api,
                                                           nvinfer1::IBuilderConfig& config_api) noexcept {
    std::string head = "buildSerializedNetwork: ";
    auto* network = dynamic_cast<Network*>(&network_api);
    auto* config = dynamic_cast<Config*>(&config_api);
    if (network == nullptr || config == nullptr) {
        refuse(logger_, head + "the network or the config was not made by this library");
        return nullptr;
    }
    if (&network->impl().builder() != &owner_ || &config->impl().builder() != &owner_) {
        refuse(logger_, head + "the network and the config must come from this builder");
        return nullptr;
    }
    NetworkImpl& net = network->impl();
    head = "buildSerializedNetwork of `" + net.name + "`: ";
    CudaContextInfo cuda;
    std::string why;
    if (!current_context(&cuda, &why)) {
        refuse(logger_, head + why + ": TensorRT builds on the CUDA device current on the calling thread");
        return nullptr;
    }
    if (!device_usable(logger_, cuda.device, "buildSerializedNetwork of `" + net.name + "`")) return nullptr;
    if (net.onnx.empty()) {
        refuse(logger_, head + "the network is empty: parse an ONNX model into it first");
        return nullptr;
    }
    wait_for_build_gate();
    // Every profile must give a range to every dynamic input, within the input's static
    // dimensions and rank.
    std::vector<std::vector<ProfileRange>> profiles;
    for (Profile const* p : config->impl().profiles()) profiles.push_back(p->impl().ranges());
    for (TensorInfo const& t : net.io) {
        if (!t.is_input || !has_dynamic(t.dims)) continue;
        if (profiles.empty()) {
            refuse(logger_, head + "input `" + t.name + "` is dynamic " + dims_string(t.dims) +
                                ", but no optimisation profile has been defined");
            return nullptr;
        }
    }
    for (size_t p = 0; p < profiles.size(); ++p) {
        for (TensorInfo const& t : net.io) {
            if (!t.is_input) continue;
            ProfileRange const* range = nullptr;
            for (ProfileRange const& r : profiles[p]) {
                if (r.name == t.name) range = &r;
            }
            if (range == nullptr) {
                if (has_dynamic(t.dims)) {
                    refuse(logger_, head + "optimisation profile " + std::to_string(p) + " has no range for dynamic input `" +
                                        t.name + "`");
                    return nullptr;
                }
                continue;
            }
            for (Dims const* d : {&range->min, &range->opt, &range->max}) {
                bool fits = d->nbDims == t.dims.nbDims;
                for (int32_t i = 0; fits && i < d->nbDims; ++i) fits = t.dims.d[i] < 0 || t.dims.d[i] == d->d[i];
                if (!fits) {
                    refuse(logger_, head + "optimisation profile " + std::to_string(p) + " gives input `" + t.name +
                                        "` the shape " + dims_string(*d) + ", which does not fit its dimensions " +
                                        dims_string(t.dims));
                    return nullptr;
                }
            }
        }
        for (ProfileRange const& r : profiles[p]) {
            bool known = false;
            for (TensorInfo const& t : net.io) known = known || (t.is_input && t.name == r.name);
            if (!known) {
                refuse(logger_, head + "optimisation profile " + std::to_string(p) + " names `" + r.name +
                                    "`, which is not an input of the network");
                return nullptr;
            }
        }
    }
    std::vector<TensorInfo> io = net.io;
    if (!find_data_dependent(net.onnx, profiles, &io, &why)) {
        refuse(logger_, head + "finding the outputs' data-dependent dimensions: " + why);
        return nullptr;
    }
    hold_primary_context(cuda.device);
    nvinfer1::IProgressMonitor* monitor = config->impl().getProgressMonitor();
    char const* phases[] = {"Parsing the network", "Choosing kernels", "Serializing the engine"};
    if (monitor != nullptr) monitor->phaseStart("Building the engine", nullptr, 3);
    for (int32_t step = 0; step < 3; ++step) {
        if (monitor != nullptr) {
            monitor->phaseStart(phases[step], "Building the engine", 1);
            bool go_on = monitor->stepComplete(phases[step], 0);
            monitor->phaseFinish(phases[step]);
            if (!go_on) {
                monitor->phaseFinish("Building the engine");
                refuse(logger_, head + "cancelled by the progress monitor");
                return nullptr;
            }
            go_on = monitor->stepComplete("Building the engine", step);
            if (!go_on) {
                monitor->phaseFinish("Building the engine");
                refuse(logger_, head + "cancelled by the progress monitor");
                return nullptr;
            }
        }
    }
    if (monitor != nullptr) monitor->phaseFinish("Building the engine");
    if (TimingCache* cache = config->impl().cache()) {
        std::string entry = std::to_string(cuda.compute_capability) + ":" +
                            std::to_string(fnv1a(net.onnx.data(), net.onnx.size()));
        bool hit = cache->impl().record(entry);
        log(logger_, Severity::kINFO,
            head + (hit ? "the timing cache had this network's timings" : "timings added to the timing cache"));
    }
    Plan plan;
    plan.name = net.name;
    plan.tensorrt_version = library_version();
    plan.compute_capability = cuda.compute_capability;
    plan.builder_flags = config->impl().getFlags();
    plan.io = io;
    plan.profiles = profiles;
    plan.onnx = net.onnx;
    try {
        return new HostMemory(serialize_plan(plan));
    } catch (std::exception const& e) {
        refuse(logger_, head + e.what());
        return nullptr;
    }
}

nvinfer1::IHostMemory* host_memory(std::vector<uint8_t> bytes) { return new HostMemory(std::move(bytes)); }

void network_attach_parser(Network* network) { network->impl().parsers++; }

void network_detach_parser(Network* network) {
    if (is_live(network)) network->impl().parsers--;
}

bool network_has_model(Network* network) { return !network->impl().onnx.empty(); }

void network_set_model(Network* network, std::string name, std::vector<TensorInfo> io, std::vector<uint8_t> onnx) {
    NetworkImpl& net = network->impl();
    if (net.name.empty()) net.name = std::move(name);
    for (TensorInfo const& t : io) {
        (t.is_input ? net.inputs : net.outputs).push_back(std::make_unique<Tensor>(t));
    }
    net.io = std::move(io);
    net.onnx = std::move(onnx);
}

Network* as_network(nvinfer1::INetworkDefinition* network) {
    auto* ours = dynamic_cast<Network*>(network);
    return ours != nullptr && is_live(ours) ? ours : nullptr;
}

}  // namespace standin

extern "C" void* standin_cpp_create_builder(void* logger, int32_t version) {
    auto* log = static_cast<nvinfer1::ILogger*>(logger);
    if (!standin::caller_version_ok(log, "createInferBuilder", version)) return nullptr;
    standin::CudaContextInfo cuda;
    std::string why;
    if (!standin::current_context(&cuda, &why)) {
        standin::refuse(log, "createInferBuilder: " + why + ": a builder needs a CUDA device");
        return nullptr;
    }
    if (!standin::device_usable(log, cuda.device, "createInferBuilder")) return nullptr;
    try {
        return static_cast<nvinfer1::IBuilder*>(new standin::Builder(log, cuda));
    } catch (...) {
        return nullptr;
    }
}
