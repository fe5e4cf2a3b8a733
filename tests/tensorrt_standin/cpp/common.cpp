// The stand-in TensorRT's shared services: the version it plays, messages, the rules'
// bookkeeping (refusals, violations), fault injection, and shape helpers.
#include "standin.h"

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <set>
#include <sstream>
#include <thread>

namespace standin {

namespace {

std::atomic<uint64_t> g_violations{0};
std::atomic<uint64_t> g_refusals{0};

std::mutex g_live_mutex;
std::set<void const*>& live() {
    static auto* objects = new std::set<void const*>();  // never destroyed: used at exit
    return *objects;
}

int32_t parse_version(char const* text) {
    int major = 0, minor = 0, patch = 0;
    if (std::sscanf(text, "%d.%d.%d", &major, &minor, &patch) < 2) return -1;
    return major * 10000 + minor * 100 + patch;
}

}  // namespace

[[noreturn]] void unimplemented(char const* method) noexcept {
    std::fprintf(stderr,
                 "celer TensorRT stand-in: %s is not implemented by the stand-in (celer's shim does not call it; "
                 "a caller that does needs the real TensorRT or a stand-in that models it): aborting\n",
                 method);
    std::fflush(stderr);
    std::abort();
}

int32_t library_version() {
    static int32_t const version = [] {
        char const* text = std::getenv("CELER_TRT_STANDIN_VERSION");
        if (text != nullptr && *text != '\0') {
            int32_t v = parse_version(text);
            if (v > 0) return v;
            std::fprintf(stderr, "celer TensorRT stand-in: CELER_TRT_STANDIN_VERSION=%s is not MAJOR.MINOR.PATCH\n",
                         text);
            std::abort();
        }
        return static_cast<int32_t>(NV_TENSORRT_VERSION);
    }();
    return version;
}

std::string version_string(int32_t v) {
    return std::to_string(v / 10000) + "." + std::to_string((v / 100) % 100) + "." + std::to_string(v % 100);
}

bool caller_version_ok(ILogger* logger, char const* factory, int32_t headers) {
    int32_t library = library_version();
    if (headers / 10000 == library / 10000 && headers <= library) return true;
    refuse(logger, std::string(factory) + ": the caller was compiled against the headers of TensorRT " +
                       version_string(headers) + ", and this library is TensorRT " + version_string(library) +
                       ": it serves callers of its major version built with its own or older headers");
    return false;
}

void log(ILogger* logger, Severity severity, std::string const& message) {
    std::string text = "[celer TensorRT stand-in] " + message;
    if (logger != nullptr) {
        logger->log(severity, text.c_str());
    } else {
        std::fprintf(stderr, "%s\n", text.c_str());
    }
}

void refuse(ILogger* logger, std::string const& message) {
    g_refusals++;
    log(logger, Severity::kERROR, message);
}

void violation(ILogger* logger, std::string const& message) {
    g_violations++;
    std::string text = "rule violated: " + message;
    log(logger, Severity::kINTERNAL_ERROR, text);
    char const* mode = std::getenv("CELER_TRT_STANDIN_ON_VIOLATION");
    if (mode != nullptr && std::string(mode) == "log") return;
    // Also straight to stderr: the logger may be one that drops messages.
    std::fprintf(stderr, "celer TensorRT stand-in: %s: aborting (CELER_TRT_STANDIN_ON_VIOLATION=log to go on)\n",
                 text.c_str());
    std::fflush(stderr);
    std::abort();
}

void wait_for_build_gate() {
    char const* path = std::getenv("CELER_TRT_STANDIN_BUILD_GATE");
    if (path == nullptr || *path == '\0') return;
    auto const until = std::chrono::steady_clock::now() + std::chrono::minutes(10);
    while (std::chrono::steady_clock::now() < until) {
        if (std::ifstream(path)) return;
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
}

bool fault_armed(char const* call) {
    char const* path = std::getenv("CELER_TRT_STANDIN_FAULT_FILE");
    if (path == nullptr || *path == '\0') return false;
    static std::mutex one_at_a_time;
    std::lock_guard<std::mutex> lock(one_at_a_time);
    std::ifstream file(path);
    if (!file) return false;
    std::string word;
    file >> word;
    if (word != call) return false;
    file.close();
    std::remove(path);
    return true;
}

void register_live(void const* object) {
    std::lock_guard<std::mutex> lock(g_live_mutex);
    live().insert(object);
}

void unregister_live(void const* object) {
    std::lock_guard<std::mutex> lock(g_live_mutex);
    live().erase(object);
}

bool is_live(void const* object) {
    std::lock_guard<std::mutex> lock(g_live_mutex);
    return live().count(object) != 0;
}

std::string dims_string(Dims const& dims) {
    if (dims.nbDims < 0) return "[unknown rank]";
    std::string s = "[";
    for (int32_t i = 0; i < dims.nbDims; ++i) {
        if (i > 0) s += "x";
        s += std::to_string(dims.d[i]);
    }
    return s + "]";
}

bool dims_equal(Dims const& a, Dims const& b) {
    if (a.nbDims != b.nbDims) return false;
    for (int32_t i = 0; i < a.nbDims; ++i) {
        if (a.d[i] != b.d[i]) return false;
    }
    return true;
}

int64_t volume(Dims const& dims) {
    int64_t v = 1;
    for (int32_t i = 0; i < dims.nbDims; ++i) v *= dims.d[i] < 0 ? 0 : dims.d[i];
    return v;
}

bool has_dynamic(Dims const& dims) {
    for (int32_t i = 0; i < dims.nbDims; ++i) {
        if (dims.d[i] < 0) return true;
    }
    return false;
}

size_t element_bytes(DataType type) {
    switch (type) {
        case DataType::kFLOAT: return 4;
        case DataType::kHALF: return 2;
        case DataType::kINT8: return 1;
        case DataType::kINT32: return 4;
        case DataType::kBOOL: return 1;
        case DataType::kUINT8: return 1;
        case DataType::kINT64: return 8;
        default: return 0;
    }
}

char const* type_name(DataType type) {
    switch (type) {
        case DataType::kFLOAT: return "float32";
        case DataType::kHALF: return "float16";
        case DataType::kINT8: return "int8";
        case DataType::kINT32: return "int32";
        case DataType::kBOOL: return "bool";
        case DataType::kUINT8: return "uint8";
        case DataType::kINT64: return "int64";
        default: return "a type the stand-in does not run";
    }
}

uint64_t fnv1a(void const* data, size_t bytes) {
    auto const* p = static_cast<unsigned char const*>(data);
    uint64_t h = 0xcbf29ce484222325ull;
    for (size_t i = 0; i < bytes; ++i) {
        h ^= p[i];
        h *= 0x100000001b3ull;
    }
    return h;
}

}  // namespace standin

extern "C" uint64_t standin_cpp_violations(void) { return standin::g_violations.load(); }
extern "C" uint64_t standin_cpp_refusals(void) { return standin::g_refusals.load(); }
extern "C" int32_t standin_cpp_library_version(void) { return standin::library_version(); }
