// The stand-in's serialized engines ("plans") and timing caches. A real plan is bound to
// the TensorRT version and the GPU model that built it; this one records both, with the
// builder flags, the optimisation profiles, the network (the ONNX model itself, and which
// output dimensions are data-dependent), and a checksum, so that a plan from another version or GPU, or a damaged one, is refused at
// deserialisation as the real runtime refuses it.
#include "standin.h"

#include <cstring>

namespace standin {

namespace {

constexpr char kPlanMagic[] = "celer TensorRT stand-in plan";
constexpr char kCacheMagic[] = "celer TensorRT stand-in timing cache";
// 2: each tensor records its data-dependent dimensions.
constexpr uint32_t kPlanFormat = 2;
constexpr uint32_t kCacheFormat = 1;

class Writer {
public:
    void bytes(void const* data, size_t n) {
        auto const* p = static_cast<uint8_t const*>(data);
        out.insert(out.end(), p, p + n);
    }
    template <typename T>
    void value(T v) {
        bytes(&v, sizeof v);
    }
    void text(std::string const& s) {
        value<uint32_t>(static_cast<uint32_t>(s.size()));
        bytes(s.data(), s.size());
    }
    void dims(Dims const& d) {
        value<int32_t>(d.nbDims);
        for (int32_t i = 0; i < d.nbDims; ++i) value<int64_t>(d.d[i]);
    }
    std::vector<uint8_t> out;
};

class Reader {
public:
    Reader(void const* data, size_t size) : p_(static_cast<uint8_t const*>(data)), left_(size) {}
    bool bytes(void* into, size_t n) {
        if (n > left_) return false;
        std::memcpy(into, p_, n);
        p_ += n;
        left_ -= n;
        return true;
    }
    template <typename T>
    bool value(T* v) {
        return bytes(v, sizeof *v);
    }
    bool text(std::string* s) {
        uint32_t n = 0;
        if (!value(&n) || n > left_) return false;
        s->assign(reinterpret_cast<char const*>(p_), n);
        p_ += n;
        left_ -= n;
        return true;
    }
    bool dims(Dims* d) {
        *d = Dims{};
        if (!value(&d->nbDims) || d->nbDims < 0 || d->nbDims > Dims::MAX_DIMS) return false;
        for (int32_t i = 0; i < d->nbDims; ++i) {
            if (!value(&d->d[i])) return false;
        }
        return true;
    }
    size_t left() const { return left_; }

private:
    uint8_t const* p_;
    size_t left_;
};

bool starts_with(void const* data, size_t size, char const* magic) {
    size_t n = std::strlen(magic) + 1;
    return size >= n && std::memcmp(data, magic, n) == 0;
}

}  // namespace

std::vector<uint8_t> serialize_plan(Plan const& plan) {
    Writer w;
    w.bytes(kPlanMagic, sizeof kPlanMagic);
    w.value<uint32_t>(kPlanFormat);
    w.text(plan.name);
    w.value<int32_t>(plan.tensorrt_version);
    w.value<int32_t>(plan.compute_capability);
    w.value<uint32_t>(plan.builder_flags);
    w.value<uint32_t>(static_cast<uint32_t>(plan.io.size()));
    for (TensorInfo const& t : plan.io) {
        w.text(t.name);
        w.value<uint8_t>(t.is_input ? 1 : 0);
        w.value<int32_t>(static_cast<int32_t>(t.type));
        w.dims(t.dims);
        w.value<uint32_t>(t.data_dependent);
    }
    w.value<uint32_t>(static_cast<uint32_t>(plan.profiles.size()));
    for (auto const& profile : plan.profiles) {
        w.value<uint32_t>(static_cast<uint32_t>(profile.size()));
        for (ProfileRange const& r : profile) {
            w.text(r.name);
            w.dims(r.min);
            w.dims(r.opt);
            w.dims(r.max);
        }
    }
    w.value<uint64_t>(plan.onnx.size());
    w.bytes(plan.onnx.data(), plan.onnx.size());
    w.value<uint64_t>(fnv1a(w.out.data(), w.out.size()));
    return std::move(w.out);
}

bool parse_plan(void const* data, size_t size, Plan* out, std::string* why) {
    if (data == nullptr || !starts_with(data, size, kPlanMagic)) {
        *why = "not a serialized engine (no plan header)";
        return false;
    }
    if (size < sizeof(uint64_t)) {
        *why = "the plan is truncated";
        return false;
    }
    uint64_t recorded = 0;
    std::memcpy(&recorded, static_cast<uint8_t const*>(data) + size - sizeof recorded, sizeof recorded);
    if (recorded != fnv1a(data, size - sizeof recorded)) {
        *why = "the plan is damaged (its checksum does not match)";
        return false;
    }
    Reader r(data, size - sizeof recorded);
    char magic[sizeof kPlanMagic];
    uint32_t format = 0, flags = 0, n_io = 0, n_profiles = 0;
    int32_t version = 0, cc = 0;
    Plan plan;
    bool ok = r.bytes(magic, sizeof magic) && r.value(&format) && format == kPlanFormat && r.text(&plan.name) &&
              r.value(&version) && r.value(&cc) && r.value(&flags) && r.value(&n_io);
    plan.tensorrt_version = version;
    plan.compute_capability = cc;
    plan.builder_flags = flags;
    for (uint32_t i = 0; ok && i < n_io; ++i) {
        TensorInfo t;
        uint8_t is_input = 0;
        int32_t type = 0;
        ok = r.text(&t.name) && r.value(&is_input) && r.value(&type) && r.dims(&t.dims) &&
             r.value(&t.data_dependent);
        t.is_input = is_input != 0;
        t.type = static_cast<DataType>(type);
        plan.io.push_back(t);
    }
    ok = ok && r.value(&n_profiles);
    for (uint32_t p = 0; ok && p < n_profiles; ++p) {
        uint32_t n = 0;
        ok = r.value(&n);
        std::vector<ProfileRange> profile;
        for (uint32_t i = 0; ok && i < n; ++i) {
            ProfileRange range;
            ok = r.text(&range.name) && r.dims(&range.min) && r.dims(&range.opt) && r.dims(&range.max);
            profile.push_back(range);
        }
        plan.profiles.push_back(profile);
    }
    uint64_t onnx_bytes = 0;
    ok = ok && r.value(&onnx_bytes) && onnx_bytes == r.left();
    if (ok) {
        plan.onnx.resize(onnx_bytes);
        ok = r.bytes(plan.onnx.data(), onnx_bytes);
    }
    if (!ok) {
        *why = "the plan's layout is not this stand-in's (format " + std::to_string(format) + ")";
        return false;
    }
    *out = std::move(plan);
    return true;
}

std::vector<uint8_t> serialize_timing_cache(TimingCacheData const& cache) {
    Writer w;
    w.bytes(kCacheMagic, sizeof kCacheMagic);
    w.value<uint32_t>(kCacheFormat);
    w.value<int32_t>(cache.tensorrt_version);
    w.value<int32_t>(cache.compute_capability);
    w.value<uint32_t>(static_cast<uint32_t>(cache.entries.size()));
    for (std::string const& e : cache.entries) w.text(e);
    return std::move(w.out);
}

bool parse_timing_cache(void const* data, size_t size, TimingCacheData* out, std::string* why) {
    if (data == nullptr || !starts_with(data, size, kCacheMagic)) {
        *why = "not a serialized timing cache";
        return false;
    }
    Reader r(data, size);
    char magic[sizeof kCacheMagic];
    uint32_t format = 0, n = 0;
    TimingCacheData cache;
    bool ok = r.bytes(magic, sizeof magic) && r.value(&format) && format == kCacheFormat &&
              r.value(&cache.tensorrt_version) && r.value(&cache.compute_capability) && r.value(&n);
    for (uint32_t i = 0; ok && i < n; ++i) {
        std::string entry;
        ok = r.text(&entry);
        cache.entries.push_back(entry);
    }
    if (!ok || r.left() != 0) {
        *why = "the timing cache is damaged";
        return false;
    }
    *out = std::move(cache);
    return true;
}

}  // namespace standin
