// celer's stand-in CUDA driver: a libcuda.so.1 that cudarc's loader (through which celer's
// driver layer resolves its entry points) finds exactly as it finds the real one, and that runs celer's own kernels on the CPU, so that the GPU request path
// runs on every commit on machines without a GPU. It is built for the tests (build.rs)
// and never ships.
//
// What it holds to, so that the bugs a GPU would show are caught here too:
// - Device memory is its own address range (arena.cpp): a host pointer passed as a device
//   pointer is refused, naming the call and the parameter; a kernel's access past the end
//   of an allocation, or to freed memory, is an illegal address naming the launch.
// - Each stream is a queue that runs only when it is synchronised (cuStreamSynchronize,
//   cuEventSynchronize, a synchronous copy): a missing synchronisation is never hidden by
//   work that already ran. A copy into pinned memory fills its destination with garbage
//   (0xCB bytes) when it is queued, so reading it before the sync reads garbage; a pinned
//   source changed while its copy is queued is an error, and so is pinned memory freed or
//   unregistered while a copy of it is queued (a sticky CUDA_ERROR_ILLEGAL_ADDRESS naming
//   the copy and what ended the memory). Pageable copies behave as CUDA documents them
//   (staged at once, or synchronous).
// - Pinned (page-locked) host memory is of two kinds, treated alike by copies: memory of
//   cuMemHostAlloc, and the caller's own memory registered with cuMemHostRegister_v2.
//   cuMemHostRegister_v2(p, bytes, flags) needs a current context (INVALID_CONTEXT, or its
//   sticky error, as cuMemHostAlloc); a null p, 0 bytes, device memory, or flags outside
//   PORTABLE|DEVICEMAP|IOMEMORY|READ_ONLY (1|2|4|8) are CUDA_ERROR_INVALID_VALUE; a range
//   overlapping page-locked memory of either kind is
//   CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED. It pins nothing (the flags change nothing:
//   there is no device mapping to give); it records the range, so that copies from and to
//   it are DMA. A registration belongs to the context current at the call: when that
//   context is destroyed (last cuDevicePrimaryCtxRelease, cuDevicePrimaryCtxReset, or
//   cuCtxDestroy of a context of cuCtxCreate) its
//   registrations end, whatever their flags (PORTABLE included: kept simple), and the
//   memory, still the caller's, is pageable to later copies on every GPU (rule
//   "registration ended with its context": each such copy is counted in
//   pageable_after_context_end besides the pageable copies, and leaves a note naming the
//   copy and the context, celer_standin_last_note). cuMemHostUnregister(p) ends a
//   registration: p must be the start of a registered range, else
//   CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED (also for memory of cuMemHostAlloc); it never
//   unmaps anything. cuMemFreeHost of a registered range is CUDA_ERROR_INVALID_VALUE (not
//   memory of cuMemHostAlloc), and the range stays registered and mapped.
// - cuMemAllocAsync/cuMemFreeAsync follow stream order; freed memory faults on access.
// - Events record the time their stream reached them; cuEventElapsedTime refuses events
//   created with CU_EVENT_DISABLE_TIMING, as the real driver does.
// - cuLaunchKernel reads kernelParams[k] as the k-th declared parameter type of the host
//   build (registry.h), checks pointer parameters, and cuModuleLoadData checks each
//   kernel's parameter bytes against the CUBIN's own record.
// - An error in a kernel (illegal address, a lane that returned before a shuffle naming
//   it) makes the context's error sticky, as on a GPU: every later call in the context
//   fails until the context is destroyed (last cuDevicePrimaryCtxRelease) or reset.
//
// Modes that show what a GPU's freedom would (read at cuInit; a value other than those
// listed makes cuInit fail with CUDA_ERROR_INVALID_VALUE naming it):
// - Execution order, CELER_CUDA_STANDIN_ORDER: `forward` (default: CUDA's linear block
//   order, lanes started in thread order, so a lane runs until it parks before the next
//   starts), `reverse` (blocks last first, z then y then x descending; in each block the
//   lanes start highest thread index first and resume from a barrier or shuffle in that
//   order), `random:<seed>` (seed: u64 in decimal; blocks in a permutation made by
//   Fisher-Yates with splitmix64 from the seed, the same for the same seed and grid; lanes
//   as reverse). A kernel that reads another lane's shared slot without a __syncthreads
//   between, or another block's output, gives another answer. In-process:
//   celer_standin_set_order(text) (0, or CUDA_ERROR_INVALID_VALUE) and
//   celer_standin_order().
// - `__shared__` poison, CELER_CUDA_STANDIN_POISON_SHARED (1 default, 0 off): build.rs
//   follows each `__shared__` declaration of a kernel source with a call that fills the
//   variable with 0xCD bytes (as a float about -4.3e8) when the first lane of a block
//   reaches it, instead of the previous block's values. celer_standin_set_shared_poison.
// - Device memory poison, CELER_CUDA_STANDIN_POISON_DEVICE (1 default, 0 off): fresh
//   allocations (cuMemAlloc, cuMemAllocAsync) hold 0xCD bytes, not zeros (celer's
//   alloc_zeros memsets them, so only reads of memory nothing wrote see it). Controls:
//   celer_standin_poison_live(byte) fills every live allocation; celer_standin_mark_writes()
//   starts tracking which allocations are written (a copy or memset into one, a launch with
//   a pointer to non-const data into one, device work with a written range in one);
//   celer_standin_poison_written(byte) fills those written since the mark (or the last
//   poison_written) and tracks anew. Both poisoning controls first run every stream's
//   queued work (nothing in flight sees the poison) and return how many allocations they
//   filled.
// - CELER_CUDA_STANDIN_POISON_FILE=PATH, the same for a server in another process: at the
//   start of each enqueue call (cuMemcpy*, cuMemsetD8*, cuLaunchKernel,
//   celer_standin_enqueue_work), before that call's own operation is checked or queued,
//   if PATH exists its text is read and the file removed; the text (trailing whitespace
//   ignored) is `mark` (celer_standin_mark_writes), `poison` or `poison <byte>`
//   (celer_standin_poison_written, byte 0xCD unless given: decimal or 0x hex), or
//   `poison_live [<byte>]`; anything else is reported (stderr, last error) and ignored.
//   A test writes `mark` before the first request, `poison` before the next: that
//   request's first enqueue poisons what the first request wrote, before it runs.
// - CELER_CUDA_STANDIN_COUNTERS_FILE=PATH, the counters (celer_standin_counter) of a server
//   in another process: every counter as a `name value` line, the file rewritten whole
//   (written beside it, then renamed) at each host synchronisation, host registration and
//   pinned allocation. A request's last host synchronisation comes before its response, so
//   a test reads the file after each response and counts what the request moved.
// - Cross-stream hazards, CELER_CUDA_STANDIN_HAZARDS (1 default, 0 off;
//   celer_standin_set_hazards in-process): each stream, event and context carries a vector
//   clock (per stream, the last of its operations ordered before this point); each
//   allocation, per stream, its last write and its reads since. An operation enqueued on
//   stream B that reads an allocation whose last write was on stream A (or writes one A
//   read or wrote; a free counts as a write), when nothing orders it after that access, is
//   refused at the enqueue call with CUDA_ERROR_INVALID_VALUE (nothing queued, nothing
//   sticky), naming both operations (kernel names and launch numbers, or the call), both
//   streams and the allocation. Ordered means: B waited (cuStreamWaitEvent) on an event
//   recorded on A at or after the access, transitively through other streams' waits; or
//   the host saw A past it (cuStreamSynchronize, cuEventSynchronize of such an event,
//   cuCtxSynchronize, a successful cuStreamQuery/cuEventQuery, a synchronous copy or
//   memset) before B's operation was enqueued. What an operation accesses: a launch, the
//   allocation each pointer parameter points into (a write unless it points to const);
//   copies and memsets their ranges; device work its declared ranges; cuMemAllocAsync is a
//   write at the stream's position. Streams are independent of the null stream (celer
//   makes non-blocking streams).
// - Launch limits from the CUBIN: cuLaunchKernel refuses a block of more threads than the
//   kernel's __launch_bounds__ (EIATTR_MAX_THREADS) or 1024 with CUDA_ERROR_INVALID_VALUE,
//   and one whose registers (EIATTR_REGCOUNT per thread, allocated per warp in units of
//   256) exceed the SM's 65536 with CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES, naming the kernel,
//   its registers and its bound.
//
// Fault injection, for recovery tests: CELER_CUDA_STANDIN_FAIL_LAUNCH=N fails the N-th
// cuLaunchKernel with CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES (not sticky);
// CELER_CUDA_STANDIN_STICKY_LAUNCH=N makes the N-th launch fault with a sticky
// CUDA_ERROR_ILLEGAL_ADDRESS when it runs; CELER_CUDA_STANDIN_HANG_LAUNCH=N makes the N-th
// launch hang when it runs, as a kernel that never ends on a GPU without a watchdog (a
// datacenter GPU has none): the thread running its stream (a cuStreamSynchronize's, a
// cuEventSynchronize's, a cuCtxSynchronize's, a synchronous copy's) blocks there, holding
// only that stream, until the process exits or celer_standin_release_hangs lets it go on
// (then it runs as any launch); the hang is said on stderr. A poll of that stream
// (cuStreamQuery, cuEventQuery) answers CUDA_ERROR_NOT_READY without waiting, as it does
// for any stream another thread is running. CELER_CUDA_STANDIN_FAULT_FILE=PATH: when that
// file exists at a launch, the launch gets the fault the file names ("fail", "sticky" or
// "hang") and the file is removed (a test arms a fault in a server process between
// requests). In-process tests use celer_standin_inject.
//
// Counted after a loss (for tests that show a caller made no further call on a lost
// device): celer_standin_device_counter("calls_in_lost_context", device) counts every call
// of an exported entry point (celer_standin_enqueue_work included; the stand-in's other
// controls not) made, after a context of that device became sticky, in that context while
// it is live: the context of the stream or event the call names, of the module
// (cuModuleGetFunction, cuModuleUnload) or the device memory (cuMemFree) it names, the
// context it names (cuCtxSetCurrent), the device's primary context (cuDevicePrimaryCtx*),
// else the context current on the calling thread. Counted whether the call then fails with
// the sticky error (most do) or goes ahead (a release, a destroy, a free). Not counted: the
// probe (cuInit, cuDriverGetVersion, cuDeviceGet*, cuDeviceTotalMem), cuCtxGetCurrent,
// cuGetErrorName, cuGetErrorString and cuGetExportTable, which work in no context; and calls
// after the context is destroyed (its handles are dead: they fail INVALID_HANDLE or
// INVALID_CONTEXT, and name no device). The call that was running when the context became
// sticky (the synchronisation that ran the faulting kernel) started before and is not
// counted; the next call of each thread that uses the context is: that is how a caller
// discovers the loss. "lost_contexts" counts the losses themselves (a context's error
// became sticky, or a context that existed was reset); celer_standin_device_lost(device,
// why, len) says how many and what the last one was (the stand-in TensorRT's rule that the
// process must be relaunched reads it). CELER_CUDA_STANDIN_COUNTERS_AT_EXIT=PATH writes every
// counter (`name value`) and each device's (`name[device] value`) to PATH when the process
// exits (atexit: a return from main or exit(), not a kill or an abort), for a test that
// reads what a server in another process did until its end.
// Chosen return codes, for codes beyond the caller's bindings:
// CELER_CUDA_STANDIN_RETURN=<entry point>:<code>[@<nth call>] (several joined by commas;
// nth counts that entry point's calls from cuInit, 1 by default) makes that call of that
// entry point return the decimal <code> instead of doing anything; in-process,
// celer_standin_inject_return(entry, code, nth) arms the same from the next call on (nth 0
// disarms it). Any exported entry point may be named (not one this version lacks), and
// any code but 0: one cuda.h defines from this driver's version or before, or one no
// cuda.h has (1000, say: a driver newer than every header). A code a later CUDA introduced
// is refused, naming why, since such a driver never returns it: CUDA_ERROR_CONTAINED
// (226, Hopper's error containment) exists from 12.8, so the 11.8, 12.2 and 12.4 builds
// refuse it (cuInit fails with CUDA_ERROR_INVALID_VALUE naming the variable's text).
// A code that means a lost context (cuda.h's sticky ones, CONTAINED among them) and any
// code the stand-in does not know (conservatively) is sticky: the context of the call
// (its stream's or event's, else the current one) fails every later call with the same
// code, as "the process must be terminated and relaunched" says, until it is destroyed or
// reset. Another code is returned by that one call only. cuGetErrorName and
// cuGetErrorString answer CUDA_ERROR_INVALID_VALUE (and a null string) for a code this
// version does not define, as the real driver does (codes.cpp lists the codes and their
// versions).
// Other settings: CELER_CUDA_STANDIN_DEVICES (GPUs, default 1), CELER_CUDA_STANDIN_SM
// (compute capability as major * 10 + minor, default 90; "90,80" gives device i the i-th
// and later devices the last, so a machine can hold GPUs of different models: each
// device's cuDeviceGetAttribute 75/76 and cuDeviceGetName ("... sm_80 ...") answer for it,
// and cuModuleLoadData checks a CUBIN against its context's device; cuInit refuses any
// other text rather than quietly testing sm_90), CELER_CUDA_STANDIN_MEMORY_MIB (default
// 16384), CELER_CUDA_STANDIN_QUIET (no error details on stderr).
//
// Device work of other stand-in libraries: celer_standin_enqueue_work
// (celer_standin_work.h) queues a host function that runs in stream order, over device
// ranges checked when queued and again when it runs, as a kernel; the stand-in TensorRT
// runs engines through it. It is one more operation of a stream's queue, so events,
// cuStreamWaitEvent, cuStreamQuery and cuCtxSynchronize treat it as any other. Held to:
// - when queued, each range (of more than 0 bytes: an empty one touches nothing) lies in
//   one live allocation of the stream's context, with no cuMemFreeAsync of it queued (as
//   a copy's or a launch's pointers): else CUDA_ERROR_INVALID_VALUE naming the label and
//   the range, nothing queued;
// - when it runs: skipped in a sticky context; a range freed since (by a free on another
//   stream that ran first, say) is a sticky CUDA_ERROR_ILLEGAL_ADDRESS naming the label,
//   the range and the address, and `run` is not called; a nonzero return of `run` is a
//   sticky CUDA_ERROR_LAUNCH_FAILED "label: why"; a range declared read only that `run`
//   changed (and that no written range overlaps) is a sticky CUDA_ERROR_LAUNCH_FAILED; a
//   write into an allocation's alignment padding is a sticky CUDA_ERROR_ILLEGAL_ADDRESS;
// - `done` is called exactly once on every path (after `run`, skipped, dropped with its
//   stream or context, or refused when queued);
// - `run` is ordinary host code, not a kernel: a fault in it is not turned into an error
//   of the context (jumping out of it would skip its destructors and keep its locks), but
//   a fault at a device address says which work was running before the process ends.
// Counters work_enqueued and work_run count it. celer_standin_make_sticky(context, code,
// message) makes a context's error sticky for such a library (its work faulted at a
// launch): as a kernel's fault, counted in sticky_errors.
//
// cuDevicePrimaryCtxReset destroys the primary context whoever holds it (its memory,
// streams, events, modules and sticky error), but keeps the retains counted (as CUDA
// documents: it "does not release" the context); a retain after it gets a fresh context,
// a release after it only counts down (the last one destroys the fresh context, if one was
// made), and cuDevicePrimaryCtxGetState says active while a context exists and is
// retained. Handles of a destroyed context, and of its streams, events and modules, stay
// dead: their objects are never freed, so no new object gets a dead one's address and a
// stale handle (a stream celer destroys after the reset, say) fails instead of reaching
// the new context.
//
// cuCtxCreate_v2 makes a context of the caller's own on a device, besides its primary one
// (flags: CU_CTX_SCHED_* | MAP_HOST | LMEM_RESIZE_TO_MAX, else CUDA_ERROR_INVALID_VALUE),
// and pushes it on the calling thread's context stack (current, the one current before
// below it; cuCtxPushCurrent_v2/cuCtxPopCurrent_v2 push and pop any live context). No reset
// of the primary context touches it; cuCtxDestroy_v2 destroys it as a reset destroys the
// primary one (popping it if it is current on the calling thread). cuCtxDestroy_v2 of a
// primary context, or of a dead or foreign handle, is CUDA_ERROR_INVALID_CONTEXT; so is
// cuCtxPopCurrent_v2 with no context current.
//
// Driver functions provided (celer's code path and its driver layer, src/cuda/driver):
//   probe:     cuDriverGetVersion cuInit cuDeviceGetCount cuDeviceGet cuDeviceGetName
//              cuDeviceGetUuid cuDeviceGetUuid_v2 cuDeviceTotalMem_v2 cuDeviceGetAttribute
//   context:   cuDevicePrimaryCtxRetain cuDevicePrimaryCtxRelease_v2
//              cuDevicePrimaryCtxReset_v2 cuDevicePrimaryCtxSetFlags_v2
//              cuDevicePrimaryCtxGetState cuCtxGetCurrent cuCtxSetCurrent cuCtxGetDevice
//              cuCtxSetFlags cuCtxGetFlags cuCtxSynchronize cuCtxCreate_v2
//              cuCtxDestroy_v2 cuCtxPushCurrent_v2 cuCtxPopCurrent_v2
//   modules:   cuModuleLoadData cuModuleGetFunction cuModuleUnload
//   streams:   cuStreamCreate cuStreamSynchronize cuStreamQuery cuStreamWaitEvent
//              cuStreamDestroy_v2
//   events:    cuEventCreate cuEventRecord cuEventSynchronize cuEventQuery
//              cuEventElapsedTime cuEventElapsedTime_v2 cuEventDestroy_v2
//   memory:    cuMemAllocAsync cuMemFreeAsync cuMemAlloc_v2 cuMemFree_v2 cuMemGetInfo_v2
//              cuMemsetD8Async cuMemsetD8_v2 cuMemcpyHtoDAsync_v2 cuMemcpyDtoHAsync_v2
//              cuMemcpyDtoDAsync_v2 cuMemcpyHtoD_v2 cuMemcpyDtoH_v2 cuMemHostAlloc
//              cuMemFreeHost cuMemHostRegister_v2 cuMemHostUnregister
//   launch:    cuLaunchKernel
//   errors:    cuGetErrorString cuGetErrorName (only for codes of this version: codes.cpp)
//   other:     cuGetExportTable (NVRTC asks a loaded driver for its private tables; the
//              stand-in has none)
//   stand-ins: celer_standin_enqueue_work and celer_standin_make_sticky (device work of
//              the stand-in TensorRT, and its faults), celer_standin_device_lost (its
//              relaunch rule), and the
//              test controls celer_standin_* (last error, fault injection, chosen
//              return codes, counters, order, hazards, shared and device poison, hung
//              launches released)
// Not provided (celer's driver layer fails naming the missing entry point if one is ever
// called, which shows at once): graphs, peer and managed memory, texture, cooperative launches, TensorRT's needs.
#include <dlfcn.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "celer_standin_work.h"
#include "standin.h"

#define EXPORT extern "C" __attribute__((visibility("default")))
// The first statement of every exported entry point: a call in a lost context is counted
// (calls_in_lost_context, see note_call), then a code armed for this call is returned
// instead (see injected_return). The context is the stream's or the event's, else the
// current one.
#define RETURN_IF_INJECTED(entry, stream, event)                                 \
    note_call([&] { return context_of_handles(stream, event); });               \
    if (int injected = injected_return(entry, stream, event)) return injected
// The same for an entry point that names its context another way (`context`: an
// expression giving the Context*, evaluated under the state lock, only once a context of
// the process has become sticky).
#define RETURN_IF_INJECTED_IN(entry, context)                                   \
    note_call([&] { return (context); });                                        \
    if (int injected = injected_return(entry, nullptr, nullptr)) return injected
// The same for the probe and the error names, which work in no context: not counted.
#define RETURN_IF_INJECTED_PROBE(entry) \
    if (int injected = injected_return(entry, nullptr, nullptr)) return injected

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
struct CUuuid {
    char bytes[16];
};

namespace standin {

// ---- errors ---------------------------------------------------------------------------

namespace {
std::mutex last_error_mutex;
std::string last_error_text;
// The last note of a rule that changes no result (celer_standin_last_note).
std::string last_note_text;
}  // namespace

std::string format(const char* fmt, ...) {
    va_list args;
    va_start(args, fmt);
    va_list copy;
    va_copy(copy, args);
    int n = vsnprintf(nullptr, 0, fmt, copy);
    va_end(copy);
    std::string out(n > 0 ? size_t(n) : 0, '\0');
    if (n > 0) vsnprintf(&out[0], size_t(n) + 1, fmt, args);
    va_end(args);
    return out;
}

int fail(int result, const std::string& message) {
    {
        std::lock_guard<std::mutex> lock(last_error_mutex);
        last_error_text = format("%s: %s", result_name(result), message.c_str());
    }
    if (getenv("CELER_CUDA_STANDIN_QUIET") == nullptr) {
        fprintf(stderr, "cuda stand-in: %s: %s\n", result_name(result), message.c_str());
    }
    return result;
}

namespace {

// ---- settings and counters ------------------------------------------------------------

// CELER_CUDA_STANDIN_SM: one compute capability for every device ("90"), or one per device
// ("90,80": device i gets the i-th, later devices the last); unset or empty is 90. False
// for anything else (a typo must not quietly test sm_90).
bool sm_list(const char* text, size_t devices, std::vector<int>* sms) {
    std::vector<int> listed;
    for (const char* p = text; p != nullptr && *p != '\0';) {
        if (*p < '0' || *p > '9') return false;  // strtol would take a sign or spaces
        char* end = nullptr;
        long v = strtol(p, &end, 10);
        if (v < 10 || v > 999) return false;  // major * 10 + minor: sm_10 .. sm_999
        listed.push_back(int(v));
        if (*end == '\0') break;
        if (*end != ',') return false;
        p = end + 1;
        if (*p == '\0') return false;
    }
    if (listed.empty()) listed.push_back(90);
    sms->clear();
    for (size_t i = 0; i < devices; ++i) sms->push_back(listed[i < listed.size() ? i : listed.size() - 1]);
    return true;
}

// A switch: unset or empty is `fallback`, "1" on, "0" off; false (refused) for anything else.
bool env_switch(const char* name, bool fallback, bool* out) {
    const char* v = getenv(name);
    if (v == nullptr || *v == '\0') {
        *out = fallback;
        return true;
    }
    if (strcmp(v, "0") != 0 && strcmp(v, "1") != 0) return false;
    *out = v[0] == '1';
    return true;
}

long env_number(const char* name, long fallback) {
    const char* v = getenv(name);
    if (v == nullptr || *v == '\0') return fallback;
    char* end = nullptr;
    long n = strtol(v, &end, 10);
    return end != nullptr && *end == '\0' ? n : fallback;
}

struct Counters {
    std::atomic<uint64_t> launches_enqueued{0};
    std::atomic<uint64_t> launches_run{0};
    std::atomic<uint64_t> htod_copies{0};
    std::atomic<uint64_t> htod_bytes{0};
    std::atomic<uint64_t> dtoh_copies{0};
    std::atomic<uint64_t> dtoh_bytes{0};
    std::atomic<uint64_t> dtod_copies{0};
    std::atomic<uint64_t> dtod_bytes{0};
    std::atomic<uint64_t> memsets{0};
    std::atomic<uint64_t> memset_bytes{0};
    std::atomic<uint64_t> contexts_created{0};
    std::atomic<uint64_t> stream_syncs{0};
    std::atomic<uint64_t> event_syncs{0};
    std::atomic<uint64_t> ctx_syncs{0};
    std::atomic<uint64_t> host_syncs{0};
    std::atomic<uint64_t> device_allocs{0};
    std::atomic<uint64_t> device_frees{0};
    std::atomic<uint64_t> pinned_allocs{0};
    std::atomic<uint64_t> pinned_alloc_bytes{0};
    std::atomic<uint64_t> pinned_frees{0};
    std::atomic<uint64_t> host_registers{0};
    std::atomic<uint64_t> host_register_bytes{0};
    std::atomic<uint64_t> host_unregisters{0};
    std::atomic<uint64_t> pageable_htod_copies{0};
    std::atomic<uint64_t> pageable_dtoh_copies{0};
    std::atomic<uint64_t> pageable_after_context_end{0};
    std::atomic<uint64_t> sticky_errors{0};
    std::atomic<uint64_t> work_enqueued{0};
    std::atomic<uint64_t> work_run{0};
    // Launches armed to hang (CELER_CUDA_STANDIN_HANG_LAUNCH, the fault file's `hang`)
    // that reached the head of their stream, and those still hanging now.
    std::atomic<uint64_t> hung_launches{0};
    std::atomic<uint64_t> hanging_now{0};
    // Launch numbers (counted from 1) at which to inject a fault; 0 = none.
    std::atomic<uint64_t> fail_launch_at{0};
    std::atomic<uint64_t> sticky_launch_at{0};
    std::atomic<uint64_t> hang_launch_at{0};
};
Counters counters;

// Every counter celer_standin_counter and CELER_CUDA_STANDIN_COUNTERS_FILE report, by name.
#define EVERY_COUNTER(X)                                                                     \
    X(launches_enqueued) X(launches_run) X(htod_copies) X(htod_bytes) X(dtoh_copies)         \
    X(dtoh_bytes) X(dtod_copies) X(dtod_bytes) X(memsets) X(memset_bytes) X(contexts_created) \
    X(stream_syncs) X(event_syncs) X(ctx_syncs) X(host_syncs) X(device_allocs)                \
    X(device_frees) X(pinned_allocs) X(pinned_alloc_bytes) X(pinned_frees) X(host_registers)  \
    X(host_register_bytes) X(host_unregisters) X(pageable_htod_copies)                        \
    X(pageable_dtoh_copies) X(pageable_after_context_end) X(sticky_errors) X(work_enqueued)    \
    X(work_run) X(hung_launches) X(hanging_now)

// What fresh device memory holds (CELER_CUDA_STANDIN_POISON_DEVICE), and what the poison
// controls write unless told another byte: as a float, 0xCDCDCDCD is about -4.3e8.
constexpr unsigned char kPoison = 0xCD;

// ---- objects --------------------------------------------------------------------------

struct Context;
struct Stream;

// A vector clock: for each stream (by its id), the last of its operations (by seq) that
// is ordered before this point. Streams keep one (what their next operation comes after),
// events the one of their record, contexts the host's (what synchronisations showed done).
using Clock = std::map<uint64_t, uint64_t>;

void merge(Clock& into, const Clock& from) {
    for (const auto& [stream, seq] : from) {
        uint64_t& mine = into[stream];
        if (seq > mine) mine = seq;
    }
}

uint64_t clock_at(const Clock& clock, uint64_t stream) {
    auto found = clock.find(stream);
    return found == clock.end() ? 0 : found->second;
}

struct Event {
    Context* context;
    unsigned int flags;
    // Each cuEventRecord starts a new generation; the event completes when its stream
    // reaches the record of the latest one.
    uint64_t generation = 0;
    Stream* stream = nullptr;
    uint64_t seq = 0;
    bool completed = true;  // an event never recorded counts as complete
    std::chrono::steady_clock::time_point time{};
    // The recording stream's clock at the latest record (its record included).
    Clock clock;
};

// Device work queued by another stand-in library (celer_standin_enqueue_work): its
// callbacks, and `done` called exactly once, when the last holder lets go (after `run`,
// or when the work is dropped unrun: a sticky context, a destroyed stream or context).
struct Work {
    int (*run)(void*, char*, size_t) = nullptr;
    void (*done)(void*) = nullptr;
    void* user = nullptr;
    ~Work() {
        if (done != nullptr) done(user);
    }
};

struct WorkRange {
    uintptr_t address;
    size_t bytes;
    bool writes;
    std::string what;
};

struct Op {
    enum Kind { Launch, HtoD, DtoH, DtoD, Memset, Record, Wait, Free, DeviceWork } kind;
    uint64_t seq = 0;
    std::string label;
    // Launch
    const KernelEntry* kernel = nullptr;
    LaunchShape shape{};
    std::vector<unsigned char> params;
    std::vector<size_t> param_offsets;
    bool inject_sticky = false;
    bool inject_hang = false;
    // Copies, memset, free
    uintptr_t device = 0;
    uintptr_t device_src = 0;
    void* host = nullptr;
    size_t bytes = 0;
    // Asynchronous DMA from or to page-locked memory (cuMemHostAlloc's or registered):
    // the host side is read or written when the stream gets there. locked_id is its
    // range's (page_locked_id), to tell when it ended while the copy was queued.
    bool pinned = false;
    uint64_t locked_id = 0;
    std::vector<unsigned char> staged;
    uint64_t source_hash = 0;
    unsigned char value = 0;
    // Record, Wait
    Event* event = nullptr;
    uint64_t event_generation = 0;
    // DeviceWork
    std::shared_ptr<Work> work;
    std::vector<WorkRange> ranges;
};

struct Stream {
    Context* context;
    bool is_null;
    // Never reused (unlike addresses): names the stream in clocks and access records.
    uint64_t id = 0;
    Clock clock;
    std::mutex queue_mutex;
    std::deque<Op> queue;
    uint64_t next_seq = 1;
    // Held while the stream's work runs, so that two synchronising threads take turns.
    std::recursive_mutex run_mutex;
};

struct Function;

struct Module {
    Context* context;
    std::string arch;
    std::vector<CubinKernel> kernels;
    std::map<std::string, Function*> functions;
};

struct Function {
    Module* module;
    const KernelEntry* kernel;
    // From the CUBIN: registers per thread, and __launch_bounds__'s threads (0: none).
    unsigned registers = 0;
    unsigned max_threads = 0;
};

struct Context {
    int device;
    uint64_t generation;
    unsigned int flags;
    std::atomic<int> sticky{SUCCESS};
    std::string sticky_message;
    Stream* null_stream = nullptr;
    std::set<Stream*> streams;
    std::set<Event*> events;
    std::set<Module*> modules;
    // What the host has seen done (stream, event and context synchronisations, copies
    // that waited): every operation enqueued later comes after it.
    Clock host_clock;
    // The clocks of its destroyed streams (their work still counts for cuCtxSynchronize).
    Clock retired_clock;
};

// What an operation reads or writes: a device range (a launch's pointer parameter: the
// allocation it points into).
struct Access {
    uintptr_t address;
    size_t bytes;
    bool writes;
    std::string what;
    bool pointer = false;  // a launch parameter: the allocation at `address`, even if bytes is 0
};

struct AccessRecord {
    uint64_t seq;
    std::string label;
    std::string stream;
};

struct AllocationAccesses {
    std::map<uint64_t, AccessRecord> writes;  // by stream id: its last write
    std::map<uint64_t, AccessRecord> reads;   // by stream id: its last read since
};

struct Device {
    int retains = 0;
    unsigned int primary_flags = 0;
    Context* primary = nullptr;
    // Times a context of this device was lost: its error became sticky, or it was reset
    // while it existed (celer_standin_device_lost); and what the last one was.
    uint64_t lost_contexts = 0;
    std::string last_loss;
    bool last_loss_was_reset = false;
    // Calls made in a context of this device after its error became sticky (note_call).
    uint64_t calls_in_lost_context = 0;
};

struct State {
    std::recursive_mutex mutex;
    bool initialized = false;
    // Compute capability (major * 10 + minor) of each device.
    std::vector<int> sms;
    std::string fault_file;
    size_t memory_bytes = size_t(16) << 30;
    std::vector<Device> devices;
    uint64_t next_generation = 1;
    // Live handles, to refuse a destroyed or foreign one instead of crashing.
    std::set<Context*> contexts;
    std::set<Stream*> streams;
    std::set<Event*> events;
    std::set<Module*> modules;
    std::set<Function*> functions;
    // Device allocations with a cuMemFreeAsync queued: using them after that is an error.
    std::set<uintptr_t> freeing;
    uint64_t next_stream_id = 1;
    // CELER_CUDA_STANDIN_HAZARDS (on unless "0"): cross-stream accesses without a
    // dependency are refused at enqueue.
    bool hazards = true;
    // CELER_CUDA_STANDIN_POISON_DEVICE (on unless "0"): fresh allocations hold kPoison.
    bool poison_device = true;
    // CELER_CUDA_STANDIN_POISON_FILE: commands for write tracking and poisoning.
    std::string poison_file;
    // CELER_CUDA_STANDIN_COUNTERS_FILE: where every counter is written (dump_counters).
    std::string counters_file;
    // CELER_CUDA_STANDIN_COUNTERS_AT_EXIT: where the counters go when the process exits.
    std::string counters_at_exit;
    // By allocation base: the last write and the reads since, per stream.
    std::map<uintptr_t, struct AllocationAccesses> accesses;
    // celer_standin_mark_writes: allocations written since the mark (or last poison).
    bool tracking_writes = false;
    std::set<uintptr_t> written;
};

State& state() {
    static State* s = new State();  // never destroyed: the driver may be called at exit
    return *s;
}

thread_local Context* current = nullptr;
// The calling thread's context stack below `current` (cuCtxCreate and cuCtxPushCurrent
// push, cuCtxPopCurrent and cuCtxDestroy of the current context pop; cuCtxSetCurrent
// replaces the top, `current`, as CUDA's does).
thread_local std::vector<Context*> below_current;

using Lock = std::lock_guard<std::recursive_mutex>;

uint64_t fnv1a(const void* data, size_t bytes) {
    const unsigned char* p = static_cast<const unsigned char*>(data);
    uint64_t h = 0xcbf29ce484222325ull;
    for (size_t i = 0; i < bytes; ++i) {
        h ^= p[i];
        h *= 0x100000001b3ull;
    }
    return h;
}

// How the page-locked range `id` of a queued copy ended, for the copy's error: "was
// freed (cuMemFreeHost)", "was unregistered (cuMemHostUnregister)", "was unregistered by
// cuDevicePrimaryCtxReset" (its context's destruction).
std::string locked_end_text(uint64_t id) {
    const char* why = page_locked_ended_by(id);
    if (why == nullptr) return "is no longer page-locked";
    if (strcmp(why, "cuMemFreeHost") == 0) return "was freed (cuMemFreeHost)";
    if (strcmp(why, "cuMemHostUnregister") == 0) return "was unregistered (cuMemHostUnregister)";
    return format("was unregistered by %s", why);
}

// A hash of device bytes, fast enough to take of an engine's weights before and after
// each run (four independent 8-byte lanes): whether work changed a range it declared
// read only.
uint64_t content_hash(uintptr_t address, size_t bytes) {
    const unsigned char* p = reinterpret_cast<const unsigned char*>(address);
    uint64_t h[4] = {0x243f6a8885a308d3ull, 0x13198a2e03707344ull, 0xa4093822299f31d0ull, 0x082efa98ec4e6c89ull};
    size_t i = 0;
    for (; i + 32 <= bytes; i += 32) {
        for (int k = 0; k < 4; ++k) {
            uint64_t w;
            memcpy(&w, p + i + 8 * k, 8);
            h[k] = (h[k] ^ w) * 0x9e3779b97f4a7c15ull;
            h[k] ^= h[k] >> 29;
        }
    }
    for (; i < bytes; ++i) h[0] = (h[0] ^ p[i]) * 0x100000001b3ull;
    return h[0] ^ (h[1] * 3) ^ (h[2] * 5) ^ (h[3] * 7) ^ bytes;
}

bool context_alive(Context* c) { return c != nullptr && state().contexts.count(c) != 0; }

// Set when any context first becomes sticky: until then no call is counted as one in a
// lost context, and the entry points skip the lookup (and its lock) altogether.
std::atomic<bool> any_sticky{false};

// Records a loss of device `device`'s context (a sticky error, or a reset of a context that
// existed): what the stand-in TensorRT asks before each call on the device.
void record_loss(int device, const std::string& what, bool reset) {
    Lock lock(state().mutex);
    if (device < 0 || size_t(device) >= state().devices.size()) return;
    Device& d = state().devices[size_t(device)];
    d.lost_contexts += 1;
    d.last_loss = what;
    d.last_loss_was_reset = reset;
}

void make_sticky(Context* c, int result, const std::string& message) {
    int expected = SUCCESS;
    if (c->sticky.compare_exchange_strong(expected, result)) {
        c->sticky_message = message;
        counters.sticky_errors++;
        any_sticky = true;
        record_loss(c->device,
                    format("its context's error became sticky (%s: %s)", result_name(result), message.c_str()), false);
        fail(result, message + " (the context's error is now sticky: every call fails until it is destroyed or reset)");
    }
}

// Counts a call in a lost context: `resolve` gives the context the call works in (under
// the state lock); when it is live and its error is sticky, the call counts for its device
// (calls_in_lost_context). Whatever the call then does (it fails with the sticky error, or,
// for a release or a destroy, goes ahead) it was a call on a lost device.
template <typename Resolve>
void note_call(Resolve resolve) {
    if (!any_sticky.load()) return;
    Lock lock(state().mutex);
    Context* c = resolve();
    if (!context_alive(c) || c->sticky.load() == SUCCESS) return;
    if (size_t(c->device) < state().devices.size()) state().devices[size_t(c->device)].calls_in_lost_context++;
}

// The primary context of `device`, if it has one (for the calls that name a device).
Context* primary_of(int device) {
    State& st = state();
    if (device < 0 || size_t(device) >= st.devices.size()) return nullptr;
    return st.devices[size_t(device)].primary;
}

// The context of a live module (or of a live function's module, for cuModuleGetFunction's
// module handle), else none.
Context* context_of_module(void* module) {
    Module* m = static_cast<Module*>(module);
    return state().modules.count(m) ? m->context : nullptr;
}

// The live context whose memory `pointer` is in, else none.
Context* context_of_memory(uintptr_t pointer) {
    AllocationView view;
    if (!find_allocation(pointer, 0, &view) || !view.live) return nullptr;
    for (Context* c : state().contexts) {
        if (c->generation == view.context_generation) return c;
    }
    return nullptr;
}

// ---- hung launches (CELER_CUDA_STANDIN_HANG_LAUNCH, the fault file's `hang`) -----------

// Never destroyed: a thread may still wait on them while the process exits.
std::mutex& hang_mutex() {
    static auto* m = new std::mutex();
    return *m;
}
std::condition_variable& hang_released() {
    static auto* cv = new std::condition_variable();
    return *cv;
}
// Bumped by celer_standin_release_hangs: a launch hanging since an older value goes on.
uint64_t hang_generation = 0;

// A launch armed to hang has reached the head of its stream: the thread running the stream
// (a synchronisation's) waits, as for a kernel that never finishes on a GPU without a
// watchdog, until the process exits or a test releases it. Holds no lock of the driver
// but the stream's own (another thread synchronising this stream waits too).
void hang_here(const std::string& label) {
    // Said on stderr (a server's log), as a poison is: a test can tell the hang was reached.
    fprintf(stderr, "cuda stand-in: %s hangs (injected): its stream gets no further until the process exits\n",
            label.c_str());
    std::unique_lock<std::mutex> lock(hang_mutex());
    // Counted under the lock, after reading the generation: a release that sees this hang
    // counted (hanging_now) bumps the generation after, and so lets it go.
    uint64_t since = hang_generation;
    counters.hung_launches++;
    counters.hanging_now++;
    hang_released().wait(lock, [&] { return hang_generation != since; });
    counters.hanging_now--;
}

// Per thread, for each device: how many losses the device had when a call of this thread
// was last answered its sticky error (celer_standin_thread_told_of_loss): the caller knows
// of the loss from then on.
thread_local std::map<int, uint64_t> told_of_loss;

void tell_thread(Context* c) {
    Lock lock(state().mutex);
    if (size_t(c->device) < state().devices.size()) {
        told_of_loss[c->device] = state().devices[size_t(c->device)].lost_contexts;
    }
}

// The error every call in a context returns once it is sticky (the calling thread is then
// told of the loss).
int sticky_error(Context* c) {
    int r = c->sticky.load();
    if (r != SUCCESS) tell_thread(c);
    return r;
}

std::string pointer_text(uintptr_t p) { return format("0x%lx", static_cast<unsigned long>(p)); }

// ---- chosen return codes (CELER_CUDA_STANDIN_RETURN, celer_standin_inject_return) ------

// One armed code: the `calls_left`-th call of `entry` from now returns `code`.
struct ArmedReturn {
    std::string entry;
    int code;
    uint64_t calls_left;
};

std::mutex returns_mutex;
std::vector<ArmedReturn> armed_returns;
std::atomic<bool> any_armed{false};

// Whether this library (this version's build) exports `name`: its export map leaves out
// the entry points its version lacks, so those cannot be armed.
bool exported_here(const char* name) {
    Dl_info self;
    if (dladdr(reinterpret_cast<void*>(&exported_here), &self) == 0 || self.dli_fname == nullptr) return false;
    void* library = dlopen(self.dli_fname, RTLD_LAZY | RTLD_NOLOAD);
    if (library == nullptr) return false;
    bool found = dlsym(library, name) != nullptr;
    dlclose(library);
    return found;
}

// Arms `code` for the `nth` call of `entry` from now (1: the next); nth 0 disarms `entry`.
// SUCCESS, or INVALID_VALUE with `why`: an entry point this library does not export,
// CUDA_SUCCESS, or a code cuda.h introduced after this driver's version (such a driver
// never returns it). A code no cuda.h has is taken at any version.
int arm_return(const std::string& entry, long long code, uint64_t nth, std::string* why) {
    std::string version = format("%d.%d", driver_version() / 1000, driver_version() % 1000 / 10);
    if (entry.rfind("cu", 0) != 0 || !exported_here(entry.c_str())) {
        *why = format("%s is not an entry point this CUDA %s stand-in exports", entry.c_str(), version.c_str());
        return INVALID_VALUE;
    }
    if (code <= 0 || code > 0x7fffffff) {
        *why = format("%lld is not an error code to return (1 to 2147483647)", code);
        return INVALID_VALUE;
    }
    int since = code_since(int(code));
    if (since > driver_version()) {
        *why = format("%s (%lld) is CUDA %d.%d's: a CUDA %s driver never returns it (inject a code no cuda.h has, e.g. "
                      "1000, for a code beyond the driver's)",
                      result_name(int(code)), code, since / 1000, since % 1000 / 10, version.c_str());
        return INVALID_VALUE;
    }
    std::lock_guard<std::mutex> lock(returns_mutex);
    for (auto it = armed_returns.begin(); it != armed_returns.end();) {
        it = it->entry == entry ? armed_returns.erase(it) : std::next(it);
    }
    if (nth > 0) armed_returns.push_back(ArmedReturn{entry, int(code), nth});
    any_armed = !armed_returns.empty();
    return SUCCESS;
}

// CELER_CUDA_STANDIN_RETURN's text: `<entry point>:<code>[@<nth call>]`, several joined by
// commas. False, with `why`, for anything else.
bool arm_returns_from(const char* text, std::string* why) {
    std::string all = text;
    size_t start = 0;
    while (start <= all.size()) {
        size_t end = all.find(',', start);
        std::string one = all.substr(start, end == std::string::npos ? std::string::npos : end - start);
        size_t colon = one.find(':');
        size_t at = one.find('@');
        if (colon == std::string::npos || colon == 0) {
            *why = format("`%s` is not <entry point>:<code>[@<nth call>]", one.c_str());
            return false;
        }
        std::string code_text = one.substr(colon + 1, at == std::string::npos ? std::string::npos : at - colon - 1);
        std::string nth_text = at == std::string::npos ? "1" : one.substr(at + 1);
        char* code_end = nullptr;
        char* nth_end = nullptr;
        long long code = strtoll(code_text.c_str(), &code_end, 10);
        unsigned long long nth = strtoull(nth_text.c_str(), &nth_end, 10);
        if (code_text.empty() || *code_end != '\0' || nth_text.empty() || nth_text[0] == '-' || *nth_end != '\0' ||
            nth == 0) {
            *why = format("`%s` is not <entry point>:<code>[@<nth call>] (decimal code, nth from 1)", one.c_str());
            return false;
        }
        if (arm_return(one.substr(0, colon), code, nth, why) != SUCCESS) return false;
        if (end == std::string::npos) break;
        start = end + 1;
    }
    return true;
}

Context* context_of_handles(void* stream, void* event);

// Called first by every exported entry point: the code armed for this call of `entry`
// (which it then returns instead of doing anything), or SUCCESS. A lost code (sticky in
// cuda.h, or one the stand-in does not know) makes the context's error sticky: the
// context of `stream` or `event` when given and live, else the current one.
int injected_return(const char* entry, void* stream, void* event) {
    if (!any_armed.load()) return SUCCESS;
    int code = SUCCESS;
    {
        std::lock_guard<std::mutex> lock(returns_mutex);
        for (auto it = armed_returns.begin(); it != armed_returns.end(); ++it) {
            if (it->entry != entry) continue;
            if (--it->calls_left == 0) {
                code = it->code;
                armed_returns.erase(it);
            }
            break;
        }
        any_armed = !armed_returns.empty();
    }
    if (code == SUCCESS) return SUCCESS;
    Lock lock(state().mutex);
    std::string message = format("%s: injected return code %d (CELER_CUDA_STANDIN_RETURN)", entry, code);
    Context* c = context_of_handles(stream, event);
    if (context_alive(c) && code_is_lost(code)) {
        make_sticky(c, code, message);
        tell_thread(c);
    } else {
        fail(code, message);
    }
    return code;
}

// ---- counters ----------------------------------------------------------------------------

// Every counter by name, as celer_standin_counter answers them (its comment lists them).
std::vector<std::pair<const char*, uint64_t>> counter_list() {
    std::vector<std::pair<const char*, uint64_t>> all;
#define COUNTER(field) all.emplace_back(#field, counters.field.load());
    EVERY_COUNTER(COUNTER)
#undef COUNTER
    all.emplace_back("device_bytes", uint64_t(device_bytes_in_use()));
    return all;
}

// A device's counter by name (celer_standin_device_counter's), or false for a name or a
// device it does not know.
bool device_counter(const std::string& name, int device, uint64_t* out) {
    Lock lock(state().mutex);
    if (device < 0 || size_t(device) >= state().devices.size()) return false;
    const Device& d = state().devices[size_t(device)];
    if (name == "calls_in_lost_context") {
        *out = d.calls_in_lost_context;
    } else if (name == "lost_contexts") {
        *out = d.lost_contexts;
    } else {
        return false;
    }
    return true;
}

// CELER_CUDA_STANDIN_COUNTERS_AT_EXIT: the counters, one `name value` a line, and each
// device's as `name[device] value`, written when the process exits (atexit), for a test
// to read what a server in another process did until its very end.
void write_counters_at_exit() {
    std::string path;
    size_t devices = 0;
    {
        Lock lock(state().mutex);
        path = state().counters_at_exit;
        devices = state().devices.size();
    }
    FILE* f = fopen(path.c_str(), "w");
    if (f == nullptr) {
        fprintf(stderr, "cuda stand-in: CELER_CUDA_STANDIN_COUNTERS_AT_EXIT=%s cannot be written\n", path.c_str());
        return;
    }
    for (const auto& [name, value] : counter_list()) {
        fprintf(f, "%s %llu\n", name, static_cast<unsigned long long>(value));
    }
    for (size_t d = 0; d < devices; ++d) {
        for (const char* name : {"calls_in_lost_context", "lost_contexts"}) {
            uint64_t value = 0;
            if (device_counter(name, int(d), &value)) {
                fprintf(f, "%s[%zu] %llu\n", name, d, static_cast<unsigned long long>(value));
            }
        }
    }
    fclose(f);
}

// ---- running queued work --------------------------------------------------------------

void run_until(Stream* s, uint64_t seq);
std::string stream_text(const Stream* s);

void complete_event(Event* e, uint64_t generation) {
    if (e->generation == generation) {
        e->completed = true;
        e->time = std::chrono::steady_clock::now();
    }
}

// Runs one queued operation; on a fault the context becomes sticky.
void execute(Stream* s, Op& op) {
    Context* c = s->context;
    if (c->sticky.load() != SUCCESS) {
        // A sticky context runs nothing more; frees still free (memory goes with it).
        if (op.kind == Op::Free) {
            device_free(op.device, "cuMemFreeAsync");
            std::lock_guard<std::recursive_mutex> lock(state().mutex);
            state().freeing.erase(op.device);
        }
        return;
    }
    std::string why;
    switch (op.kind) {
        case Op::Launch: {
            if (op.inject_hang) hang_here(op.label);
            if (op.inject_sticky) {
                make_sticky(c, ILLEGAL_ADDRESS, op.label + ": injected fault (CELER_CUDA_STANDIN_STICKY_LAUNCH)");
                return;
            }
            // The pointers were checked when queued; a free queued since would show here.
            for (size_t k = 0; k < op.kernel->param_count; ++k) {
                const ParamInfo& p = op.kernel->params[k];
                if (!p.is_pointer) continue;
                uintptr_t v;
                memcpy(&v, op.params.data() + op.param_offsets[k], sizeof(v));
                if (v != 0 && !device_range_ok(v, 0, &why)) {
                    make_sticky(c, ILLEGAL_ADDRESS, format("%s: parameter %zu: %s", op.label.c_str(), k, why.c_str()));
                    return;
                }
            }
            std::vector<void*> args(op.kernel->param_count + 1);
            for (size_t k = 0; k < op.kernel->param_count; ++k) args[k] = op.params.data() + op.param_offsets[k];
            KernelFault fault;
            counters.launches_run++;
            if (!run_kernel(*op.kernel, op.shape, args.data(), op.label, &fault)) {
                make_sticky(c, fault.result, fault.message);
                return;
            }
            // A write past an allocation's end that stayed inside its alignment padding
            // did not fault: its canary shows it.
            for (size_t k = 0; k < op.kernel->param_count; ++k) {
                if (!op.kernel->params[k].is_pointer) continue;
                uintptr_t v;
                memcpy(&v, op.params.data() + op.param_offsets[k], sizeof(v));
                if (v != 0 && !padding_intact(v, &why)) {
                    make_sticky(c, ILLEGAL_ADDRESS, format("%s: illegal write at %s, by parameter %zu's kernel code "
                                                           "(found after the launch, in the allocation's alignment "
                                                           "padding)",
                                                           op.label.c_str(), why.c_str(), k));
                    return;
                }
            }
            return;
        }
        case Op::HtoD: {
            if (!device_range_ok(op.device, op.bytes, &why)) {
                make_sticky(c, ILLEGAL_ADDRESS, op.label + ": destination " + why);
                return;
            }
            const void* source = op.staged.data();
            if (op.pinned) {
                if (page_locked_id(op.host, op.bytes) != op.locked_id) {
                    make_sticky(c, ILLEGAL_ADDRESS, op.label + ": the pinned source " + locked_end_text(op.locked_id) +
                                                        " while its copy was queued");
                    return;
                }
                if (fnv1a(op.host, op.bytes) != op.source_hash) {
                    make_sticky(c, ILLEGAL_ADDRESS,
                                op.label + ": the pinned source changed between cuMemcpyHtoDAsync and the copy: the "
                                           "host wrote the staging buffer before the stream reached the copy");
                    return;
                }
                source = op.host;
            }
            memcpy(reinterpret_cast<void*>(op.device), source, op.bytes);
            return;
        }
        case Op::DtoH: {
            if (!device_range_ok(op.device_src, op.bytes, &why)) {
                make_sticky(c, ILLEGAL_ADDRESS, op.label + ": source " + why);
                return;
            }
            if (op.pinned && page_locked_id(op.host, op.bytes) != op.locked_id) {
                make_sticky(c, ILLEGAL_ADDRESS, op.label + ": the pinned destination " + locked_end_text(op.locked_id) +
                                                    " while its copy was queued");
                return;
            }
            memcpy(op.host, reinterpret_cast<const void*>(op.device_src), op.bytes);
            return;
        }
        case Op::DtoD: {
            if (!device_range_ok(op.device_src, op.bytes, &why)) {
                make_sticky(c, ILLEGAL_ADDRESS, op.label + ": source " + why);
                return;
            }
            if (!device_range_ok(op.device, op.bytes, &why)) {
                make_sticky(c, ILLEGAL_ADDRESS, op.label + ": destination " + why);
                return;
            }
            memmove(reinterpret_cast<void*>(op.device), reinterpret_cast<const void*>(op.device_src), op.bytes);
            return;
        }
        case Op::Memset: {
            if (!device_range_ok(op.device, op.bytes, &why)) {
                make_sticky(c, ILLEGAL_ADDRESS, op.label + ": " + why);
                return;
            }
            memset(reinterpret_cast<void*>(op.device), op.value, op.bytes);
            return;
        }
        case Op::Record: {
            std::lock_guard<std::recursive_mutex> lock(state().mutex);
            if (state().events.count(op.event)) complete_event(op.event, op.event_generation);
            return;
        }
        case Op::Wait: {
            Stream* other = nullptr;
            uint64_t seq = 0;
            {
                std::lock_guard<std::recursive_mutex> lock(state().mutex);
                if (state().events.count(op.event) && op.event->generation == op.event_generation &&
                    !op.event->completed) {
                    other = op.event->stream;
                    seq = op.event->seq;
                }
            }
            if (other != nullptr && other != s) run_until(other, seq);
            return;
        }
        case Op::Free: {
            device_free(op.device, "cuMemFreeAsync");
            std::lock_guard<std::recursive_mutex> lock(state().mutex);
            state().freeing.erase(op.device);
            return;
        }
        case Op::DeviceWork: {
            std::string where = "device work on " + stream_text(s);
            auto range_text = [&](const WorkRange& r) {
                return format("%s [%s, +%zu)", r.what.c_str(), pointer_text(r.address).c_str(), r.bytes);
            };
            // Checked again now, before `run` can touch them: a free that ran since the
            // enqueue (queued on another stream) shows here, as a kernel's access to freed
            // memory does. (A context reset drops the work with its stream instead.)
            for (const WorkRange& r : op.ranges) {
                if (r.bytes != 0 && !device_range_ok(r.address, r.bytes, &why)) {
                    make_sticky(c, ILLEGAL_ADDRESS, format("%s: %s: %s (%s)", op.label.c_str(), range_text(r).c_str(),
                                                           why.c_str(), where.c_str()));
                    op.work.reset();
                    return;
                }
            }
            // What the ranges declared read only hold, to tell afterwards whether `run` wrote
            // them; one that a written range overlaps may change through that one.
            std::vector<std::pair<const WorkRange*, uint64_t>> read_only;
            for (const WorkRange& r : op.ranges) {
                if (r.writes || r.bytes == 0) continue;
                bool written = false;
                for (const WorkRange& w : op.ranges) {
                    written = written || (w.writes && w.address < r.address + r.bytes && r.address < w.address + w.bytes);
                }
                if (!written) read_only.emplace_back(&r, content_hash(r.address, r.bytes));
            }
            char failure[1024] = {0};
            counters.work_run++;
            note_running_work(op.label.c_str());
            int failed = op.work->run(op.work->user, failure, sizeof failure);
            note_running_work(nullptr);
            op.work.reset();  // `done`, before anything else can wait on this stream
            if (failed != 0) {
                failure[sizeof failure - 1] = '\0';
                std::string reason = failure[0] != '\0' ? failure : format("run returned %d and gave no reason", failed);
                make_sticky(c, LAUNCH_FAILED, format("%s: %s (%s)", op.label.c_str(), reason.c_str(), where.c_str()));
                return;
            }
            for (const auto& [r, before] : read_only) {
                // Live still, unless `run` freed it (then reading it would fault here).
                if (!device_range_ok(r->address, r->bytes, &why)) {
                    make_sticky(c, ILLEGAL_ADDRESS, format("%s: %s was freed while the work ran: %s (%s)",
                                                           op.label.c_str(), range_text(*r).c_str(), why.c_str(),
                                                           where.c_str()));
                    return;
                }
                if (content_hash(r->address, r->bytes) != before) {
                    make_sticky(c, LAUNCH_FAILED, format("%s: the work changed %s, which it declared read only (%s)",
                                                         op.label.c_str(), range_text(*r).c_str(), where.c_str()));
                    return;
                }
            }
            // A write past a range's allocation that stayed inside its alignment padding did
            // not fault: its canary shows it, as after a launch.
            for (const WorkRange& r : op.ranges) {
                if (r.bytes != 0 && !padding_intact(r.address, &why)) {
                    make_sticky(c, ILLEGAL_ADDRESS, format("%s: illegal write at %s, by the work over %s (found after "
                                                           "it ran, in the allocation's alignment padding) (%s)",
                                                           op.label.c_str(), why.c_str(), r.what.c_str(),
                                                           where.c_str()));
                    return;
                }
            }
            return;
        }
    }
}

// Runs stream `s`'s queued work up to and including operation `seq` (all of it for
// UINT64_MAX), on the calling thread.
void run_until(Stream* s, uint64_t seq) {
    std::lock_guard<std::recursive_mutex> running(s->run_mutex);
    for (;;) {
        Op op;
        {
            std::lock_guard<std::mutex> lock(s->queue_mutex);
            if (s->queue.empty() || s->queue.front().seq > seq) return;
            op = std::move(s->queue.front());
            s->queue.pop_front();
        }
        execute(s, op);
    }
}

// What a poll (cuStreamQuery, cuEventQuery) lets the "GPU" do meanwhile: run `s` up to
// `seq`, unless another thread is running it now (a synchronisation, or a launch that
// hangs): a poll never waits, on a GPU or here.
void run_until_if_free(Stream* s, uint64_t seq) {
    std::unique_lock<std::recursive_mutex> running(s->run_mutex, std::try_to_lock);
    if (running.owns_lock()) run_until(s, seq);
}

// ---- cross-stream hazards and write tracking -------------------------------------------

// The host has seen `clock` done (it synchronised a stream or an event, or a copy waited):
// every operation enqueued from now on in context `c` comes after it.
void host_saw(Context* c, const Clock& clock) {
    Lock lock(state().mutex);
    if (context_alive(c)) merge(c->host_clock, clock);
}

// Stream `s`'s clock now: what its next operation comes after.
Clock stream_clock(Stream* s) {
    Lock lock(state().mutex);
    return s->clock;
}

// What a host wait for stream `s` up to operation `seq` shows done.
Clock clock_until(Stream* s, uint64_t seq) {
    Lock lock(state().mutex);
    Clock clock = s->clock;
    clock[s->id] = seq;
    return clock;
}

// CELER_CUDA_STANDIN_COUNTERS_FILE=PATH: every counter as `name value` lines, rewritten
// whole (PATH.tmp, then renamed over PATH, so a reader never sees half a file) at each
// host synchronisation, host registration and pinned allocation: the counts of a server
// in another process, read by a test after each response (a request's last host
// synchronisation precedes its response). The path is set once, when the driver starts.
void dump_counters() {
    const std::string& path = state().counters_file;
    if (path.empty()) return;
    std::string text;
#define DUMP(field) text += format("%s %llu\n", #field, static_cast<unsigned long long>(counters.field.load()));
    EVERY_COUNTER(DUMP)
#undef DUMP
    std::string tmp = path + ".tmp";
    FILE* f = fopen(tmp.c_str(), "w");
    if (f == nullptr) {
        fprintf(stderr, "cuda stand-in: CELER_CUDA_STANDIN_COUNTERS_FILE %s: cannot write %s\n", path.c_str(),
                tmp.c_str());
        return;
    }
    fwrite(text.data(), 1, text.size(), f);
    fclose(f);
    rename(tmp.c_str(), path.c_str());
}

// A host synchronisation, counted (and reported to CELER_CUDA_STANDIN_COUNTERS_FILE).
void count_host_sync() {
    counters.host_syncs++;
    dump_counters();
}

// Runs `s` up to `seq` for a call that returns only then (a synchronous copy or memset).
void wait_for(Stream* s, uint64_t seq) {
    count_host_sync();
    Clock seen = clock_until(s, seq);
    run_until(s, seq);
    host_saw(s->context, seen);
}

// The allocation an access touches, if it touches one (an empty range touches nothing).
bool accessed_allocation(const Access& a, AllocationView* view) {
    if (a.bytes == 0 && !a.pointer) return false;
    if (a.address == 0) return false;
    return find_allocation(a.address, a.pointer ? 0 : a.bytes, view) && view->live;
}

// Refuses an operation of stream `s` (label `label`) that reads or writes an allocation
// another stream wrote (or, for a write, read) with no dependency on that access.
int check_hazards(Stream* s, const std::string& label, const std::vector<Access>& accesses) {
    State& st = state();
    for (const Access& a : accesses) {
        AllocationView view;
        if (!accessed_allocation(a, &view)) continue;
        auto found = st.accesses.find(view.base);
        if (found == st.accesses.end()) continue;
        std::string allocation =
            format("the %zu-byte allocation at %s", view.size, pointer_text(view.base).c_str());
        auto unordered = [&](const std::map<uint64_t, AccessRecord>& records, const char* verb) -> int {
            for (const auto& [stream, record] : records) {
                if (stream == s->id || clock_at(s->clock, stream) >= record.seq) continue;
                return fail(INVALID_VALUE,
                            format("%s: cross-stream hazard: it %s %s (%s), which %s %s, and nothing orders it "
                                   "after that: %s did not wait (cuStreamWaitEvent) on an event recorded on %s after "
                                   "it, and the host did not synchronise %s past it (cuStreamSynchronize, "
                                   "cuEventSynchronize, cuCtxSynchronize, a synchronous copy). On a GPU the two can "
                                   "run at the same time (CELER_CUDA_STANDIN_HAZARDS=0 turns this check off)",
                                   label.c_str(), a.writes ? "writes" : "reads", a.what.c_str(), allocation.c_str(),
                                   record.label.c_str(), verb, stream_text(s).c_str(), record.stream.c_str(),
                                   record.stream.c_str()));
            }
            return SUCCESS;
        };
        if (int r = unordered(found->second.writes, "wrote")) return r;
        if (a.writes) {
            if (int r = unordered(found->second.reads, "read")) return r;
        }
    }
    return SUCCESS;
}

void record_accesses(Stream* s, uint64_t seq, const std::string& label, const std::vector<Access>& accesses) {
    State& st = state();
    for (const Access& a : accesses) {
        AllocationView view;
        if (!accessed_allocation(a, &view)) continue;
        if (a.writes && st.tracking_writes) st.written.insert(view.base);
        if (!st.hazards) continue;
        AllocationAccesses& record = st.accesses[view.base];
        AccessRecord mine{seq, label, stream_text(s)};
        if (a.writes) {
            // Every other access was ordered before this one (else it was refused): the
            // next access needs to come after this one only.
            record.writes.clear();
            record.reads.clear();
            record.writes[s->id] = std::move(mine);
        } else {
            record.reads[s->id] = std::move(mine);
        }
    }
}

// Queues `op` on stream `s`, after checking its accesses for cross-stream hazards; on
// success `op` is moved into the queue and *seq (if asked) is its sequence number. On an
// error nothing is queued and `op` stays the caller's (device work's `done` then runs
// when the caller drops it, after every lock is released).
int enqueue(Stream* s, Op& op, const std::vector<Access>& accesses = {}, uint64_t* seq_out = nullptr) {
    State& st = state();
    Lock lock(st.mutex);
    if (!st.streams.count(s)) {
        return fail(INVALID_HANDLE, format("%s: the stream was destroyed while the call ran", op.label.c_str()));
    }
    merge(s->clock, s->context->host_clock);
    uint64_t seq = s->next_seq;
    if (st.hazards) {
        if (int r = check_hazards(s, op.label, accesses)) return r;
    }
    record_accesses(s, seq, op.label, accesses);
    s->clock[s->id] = seq;
    {
        std::lock_guard<std::mutex> queue_lock(s->queue_mutex);
        s->next_seq = seq + 1;
        op.seq = seq;
        s->queue.push_back(std::move(op));
    }
    if (seq_out != nullptr) *seq_out = seq;
    return SUCCESS;
}

// Runs every live stream's queued work (before memory is poisoned: nothing in flight may
// see it). Takes no lock while the work runs.
void run_all_streams() {
    std::vector<Stream*> streams;
    {
        Lock lock(state().mutex);
        streams.assign(state().streams.begin(), state().streams.end());
    }
    for (Stream* s : streams) {
        {
            Lock lock(state().mutex);
            if (!state().streams.count(s)) continue;
        }
        run_until(s, UINT64_MAX);
    }
}

// Fills the live allocations among `bases` (all live ones when null) with `byte`.
uint64_t poison_allocations(const std::set<uintptr_t>* bases, unsigned char byte) {
    std::vector<AllocationView> live;
    live_allocations(&live);
    uint64_t poisoned = 0;
    for (const AllocationView& a : live) {
        if (bases != nullptr && !bases->count(a.base)) continue;
        memset(reinterpret_cast<void*>(a.base), byte, a.size);
        poisoned++;
    }
    return poisoned;
}

uint64_t poison_written(unsigned char byte) {
    run_all_streams();
    Lock lock(state().mutex);
    uint64_t n = poison_allocations(&state().written, byte);
    state().written.clear();
    state().tracking_writes = true;
    return n;
}

void mark_writes() {
    Lock lock(state().mutex);
    state().written.clear();
    state().tracking_writes = true;
}

// CELER_CUDA_STANDIN_POISON_FILE: at each enqueue call, a command in the file is carried
// out and the file removed. Called with no lock held (poisoning runs the streams).
void poll_poison_file() {
    std::string path;
    {
        Lock lock(state().mutex);
        path = state().poison_file;
    }
    if (path.empty()) return;
    FILE* f = fopen(path.c_str(), "r");
    if (f == nullptr) return;
    char text[64] = {0};
    size_t got = fread(text, 1, sizeof(text) - 1, f);
    fclose(f);
    remove(path.c_str());
    text[got] = '\0';
    std::string command(text);
    while (!command.empty() && (command.back() == '\n' || command.back() == ' ' || command.back() == '\r')) {
        command.pop_back();
    }
    unsigned char byte = kPoison;
    std::string verb = command;
    size_t space = command.find(' ');
    if (space != std::string::npos) {
        verb = command.substr(0, space);
        byte = static_cast<unsigned char>(strtoul(command.c_str() + space + 1, nullptr, 0));
    }
    if (verb == "mark") {
        mark_writes();
    } else if (verb == "poison") {
        // Said on stderr (a server's log) so that a test can tell the poison reached memory.
        uint64_t n = poison_written(byte);
        fprintf(stderr, "cuda stand-in: poisoned %llu allocations written since the mark (0x%02x)\n",
                static_cast<unsigned long long>(n), byte);
    } else if (verb == "poison_live") {
        run_all_streams();
        Lock lock(state().mutex);
        poison_allocations(nullptr, byte);
    } else {
        fail(INVALID_VALUE, format("CELER_CUDA_STANDIN_POISON_FILE %s: unknown command \"%s\" (mark, poison [byte], "
                                   "poison_live [byte]); ignored",
                                   path.c_str(), command.c_str()));
    }
}

// ---- handles ----------------------------------------------------------------------------

// The stream a call names: its own, or the context's null stream for 0 (and the legacy
// and per-thread handles 1 and 2).
int resolve_stream(void* handle, Stream** out, const char* call) {
    State& st = state();
    if (reinterpret_cast<uintptr_t>(handle) <= 2) {
        if (!context_alive(current)) return fail(INVALID_CONTEXT, format("%s: no current context", call));
        *out = current->null_stream;
        return SUCCESS;
    }
    Stream* s = static_cast<Stream*>(handle);
    if (!st.streams.count(s)) return fail(INVALID_HANDLE, format("%s: %p is not a live stream", call, handle));
    *out = s;
    return SUCCESS;
}

Context* context_of_handles(void* stream, void* event) {
    State& st = state();
    Stream* s = static_cast<Stream*>(stream);
    if (reinterpret_cast<uintptr_t>(stream) > 2 && st.streams.count(s)) return s->context;
    Event* e = static_cast<Event*>(event);
    if (e != nullptr && st.events.count(e)) return e->context;
    return current;
}

std::string stream_text(const Stream* s) {
    return s->is_null ? std::string("the null stream") : format("stream %p", static_cast<const void*>(s));
}

// "the primary context of GPU 0", or "context 0x... (cuCtxCreate) of GPU 1".
std::string context_text(const Context* c) {
    State& st = state();
    bool primary = size_t(c->device) < st.devices.size() && st.devices[size_t(c->device)].primary == c;
    if (primary) return format("the primary context of GPU %d", c->device);
    return format("context %p (cuCtxCreate) of GPU %d", static_cast<const void*>(c), c->device);
}

// Rule "registration ended with its context": a pageable copy (`pageable`) from or to host
// memory whose registration ended with the context that made it is counted and noted: on
// a GPU such a copy is staged and synchronous, on every GPU, however portable the
// registration was.
void note_registration_ended(bool pageable, const void* host, size_t bytes, const char* call, const Context* c) {
    if (!pageable) return;
    std::string ended = registration_ended_with_context(host, bytes);
    if (ended.empty()) return;
    counters.pageable_after_context_end++;
    std::string note = format("registration ended with its context: %s(%p, %zu bytes) on GPU %d copies pageable "
                              "memory (staged, synchronous): its cuMemHostRegister ended with %s, for every GPU",
                              call, host, bytes, c->device, ended.c_str());
    {
        std::lock_guard<std::mutex> lock(last_error_mutex);
        last_note_text = note;
    }
    if (getenv("CELER_CUDA_STANDIN_QUIET") == nullptr) fprintf(stderr, "cuda stand-in: note: %s\n", note.c_str());
}

Context* new_context(int device, unsigned int flags) {
    State& st = state();
    Context* c = new Context();
    c->device = device;
    c->generation = st.next_generation++;
    c->flags = flags;
    Stream* null_stream = new Stream();
    null_stream->context = c;
    null_stream->is_null = true;
    null_stream->id = st.next_stream_id++;
    c->null_stream = null_stream;
    st.contexts.insert(c);
    st.streams.insert(null_stream);
    counters.contexts_created++;
    return c;
}

// Destroys a context and everything in it: its memory is freed, its handles die. The
// objects themselves are kept (a few hundred bytes each, per destroyed context): were one
// freed, the next context, stream, event or module made (a reset and a retain make them at
// once) could get its address, and a stale handle (a stream celer destroys after the
// reset, say) would reach the new object instead of failing.
void destroy_context(Context* c, const char* why) {
    State& st = state();
    device_free_generation(c->generation, why);
    // Host memory it registered is pageable again (the memory stays the caller's).
    host_unregister_generation(c->generation, why, context_text(c));
    // The accesses recorded of its memory go with it.
    for (auto it = st.accesses.begin(); it != st.accesses.end();) {
        AllocationView view;
        bool live = find_allocation(it->first, 0, &view) && view.live;
        it = live ? std::next(it) : st.accesses.erase(it);
    }
    std::vector<Stream*> streams(c->streams.begin(), c->streams.end());
    streams.push_back(c->null_stream);
    for (Stream* s : streams) {
        st.streams.erase(s);
        // Queued work is dropped unrun (device work's `done` is called here).
        std::deque<Op> dropped;
        std::lock_guard<std::mutex> lock(s->queue_mutex);
        dropped.swap(s->queue);
    }
    for (Event* e : c->events) st.events.erase(e);
    for (Module* m : c->modules) {
        for (auto& [name, f] : m->functions) st.functions.erase(f);
        st.modules.erase(m);
    }
    c->streams.clear();
    c->events.clear();
    c->modules.clear();
    st.contexts.erase(c);
    if (current == c) {
        // CUDA pops a destroyed context current on the calling thread (a reset's or a
        // release's leaves nothing current: celer binds again before each call).
        current = nullptr;
        if (strcmp(why, "cuCtxDestroy") == 0 && !below_current.empty()) {
            current = below_current.back();
            below_current.pop_back();
        }
    }
}

// Checks that `device` is a device and the driver was initialised.
int check_device(int device, const char* call) {
    State& st = state();
    if (!st.initialized) return fail(NOT_INITIALIZED, format("%s before cuInit", call));
    if (device < 0 || size_t(device) >= st.devices.size()) {
        return fail(INVALID_DEVICE, format("%s: device %d (the stand-in has %zu)", call, device, st.devices.size()));
    }
    return SUCCESS;
}

// Checks the context a call works in: live, and not sticky.
int check_context(Context* c, const char* call) {
    if (!context_alive(c)) return fail(INVALID_CONTEXT, format("%s: no live context", call));
    return sticky_error(c);
}

// [address, address + bytes) as a copy or memset target, checked when queued.
int check_device_range(uintptr_t address, size_t bytes, const char* call, const char* what) {
    std::string why;
    if (!device_range_ok(address, bytes, &why)) {
        return fail(INVALID_VALUE, format("%s: %s %s", call, what, why.c_str()));
    }
    AllocationView view;
    if (find_allocation(address, bytes, &view) && state().freeing.count(view.base)) {
        return fail(INVALID_VALUE, format("%s: %s %s is in an allocation whose cuMemFreeAsync is already queued", call,
                                          what, pointer_text(address).c_str()));
    }
    return SUCCESS;
}

int check_host_pointer(const void* host, size_t bytes, const char* call, const char* what) {
    if (bytes > 0 && host == nullptr) return fail(INVALID_VALUE, format("%s: %s is null", call, what));
    if (arena_contains(reinterpret_cast<uintptr_t>(host))) {
        return fail(INVALID_VALUE, format("%s: %s %p is device memory, not host memory", call, what, host));
    }
    return SUCCESS;
}

// ---- kernel parameters ------------------------------------------------------------------

// Reads kernelParams[k] as the k-th parameter type (kernelParams[k] points at the k-th
// argument). An entry that cannot be read (fewer arguments than the kernel takes) is an
// error of the launch instead of a crash of the caller.
int capture_params(const KernelEntry& k, void** params, Op* op, const std::string& label) {
    size_t offset = 0;
    op->param_offsets.resize(k.param_count);
    for (size_t i = 0; i < k.param_count; ++i) {
        size_t align = k.params[i].align == 0 ? 1 : k.params[i].align;
        offset = (offset + align - 1) / align * align;
        op->param_offsets[i] = offset;
        offset += k.params[i].size;
    }
    op->params.assign(offset + 8, 0);
    if (k.param_count > 0 && params == nullptr) {
        return fail(INVALID_VALUE, format("%s: kernelParams is null but %s takes %zu parameters (%s)", label.c_str(),
                                          k.name, k.param_count, k.signature));
    }
    for (size_t i = 0; i < k.param_count; ++i) {
        void* argument = nullptr;
        if (!guarded_copy(&argument, &params[i], sizeof(argument)) ||
            !guarded_copy(op->params.data() + op->param_offsets[i], argument, k.params[i].size)) {
            return fail(INVALID_VALUE, format("%s: kernelParams[%zu] cannot be read: fewer arguments than %s(%s) takes",
                                              label.c_str(), i, k.name, k.signature));
        }
    }
    // Pointer parameters: device memory, live, not being freed, aligned for their type.
    for (size_t i = 0; i < k.param_count; ++i) {
        const ParamInfo& p = k.params[i];
        if (!p.is_pointer) continue;
        uintptr_t v;
        memcpy(&v, op->params.data() + op->param_offsets[i], sizeof(v));
        if (v == 0) continue;  // a null pointer faults only if the kernel uses it
        std::string why;
        std::string param = format("parameter %zu of %s(%s)", i, k.name, k.signature);
        if (!arena_contains(v)) {
            return fail(INVALID_VALUE, format("%s: %s is %s, not device memory (a host pointer, or an argument of "
                                              "another type in its place: swapped or missing arguments?)",
                                              label.c_str(), param.c_str(), pointer_text(v).c_str()));
        }
        if (!device_range_ok(v, 0, &why)) {
            return fail(INVALID_VALUE, format("%s: %s: %s", label.c_str(), param.c_str(), why.c_str()));
        }
        AllocationView view;
        if (find_allocation(v, 0, &view) && state().freeing.count(view.base)) {
            return fail(INVALID_VALUE, format("%s: %s points into an allocation whose cuMemFreeAsync is already queued",
                                              label.c_str(), param.c_str()));
        }
        if (p.pointee_align > 1 && v % p.pointee_align != 0) {
            return fail(INVALID_VALUE, format("%s: %s is %s, not aligned to its type's %zu bytes (a GPU faults with "
                                              "CUDA_ERROR_MISALIGNED_ADDRESS)",
                                              label.c_str(), param.c_str(), pointer_text(v).c_str(), p.pointee_align));
        }
    }
    return SUCCESS;
}

size_t host_param_bytes(const KernelEntry& k) {
    size_t offset = 0;
    for (size_t i = 0; i < k.param_count; ++i) {
        size_t align = k.params[i].align == 0 ? 1 : k.params[i].align;
        offset = (offset + align - 1) / align * align + k.params[i].size;
    }
    return offset;
}

}  // namespace
}  // namespace standin

using namespace standin;

// ---- probe -----------------------------------------------------------------------------

EXPORT CUresult cuDriverGetVersion(int* version) {
    RETURN_IF_INJECTED_PROBE("cuDriverGetVersion");
    if (version == nullptr) return INVALID_VALUE;
    *version = driver_version();
    return SUCCESS;
}

EXPORT CUresult cuInit(unsigned int flags) {
    if (flags != 0) return fail(INVALID_VALUE, "cuInit: flags must be 0");
    State& st = state();
    Lock lock(st.mutex);
    if (!st.initialized) {
        long devices = env_number("CELER_CUDA_STANDIN_DEVICES", 1);
        st.devices.assign(size_t(devices < 0 ? 0 : devices), Device{});
        const char* sm = getenv("CELER_CUDA_STANDIN_SM");
        if (!sm_list(sm, st.devices.size(), &st.sms)) {
            return fail(INVALID_VALUE, format("cuInit: CELER_CUDA_STANDIN_SM=%s is not a compute capability (90) or a "
                                              "comma list of them, one per device (90,80)",
                                              sm));
        }
        const char* order_env = getenv("CELER_CUDA_STANDIN_ORDER");
        ExecutionOrder order;
        if (!parse_order(order_env, &order)) {
            return fail(INVALID_VALUE, format("cuInit: CELER_CUDA_STANDIN_ORDER=%s is not forward, reverse or "
                                              "random:<seed> (a seed of 64 bits, in decimal)",
                                              order_env));
        }
        bool shared = true;
        for (auto [name, setting] : {std::pair<const char*, bool*>{"CELER_CUDA_STANDIN_HAZARDS", &st.hazards},
                                     {"CELER_CUDA_STANDIN_POISON_SHARED", &shared},
                                     {"CELER_CUDA_STANDIN_POISON_DEVICE", &st.poison_device}}) {
            if (!env_switch(name, true, setting)) {
                return fail(INVALID_VALUE, format("cuInit: %s=%s: 1 (on, the default) or 0 (off)", name, getenv(name)));
            }
        }
        set_execution_order(order);
        set_shared_poison(shared);
        const char* poison_file = getenv("CELER_CUDA_STANDIN_POISON_FILE");
        st.poison_file = poison_file != nullptr ? poison_file : "";
        const char* counters_file = getenv("CELER_CUDA_STANDIN_COUNTERS_FILE");
        st.counters_file = counters_file != nullptr ? counters_file : "";
        st.memory_bytes = size_t(env_number("CELER_CUDA_STANDIN_MEMORY_MIB", 16384)) << 20;
        long fail_at = env_number("CELER_CUDA_STANDIN_FAIL_LAUNCH", 0);
        long sticky_at = env_number("CELER_CUDA_STANDIN_STICKY_LAUNCH", 0);
        long hang_at = env_number("CELER_CUDA_STANDIN_HANG_LAUNCH", 0);
        const char* fault_file = getenv("CELER_CUDA_STANDIN_FAULT_FILE");
        st.fault_file = fault_file != nullptr ? fault_file : "";
        counters.fail_launch_at = fail_at > 0 ? uint64_t(fail_at) : 0;
        counters.sticky_launch_at = sticky_at > 0 ? uint64_t(sticky_at) : 0;
        counters.hang_launch_at = hang_at > 0 ? uint64_t(hang_at) : 0;
        const char* counters_at_exit = getenv("CELER_CUDA_STANDIN_COUNTERS_AT_EXIT");
        if (counters_at_exit != nullptr && *counters_at_exit != '\0') {
            st.counters_at_exit = counters_at_exit;
            atexit(write_counters_at_exit);
        }
        const char* returns = getenv("CELER_CUDA_STANDIN_RETURN");
        std::string why;
        if (returns != nullptr && *returns != '\0' && !arm_returns_from(returns, &why)) {
            return fail(INVALID_VALUE, format("cuInit: CELER_CUDA_STANDIN_RETURN=%s: %s", returns, why.c_str()));
        }
        install_fault_handlers();
        st.initialized = true;
    }
    // After the settings are read: CELER_CUDA_STANDIN_RETURN may name cuInit itself.
    RETURN_IF_INJECTED_PROBE("cuInit");
    return SUCCESS;
}

EXPORT CUresult cuDeviceGetCount(int* count) {
    RETURN_IF_INJECTED_PROBE("cuDeviceGetCount");
    State& st = state();
    Lock lock(st.mutex);
    if (!st.initialized) return fail(NOT_INITIALIZED, "cuDeviceGetCount before cuInit");
    if (count == nullptr) return INVALID_VALUE;
    *count = int(st.devices.size());
    return SUCCESS;
}

EXPORT CUresult cuDeviceGet(CUdevice* device, int ordinal) {
    RETURN_IF_INJECTED_PROBE("cuDeviceGet");
    State& st = state();
    Lock lock(st.mutex);
    if (int r = check_device(ordinal, "cuDeviceGet")) return r;
    if (device == nullptr) return INVALID_VALUE;
    *device = ordinal;
    return SUCCESS;
}

EXPORT CUresult cuDeviceGetName(char* name, int length, CUdevice device) {
    RETURN_IF_INJECTED_PROBE("cuDeviceGetName");
    State& st = state();
    Lock lock(st.mutex);
    if (int r = check_device(device, "cuDeviceGetName")) return r;
    if (name == nullptr || length <= 0) return INVALID_VALUE;
    snprintf(name, size_t(length), "celer CUDA stand-in (sm_%d on the CPU)", st.sms[size_t(device)]);
    return SUCCESS;
}

static void uuid_of(int device, char* bytes) {
    for (int i = 0; i < 16; ++i) bytes[i] = char((0x5a + i * 29 + device * 71) & 0xff);
}

static CUresult device_uuid(CUuuid* uuid, CUdevice device) {
    State& st = state();
    Lock lock(st.mutex);
    if (int r = check_device(device, "cuDeviceGetUuid")) return r;
    if (uuid == nullptr) return INVALID_VALUE;
    uuid_of(device, uuid->bytes);
    return SUCCESS;
}

EXPORT CUresult cuDeviceGetUuid(CUuuid* uuid, CUdevice device) {
    RETURN_IF_INJECTED_PROBE("cuDeviceGetUuid");
    return device_uuid(uuid, device);
}
EXPORT CUresult cuDeviceGetUuid_v2(CUuuid* uuid, CUdevice device) {
    RETURN_IF_INJECTED_PROBE("cuDeviceGetUuid_v2");
    return device_uuid(uuid, device);
}

EXPORT CUresult cuDeviceTotalMem_v2(size_t* bytes, CUdevice device) {
    RETURN_IF_INJECTED_PROBE("cuDeviceTotalMem_v2");
    State& st = state();
    Lock lock(st.mutex);
    if (int r = check_device(device, "cuDeviceTotalMem")) return r;
    if (bytes == nullptr) return INVALID_VALUE;
    *bytes = st.memory_bytes;
    return SUCCESS;
}

EXPORT CUresult cuDeviceGetAttribute(int* value, int attribute, CUdevice device) {
    RETURN_IF_INJECTED_PROBE("cuDeviceGetAttribute");
    State& st = state();
    Lock lock(st.mutex);
    if (int r = check_device(device, "cuDeviceGetAttribute")) return r;
    if (value == nullptr) return INVALID_VALUE;
    switch (attribute) {
        case 1: *value = 1024; break;                   // MAX_THREADS_PER_BLOCK
        case 2: case 3: *value = 1024; break;           // MAX_BLOCK_DIM_X, Y
        case 4: *value = 64; break;                     // MAX_BLOCK_DIM_Z
        case 5: *value = 2147483647; break;             // MAX_GRID_DIM_X
        case 6: case 7: *value = 65535; break;          // MAX_GRID_DIM_Y, Z
        case 8: *value = 48 * 1024; break;              // MAX_SHARED_MEMORY_PER_BLOCK
        case 10: *value = 32; break;                    // WARP_SIZE
        case 13: *value = 1000000; break;               // CLOCK_RATE (kHz)
        case 16: *value = 2; break;                     // MULTIPROCESSOR_COUNT
        case 19: *value = 1; break;                     // CAN_MAP_HOST_MEMORY
        case 33: *value = 0; break;                     // PCI_BUS_ID
        case 36: *value = 1000000; break;               // MEMORY_CLOCK_RATE (kHz)
        case 37: *value = 128; break;                   // GLOBAL_MEMORY_BUS_WIDTH
        case 38: *value = 4 << 20; break;               // L2_CACHE_SIZE
        case 39: *value = 2048; break;                  // MAX_THREADS_PER_MULTIPROCESSOR
        case 40: *value = 2; break;                     // ASYNC_ENGINE_COUNT
        case 41: *value = 1; break;                     // UNIFIED_ADDRESSING
        case 75: *value = st.sms[size_t(device)] / 10; break;  // COMPUTE_CAPABILITY_MAJOR
        case 76: *value = st.sms[size_t(device)] % 10; break;  // COMPUTE_CAPABILITY_MINOR
        case 115: *value = 1; break;                    // MEMORY_POOLS_SUPPORTED
        default: *value = 0; break;
    }
    return SUCCESS;
}

// ---- contexts ----------------------------------------------------------------------------

EXPORT CUresult cuDevicePrimaryCtxRetain(void** context, CUdevice device) {
    RETURN_IF_INJECTED_IN("cuDevicePrimaryCtxRetain", primary_of(device));
    State& st = state();
    Lock lock(st.mutex);
    if (int r = check_device(device, "cuDevicePrimaryCtxRetain")) return r;
    if (context == nullptr) return INVALID_VALUE;
    Device& d = st.devices[size_t(device)];
    if (d.primary == nullptr) d.primary = new_context(device, d.primary_flags);
    d.retains += 1;
    *context = d.primary;
    return SUCCESS;
}

EXPORT CUresult cuDevicePrimaryCtxRelease_v2(CUdevice device) {
    RETURN_IF_INJECTED_IN("cuDevicePrimaryCtxRelease_v2", primary_of(device));
    State& st = state();
    Lock lock(st.mutex);
    if (int r = check_device(device, "cuDevicePrimaryCtxRelease")) return r;
    Device& d = st.devices[size_t(device)];
    if (d.retains <= 0) {
        return fail(INVALID_CONTEXT, format("cuDevicePrimaryCtxRelease(%d): the primary context is not retained", device));
    }
    d.retains -= 1;
    if (d.retains == 0 && d.primary != nullptr) {
        // The last release destroys the primary context, sticky error and all; the next
        // retain makes a new one.
        destroy_context(d.primary, "the primary context's destruction (last cuDevicePrimaryCtxRelease)");
        d.primary = nullptr;
    }
    return SUCCESS;
}

// As CUDA documents it: destroys the primary context (its memory, streams, events,
// modules and sticky error) whoever holds it, but "does not release it": the retains stay
// counted, the next retain gets a fresh context, and a release after the reset is fine.
EXPORT CUresult cuDevicePrimaryCtxReset_v2(CUdevice device) {
    RETURN_IF_INJECTED_IN("cuDevicePrimaryCtxReset_v2", primary_of(device));
    State& st = state();
    Lock lock(st.mutex);
    if (int r = check_device(device, "cuDevicePrimaryCtxReset")) return r;
    Device& d = st.devices[size_t(device)];
    if (d.primary != nullptr) {
        destroy_context(d.primary, "cuDevicePrimaryCtxReset");
        d.primary = nullptr;
        record_loss(device, "its context was reset (cuDevicePrimaryCtxReset)", true);
    }
    return SUCCESS;
}

EXPORT CUresult cuDevicePrimaryCtxSetFlags_v2(CUdevice device, unsigned int flags) {
    RETURN_IF_INJECTED_IN("cuDevicePrimaryCtxSetFlags_v2", primary_of(device));
    State& st = state();
    Lock lock(st.mutex);
    if (int r = check_device(device, "cuDevicePrimaryCtxSetFlags")) return r;
    Device& d = st.devices[size_t(device)];
    d.primary_flags = flags;
    if (d.primary != nullptr) d.primary->flags = flags;
    return SUCCESS;
}

EXPORT CUresult cuDevicePrimaryCtxGetState(CUdevice device, unsigned int* flags, int* active) {
    RETURN_IF_INJECTED_IN("cuDevicePrimaryCtxGetState", primary_of(device));
    State& st = state();
    Lock lock(st.mutex);
    if (int r = check_device(device, "cuDevicePrimaryCtxGetState")) return r;
    if (flags == nullptr || active == nullptr) return INVALID_VALUE;
    Device& d = st.devices[size_t(device)];
    *flags = d.primary != nullptr ? d.primary->flags : d.primary_flags;
    *active = d.primary != nullptr && d.retains > 0 ? 1 : 0;
    return SUCCESS;
}

EXPORT CUresult cuCtxGetCurrent(void** context) {
    RETURN_IF_INJECTED_PROBE("cuCtxGetCurrent");
    Lock lock(state().mutex);
    if (context == nullptr) return INVALID_VALUE;
    *context = context_alive(current) ? current : nullptr;
    return SUCCESS;
}

EXPORT CUresult cuCtxSetCurrent(void* context) {
    RETURN_IF_INJECTED_IN("cuCtxSetCurrent", static_cast<Context*>(context));
    Lock lock(state().mutex);
    Context* c = static_cast<Context*>(context);
    if (c != nullptr && !context_alive(c)) {
        return fail(INVALID_CONTEXT, format("cuCtxSetCurrent(%p): not a live context (destroyed?)", context));
    }
    current = c;
    return SUCCESS;
}

// The flags cuCtxCreate takes: CU_CTX_SCHED_* (0-4), MAP_HOST (0x8), LMEM_RESIZE_TO_MAX (0x10).
static const unsigned int kCtxCreateFlags = 0x7 | 0x8 | 0x10;

EXPORT CUresult cuCtxCreate_v2(void** context, unsigned int flags, CUdevice device) {
    RETURN_IF_INJECTED("cuCtxCreate_v2", nullptr, nullptr);
    State& st = state();
    Lock lock(st.mutex);
    if (int r = check_device(device, "cuCtxCreate")) return r;
    if (context == nullptr) return fail(INVALID_VALUE, "cuCtxCreate: null context pointer");
    if ((flags & ~kCtxCreateFlags) != 0 || (flags & 0x7) > 4) {
        return fail(INVALID_VALUE, format("cuCtxCreate(flags 0x%x): not CU_CTX_SCHED_* | MAP_HOST | LMEM_RESIZE_TO_MAX",
                                          flags));
    }
    Context* c = new_context(device, flags);
    below_current.push_back(current);
    current = c;
    *context = c;
    return SUCCESS;
}

EXPORT CUresult cuCtxPushCurrent_v2(void* context) {
    RETURN_IF_INJECTED("cuCtxPushCurrent_v2", nullptr, nullptr);
    Lock lock(state().mutex);
    Context* c = static_cast<Context*>(context);
    if (!context_alive(c)) {
        return fail(INVALID_CONTEXT, format("cuCtxPushCurrent(%p): not a live context (destroyed?)", context));
    }
    below_current.push_back(current);
    current = c;
    return SUCCESS;
}

EXPORT CUresult cuCtxPopCurrent_v2(void** context) {
    RETURN_IF_INJECTED("cuCtxPopCurrent_v2", nullptr, nullptr);
    Lock lock(state().mutex);
    if (current == nullptr) return fail(INVALID_CONTEXT, "cuCtxPopCurrent: no context is current on this thread");
    if (context != nullptr) *context = current;
    current = below_current.empty() ? nullptr : below_current.back();
    if (!below_current.empty()) below_current.pop_back();
    return SUCCESS;
}

EXPORT CUresult cuCtxDestroy_v2(void* context) {
    RETURN_IF_INJECTED("cuCtxDestroy_v2", nullptr, nullptr);
    State& st = state();
    Lock lock(st.mutex);
    Context* c = static_cast<Context*>(context);
    if (!context_alive(c)) {
        return fail(INVALID_CONTEXT, format("cuCtxDestroy(%p): not a live context (destroyed?)", context));
    }
    if (st.devices[size_t(c->device)].primary == c) {
        return fail(INVALID_CONTEXT, format("cuCtxDestroy(%p): the primary context of GPU %d (cuDevicePrimaryCtxRelease "
                                            "or cuDevicePrimaryCtxReset end it)",
                                            context, c->device));
    }
    destroy_context(c, "cuCtxDestroy");
    return SUCCESS;
}

EXPORT CUresult cuCtxGetDevice(CUdevice* device) {
    RETURN_IF_INJECTED("cuCtxGetDevice", nullptr, nullptr);
    Lock lock(state().mutex);
    if (!context_alive(current)) return fail(INVALID_CONTEXT, "cuCtxGetDevice: no current context");
    if (device == nullptr) return INVALID_VALUE;
    *device = current->device;
    return SUCCESS;
}

EXPORT CUresult cuCtxSetFlags(unsigned int flags) {
    RETURN_IF_INJECTED("cuCtxSetFlags", nullptr, nullptr);
    State& st = state();
    Lock lock(st.mutex);
    if (int r = check_context(current, "cuCtxSetFlags")) return r;
    current->flags = flags;
    st.devices[size_t(current->device)].primary_flags = flags;
    return SUCCESS;
}

EXPORT CUresult cuCtxGetFlags(unsigned int* flags) {
    RETURN_IF_INJECTED("cuCtxGetFlags", nullptr, nullptr);
    Lock lock(state().mutex);
    if (!context_alive(current)) return fail(INVALID_CONTEXT, "cuCtxGetFlags: no current context");
    if (flags == nullptr) return INVALID_VALUE;
    *flags = current->flags;
    return SUCCESS;
}

EXPORT CUresult cuCtxSynchronize() {
    RETURN_IF_INJECTED("cuCtxSynchronize", nullptr, nullptr);
    std::vector<Stream*> streams;
    Context* c;
    {
        Lock lock(state().mutex);
        c = current;
        if (!context_alive(c)) return fail(INVALID_CONTEXT, "cuCtxSynchronize: no current context");
        streams.assign(c->streams.begin(), c->streams.end());
        streams.push_back(c->null_stream);
    }
    Clock seen;
    {
        Lock lock(state().mutex);
        for (Stream* s : streams) merge(seen, s->clock);
        merge(seen, c->retired_clock);
    }
    for (Stream* s : streams) run_until(s, UINT64_MAX);
    host_saw(c, seen);
    counters.ctx_syncs++;
    count_host_sync();
    return sticky_error(c);
}

// ---- modules -------------------------------------------------------------------------------

EXPORT CUresult cuModuleLoadData(void** module, const void* image) {
    RETURN_IF_INJECTED("cuModuleLoadData", nullptr, nullptr);
    State& st = state();
    Lock lock(st.mutex);
    if (int r = check_context(current, "cuModuleLoadData")) return r;
    if (module == nullptr || image == nullptr) return INVALID_VALUE;
    std::string why;
    Cubin cubin;
    if (!read_cubin(image, &why, &cubin)) return fail(INVALID_IMAGE, "cuModuleLoadData: " + why);
    // A driver runs the CUBINs of its own CUDA major and older ones, never a newer one's
    // (NVRTC 13's output needs a CUDA 13 driver, R580 or later).
    if (cubin.cuda_major * 1000 > driver_version()) {
        return fail(INVALID_IMAGE, format("cuModuleLoadData: a CUBIN written by CUDA %d (its ELF ABI) cannot load on "
                                          "this CUDA %d.%d driver",
                                          cubin.cuda_major, driver_version() / 1000, driver_version() % 1000 / 10));
    }
    const std::string& arch = cubin.arch;
    int cubin_sm = atoi(arch.c_str() + 3);
    int sm = st.sms[size_t(current->device)];
    // A CUBIN runs on its own major architecture, at its minor version or a later one.
    if (cubin_sm / 10 != sm / 10 || cubin_sm % 10 > sm % 10) {
        return fail(NO_BINARY_FOR_GPU, format("cuModuleLoadData: a CUBIN for %s cannot run on this sm_%d device",
                                              arch.c_str(), sm));
    }
    for (const CubinKernel& k : cubin.kernels) {
        const KernelEntry* host = find_kernel(k.name.c_str());
        if (host != nullptr && k.param_bytes != host_param_bytes(*host)) {
            return fail(INVALID_IMAGE,
                        format("cuModuleLoadData: kernel %s takes %zu bytes of parameters in the CUBIN but %zu in the "
                               "stand-in's host build (%s): the stand-in was built from other sources",
                               k.name.c_str(), k.param_bytes, host_param_bytes(*host), host->signature));
        }
    }
    Module* m = new Module();
    m->context = current;
    m->arch = arch;
    m->kernels = std::move(cubin.kernels);
    current->modules.insert(m);
    st.modules.insert(m);
    *module = m;
    return SUCCESS;
}

EXPORT CUresult cuModuleGetFunction(void** function, void* module, const char* name) {
    RETURN_IF_INJECTED_IN("cuModuleGetFunction", context_of_module(module));
    State& st = state();
    Lock lock(st.mutex);
    Module* m = static_cast<Module*>(module);
    if (!st.modules.count(m)) return fail(INVALID_HANDLE, format("cuModuleGetFunction: %p is not a live module", module));
    if (int r = check_context(m->context, "cuModuleGetFunction")) return r;
    if (function == nullptr || name == nullptr) return INVALID_VALUE;
    auto cached = m->functions.find(name);
    if (cached != m->functions.end()) {
        *function = cached->second;
        return SUCCESS;
    }
    bool in_cubin = false;
    for (const CubinKernel& k : m->kernels) in_cubin = in_cubin || k.name == name;
    if (!in_cubin) return fail(NOT_FOUND, format("cuModuleGetFunction: the module has no kernel `%s`", name));
    const KernelEntry* host = find_kernel(name);
    if (host == nullptr) {
        return fail(NOT_FOUND, format("cuModuleGetFunction: the stand-in has no host build of kernel `%s` (rebuild it "
                                      "from the same .cu sources)",
                                      name));
    }
    Function* f = new Function{m, host};
    for (const CubinKernel& k : m->kernels) {
        if (k.name != name) continue;
        f->registers = k.registers;
        f->max_threads = k.max_threads;
    }
    m->functions[name] = f;
    st.functions.insert(f);
    *function = f;
    return SUCCESS;
}

EXPORT CUresult cuModuleUnload(void* module) {
    RETURN_IF_INJECTED_IN("cuModuleUnload", context_of_module(module));
    State& st = state();
    Lock lock(st.mutex);
    Module* m = static_cast<Module*>(module);
    if (!st.modules.count(m)) return fail(INVALID_HANDLE, format("cuModuleUnload: %p is not a live module", module));
    for (auto& [name, f] : m->functions) {
        st.functions.erase(f);
        delete f;
    }
    m->context->modules.erase(m);
    st.modules.erase(m);
    delete m;
    return SUCCESS;
}

// ---- streams -------------------------------------------------------------------------------

EXPORT CUresult cuStreamCreate(void** stream, unsigned int flags) {
    RETURN_IF_INJECTED("cuStreamCreate", nullptr, nullptr);
    (void)flags;  // blocking or not, a stream is its own queue here
    State& st = state();
    Lock lock(st.mutex);
    if (int r = check_context(current, "cuStreamCreate")) return r;
    if (stream == nullptr) return INVALID_VALUE;
    Stream* s = new Stream();
    s->context = current;
    s->is_null = false;
    s->id = st.next_stream_id++;
    current->streams.insert(s);
    st.streams.insert(s);
    *stream = s;
    return SUCCESS;
}

EXPORT CUresult cuStreamSynchronize(void* stream) {
    RETURN_IF_INJECTED("cuStreamSynchronize", stream, nullptr);
    Stream* s;
    {
        Lock lock(state().mutex);
        if (int r = resolve_stream(stream, &s, "cuStreamSynchronize")) return r;
    }
    Clock seen = stream_clock(s);  // everything enqueued on it so far
    run_until(s, UINT64_MAX);
    host_saw(s->context, seen);
    counters.stream_syncs++;
    count_host_sync();
    return sticky_error(s->context);
}

EXPORT CUresult cuStreamQuery(void* stream) {
    RETURN_IF_INJECTED("cuStreamQuery", stream, nullptr);
    Stream* s;
    {
        Lock lock(state().mutex);
        if (int r = resolve_stream(stream, &s, "cuStreamQuery")) return r;
        if (int r = sticky_error(s->context)) return r;
    }
    bool idle;
    Clock seen;
    {
        Lock state_lock(state().mutex);
        std::lock_guard<std::mutex> lock(s->queue_mutex);
        idle = s->queue.empty();
        seen = s->clock;
    }
    if (idle) {
        // The host saw the stream done: what it did comes before what is enqueued next.
        host_saw(s->context, seen);
        return SUCCESS;
    }
    // A GPU makes progress while the host polls: the work runs, and the next query sees it.
    run_until_if_free(s, UINT64_MAX);
    return NOT_READY;
}

EXPORT CUresult cuStreamWaitEvent(void* stream, void* event, unsigned int flags) {
    RETURN_IF_INJECTED("cuStreamWaitEvent", stream, event);
    (void)flags;
    State& st = state();
    Stream* s;
    Op op;
    {
        Lock lock(st.mutex);
        if (int r = resolve_stream(stream, &s, "cuStreamWaitEvent")) return r;
        if (int r = check_context(s->context, "cuStreamWaitEvent")) return r;
        Event* e = static_cast<Event*>(event);
        if (!st.events.count(e)) return fail(INVALID_HANDLE, format("cuStreamWaitEvent: %p is not a live event", event));
        // What the event's record came after comes before everything the stream does next
        // (whether or not the record has run yet).
        merge(s->clock, e->clock);
        if (e->completed) return SUCCESS;
        op.kind = Op::Wait;
        op.event = e;
        op.event_generation = e->generation;
        op.label = format("cuStreamWaitEvent(%p) on %s", event, stream_text(s).c_str());
        return enqueue(s, op);
    }
}

EXPORT CUresult cuStreamDestroy_v2(void* stream) {
    RETURN_IF_INJECTED("cuStreamDestroy_v2", stream, nullptr);
    State& st = state();
    Stream* s;
    {
        Lock lock(st.mutex);
        s = static_cast<Stream*>(stream);
        if (!st.streams.count(s) || s->is_null) {
            return fail(INVALID_HANDLE, format("cuStreamDestroy: %p is not a live stream", stream));
        }
    }
    // As on a GPU, work already queued still runs (and its frees free).
    run_until(s, UINT64_MAX);
    Lock lock(st.mutex);
    if (!st.streams.count(s)) return SUCCESS;  // its context went meanwhile
    merge(s->context->retired_clock, s->clock);
    s->context->streams.erase(s);
    st.streams.erase(s);
    {
        // Events recorded on it keep their times but can no longer be waited through it.
        for (Event* e : st.events) {
            if (e->stream == s) e->stream = nullptr;
        }
    }
    delete s;
    return SUCCESS;
}

// ---- events ----------------------------------------------------------------------------------

EXPORT CUresult cuEventCreate(void** event, unsigned int flags) {
    RETURN_IF_INJECTED("cuEventCreate", nullptr, nullptr);
    State& st = state();
    Lock lock(st.mutex);
    if (int r = check_context(current, "cuEventCreate")) return r;
    if (event == nullptr) return INVALID_VALUE;
    Event* e = new Event();
    e->context = current;
    e->flags = flags;
    current->events.insert(e);
    st.events.insert(e);
    *event = e;
    return SUCCESS;
}

EXPORT CUresult cuEventRecord(void* event, void* stream) {
    RETURN_IF_INJECTED("cuEventRecord", stream, event);
    State& st = state();
    Stream* s;
    Op op;
    {
        Lock lock(st.mutex);
        Event* e = static_cast<Event*>(event);
        if (!st.events.count(e)) return fail(INVALID_HANDLE, format("cuEventRecord: %p is not a live event", event));
        if (int r = resolve_stream(stream, &s, "cuEventRecord")) return r;
        if (int r = check_context(s->context, "cuEventRecord")) return r;
        if (s->context != e->context) {
            return fail(INVALID_CONTEXT, "cuEventRecord: the event and the stream belong to different contexts");
        }
        op.kind = Op::Record;
        op.event = e;
        op.event_generation = e->generation + 1;
        op.label = format("cuEventRecord(%p) on %s", event, stream_text(s).c_str());
        // Queued under the state lock, so that the event's seq is the record's own.
        uint64_t seq = 0;
        if (int r = enqueue(s, op, {}, &seq)) return r;
        e->generation += 1;
        e->completed = false;
        e->stream = s;
        e->seq = seq;
        e->clock = s->clock;
    }
    return SUCCESS;
}

EXPORT CUresult cuEventSynchronize(void* event) {
    RETURN_IF_INJECTED("cuEventSynchronize", nullptr, event);
    State& st = state();
    Stream* s = nullptr;
    uint64_t seq = 0;
    Context* c;
    Clock seen;
    {
        Lock lock(st.mutex);
        Event* e = static_cast<Event*>(event);
        if (!st.events.count(e)) return fail(INVALID_HANDLE, format("cuEventSynchronize: %p is not a live event", event));
        c = e->context;
        seen = e->clock;
        if (!e->completed && e->stream != nullptr) {
            s = e->stream;
            seq = e->seq;
        }
    }
    if (s != nullptr) run_until(s, seq);
    host_saw(c, seen);
    counters.event_syncs++;
    count_host_sync();
    return sticky_error(c);
}

EXPORT CUresult cuEventQuery(void* event) {
    RETURN_IF_INJECTED("cuEventQuery", nullptr, event);
    State& st = state();
    Stream* s = nullptr;
    uint64_t seq = 0;
    {
        Lock lock(st.mutex);
        Event* e = static_cast<Event*>(event);
        if (!st.events.count(e)) return fail(INVALID_HANDLE, format("cuEventQuery: %p is not a live event", event));
        if (int r = sticky_error(e->context)) return r;
        if (e->completed || e->stream == nullptr) {
            merge(e->context->host_clock, e->clock);
            return SUCCESS;
        }
        s = e->stream;
        seq = e->seq;
    }
    // Not complete now; the polled GPU gets on with it for the next query.
    run_until_if_free(s, seq);
    return NOT_READY;
}

static CUresult elapsed(float* ms, void* start, void* end) {
    State& st = state();
    Lock lock(st.mutex);
    Event* a = static_cast<Event*>(start);
    Event* b = static_cast<Event*>(end);
    if (!st.events.count(a) || !st.events.count(b)) {
        return fail(INVALID_HANDLE, "cuEventElapsedTime: not live events");
    }
    if (int r = sticky_error(a->context)) return r;
    if (ms == nullptr) return INVALID_VALUE;
    if ((a->flags | b->flags) & 0x2) {
        return fail(INVALID_HANDLE,
                    "cuEventElapsedTime: an event was created with CU_EVENT_DISABLE_TIMING (an event made without timing)");
    }
    if (a->generation == 0 || b->generation == 0) {
        return fail(INVALID_HANDLE, "cuEventElapsedTime: an event was never recorded");
    }
    if (!a->completed || !b->completed) return NOT_READY;
    *ms = std::chrono::duration<float, std::milli>(b->time - a->time).count();
    return SUCCESS;
}

EXPORT CUresult cuEventElapsedTime(float* ms, void* start, void* end) {
    RETURN_IF_INJECTED("cuEventElapsedTime", nullptr, start);
    return elapsed(ms, start, end);
}
EXPORT CUresult cuEventElapsedTime_v2(float* ms, void* start, void* end) {
    RETURN_IF_INJECTED("cuEventElapsedTime_v2", nullptr, start);
    return elapsed(ms, start, end);
}

EXPORT CUresult cuEventDestroy_v2(void* event) {
    RETURN_IF_INJECTED("cuEventDestroy_v2", nullptr, event);
    State& st = state();
    Lock lock(st.mutex);
    Event* e = static_cast<Event*>(event);
    if (!st.events.count(e)) return fail(INVALID_HANDLE, format("cuEventDestroy: %p is not a live event", event));
    // Queued records of it find it gone and do nothing.
    e->context->events.erase(e);
    st.events.erase(e);
    delete e;
    return SUCCESS;
}

// ---- memory ------------------------------------------------------------------------------------

static CUresult alloc_in(Context* c, CUdeviceptr* pointer, size_t bytes, const char* call) {
    State& st = state();
    if (pointer == nullptr) return INVALID_VALUE;
    if (device_bytes_in_use() + bytes > st.memory_bytes) {
        return fail(OUT_OF_MEMORY, format("%s(%zu bytes): %zu of the stand-in's %zu bytes are in use", call, bytes,
                                          device_bytes_in_use(), st.memory_bytes));
    }
    uintptr_t base = 0;
    if (int r = device_alloc(bytes, c->generation, &base)) return r;
    // Not the zeros of fresh pages: a read of memory nothing wrote reads garbage.
    if (st.poison_device) memset(reinterpret_cast<void*>(base), kPoison, bytes);
    counters.device_allocs++;
    *pointer = base;
    return SUCCESS;
}

EXPORT CUresult cuMemAllocAsync(CUdeviceptr* pointer, size_t bytes, void* stream) {
    RETURN_IF_INJECTED("cuMemAllocAsync", stream, nullptr);
    Lock lock(state().mutex);
    Stream* s;
    if (int r = resolve_stream(stream, &s, "cuMemAllocAsync")) return r;
    if (int r = check_context(s->context, "cuMemAllocAsync")) return r;
    // The memory is the stream's from here in stream order, and no one else's before: for
    // the hazard check, a write at the stream's present position.
    if (int r = alloc_in(s->context, pointer, bytes, "cuMemAllocAsync")) return r;
    State& st = state();
    uint64_t position = s->next_seq - 1;
    if (st.hazards && position > 0) {
        st.accesses[*pointer].writes[s->id] = AccessRecord{
            position, format("cuMemAllocAsync(%zu bytes) on %s", bytes, stream_text(s).c_str()), stream_text(s)};
    }
    return SUCCESS;
}

EXPORT CUresult cuMemAlloc_v2(CUdeviceptr* pointer, size_t bytes) {
    RETURN_IF_INJECTED("cuMemAlloc_v2", nullptr, nullptr);
    Lock lock(state().mutex);
    if (int r = check_context(current, "cuMemAlloc")) return r;
    return alloc_in(current, pointer, bytes, "cuMemAlloc");
}

EXPORT CUresult cuMemFreeAsync(CUdeviceptr pointer, void* stream) {
    RETURN_IF_INJECTED("cuMemFreeAsync", stream, nullptr);
    State& st = state();
    Stream* s;
    Op op;
    {
        Lock lock(st.mutex);
        if (int r = resolve_stream(stream, &s, "cuMemFreeAsync")) return r;
        AllocationView view;
        if (!find_allocation(pointer, 0, &view) || view.base != pointer) {
            return fail(INVALID_VALUE, format("cuMemFreeAsync(%s): not the start of a device allocation",
                                              pointer_text(pointer).c_str()));
        }
        if (!view.live) return SUCCESS;  // freed with its context already
        if (st.freeing.count(pointer)) {
            return fail(INVALID_VALUE, format("cuMemFreeAsync(%s): a free of it is already queued (double free)",
                                              pointer_text(pointer).c_str()));
        }
        op.kind = Op::Free;
        op.device = pointer;
        op.label = format("cuMemFreeAsync(%s) on %s", pointer_text(pointer).c_str(), stream_text(s).c_str());
        // Freeing is a write: it must come after every other stream's use of the memory.
        if (int r = enqueue(s, op, {Access{pointer, 0, true, "the allocation it frees", true}})) return r;
        st.freeing.insert(pointer);
        st.accesses.erase(pointer);
        counters.device_frees++;
    }
    return sticky_error(s->context);
}

EXPORT CUresult cuMemFree_v2(CUdeviceptr pointer) {
    RETURN_IF_INJECTED_IN("cuMemFree_v2", context_of_memory(pointer));
    Lock lock(state().mutex);
    if (int r = check_device_range(pointer, 0, "cuMemFree", "pointer")) return r;
    int r = device_free(pointer, "cuMemFree");
    if (r == SUCCESS) {
        counters.device_frees++;
        state().accesses.erase(pointer);
    }
    return r;
}

EXPORT CUresult cuMemGetInfo_v2(size_t* free_bytes, size_t* total_bytes) {
    RETURN_IF_INJECTED("cuMemGetInfo_v2", nullptr, nullptr);
    State& st = state();
    Lock lock(st.mutex);
    if (int r = check_context(current, "cuMemGetInfo")) return r;
    if (free_bytes == nullptr || total_bytes == nullptr) return INVALID_VALUE;
    *total_bytes = st.memory_bytes;
    *free_bytes = st.memory_bytes - device_bytes_in_use();
    return SUCCESS;
}

EXPORT CUresult cuMemHostAlloc(void** pointer, size_t bytes, unsigned int flags) {
    RETURN_IF_INJECTED("cuMemHostAlloc", nullptr, nullptr);
    Lock lock(state().mutex);
    if (int r = check_context(current, "cuMemHostAlloc")) return r;
    if (pointer == nullptr) return INVALID_VALUE;
    void* p = pinned_alloc(bytes, flags);
    if (p == nullptr) return fail(OUT_OF_MEMORY, format("cuMemHostAlloc(%zu bytes): no memory", bytes));
    counters.pinned_allocs++;
    counters.pinned_alloc_bytes += bytes;
    dump_counters();
    *pointer = p;
    return SUCCESS;
}

EXPORT CUresult cuMemFreeHost(void* pointer) {
    RETURN_IF_INJECTED("cuMemFreeHost", nullptr, nullptr);
    Lock lock(state().mutex);
    if (int r = pinned_free(pointer)) return r;
    counters.pinned_frees++;
    return SUCCESS;
}

// The flags cuMemHostRegister takes: CU_MEMHOSTREGISTER_PORTABLE, _DEVICEMAP, _IOMEMORY,
// _READ_ONLY. They change nothing here (every context sees one address space, and the
// stand-in has no device pointer for host memory to give).
static const unsigned int kHostRegisterFlags = 0x1 | 0x2 | 0x4 | 0x8;

EXPORT CUresult cuMemHostRegister_v2(void* pointer, size_t bytes, unsigned int flags) {
    RETURN_IF_INJECTED("cuMemHostRegister_v2", nullptr, nullptr);
    Lock lock(state().mutex);
    if (int r = check_context(current, "cuMemHostRegister")) return r;
    if (pointer == nullptr || bytes == 0) {
        return fail(INVALID_VALUE, format("cuMemHostRegister(%p, %zu bytes): %s", pointer, bytes,
                                          pointer == nullptr ? "a null pointer" : "an empty range"));
    }
    if (bytes > UINTPTR_MAX - reinterpret_cast<uintptr_t>(pointer)) {
        return fail(INVALID_VALUE, format("cuMemHostRegister(%p, %zu bytes): the range wraps the address space",
                                          pointer, bytes));
    }
    if (flags & ~kHostRegisterFlags) {
        return fail(INVALID_VALUE, format("cuMemHostRegister(%p, %zu bytes, flags 0x%x): unknown flags 0x%x", pointer,
                                          bytes, flags, flags & ~kHostRegisterFlags));
    }
    if (int r = check_host_pointer(pointer, bytes, "cuMemHostRegister", "the range")) return r;
    if (int r = host_register(pointer, bytes, flags, current->generation)) return r;
    counters.host_registers++;
    counters.host_register_bytes += bytes;
    dump_counters();
    return SUCCESS;
}

EXPORT CUresult cuMemHostUnregister(void* pointer) {
    RETURN_IF_INJECTED("cuMemHostUnregister", nullptr, nullptr);
    Lock lock(state().mutex);
    if (int r = host_unregister(pointer)) return r;
    counters.host_unregisters++;
    return SUCCESS;
}

static CUresult memset_d8(CUdeviceptr pointer, unsigned char value, size_t bytes, void* stream, const char* call,
                          bool synchronous) {
    poll_poison_file();
    Stream* s;
    Op op;
    {
        Lock lock(state().mutex);
        if (int r = resolve_stream(stream, &s, call)) return r;
        if (int r = check_context(s->context, call)) return r;
        if (int r = check_device_range(pointer, bytes, call, "destination")) return r;
        op.kind = Op::Memset;
        op.device = pointer;
        op.bytes = bytes;
        op.value = value;
        op.label = format("%s(%s, %u, %zu bytes) on %s", call, pointer_text(pointer).c_str(), value, bytes,
                          stream_text(s).c_str());
    }
    uint64_t seq = 0;
    if (int r = enqueue(s, op, {Access{pointer, bytes, true, "its destination"}}, &seq)) return r;
    counters.memsets++;
    counters.memset_bytes += bytes;
    if (synchronous) wait_for(s, seq);
    return sticky_error(s->context);
}

EXPORT CUresult cuMemsetD8Async(CUdeviceptr pointer, unsigned char value, size_t bytes, void* stream) {
    RETURN_IF_INJECTED("cuMemsetD8Async", stream, nullptr);
    return memset_d8(pointer, value, bytes, stream, "cuMemsetD8Async", false);
}

EXPORT CUresult cuMemsetD8_v2(CUdeviceptr pointer, unsigned char value, size_t bytes) {
    RETURN_IF_INJECTED("cuMemsetD8_v2", nullptr, nullptr);
    return memset_d8(pointer, value, bytes, nullptr, "cuMemsetD8", true);
}

static CUresult copy_htod(CUdeviceptr dst, const void* src, size_t bytes, void* stream, const char* call,
                          bool synchronous) {
    poll_poison_file();
    Stream* s;
    Op op;
    {
        Lock lock(state().mutex);
        if (int r = resolve_stream(stream, &s, call)) return r;
        if (int r = check_context(s->context, call)) return r;
        if (int r = check_device_range(dst, bytes, call, "destination")) return r;
        if (int r = check_host_pointer(src, bytes, call, "source")) return r;
        op.kind = Op::HtoD;
        op.device = dst;
        op.host = const_cast<void*>(src);
        op.bytes = bytes;
        op.locked_id = bytes > 0 ? page_locked_id(src, bytes) : 0;
        op.pinned = op.locked_id != 0;
        op.label = format("%s(%s <- %p, %zu bytes) on %s", call, pointer_text(dst).c_str(), src, bytes,
                          stream_text(s).c_str());
    }
    // A real driver copies pageable bytes through a page-locked buffer of its own.
    bool pageable = bytes > 0 && !op.pinned;
    if (op.pinned && !synchronous) {
        // DMA from pinned memory reads it when the stream gets there: remember what it
        // held, to tell if the host changes it before then.
        op.source_hash = fnv1a(src, bytes);
    } else {
        // From pageable memory CUDA stages the bytes before the call returns.
        op.pinned = false;
        op.staged.assign(static_cast<const unsigned char*>(src), static_cast<const unsigned char*>(src) + bytes);
    }
    uint64_t seq = 0;
    if (int r = enqueue(s, op, {Access{dst, bytes, true, "its destination"}}, &seq)) return r;
    counters.htod_copies++;
    counters.htod_bytes += bytes;
    if (pageable) counters.pageable_htod_copies++;
    note_registration_ended(pageable, src, bytes, call, s->context);
    if (synchronous) wait_for(s, seq);
    return sticky_error(s->context);
}

EXPORT CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void* src, size_t bytes, void* stream) {
    RETURN_IF_INJECTED("cuMemcpyHtoDAsync_v2", stream, nullptr);
    return copy_htod(dst, src, bytes, stream, "cuMemcpyHtoDAsync", false);
}

EXPORT CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void* src, size_t bytes) {
    RETURN_IF_INJECTED("cuMemcpyHtoD_v2", nullptr, nullptr);
    return copy_htod(dst, src, bytes, nullptr, "cuMemcpyHtoD", true);
}

// Bytes a download's pinned destination holds until the copy runs.
static const unsigned char kGarbage = 0xCB;

static CUresult copy_dtoh(void* dst, CUdeviceptr src, size_t bytes, void* stream, const char* call,
                          bool synchronous) {
    poll_poison_file();
    Stream* s;
    Op op;
    {
        Lock lock(state().mutex);
        if (int r = resolve_stream(stream, &s, call)) return r;
        if (int r = check_context(s->context, call)) return r;
        if (int r = check_device_range(src, bytes, call, "source")) return r;
        if (int r = check_host_pointer(dst, bytes, call, "destination")) return r;
        op.kind = Op::DtoH;
        op.device_src = src;
        op.host = dst;
        op.bytes = bytes;
        op.locked_id = bytes > 0 ? page_locked_id(dst, bytes) : 0;
        op.pinned = op.locked_id != 0;
        op.label = format("%s(%p <- %s, %zu bytes) on %s", call, dst, pointer_text(src).c_str(), bytes,
                          stream_text(s).c_str());
    }
    // A real driver copies into pageable memory through a page-locked buffer of its own.
    bool pageable = bytes > 0 && !op.pinned;
    bool asynchronous = op.pinned && !synchronous;
    if (asynchronous) memset(dst, kGarbage, bytes);
    uint64_t seq = 0;
    if (int r = enqueue(s, op, {Access{src, bytes, false, "its source"}}, &seq)) return r;
    counters.dtoh_copies++;
    counters.dtoh_bytes += bytes;
    if (pageable) counters.pageable_dtoh_copies++;
    note_registration_ended(pageable, dst, bytes, call, s->context);
    // Into pageable memory the copy is complete when the call returns, as CUDA documents.
    if (!asynchronous) wait_for(s, seq);
    return sticky_error(s->context);
}

EXPORT CUresult cuMemcpyDtoHAsync_v2(void* dst, CUdeviceptr src, size_t bytes, void* stream) {
    RETURN_IF_INJECTED("cuMemcpyDtoHAsync_v2", stream, nullptr);
    return copy_dtoh(dst, src, bytes, stream, "cuMemcpyDtoHAsync", false);
}

EXPORT CUresult cuMemcpyDtoH_v2(void* dst, CUdeviceptr src, size_t bytes) {
    RETURN_IF_INJECTED("cuMemcpyDtoH_v2", nullptr, nullptr);
    return copy_dtoh(dst, src, bytes, nullptr, "cuMemcpyDtoH", true);
}

EXPORT CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t bytes, void* stream) {
    RETURN_IF_INJECTED("cuMemcpyDtoDAsync_v2", stream, nullptr);
    poll_poison_file();
    Stream* s;
    Op op;
    {
        Lock lock(state().mutex);
        if (int r = resolve_stream(stream, &s, "cuMemcpyDtoDAsync")) return r;
        if (int r = check_context(s->context, "cuMemcpyDtoDAsync")) return r;
        if (int r = check_device_range(src, bytes, "cuMemcpyDtoDAsync", "source")) return r;
        if (int r = check_device_range(dst, bytes, "cuMemcpyDtoDAsync", "destination")) return r;
        op.kind = Op::DtoD;
        op.device = dst;
        op.device_src = src;
        op.bytes = bytes;
        op.label = format("cuMemcpyDtoDAsync(%s <- %s, %zu bytes) on %s", pointer_text(dst).c_str(),
                          pointer_text(src).c_str(), bytes, stream_text(s).c_str());
    }
    if (int r = enqueue(s, op, {Access{src, bytes, false, "its source"}, Access{dst, bytes, true, "its destination"}})) {
        return r;
    }
    counters.dtod_copies++;
    counters.dtod_bytes += bytes;
    return sticky_error(s->context);
}

// ---- launch --------------------------------------------------------------------------------------

EXPORT CUresult cuLaunchKernel(void* function, unsigned int gx, unsigned int gy, unsigned int gz, unsigned int bx,
                               unsigned int by, unsigned int bz, unsigned int shared_bytes, void* stream,
                               void** params, void** extra) {
    RETURN_IF_INJECTED("cuLaunchKernel", stream, nullptr);
    poll_poison_file();
    State& st = state();
    Stream* s;
    Op op;
    {
        Lock lock(st.mutex);
        Function* f = static_cast<Function*>(function);
        if (!st.functions.count(f)) {
            return fail(INVALID_HANDLE, format("cuLaunchKernel: %p is not a live function", function));
        }
        if (int r = resolve_stream(stream, &s, "cuLaunchKernel")) return r;
        if (int r = check_context(s->context, "cuLaunchKernel")) return r;
        if (f->module->context != s->context) {
            return fail(INVALID_CONTEXT, "cuLaunchKernel: the kernel's module and the stream are in different contexts");
        }
        const KernelEntry& k = *f->kernel;
        uint64_t number = ++counters.launches_enqueued;
        op.label = format("kernel %s (launch %llu: grid %ux%ux%u, block %ux%ux%u, on %s)", k.name,
                          static_cast<unsigned long long>(number), gx, gy, gz, bx, by, bz, stream_text(s).c_str());
        if (gx == 0 || gy == 0 || gz == 0 || bx == 0 || by == 0 || bz == 0) {
            return fail(INVALID_VALUE, op.label + ": a grid or block dimension is 0");
        }
        if (uint64_t(bx) * by * bz > 1024 || bx > 1024 || by > 1024 || bz > 64 || gy > 65535 || gz > 65535 ||
            gx > 2147483647u) {
            return fail(INVALID_VALUE, op.label + ": over the device's grid or block limits");
        }
        // What the kernel's CUBIN allows: its __launch_bounds__, and its registers (the
        // 65536 of an SM's register file, allocated per warp in units of 256).
        uint64_t threads = uint64_t(bx) * by * bz;
        std::string resources = format("%s uses %u registers per thread, __launch_bounds__ %s", k.name, f->registers,
                                       f->max_threads != 0 ? format("%u threads", f->max_threads).c_str() : "none");
        if (f->max_threads != 0 && threads > f->max_threads) {
            return fail(INVALID_VALUE, format("%s: a block of %llu threads is more than the kernel's "
                                              "__launch_bounds__ allow (%s)",
                                              op.label.c_str(), static_cast<unsigned long long>(threads),
                                              resources.c_str()));
        }
        uint64_t registers = (threads + 31) / 32 * ((uint64_t(f->registers) * 32 + 255) / 256 * 256);
        if (registers > 65536) {
            return fail(LAUNCH_OUT_OF_RESOURCES,
                        format("%s: a block of %llu threads needs %llu registers, more than the 65536 of an SM (%s)",
                               op.label.c_str(), static_cast<unsigned long long>(threads),
                               static_cast<unsigned long long>(registers), resources.c_str()));
        }
        if (shared_bytes != 0) {
            return fail(NOT_SUPPORTED, op.label + ": dynamic shared memory is not emulated");
        }
        if (extra != nullptr) return fail(NOT_SUPPORTED, op.label + ": `extra` launch arguments are not emulated");
        if (int r = capture_params(k, params, &op, op.label)) return r;
        if (!st.fault_file.empty()) {
            // The file arms launch `number` itself: as if the variables had named it.
            FILE* armed = fopen(st.fault_file.c_str(), "r");
            if (armed != nullptr) {
                char kind[16] = {0};
                size_t got = fread(kind, 1, sizeof(kind) - 1, armed);
                fclose(armed);
                remove(st.fault_file.c_str());
                kind[got] = '\0';
                if (strncmp(kind, "fail", 4) == 0) counters.fail_launch_at = number;
                if (strncmp(kind, "sticky", 6) == 0) counters.sticky_launch_at = number;
                if (strncmp(kind, "hang", 4) == 0) counters.hang_launch_at = number;
            }
        }
        if (counters.fail_launch_at != 0 && number == counters.fail_launch_at) {
            return fail(LAUNCH_OUT_OF_RESOURCES, op.label + ": injected failure (CELER_CUDA_STANDIN_FAIL_LAUNCH)");
        }
        op.inject_sticky = counters.sticky_launch_at != 0 && number == counters.sticky_launch_at;
        op.inject_hang = counters.hang_launch_at != 0 && number == counters.hang_launch_at;
        op.kind = Op::Launch;
        op.kernel = &k;
        op.shape = LaunchShape{{gx, gy, gz}, {bx, by, bz}};
    }
    // Each pointer parameter reads the allocation it points into; one to non-const data
    // writes it too (as far as the stand-in can tell from the types).
    std::vector<Access> accesses;
    for (size_t i = 0; i < op.kernel->param_count; ++i) {
        const ParamInfo& p = op.kernel->params[i];
        if (!p.is_pointer) continue;
        uintptr_t v;
        memcpy(&v, op.params.data() + op.param_offsets[i], sizeof(v));
        if (v == 0) continue;
        accesses.push_back(Access{v, 0, !p.pointee_const, format("through parameter %zu", i), true});
    }
    return enqueue(s, op, accesses);
}

// ---- device work of other stand-in libraries ---------------------------------------------------------

// See celer_standin_work.h: the TensorRT stand-in queues an engine's execution here, so
// that it runs in stream order against device memory checked as a kernel's is.
EXPORT CUresult celer_standin_enqueue_work(void* stream, const char* label, const celer_standin_range* ranges,
                                           size_t nranges, int (*run)(void*, char*, size_t), void (*done)(void*),
                                           void* user) {
    note_call([&] { return context_of_handles(stream, nullptr); });
    poll_poison_file();
    // Owned from here: `done` runs when the last holder lets go, on every path (when
    // queuing is refused, after the state lock is released: `work` outlives `lock`).
    auto work = std::make_shared<Work>();
    work->run = run;
    work->done = done;
    work->user = user;
    std::string name = label != nullptr && *label != '\0' ? label : "device work";
    std::string call = name + " (celer_standin_enqueue_work)";
    State& st = state();
    Stream* s;
    Op op;
    {
        Lock lock(st.mutex);
        if (int r = resolve_stream(stream, &s, call.c_str())) return r;
        if (int r = check_context(s->context, call.c_str())) return r;
        if (s->context != current) {
            return fail(INVALID_CONTEXT, call + ": the stream is not of the context current on this thread");
        }
        if (run == nullptr || (nranges > 0 && ranges == nullptr)) {
            return fail(INVALID_VALUE, call + ": no `run`, or no ranges where nranges > 0");
        }
        for (size_t i = 0; i < nranges; ++i) {
            const celer_standin_range& r = ranges[i];
            std::string what = r.what != nullptr ? r.what : format("range %zu", i);
            auto address = uintptr_t(r.address);
            // An empty range touches nothing (TensorRT lets an empty tensor's address be null).
            if (r.bytes != 0) {
                if (int e = check_device_range(address, r.bytes, call.c_str(), what.c_str())) return e;
                AllocationView view;
                if (find_allocation(address, r.bytes, &view) && view.context_generation != s->context->generation) {
                    return fail(INVALID_VALUE, format("%s: %s %s is device memory of another context", call.c_str(),
                                                      what.c_str(), pointer_text(address).c_str()));
                }
            }
            op.ranges.push_back(WorkRange{address, r.bytes, r.writes != 0, what});
        }
        op.kind = Op::DeviceWork;
        op.label = name;
        op.work = std::move(work);
    }
    std::vector<Access> accesses;
    for (const WorkRange& r : op.ranges) {
        accesses.push_back(Access{r.address, r.bytes, r.writes, r.what});
    }
    if (int r = enqueue(s, op, accesses)) return r;
    counters.work_enqueued++;
    return SUCCESS;
}

// See celer_standin_work.h: another stand-in library's device work faulted in `context`
// (the stand-in TensorRT's engine, whose kernel met an illegal address): the context's
// error becomes sticky, as a kernel's fault makes it.
EXPORT CUresult celer_standin_make_sticky(void* context, int code, const char* message) {
    Lock lock(state().mutex);
    Context* c = static_cast<Context*>(context);
    if (!context_alive(c)) {
        return fail(INVALID_CONTEXT, format("celer_standin_make_sticky(%p): not a live context", context));
    }
    switch (code) {
        case ILLEGAL_ADDRESS:
        case HARDWARE_STACK_ERROR:
        case ILLEGAL_INSTRUCTION:
        case MISALIGNED_ADDRESS:
        case LAUNCH_FAILED: break;
        default:
            return fail(INVALID_VALUE, format("celer_standin_make_sticky: %s is not an error a fault makes sticky",
                                              result_name(code)));
    }
    make_sticky(c, code, message != nullptr && *message != '\0' ? message : "celer_standin_make_sticky");
    return SUCCESS;
}

// ---- errors ------------------------------------------------------------------------------------------

// Both answer only for the codes this driver's version defines: for any other,
// CUDA_ERROR_INVALID_VALUE and a null string, as the real driver answers.
EXPORT CUresult cuGetErrorString(CUresult error, const char** text) {
    RETURN_IF_INJECTED_PROBE("cuGetErrorString");
    if (text == nullptr) return INVALID_VALUE;
    if (!code_defined(error)) {
        *text = nullptr;
        return INVALID_VALUE;
    }
    *text = result_string(error);
    return SUCCESS;
}

EXPORT CUresult cuGetErrorName(CUresult error, const char** text) {
    RETURN_IF_INJECTED_PROBE("cuGetErrorName");
    if (text == nullptr) return INVALID_VALUE;
    if (!code_defined(error)) {
        *text = nullptr;
        return INVALID_VALUE;
    }
    *text = result_name(error);
    return SUCCESS;
}

// NVRTC looks for the driver's private export tables when libcuda is loaded in the
// process; the stand-in has none, and says so, so that NVRTC compiles on its own.
EXPORT CUresult cuGetExportTable(const void** table, const CUuuid* id) {
    RETURN_IF_INJECTED_PROBE("cuGetExportTable");
    (void)id;
    if (table != nullptr) *table = nullptr;
    return NOT_SUPPORTED;
}

// ---- the stand-in's own controls, for tests (not part of the CUDA API) ------------------------------

// The last error's details (what a bare error code cannot say), or "" when none.
EXPORT const char* celer_standin_last_error() {
    static thread_local std::string copy;
    std::lock_guard<std::mutex> lock(last_error_mutex);
    copy = last_error_text;
    return copy.c_str();
}

// The last note of a rule that changes no result ("registration ended with its context"),
// empty when none: owned by the calling thread until its next call.
EXPORT const char* celer_standin_last_note() {
    static thread_local std::string copy;
    std::lock_guard<std::mutex> lock(last_error_mutex);
    copy = last_note_text;
    return copy.c_str();
}

EXPORT void celer_standin_clear_last_error() {
    std::lock_guard<std::mutex> lock(last_error_mutex);
    last_error_text.clear();
}

// Arms a fault for the `nth` launch from now (1 = the next): kind 0 fails the launch call
// (not sticky); kind 1 makes it fault, sticky, when it runs. nth 0 disarms.
EXPORT void celer_standin_inject(int kind, uint64_t nth) {
    uint64_t at = nth == 0 ? 0 : counters.launches_enqueued.load() + nth;
    if (kind == 0) counters.fail_launch_at = at;
    if (kind == 1) counters.sticky_launch_at = at;
    if (kind == 2) counters.hang_launch_at = at;
}

// Arms `code` as the answer of the `nth` call of entry point `entry` from now (1: the
// next; 0 disarms `entry`), as CELER_CUDA_STANDIN_RETURN does: 0, or
// CUDA_ERROR_INVALID_VALUE (and the reason as the last error) for an entry point this
// library does not export, CUDA_SUCCESS, or a code newer than this driver's version.
EXPORT int celer_standin_inject_return(const char* entry, long long code, uint64_t nth) {
    std::string why;
    if (arm_return(entry != nullptr ? entry : "", code, nth, &why) != SUCCESS) {
        return fail(INVALID_VALUE, "celer_standin_inject_return: " + why);
    }
    return SUCCESS;
}

// The execution order (CELER_CUDA_STANDIN_ORDER's values) from the next launch that runs
// on: 0, or CUDA_ERROR_INVALID_VALUE (and the order unchanged) for text it does not know.
EXPORT int celer_standin_set_order(const char* order) {
    ExecutionOrder parsed;
    if (!parse_order(order, &parsed)) {
        return fail(INVALID_VALUE, format("celer_standin_set_order(\"%s\"): not forward, reverse or random:<seed>",
                                          order != nullptr ? order : "(null)"));
    }
    set_execution_order(parsed);
    return SUCCESS;
}

// The execution order now, as CELER_CUDA_STANDIN_ORDER writes it.
EXPORT const char* celer_standin_order() {
    static thread_local std::string text;
    text = order_text(execution_order());
    return text.c_str();
}

// Turns the poisoning of `__shared__` variables at each block's start on (1) or off (0);
// returns whether it was on.
EXPORT int celer_standin_set_shared_poison(int on) {
    bool was = shared_poison_on();
    set_shared_poison(on != 0);
    return was ? 1 : 0;
}

// Turns the cross-stream hazard check on (1) or off (0) (CELER_CUDA_STANDIN_HAZARDS);
// returns whether it was on. Accesses enqueued while it is off are not recorded.
EXPORT int celer_standin_set_hazards(int on) {
    Lock lock(state().mutex);
    bool was = state().hazards;
    state().hazards = on != 0;
    if (!state().hazards) state().accesses.clear();
    return was ? 1 : 0;
}

// Runs every stream's queued work, then fills every live device allocation with `byte`;
// returns how many allocations it filled.
EXPORT uint64_t celer_standin_poison_live(unsigned char byte) {
    run_all_streams();
    Lock lock(state().mutex);
    return poison_allocations(nullptr, byte);
}

// Starts tracking which allocations are written (by a copy or memset into them, a launch
// with a pointer to non-const data into them, device work with a written range in them),
// forgetting what was tracked before.
EXPORT void celer_standin_mark_writes() { mark_writes(); }

// Runs every stream's queued work, then fills with `byte` every live allocation written
// since the last mark (or poison_written), and tracks anew from here; returns how many
// allocations it filled.
EXPORT uint64_t celer_standin_poison_written(unsigned char byte) { return poison_written(byte); }

// A counter by name (UINT64_MAX for a name it does not know). All count calls made since
// the library was loaded, in every context:
//   launches_enqueued, launches_run   cuLaunchKernel calls queued, launches run
//   htod_copies, htod_bytes           cuMemcpyHtoD(Async) calls and their bytes
//   dtoh_copies, dtoh_bytes           cuMemcpyDtoH(Async)
//   dtod_copies, dtod_bytes           cuMemcpyDtoDAsync
//   memsets, memset_bytes             cuMemsetD8(Async)
//   stream_syncs                      cuStreamSynchronize
//   event_syncs                       cuEventSynchronize
//   ctx_syncs                         cuCtxSynchronize
//   host_syncs                        every call at which the host waits for the device:
//                                     stream_syncs + event_syncs + ctx_syncs, plus each
//                                     copy or memset that returns only once its stream ran
//                                     it (cuMemcpyHtoD, cuMemcpyDtoH, cuMemsetD8, and
//                                     cuMemcpyDtoHAsync into pageable memory, which CUDA
//                                     completes before returning). Not the polls
//                                     (cuStreamQuery, cuEventQuery) nor cuStreamDestroy.
//   device_allocs, device_frees       cuMemAlloc(Async) that succeeded; cuMemFree and
//                                     cuMemFreeAsync accepted (frees of a context's memory
//                                     with the context are not counted)
//   pinned_allocs, pinned_alloc_bytes cuMemHostAlloc
//   pinned_frees                      cuMemFreeHost
//   host_registers, host_register_bytes cuMemHostRegister calls that registered, and
//                                     their bytes
//   host_unregisters                  cuMemHostUnregister calls accepted (registrations
//                                     ended with their context are not counted)
//   pageable_htod_copies              cuMemcpyHtoD(Async) of more than 0 bytes whose
//   pageable_dtoh_copies              source (dtoh: destination) is not in one page-locked
//                                     range (cuMemHostAlloc or cuMemHostRegister): the
//                                     copies a real driver stages through a page-locked
//                                     buffer of its own, a host copy of the data, whether
//                                     the call was synchronous or not. A synchronous copy
//                                     from or to page-locked memory is not one.
//   pageable_after_context_end        of those pageable copies, each whose range was
//                                     registered and the registration ended with its
//                                     context (rule "registration ended with its context")
//   contexts_created, sticky_errors, work_enqueued, work_run
//   hung_launches                     launches armed to hang that reached the head of
//                                     their stream (and hung there)
//   hanging_now                       of those, the ones still hanging (not a count)
//   device_bytes                      device memory in use now (not a count)
EXPORT uint64_t celer_standin_counter(const char* name) {
    std::string n = name == nullptr ? "" : name;
    for (const auto& [field, value] : counter_list()) {
        if (n == field) return value;
    }
    return UINT64_MAX;
}

// A counter of device `device` by name (UINT64_MAX for a name or a device it does not know):
//   calls_in_lost_context  calls of the driver's entry points made in a context of the
//                          device after its error became sticky (see note_call and the
//                          header: "Counted after a loss")
//   lost_contexts          times a context of the device was lost: its error became
//                          sticky, or it was reset (cuDevicePrimaryCtxReset) while it existed
EXPORT uint64_t celer_standin_device_counter(const char* name, int device) {
    uint64_t value = 0;
    return device_counter(name == nullptr ? "" : name, device, &value) ? value : UINT64_MAX;
}

// For the stand-in TensorRT (whose rule is that no TensorRT call touches a device after its
// context was lost: the process must be relaunched): how many times device `device`'s
// context was lost (0: never, or no such device); whether the last loss was a reset
// (`reset`, may be null); and what it was in `why` (`len` bytes, NUL-terminated; may be null).
EXPORT uint64_t celer_standin_device_lost(int device, int* reset, char* why, size_t len) {
    Lock lock(state().mutex);
    if (device < 0 || size_t(device) >= state().devices.size()) return 0;
    const Device& d = state().devices[size_t(device)];
    if (reset != nullptr) *reset = d.last_loss_was_reset ? 1 : 0;
    if (why != nullptr && len > 0) snprintf(why, len, "%s", d.last_loss.c_str());
    return d.lost_contexts;
}

// For the stand-in TensorRT: the number of device `device`'s losses (as
// celer_standin_device_lost counts them) when a driver call of the calling thread was last
// answered that device's sticky error; 0 if none was. A thread told of a loss knows it.
EXPORT uint64_t celer_standin_thread_told_of_loss(int device) {
    auto found = told_of_loss.find(device);
    return found == told_of_loss.end() ? 0 : found->second;
}

// Lets every hung launch (CELER_CUDA_STANDIN_HANG_LAUNCH, the fault file's `hang`) go on:
// it runs as a launch does, and its stream after it. Returns how many were hanging.
EXPORT uint64_t celer_standin_release_hangs() {
    uint64_t hanging = counters.hanging_now.load();
    {
        std::lock_guard<std::mutex> lock(hang_mutex());
        hang_generation += 1;
    }
    hang_released().notify_all();
    return hanging;
}
