// The CUDA driver as the stand-in TensorRT uses it: opened by name, like the real
// libnvinfer's CUDA runtime opens it. Only celer's stand-in driver has
// celer_standin_enqueue_work, which an engine's execution needs: on a real driver (where
// the real TensorRT belongs) the stand-in says so instead of running anything.
#include "standin.h"

#include <dlfcn.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <set>

#include "celer_standin_work.h"

namespace standin {

namespace {

using CuResult = int;

struct Driver {
    void* handle = nullptr;
    std::string error;
    CuResult (*ctx_get_current)(void**) = nullptr;
    CuResult (*ctx_get_device)(int*) = nullptr;
    CuResult (*device_get_attribute)(int*, int, int) = nullptr;
    CuResult (*primary_ctx_retain)(void**, int) = nullptr;
    CuResult (*mem_alloc)(uint64_t*, size_t) = nullptr;
    CuResult (*mem_free)(uint64_t) = nullptr;
    CuResult (*memcpy_htod)(uint64_t, void const*, size_t) = nullptr;
    CuResult (*get_error_name)(CuResult, char const**) = nullptr;
    CuResult (*get_error_string)(CuResult, char const**) = nullptr;
    CuResult (*stream_synchronize)(void*) = nullptr;
    decltype(&celer_standin_enqueue_work) enqueue_work = nullptr;
    decltype(&celer_standin_make_sticky) make_sticky = nullptr;
    uint64_t (*device_lost)(int, int*, char*, size_t) = nullptr;
    uint64_t (*thread_told_of_loss)(int) = nullptr;
};

template <typename Fn>
void resolve(Driver& d, Fn* slot, char const* name) {
    *slot = reinterpret_cast<Fn>(dlsym(d.handle, name));
    if (*slot == nullptr && d.error.empty()) {
        d.error = std::string("libcuda.so.1 has no ") + name;
    }
}

Driver const& driver() {
    static Driver const d = [] {
        Driver d;
        d.handle = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
        if (d.handle == nullptr) {
            char const* e = dlerror();
            d.error = std::string("cannot open libcuda.so.1: ") + (e != nullptr ? e : "?");
            return d;
        }
        resolve(d, &d.ctx_get_current, "cuCtxGetCurrent");
        resolve(d, &d.ctx_get_device, "cuCtxGetDevice");
        resolve(d, &d.device_get_attribute, "cuDeviceGetAttribute");
        resolve(d, &d.primary_ctx_retain, "cuDevicePrimaryCtxRetain");
        resolve(d, &d.mem_alloc, "cuMemAlloc_v2");
        resolve(d, &d.mem_free, "cuMemFree_v2");
        resolve(d, &d.memcpy_htod, "cuMemcpyHtoD_v2");
        resolve(d, &d.get_error_name, "cuGetErrorName");
        resolve(d, &d.get_error_string, "cuGetErrorString");
        resolve(d, &d.stream_synchronize, "cuStreamSynchronize");
        d.enqueue_work = reinterpret_cast<decltype(&celer_standin_enqueue_work)>(
            dlsym(d.handle, "celer_standin_enqueue_work"));
        d.make_sticky =
            reinterpret_cast<decltype(&celer_standin_make_sticky)>(dlsym(d.handle, "celer_standin_make_sticky"));
        d.device_lost =
            reinterpret_cast<uint64_t (*)(int, int*, char*, size_t)>(dlsym(d.handle, "celer_standin_device_lost"));
        d.thread_told_of_loss =
            reinterpret_cast<uint64_t (*)(int)>(dlsym(d.handle, "celer_standin_thread_told_of_loss"));
        bool ours = d.enqueue_work != nullptr && d.make_sticky != nullptr && d.device_lost != nullptr &&
                    d.thread_told_of_loss != nullptr;
        if (!ours && d.error.empty()) {
            d.error =
                "libcuda.so.1 is not celer's stand-in CUDA driver (no celer_standin_enqueue_work, "
                "celer_standin_make_sticky, celer_standin_device_lost or celer_standin_thread_told_of_loss): the "
                "TensorRT stand-in runs only on it; on a real GPU use the real TensorRT";
        }
        return d;
    }();
    return d;
}

}  // namespace

std::string result_text(int r) {
    char const* name = nullptr;
    Driver const& d = driver();
    if (d.get_error_name != nullptr && d.get_error_name(r, &name) == 0 && name != nullptr) return name;
    return "CUresult " + std::to_string(r);
}

std::string cuda_runtime_error(int r) {
    char const* text = nullptr;
    Driver const& d = driver();
    if (d.get_error_string != nullptr && d.get_error_string(r, &text) == 0 && text != nullptr) {
        return std::string("Error Code 1: Cuda Runtime (") + text + ")";
    }
    return "Error Code 1: Cuda Runtime (" + result_text(r) + ")";
}

bool is_sticky_error(int r) {
    // CUDA_ERROR_ILLEGAL_ADDRESS, _LAUNCH_FAILED, _HARDWARE_STACK_ERROR,
    // _ILLEGAL_INSTRUCTION, _MISALIGNED_ADDRESS: the faults that poison a context.
    return r == 700 || r == 719 || r == 714 || r == 715 || r == 716;
}

namespace {

bool usable(std::string* why) {
    Driver const& d = driver();
    if (!d.error.empty()) {
        *why = d.error;
        return false;
    }
    return true;
}

struct PendingWork {
    std::function<std::string()> run;
    std::function<void()> done;
};

int run_trampoline(void* user, char* why, size_t why_len) {
    auto* work = static_cast<PendingWork*>(user);
    std::string failure;
    try {
        failure = work->run();
    } catch (std::exception const& e) {
        failure = std::string("exception: ") + e.what();
    } catch (...) {
        failure = "unknown exception";
    }
    if (failure.empty()) return 0;
    if (why != nullptr && why_len > 0) {
        std::strncpy(why, failure.c_str(), why_len - 1);
        why[why_len - 1] = '\0';
    }
    return 1;
}

void done_trampoline(void* user) {
    std::unique_ptr<PendingWork> work(static_cast<PendingWork*>(user));
    try {
        if (work->done) work->done();
    } catch (...) {
    }
}

}  // namespace

bool current_context(CudaContextInfo* out, std::string* why) {
    if (!usable(why)) return false;
    Driver const& d = driver();
    void* context = nullptr;
    if (d.ctx_get_current(&context) != 0 || context == nullptr) {
        *why = "no CUDA context is current on the calling thread";
        return false;
    }
    int device = -1;
    if (CuResult r = d.ctx_get_device(&device)) {
        *why = "cuCtxGetDevice: " + result_text(r);
        return false;
    }
    int major = 0, minor = 0;
    if (d.device_get_attribute(&major, 75, device) != 0 || d.device_get_attribute(&minor, 76, device) != 0) {
        *why = "cannot read the device's compute capability";
        return false;
    }
    out->context = context;
    out->device = device;
    out->compute_capability = major * 10 + minor;
    return true;
}

void check_destroyed_in(ILogger* logger, std::string const& what, char const* made, CudaContextInfo const& home) {
    CudaContextInfo now;
    std::string why;
    bool any = current_context(&now, &why);
    if (any && now.context == home.context) return;
    std::string found;
    if (!any) {
        found = why;
    } else if (now.device == home.device) {
        found = "another CUDA context of device " + std::to_string(now.device) +
                " is current (the one it was " + made + " in was destroyed or reset)";
    } else {
        found = "device " + std::to_string(now.device) + "'s CUDA context is current";
    }
    violation(logger, what + " destroyed while " + found + ", not the context it was " + made + " in (device " +
                          std::to_string(home.device) +
                          "): TensorRT frees an object's device memory through the current CUDA context, so an "
                          "engine, an execution context and a builder are destroyed with the context they were "
                          "made in current");
}

namespace {

// Per thread, for each device: the device's losses when an enqueueV3 of this thread last
// reported its sticky error (the CUDA runtime's error, logged): the caller knows from then.
thread_local std::map<int, uint64_t> reported_loss;

}  // namespace

void told_of_loss(int device) {
    std::string why;
    if (device < 0 || !usable(&why)) return;
    reported_loss[device] = driver().device_lost(device, nullptr, nullptr, 0);
}

bool device_usable(ILogger* logger, int device, std::string const& what, Touch touch) {
    std::string why;
    if (device < 0 || !usable(&why)) return true;  // no device to speak of: the call's own checks say so
    Driver const& d = driver();
    char last[1024] = {0};
    int reset = 0;
    uint64_t lost = d.device_lost(device, &reset, last, sizeof last);
    // Per device: its losses when TensorRT first worked on it. A loss before then (a
    // context reset before TensorRT was ever used there) leaves no state of TensorRT's in a
    // dead context.
    static std::mutex mutex;
    static auto* since = new std::map<int, uint64_t>();  // never destroyed: used at exit
    uint64_t began = 0;
    {
        std::lock_guard<std::mutex> lock(mutex);
        auto [first, fresh] = since->emplace(device, lost);
        if (fresh || first->second == lost) return true;
        began = first->second;
    }
    if (touch == Touch::Request && reset == 0) {
        // The call of a run that began before the loss, on a thread that has not been told
        // of it yet: the call that discovers it (enqueueV3 fails with the sticky error),
        // as another replica's run in the same context must. Once told, the thread must
        // leave the device alone.
        auto reported = reported_loss.find(device);
        uint64_t told = std::max(d.thread_told_of_loss(device), reported == reported_loss.end() ? 0 : reported->second);
        if (told <= began) return true;
    }
    violation(logger, what + " touches device " + std::to_string(device) + " after " + last +
                          ": TensorRT's CUDA runtime keeps state in the device's context, which is lost, and the "
                          "process must be terminated and relaunched to use CUDA again: no TensorRT call may touch "
                          "the device any more once the caller knows (its engines, execution contexts and runtime are "
                          "left alive, not destroyed)");
    return false;
}

void hold_primary_context(int device) {
    static std::mutex mutex;
    static std::set<int> held;
    std::lock_guard<std::mutex> lock(mutex);
    if (held.count(device) != 0) return;
    std::string why;
    if (!usable(&why)) return;
    void* context = nullptr;
    if (driver().primary_ctx_retain(&context, device) == 0) held.insert(device);
}

bool device_alloc(size_t bytes, uint64_t* out, std::string* why) {
    if (!usable(why)) return false;
    if (CuResult r = driver().mem_alloc(out, bytes == 0 ? 1 : bytes)) {
        *why = "cuMemAlloc(" + std::to_string(bytes) + "): " + result_text(r);
        return false;
    }
    return true;
}

void device_free(uint64_t pointer) {
    std::string why;
    if (pointer != 0 && usable(&why)) driver().mem_free(pointer);
}

bool copy_to_device(uint64_t destination, void const* source, size_t bytes, std::string* why) {
    if (!usable(why)) return false;
    if (CuResult r = driver().memcpy_htod(destination, source, bytes)) {
        *why = "cuMemcpyHtoD: " + result_text(r);
        return false;
    }
    return true;
}

bool enqueue_work(void* stream, std::string const& label, std::vector<WorkRange> const& ranges,
                  std::function<std::string()> run, std::function<void()> done, std::string* why, int* code) {
    if (code != nullptr) *code = 0;
    if (!usable(why)) {
        if (done) done();
        return false;
    }
    std::vector<celer_standin_range> raw;
    raw.reserve(ranges.size());
    for (WorkRange const& r : ranges) {
        raw.push_back(celer_standin_range{r.address, r.bytes, r.writes ? 1 : 0, r.what.c_str()});
    }
    auto* work = new PendingWork{std::move(run), std::move(done)};
    // done_trampoline frees `work` in every case, a refused enqueue included.
    CuResult r = driver().enqueue_work(stream, label.c_str(), raw.data(), raw.size(), run_trampoline,
                                       done_trampoline, work);
    if (r != 0) {
        if (code != nullptr) *code = r;
        *why = "queuing the engine's work on the stream: " + result_text(r);
        return false;
    }
    return true;
}

bool make_sticky(void* context, int code, std::string const& message, std::string* why) {
    if (!usable(why)) return false;
    if (int r = driver().make_sticky(context, code, message.c_str())) {
        *why = "celer_standin_make_sticky: " + result_text(r);
        return false;
    }
    return true;
}

int synchronize(void* stream) {
    std::string why;
    if (!usable(&why)) return 1;
    return driver().stream_synchronize(stream);
}

}  // namespace standin
