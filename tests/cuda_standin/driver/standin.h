// Internal declarations shared by the stand-in driver's files. Nothing here is part of
// the driver API: see driver.cpp for the exported `cu*` functions.
#pragma once

#include <stddef.h>
#include <stdint.h>

#include <string>
#include <vector>

#include "registry.h"

namespace standin {

// CUresult values the stand-in's own checks return (a subset of cuda.h). Any other code
// reaches callers only when a test injects it (CELER_CUDA_STANDIN_RETURN), as a driver
// newer than the caller's headers would return it; codes.cpp knows them all.
enum Result : int {
    SUCCESS = 0,
    INVALID_VALUE = 1,
    OUT_OF_MEMORY = 2,
    NOT_INITIALIZED = 3,
    NO_DEVICE = 100,
    INVALID_DEVICE = 101,
    INVALID_IMAGE = 200,
    INVALID_CONTEXT = 201,
    NO_BINARY_FOR_GPU = 209,
    INVALID_HANDLE = 400,
    NOT_FOUND = 500,
    NOT_READY = 600,
    ILLEGAL_ADDRESS = 700,
    LAUNCH_OUT_OF_RESOURCES = 701,
    CONTEXT_IS_DESTROYED = 709,
    HOST_MEMORY_ALREADY_REGISTERED = 712,
    HOST_MEMORY_NOT_REGISTERED = 713,
    HARDWARE_STACK_ERROR = 714,
    ILLEGAL_INSTRUCTION = 715,
    MISALIGNED_ADDRESS = 716,
    LAUNCH_FAILED = 719,
    NOT_SUPPORTED = 801,
    UNKNOWN = 999,
};

// codes.cpp: every code of cuda.h up to CUDA 13.4, with the version that introduced it.
// The name (or "CUresult N (in no cuda.h)") and description of a code, for messages.
const char* result_name(int result);
const char* result_string(int result);
// Whether this driver's version defines `result` (cuGetErrorName answers for it).
bool code_defined(int result);
// The version that introduced `result` (cuDriverGetVersion's encoding), 0 for none.
int code_since(int result);
// Whether the context's error is sticky after `result`: the sticky codes of cuda.h, and
// any code the stand-in does not know.
bool code_is_lost(int result);

// Records `message` as the last error (celer_standin_last_error) and prints it to
// stderr unless CELER_CUDA_STANDIN_QUIET is set; returns `result` for `return fail(...)`.
int fail(int result, const std::string& message);
std::string format(const char* fmt, ...) __attribute__((format(printf, 1, 2)));

// ---- device memory (arena.cpp) ------------------------------------------------------
//
// Device memory is one reserved range of the address space that host allocations never
// use. Each allocation gets its own pages, ending exactly where an inaccessible guard
// page begins, so an access one byte past its end faults; freed pages become
// inaccessible and their addresses are never handed out again.

struct AllocationView {
    uintptr_t base;
    size_t size;
    bool live;
    // Why it is no longer live ("cuMemFreeAsync", "context reset").
    const char* ended_by;
    uint64_t context_generation;
};

bool arena_contains(uintptr_t address);
// arena_contains without the arena's lock, for the fault handler.
bool arena_contains_in_signal(uintptr_t address);
int device_alloc(size_t bytes, uint64_t context_generation, uintptr_t* out);
// Frees the allocation starting at `base`; `why` names what freed it.
int device_free(uintptr_t base, const char* why);
// Frees every live allocation of a context generation (context destroyed or reset).
void device_free_generation(uint64_t context_generation, const char* why);
// The allocation holding [address, address + bytes), live or not. False when none does.
bool find_allocation(uintptr_t address, size_t bytes, AllocationView* out);
// Describes an address for a message: which allocation it is in or near, and how.
std::string describe_address(uintptr_t address);
size_t device_bytes_in_use();
// Every live allocation, in address order.
void live_allocations(std::vector<AllocationView>* out);
// Whether [address, address + bytes) is inside one live allocation; if not, `why` says so.
bool device_range_ok(uintptr_t address, size_t bytes, std::string* why);
// Whether the alignment padding after the live allocation holding `address` is as it was
// handed out (nothing wrote past the allocation's end into it); if not, `why` says where.
bool padding_intact(uintptr_t address, std::string* why);

// Page-locked host memory: ordinary pages, remembered so that copies to and from it run
// asynchronously, as DMA from pinned memory does. Two kinds: the driver's own
// (cuMemHostAlloc: mmapped here, munmapped by cuMemFreeHost) and the caller's memory
// registered with cuMemHostRegister (never mapped or unmapped here).
void* pinned_alloc(size_t bytes, unsigned int flags);
// cuMemFreeHost: SUCCESS, or INVALID_VALUE (reported) when `pointer` is not the start of
// memory of cuMemHostAlloc (a registered range is refused and stays as it is).
int pinned_free(void* pointer);
// cuMemHostRegister of [pointer, pointer + bytes) (bytes > 0, checked by the caller) for
// the context of `context_generation`: SUCCESS, or HOST_MEMORY_ALREADY_REGISTERED
// (reported) when the range overlaps page-locked memory of either kind.
int host_register(void* pointer, size_t bytes, unsigned int flags, uint64_t context_generation);
// cuMemHostUnregister: SUCCESS, or HOST_MEMORY_NOT_REGISTERED (reported) when `pointer`
// is not the start of a registered range. The memory is the caller's: it is not unmapped.
int host_unregister(void* pointer);
// Ends every registration made by a context generation (context destroyed or reset);
// `why` names what ended them, `context` the context ("the primary context of GPU 0").
void host_unregister_generation(uint64_t context_generation, const char* why, const std::string& context);
// Which context's destruction ended the registration that held [pointer, pointer + bytes)
// ("the primary context of GPU 0, by cuDevicePrimaryCtxReset"), when it ended so and
// nothing locked the range since; else empty.
std::string registration_ended_with_context(const void* pointer, size_t bytes);
// The id of the page-locked range (of either kind) that holds [pointer, pointer + bytes),
// 0 when none does. Ids are never reused, so a copy can tell its range from one locked
// later at the same address.
uint64_t page_locked_id(const void* pointer, size_t bytes);
// Whether [pointer, pointer + bytes) lies in one page-locked range (page_locked_id != 0).
bool is_pinned(const void* pointer, size_t bytes);
// What ended the page-locked range `id` ("cuMemFreeHost", "cuMemHostUnregister", a
// context's destruction), or null while it lives.
const char* page_locked_ended_by(uint64_t id);

// ---- kernels on lanes (lanes.cpp) ---------------------------------------------------

struct LaunchShape {
    unsigned int grid[3];
    unsigned int block[3];
};

// How a launch ended when it did not complete.
struct KernelFault {
    int result;
    std::string message;
};

// The order blocks run in, and lanes start in (CELER_CUDA_STANDIN_ORDER): forward (CUDA's
// linear order, x fastest), reverse (the last block first, and in each block the highest
// thread index starts first and resumes first from a barrier or shuffle), random:<seed>
// (blocks in a permutation made from the seed, lanes as reverse).
enum class OrderKind { Forward, Reverse, Random };
struct ExecutionOrder {
    OrderKind kind;
    uint64_t seed;
};
// "forward", "reverse", "random:<u64>" (and "" for forward); false for anything else.
bool parse_order(const char* text, ExecutionOrder* out);
std::string order_text(ExecutionOrder order);
void set_execution_order(ExecutionOrder order);
ExecutionOrder execution_order();

// `__shared__` variables hold these bytes when each block starts (unless turned off:
// CELER_CUDA_STANDIN_POISON_SHARED=0); the kernels' host builds call shared_reached
// (kernel.h) after each declaration.
constexpr unsigned char kSharedPoison = 0xCD;
void set_shared_poison(bool on);
bool shared_poison_on();

// Runs every thread of a launch on this OS thread. False (and `fault` filled) when a
// lane touched memory it may not, returned before a shuffle that names it, or the
// lanes deadlocked at a barrier.
bool run_kernel(const KernelEntry& kernel, const LaunchShape& shape, void* const* args,
                const std::string& launch_label, KernelFault* fault);
// Copies `bytes` from `source`, or returns false if reading it faults (a bad pointer
// from the caller) instead of crashing.
bool guarded_copy(void* destination, const void* source, size_t bytes);
// Installs the SIGSEGV/SIGBUS/SIGFPE handlers that turn a fault inside a kernel into an
// error of that launch (and pass any other fault on to the previous handler).
void install_fault_handlers();
// Names the device work (celer_standin_enqueue_work) whose `run` is running, or none
// (null): a fault at a device address outside a kernel then says which work was running
// before the process ends. The label must live until the next call.
void note_running_work(const char* label);

// ---- NVRTC output (cubin.cpp) -------------------------------------------------------

struct CubinKernel {
    std::string name;
    // Bytes of the parameter buffer, from the kernel's .nv.info (0 when not recorded).
    size_t param_bytes;
    // Registers per thread (0 when not recorded), and the most threads a block may have
    // (__launch_bounds__; 0 when the kernel has none).
    unsigned registers;
    unsigned max_threads;
};

// A CUBIN as cuModuleLoadData needs it: its architecture ("sm_90"), the CUDA major whose
// ELF ABI it is written in (12: OS/ABI 0x33, ABI version 7; 13: OS/ABI 0x41, version 8),
// and its kernels' names and parameter buffer sizes.
struct Cubin {
    std::string arch;
    int cuda_major = 0;
    std::vector<CubinKernel> kernels;
};

// Reads a CUBIN (an ELF of machine EM_CUDA). False, with `why`, when `image` is not one.
bool read_cubin(const void* image, std::string* why, Cubin* cubin);

// The CUDA version this build of the stand-in reports (cuDriverGetVersion's encoding,
// 12020 for 12.2): one library per version, linked with version.cpp compiled for it and
// exporting only the entry points that version has (build.rs).
int driver_version();

}  // namespace standin
