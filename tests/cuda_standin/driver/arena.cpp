// Device memory and page-locked host memory of the stand-in driver.
//
// Device memory: one range of the address space reserved (PROT_NONE, MAP_NORESERVE) at
// first use, so that no host allocation can ever sit there and a host pointer is never
// mistaken for a device one. Allocations are handed out in address order and never
// reused: [guard page][pages...] with the allocation as close to the end of its pages as
// CUDA's alignment allows: every allocation starts on a 256-byte boundary, as cuMemAlloc
// guarantees (TensorRT requires it of every tensor), so an allocation whose size is not
// a multiple of 256 ends up to 255 bytes before the next guard page. An overrun past the
// pages faults at once; one into that alignment padding is caught after the launch, by
// the padding's canary (`padding_intact`), which a write changes (a read of it is not
// caught). Freed pages go back to PROT_NONE (and their memory to the kernel).
// The driver fills each fresh allocation with poison bytes (driver.cpp,
// CELER_CUDA_STANDIN_POISON_DEVICE), so that a read of memory never written reads
// garbage, not the zeros fresh pages hold.
#include <errno.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <map>
#include <mutex>

#include "standin.h"

namespace standin {
namespace {

// 4 TiB of addresses: far more than any test allocates over its life (addresses are
// never reused), and nothing is committed until an allocation's pages are touched.
constexpr size_t kArenaBytes = size_t(4) << 40;

// What CUDA guarantees of every allocation's start.
constexpr uintptr_t kAlignment = 256;
// Fills the alignment padding after an allocation.
constexpr unsigned char kCanary = 0xCD;

// The arena's first address once reserved, for a fault handler (which may not lock).
std::atomic<uintptr_t> arena_begin{0};

struct Allocation {
    size_t size;
    uintptr_t pages;     // the first accessible page
    size_t pages_bytes;  // the accessible pages (size rounded up)
    bool live;
    const char* ended_by;
    uint64_t generation;
};

// A page-locked host range: memory of cuMemHostAlloc (the driver's own, munmapped by
// cuMemFreeHost) or the caller's memory registered with cuMemHostRegister (never unmapped
// by the driver).
struct Locked {
    size_t bytes;
    unsigned int flags;
    bool registered;
    // The context generation that registered it (registered ranges only).
    uint64_t generation;
    // Never reused: a range freed and another locked at the same address differ.
    uint64_t id;
};

struct Arena {
    std::mutex mutex;
    uintptr_t begin = 0;
    uintptr_t cursor = 0;  // the next allocation's guard page
    size_t page = 4096;
    size_t in_use = 0;
    // By base address. Ended allocations stay, to name them in messages.
    std::map<uintptr_t, Allocation> allocations;
    // Page-locked host memory by base: cuMemHostAlloc's and cuMemHostRegister's.
    std::map<uintptr_t, Locked> locked;
    uint64_t next_locked_id = 1;
    // Why each page-locked range that ended did (by its id), to name it in messages.
    std::map<uint64_t, const char*> locked_ended;
    // What ended the last registration that started at each address, for the error of a
    // cuMemHostUnregister after it ended.
    std::map<uintptr_t, const char*> registration_ended;
    // Registrations ended by their context's destruction, by base: their bytes and what
    // destroyed the context, for the rule "registration ended with its context" (a later
    // copy from the range is pageable, on every GPU). Dropped when the range is locked again.
    std::map<uintptr_t, std::pair<size_t, std::string>> ended_with_context;

    bool reserve() {
        if (begin != 0) return true;
        page = size_t(sysconf(_SC_PAGESIZE));
        void* p = mmap(nullptr, kArenaBytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (p == MAP_FAILED) return false;
        begin = reinterpret_cast<uintptr_t>(p);
        cursor = begin;
        arena_begin.store(begin);
        return true;
    }
};

Arena& arena() {
    static Arena* instance = new Arena();  // never destroyed: kernels may run at exit
    return *instance;
}

size_t round_up(size_t v, size_t to) { return (v + to - 1) / to * to; }

}  // namespace

bool arena_contains(uintptr_t address) {
    Arena& a = arena();
    std::lock_guard<std::mutex> lock(a.mutex);
    return a.begin != 0 && address >= a.begin && address < a.begin + kArenaBytes;
}

bool arena_contains_in_signal(uintptr_t address) {
    uintptr_t begin = arena_begin.load();
    return begin != 0 && address >= begin && address < begin + kArenaBytes;
}

int device_alloc(size_t bytes, uint64_t generation, uintptr_t* out) {
    Arena& a = arena();
    std::lock_guard<std::mutex> lock(a.mutex);
    if (!a.reserve()) {
        return fail(OUT_OF_MEMORY, format("cannot reserve the device arena: %s", strerror(errno)));
    }
    size_t pages_bytes = round_up(bytes, a.page);
    uintptr_t pages = a.cursor + a.page;  // after the guard page
    if (pages + pages_bytes + a.page > a.begin + kArenaBytes) {
        return fail(OUT_OF_MEMORY, "the stand-in's device address range is used up");
    }
    if (pages_bytes > 0 && mprotect(reinterpret_cast<void*>(pages), pages_bytes, PROT_READ | PROT_WRITE) != 0) {
        return fail(OUT_OF_MEMORY, format("cannot map %zu bytes of device memory: %s", bytes, strerror(errno)));
    }
    uintptr_t end = pages + pages_bytes;
    uintptr_t base = (end - bytes) & ~(kAlignment - 1);
    memset(reinterpret_cast<void*>(base + bytes), kCanary, end - (base + bytes));
    a.cursor = end;
    a.allocations[base] = Allocation{bytes, pages, pages_bytes, true, nullptr, generation};
    a.in_use += bytes;
    *out = base;
    return SUCCESS;
}

void live_allocations(std::vector<AllocationView>* out) {
    Arena& a = arena();
    std::lock_guard<std::mutex> lock(a.mutex);
    out->clear();
    for (const auto& [base, allocation] : a.allocations) {
        if (allocation.live) out->push_back(AllocationView{base, allocation.size, true, nullptr, allocation.generation});
    }
}

namespace {
void release(Arena& a, uintptr_t base, Allocation& allocation, const char* why) {
    (void)base;
    uintptr_t pages = allocation.pages;
    if (allocation.pages_bytes > 0) {
        madvise(reinterpret_cast<void*>(pages), allocation.pages_bytes, MADV_DONTNEED);
        mprotect(reinterpret_cast<void*>(pages), allocation.pages_bytes, PROT_NONE);
    }
    allocation.live = false;
    allocation.ended_by = why;
    a.in_use -= allocation.size;
}
}  // namespace

int device_free(uintptr_t base, const char* why) {
    Arena& a = arena();
    std::lock_guard<std::mutex> lock(a.mutex);
    auto it = a.allocations.find(base);
    if (it == a.allocations.end()) {
        return fail(INVALID_VALUE, format("%s(0x%lx): not the start of a device allocation", why,
                                          static_cast<unsigned long>(base)));
    }
    if (!it->second.live) {
        return fail(INVALID_VALUE, format("%s(0x%lx): the allocation was already freed (by %s)", why,
                                          static_cast<unsigned long>(base), it->second.ended_by));
    }
    release(a, base, it->second, why);
    return SUCCESS;
}

void device_free_generation(uint64_t generation, const char* why) {
    Arena& a = arena();
    std::lock_guard<std::mutex> lock(a.mutex);
    for (auto& [base, allocation] : a.allocations) {
        if (allocation.live && allocation.generation == generation) release(a, base, allocation, why);
    }
}

bool find_allocation(uintptr_t address, size_t bytes, AllocationView* out) {
    Arena& a = arena();
    std::lock_guard<std::mutex> lock(a.mutex);
    auto it = a.allocations.upper_bound(address);
    if (it == a.allocations.begin()) return false;
    --it;
    const Allocation& found = it->second;
    // An empty range may sit at the very end of an allocation (an empty view).
    if (address + bytes > it->first + found.size) return false;
    *out = AllocationView{it->first, found.size, found.live, found.ended_by, found.generation};
    return true;
}

std::string describe_address(uintptr_t address) {
    Arena& a = arena();
    std::lock_guard<std::mutex> lock(a.mutex);
    if (a.begin == 0 || address < a.begin || address >= a.begin + kArenaBytes) {
        return format("0x%lx is not device memory (a host address, or garbage)", static_cast<unsigned long>(address));
    }
    auto after = a.allocations.upper_bound(address);
    if (after != a.allocations.begin()) {
        auto before = std::prev(after);
        uintptr_t base = before->first;
        const Allocation& alloc = before->second;
        uintptr_t pages_end = base + alloc.size;
        if (address < pages_end) {
            if (!alloc.live) {
                return format("0x%lx is %lu bytes into the %zu-byte allocation at 0x%lx, freed by %s",
                              static_cast<unsigned long>(address), static_cast<unsigned long>(address - base),
                              alloc.size, static_cast<unsigned long>(base), alloc.ended_by);
            }
            return format("0x%lx is %lu bytes into the live %zu-byte allocation at 0x%lx",
                          static_cast<unsigned long>(address), static_cast<unsigned long>(address - base),
                          alloc.size, static_cast<unsigned long>(base));
        }
        if (address < pages_end + a.page) {
            return format("0x%lx is %lu bytes past the end of the %zu-byte allocation at 0x%lx%s",
                          static_cast<unsigned long>(address), static_cast<unsigned long>(address - pages_end),
                          alloc.size, static_cast<unsigned long>(base), alloc.live ? "" : " (itself freed)");
        }
    }
    if (after != a.allocations.end()) {
        uintptr_t pages = after->second.pages;
        if (address < after->first && address + a.page >= pages) {
            return format("0x%lx is %lu bytes before the start of the %zu-byte allocation at 0x%lx",
                          static_cast<unsigned long>(address), static_cast<unsigned long>(after->first - address),
                          after->second.size, static_cast<unsigned long>(after->first));
        }
    }
    return format("0x%lx is device address space that no allocation holds", static_cast<unsigned long>(address));
}

bool padding_intact(uintptr_t address, std::string* why) {
    uintptr_t written = 0;
    {
        Arena& a = arena();
        std::lock_guard<std::mutex> lock(a.mutex);
        auto it = a.allocations.upper_bound(address);
        if (it == a.allocations.begin()) return true;
        --it;
        const Allocation& found = it->second;
        if (!found.live || address > it->first + found.size) return true;
        uintptr_t end = found.pages + found.pages_bytes;
        for (uintptr_t p = it->first + found.size; p < end; ++p) {
            if (*reinterpret_cast<const unsigned char*>(p) != kCanary) {
                written = p;
                break;
            }
        }
    }
    if (written == 0) return true;
    *why = describe_address(written);
    return false;
}

size_t device_bytes_in_use() {
    Arena& a = arena();
    std::lock_guard<std::mutex> lock(a.mutex);
    return a.in_use;
}

bool device_range_ok(uintptr_t address, size_t bytes, std::string* why) {
    AllocationView view;
    if (!find_allocation(address, bytes, &view)) {
        if (bytes > 0 && find_allocation(address, 0, &view)) {
            *why = format("[0x%lx, +%zu) runs %zu bytes past the end of the %zu-byte allocation at 0x%lx",
                          static_cast<unsigned long>(address), bytes,
                          static_cast<size_t>(address + bytes - view.base - view.size), view.size,
                          static_cast<unsigned long>(view.base));
        } else {
            *why = describe_address(address);
        }
        return false;
    }
    if (!view.live) {
        *why = format("0x%lx is in the %zu-byte allocation at 0x%lx, freed by %s", static_cast<unsigned long>(address),
                      view.size, static_cast<unsigned long>(view.base), view.ended_by);
        return false;
    }
    return true;
}

void* pinned_alloc(size_t bytes, unsigned int flags) {
    Arena& a = arena();
    size_t length = bytes == 0 ? 1 : bytes;
    void* p = mmap(nullptr, length, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return nullptr;
    std::lock_guard<std::mutex> lock(a.mutex);
    a.locked[reinterpret_cast<uintptr_t>(p)] = Locked{length, flags, false, 0, a.next_locked_id++};
    return p;
}

namespace {
void end_locked(Arena& a, std::map<uintptr_t, Locked>::iterator it, const char* why) {
    a.locked_ended[it->second.id] = why;
    if (it->second.registered) a.registration_ended[it->first] = why;
    a.locked.erase(it);
}
}  // namespace

int pinned_free(void* pointer) {
    Arena& a = arena();
    std::lock_guard<std::mutex> lock(a.mutex);
    auto it = a.locked.find(reinterpret_cast<uintptr_t>(pointer));
    if (it == a.locked.end()) {
        return fail(INVALID_VALUE, format("cuMemFreeHost(%p): not memory from cuMemHostAlloc", pointer));
    }
    if (it->second.registered) {
        return fail(INVALID_VALUE, format("cuMemFreeHost(%p): not memory from cuMemHostAlloc but the caller's, "
                                          "registered with cuMemHostRegister (cuMemHostUnregister ends that; the "
                                          "memory is the caller's to free)",
                                          pointer));
    }
    munmap(pointer, it->second.bytes);
    end_locked(a, it, "cuMemFreeHost");
    return SUCCESS;
}

int host_register(void* pointer, size_t bytes, unsigned int flags, uint64_t generation) {
    Arena& a = arena();
    std::lock_guard<std::mutex> lock(a.mutex);
    uintptr_t begin = reinterpret_cast<uintptr_t>(pointer);
    uintptr_t end = begin + bytes;
    // The range before (it may run into ours) and the first one starting inside ours.
    auto after = a.locked.lower_bound(begin);
    auto overlap = a.locked.end();
    if (after != a.locked.end() && after->first < end) overlap = after;
    if (overlap == a.locked.end() && after != a.locked.begin()) {
        auto before = std::prev(after);
        if (before->first + before->second.bytes > begin) overlap = before;
    }
    if (overlap != a.locked.end()) {
        return fail(HOST_MEMORY_ALREADY_REGISTERED,
                    format("cuMemHostRegister(%p, %zu bytes): overlaps the %zu bytes at 0x%lx, already page-locked "
                           "(%s)",
                           pointer, bytes, overlap->second.bytes, static_cast<unsigned long>(overlap->first),
                           overlap->second.registered ? "by cuMemHostRegister" : "memory of cuMemHostAlloc"));
    }
    a.locked[begin] = Locked{bytes, flags, true, generation, a.next_locked_id++};
    for (auto it = a.ended_with_context.begin(); it != a.ended_with_context.end();) {
        bool overlaps = it->first < end && it->first + it->second.first > begin;
        it = overlaps ? a.ended_with_context.erase(it) : std::next(it);
    }
    return SUCCESS;
}

int host_unregister(void* pointer) {
    Arena& a = arena();
    std::lock_guard<std::mutex> lock(a.mutex);
    auto it = a.locked.find(reinterpret_cast<uintptr_t>(pointer));
    if (it == a.locked.end() || !it->second.registered) {
        std::string detail;
        auto ended = a.registration_ended.find(reinterpret_cast<uintptr_t>(pointer));
        if (it != a.locked.end()) {
            detail = " (it is memory of cuMemHostAlloc)";
        } else if (ended != a.registration_ended.end()) {
            detail = format(" (the registration that started here was ended by %s)", ended->second);
        }
        return fail(HOST_MEMORY_NOT_REGISTERED,
                    format("cuMemHostUnregister(%p): not the start of a range registered with cuMemHostRegister%s",
                           pointer, detail.c_str()));
    }
    end_locked(a, it, "cuMemHostUnregister");
    return SUCCESS;
}

void host_unregister_generation(uint64_t generation, const char* why, const std::string& context) {
    Arena& a = arena();
    std::lock_guard<std::mutex> lock(a.mutex);
    for (auto it = a.locked.begin(); it != a.locked.end();) {
        auto next = std::next(it);
        if (it->second.registered && it->second.generation == generation) {
            a.ended_with_context[it->first] = {it->second.bytes, format("%s, by %s", context.c_str(), why)};
            end_locked(a, it, why);
        }
        it = next;
    }
}

std::string registration_ended_with_context(const void* pointer, size_t bytes) {
    Arena& a = arena();
    std::lock_guard<std::mutex> lock(a.mutex);
    uintptr_t address = reinterpret_cast<uintptr_t>(pointer);
    auto it = a.ended_with_context.upper_bound(address);
    if (it == a.ended_with_context.begin()) return std::string();
    --it;
    return address + bytes <= it->first + it->second.first ? it->second.second : std::string();
}

uint64_t page_locked_id(const void* pointer, size_t bytes) {
    Arena& a = arena();
    std::lock_guard<std::mutex> lock(a.mutex);
    uintptr_t address = reinterpret_cast<uintptr_t>(pointer);
    auto it = a.locked.upper_bound(address);
    if (it == a.locked.begin()) return 0;
    --it;
    return address + bytes <= it->first + it->second.bytes ? it->second.id : 0;
}

bool is_pinned(const void* pointer, size_t bytes) { return page_locked_id(pointer, bytes) != 0; }

const char* page_locked_ended_by(uint64_t id) {
    Arena& a = arena();
    std::lock_guard<std::mutex> lock(a.mutex);
    auto it = a.locked_ended.find(id);
    return it == a.locked_ended.end() ? nullptr : it->second;
}

}  // namespace standin
