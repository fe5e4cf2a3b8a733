// Kernel execution: every GPU thread of a launch runs as a lane on a fiber of the OS
// thread that synchronises the stream, one block after another.
//
// A lane runs until it returns or reaches a warp shuffle or __syncthreads, where it parks.
// A fiber that finishes its lane goes straight on to the block's next unstarted lane, so a
// kernel without shuffles costs one function call per thread; a kernel with shuffles gets
// one fiber per parked lane. When every lane a shuffle names has parked at it, the values
// are exchanged and the lanes resume; a lane that returned before a shuffle that names it
// (undefined on a GPU, where the other lanes read garbage or hang) ends the launch with
// an error naming the lane.
//
// Faults: a kernel's access outside its allocations hits a guard page or a freed page of
// the device arena and raises SIGSEGV; the handler (installed once) jumps back to the
// launch, which reports CUDA_ERROR_ILLEGAL_ADDRESS with the address described. Faults
// outside a kernel go to the handler that was there before; one at a device address
// (host code, such as another stand-in library's device work, touching freed device
// memory) first says so on stderr, naming the device work running, if any.
#include <setjmp.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <errno.h>

#include <atomic>
#include <string>
#include <utility>
#include <vector>

#include "kernel.h"
#include "standin.h"

namespace standin {

thread_local LaneCoordinates lane;

namespace {

// ---- fibers ---------------------------------------------------------------------------

constexpr size_t kStackBytes = 256 * 1024;

#if defined(__x86_64__)
// Saves the callee-saved registers, MXCSR and the x87 control word on the current stack,
// stores the stack pointer in *from, and resumes the fiber whose stack pointer is `to`.
extern "C" void standin_switch(void** from, void* to);
// First frame of a new fiber: calls r13(r12) on a 16-byte aligned stack.
extern "C" void standin_fiber_entry();
asm(R"(
    .text
    .p2align 4
    .hidden standin_switch
    .globl standin_switch
    .type standin_switch, @function
standin_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $8, %rsp
    stmxcsr (%rsp)
    fnstcw 4(%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    ldmxcsr (%rsp)
    fldcw 4(%rsp)
    addq $8, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size standin_switch, .-standin_switch

    .p2align 4
    .hidden standin_fiber_entry
    .globl standin_fiber_entry
    .type standin_fiber_entry, @function
standin_fiber_entry:
    movq %r12, %rdi
    callq *%r13
    ud2
    .size standin_fiber_entry, .-standin_fiber_entry
)");
#else
#error "the stand-in's fibers are written for x86_64"
#endif

struct Stack {
    void* memory;  // guard page + stack
    size_t bytes;
    uintptr_t top() const { return reinterpret_cast<uintptr_t>(memory) + bytes; }
};

// Stacks are kept per OS thread and reused across launches.
struct StackPool {
    std::vector<Stack> free;
    ~StackPool() {
        for (Stack& s : free) munmap(s.memory, s.bytes);
    }
    Stack take() {
        if (!free.empty()) {
            Stack s = free.back();
            free.pop_back();
            return s;
        }
        size_t page = size_t(sysconf(_SC_PAGESIZE));
        size_t bytes = kStackBytes + page;
        void* memory = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (memory == MAP_FAILED) {
            fprintf(stderr, "cuda stand-in: cannot map a lane stack\n");
            abort();
        }
        mprotect(memory, page, PROT_NONE);  // overflow faults instead of corrupting
        return Stack{memory, bytes};
    }
    void give(Stack s) { free.push_back(s); }
};

// ---- lanes ----------------------------------------------------------------------------

enum class LaneState { Unstarted, Running, AtShuffle, AtBarrier, Returned };

struct Lane {
    LaneState state = LaneState::Unstarted;
    uint3 thread_idx{};
    // The fiber the lane runs on while it is parked (index into Block::fibers).
    int fiber = -1;
    // At a shuffle: the operands, and the result once every lane has arrived.
    unsigned int mask = 0;
    unsigned int delta = 0;
    int width = 32;
    uint64_t value = 0;
    uint64_t result = 0;
    // Which shuffle of the lane this is (1, 2, ...), to tell apart shuffles in a loop.
    uint64_t shuffles = 0;
};

struct Fiber {
    Stack stack;
    void* sp = nullptr;
    bool idle = true;
};

struct Block;

// What the running OS thread is doing, read by the lanes and the fault handler.
struct Execution {
    Block* block = nullptr;
    int lane = -1;         // running lane, -1 on the scheduler
    int fiber = -1;        // running fiber
    void* scheduler_sp = nullptr;
    bool in_kernel = false;
    sigjmp_buf fault_jump;
    // Counts the blocks this OS thread has run; `__shared__` variables poisoned in this
    // thread, with the block in which they were (a variable is poisoned when the first
    // lane of a new block reaches its declaration).
    uint64_t block_serial = 0;
    std::vector<std::pair<void*, uint64_t>> shared_poisoned;
    // Set by the fault handler.
    int signal = 0;
    uintptr_t fault_address = 0;
    bool fault_write = false;
    StackPool stacks;
};
thread_local Execution execution;

struct Block {
    const KernelEntry* kernel;
    void* const* args;
    uint3 block_idx;
    dim3 block_dim;
    dim3 grid_dim;
    std::vector<Lane> lanes;
    std::vector<Fiber> fibers;
    size_t next_unstarted = 0;
    // Lanes start, and resume from a barrier or shuffle, highest index first (orders
    // reverse and random): a lane that reads another's value without a barrier between
    // them then reads it before it is written.
    bool reverse_lanes = false;
    // A lane misbehaved: why (the launch then ends with `error_result`).
    std::string error;
    int error_result = LAUNCH_FAILED;
};

void set_coordinates(Block& b, const Lane& l) {
    lane.thread_idx = l.thread_idx;
    lane.block_idx = b.block_idx;
    lane.block_dim = b.block_dim;
    lane.grid_dim = b.grid_dim;
}

// Back to the scheduler from a fiber (the fiber's stack pointer is saved).
void yield_to_scheduler() {
    Execution& e = execution;
    Fiber& f = e.block->fibers[size_t(e.fiber)];
    standin_switch(&f.sp, e.scheduler_sp);
}

// Body of every fiber: runs unstarted lanes of the block one after another; parks with
// the lane when it parks; returns to the scheduler when no lane is left to start.
void fiber_main(void*) {
    for (;;) {
        Execution& e = execution;
        Block& b = *e.block;
        while (b.next_unstarted < b.lanes.size()) {
            size_t k = b.next_unstarted++;
            int index = int(b.reverse_lanes ? b.lanes.size() - 1 - k : k);
            Lane& l = b.lanes[size_t(index)];
            l.state = LaneState::Running;
            l.fiber = e.fiber;
            e.lane = index;
            set_coordinates(b, l);
            b.kernel->thunk(b.args);
            // The lane returned. (`execution` may have been re-read across parks: use e.)
            Block& after = *execution.block;
            after.lanes[size_t(index)].state = LaneState::Returned;
            after.lanes[size_t(index)].fiber = -1;
        }
        Fiber& f = execution.block->fibers[size_t(execution.fiber)];
        f.idle = true;
        standin_switch(&f.sp, execution.scheduler_sp);
    }
}

int new_fiber(Block& b) {
    for (size_t i = 0; i < b.fibers.size(); ++i) {
        if (b.fibers[i].idle && b.fibers[i].sp == nullptr) return int(i);
    }
    Fiber f;
    f.stack = execution.stacks.take();
    b.fibers.push_back(f);
    return int(b.fibers.size() - 1);
}

// Prepares fiber `i` to start in fiber_main on its first resume.
void start_fiber(Block& b, int i) {
    Fiber& f = b.fibers[size_t(i)];
    uintptr_t top = f.stack.top() & ~uintptr_t(15);
    uint64_t* frame = reinterpret_cast<uint64_t*>(top - 8);
    frame[0] = reinterpret_cast<uint64_t>(&standin_fiber_entry);  // ret target
    frame[-1] = 0;                                                // rbp
    frame[-2] = 0;                                                // rbx
    frame[-3] = 0;                                                // r12: argument
    frame[-4] = reinterpret_cast<uint64_t>(&fiber_main);         // r13: function
    frame[-5] = 0;                                                // r14
    frame[-6] = 0;                                                // r15
    uint32_t control[2];
    __asm__ volatile("stmxcsr %0" : "=m"(control[0]));
    __asm__ volatile("fnstcw %0" : "=m"(control[1]));
    memcpy(&frame[-7], control, 8);
    f.sp = &frame[-7];
    f.idle = false;
}

void resume(Block& b, int fiber) {
    Execution& e = execution;
    e.fiber = fiber;
    Fiber& f = b.fibers[size_t(fiber)];
    standin_switch(&e.scheduler_sp, f.sp);
    e.fiber = -1;
    e.lane = -1;
}

std::string lane_name(const Block& b, size_t index) {
    const Lane& l = b.lanes[index];
    return format("thread (%u,%u,%u) of block (%u,%u,%u), lane %zu of warp %zu", l.thread_idx.x, l.thread_idx.y,
                  l.thread_idx.z, b.block_idx.x, b.block_idx.y, b.block_idx.z, index % 32, index / 32);
}

// Resolves the shuffles of one warp whose lanes have all stopped: true when lanes were
// released, false when nothing could be (the lanes wait at a barrier), and sets
// `b.error` on a broken rule.
bool release_warp(Block& b, size_t warp) {
    size_t first = warp * 32;
    size_t end = first + 32 < b.lanes.size() ? first + 32 : b.lanes.size();
    int at_shuffle = -1;
    for (size_t i = first; i < end; ++i) {
        if (b.lanes[i].state == LaneState::AtShuffle) {
            at_shuffle = int(i);
            break;
        }
    }
    if (at_shuffle < 0) return false;
    const Lane& ref = b.lanes[size_t(at_shuffle)];
    unsigned int mask = ref.mask;
    for (size_t i = first; i < end; ++i) {
        const Lane& l = b.lanes[i];
        if (l.state != LaneState::AtShuffle) continue;
        if (l.mask != mask || l.shuffles != ref.shuffles) {
            b.error = format("%s is at a shuffle with mask 0x%08x while %s is at another (mask 0x%08x): the lanes of a warp diverged",
                             lane_name(b, i).c_str(), l.mask, lane_name(b, size_t(at_shuffle)).c_str(), mask);
            return false;
        }
    }
    for (unsigned int bit = 0; bit < 32; ++bit) {
        if (!(mask & (1u << bit))) continue;
        size_t i = first + bit;
        if (i >= end) {
            b.error = format("__shfl_down_sync(0x%08x) in warp %zu names lane %u, which does not exist (the block has %zu threads)",
                             mask, warp, bit, b.lanes.size());
            return false;
        }
        const Lane& l = b.lanes[i];
        if (l.state == LaneState::Returned) {
            b.error = format("%s returned before __shfl_down_sync(0x%08x) that names it (shuffle %llu of %s): on a GPU its partners read an undefined value",
                             lane_name(b, i).c_str(), mask, static_cast<unsigned long long>(ref.shuffles),
                             lane_name(b, size_t(at_shuffle)).c_str());
            return false;
        }
        if (l.state != LaneState::AtShuffle) {
            b.error = format("%s waits at __syncthreads while its warp shuffles with mask 0x%08x: the lanes of a warp diverged",
                             lane_name(b, i).c_str(), mask);
            return false;
        }
    }
    for (size_t i = first; i < end; ++i) {
        Lane& l = b.lanes[i];
        if (l.state != LaneState::AtShuffle) continue;
        size_t lane_in_warp = i - first;
        size_t width = size_t(l.width);
        size_t segment_end = (lane_in_warp / width + 1) * width;
        size_t source = lane_in_warp + l.delta;
        l.result = source < segment_end && first + source < end ? b.lanes[first + source].value : l.value;
    }
    for (size_t k = first; k < end; ++k) {
        size_t i = b.reverse_lanes ? end - 1 - (k - first) : k;
        Lane& l = b.lanes[i];
        if (l.state != LaneState::AtShuffle) continue;
        l.state = LaneState::Running;
        resume(b, l.fiber);
    }
    return true;
}

// Runs one block to completion, or until a lane breaks a rule (b.error).
void run_block(Block& b) {
    // Start lanes until all have started; a fiber whose lane parks stays with it.
    while (b.next_unstarted < b.lanes.size()) {
        int f = new_fiber(b);
        start_fiber(b, f);
        resume(b, f);
    }
    for (;;) {
        bool all_returned = true;
        bool released = false;
        size_t warps = (b.lanes.size() + 31) / 32;
        for (size_t w = 0; w < warps && b.error.empty(); ++w) {
            // Resolving one shuffle may lead the warp to the next: repeat per warp.
            while (b.error.empty() && release_warp(b, w)) released = true;
        }
        if (!b.error.empty()) return;
        size_t at_barrier = 0;
        for (const Lane& l : b.lanes) {
            if (l.state != LaneState::Returned) all_returned = false;
            if (l.state == LaneState::AtBarrier) ++at_barrier;
        }
        if (all_returned) return;
        if (released) continue;
        // Every lane is returned or at the barrier (shuffles are all resolved).
        if (at_barrier > 0) {
            for (size_t k = 0; k < b.lanes.size(); ++k) {
                Lane& l = b.lanes[b.reverse_lanes ? b.lanes.size() - 1 - k : k];
                if (l.state != LaneState::AtBarrier) continue;
                l.state = LaneState::Running;
                resume(b, l.fiber);
            }
            continue;
        }
        b.error = "the lanes of a block stopped with none able to go on";
        return;
    }
}

// ---- faults -----------------------------------------------------------------------------

struct sigaction previous_segv, previous_bus, previous_fpe;

// The label of the device work whose `run` is running (any thread: its faults may come
// from threads of its own).
std::atomic<const char*> running_work{nullptr};

// A fault outside a kernel at a device address: the process will end (the fault is not
// ours to recover from), so say first what a bare "Segmentation fault" would not. Only
// snprintf and write: nothing that locks.
void report_host_fault(int signal, uintptr_t address) {
    if (signal == SIGFPE || !arena_contains_in_signal(address)) return;
    const char* work = running_work.load();
    char text[1024];
    int n = snprintf(text, sizeof text,
                     "cuda stand-in: %s at device address 0x%lx outside any kernel%s%s: host code touched device "
                     "memory that is freed, a guard page or past an allocation's end\n",
                     signal == SIGBUS ? "SIGBUS" : "SIGSEGV", static_cast<unsigned long>(address),
                     work != nullptr ? ", while this device work ran: " : "", work != nullptr ? work : "");
    if (n <= 0) return;
    size_t length = size_t(n) < sizeof text ? size_t(n) : sizeof text - 1;
    ssize_t written = write(2, text, length);
    (void)written;
}

void on_fault(int signal, siginfo_t* info, void* context) {
    Execution& e = execution;
    if (e.in_kernel) {
        e.in_kernel = false;
        e.signal = signal;
        e.fault_address = reinterpret_cast<uintptr_t>(info->si_addr);
#if defined(__x86_64__)
        // Bit 1 of the page-fault error code: the access was a write.
        const ucontext_t* uc = static_cast<const ucontext_t*>(context);
        e.fault_write = (uc->uc_mcontext.gregs[REG_ERR] & 2) != 0;
#endif
        siglongjmp(e.fault_jump, 1);
    }
    report_host_fault(signal, reinterpret_cast<uintptr_t>(info->si_addr));
    const struct sigaction& previous =
        signal == SIGSEGV ? previous_segv : (signal == SIGBUS ? previous_bus : previous_fpe);
    if (previous.sa_flags & SA_SIGINFO) {
        if (previous.sa_sigaction != nullptr) {
            previous.sa_sigaction(signal, info, context);
            return;
        }
    } else if (previous.sa_handler != SIG_DFL && previous.sa_handler != SIG_IGN) {
        previous.sa_handler(signal);
        return;
    }
    // Default action: let the fault happen again without us.
    struct sigaction fallback;
    memset(&fallback, 0, sizeof(fallback));
    fallback.sa_handler = SIG_DFL;
    sigaction(signal, &fallback, nullptr);
}

// ---- execution order -------------------------------------------------------------------

std::atomic<int> order_kind{int(OrderKind::Forward)};
std::atomic<uint64_t> order_seed{0};
std::atomic<bool> shared_poison{true};

uint64_t splitmix64(uint64_t* state) {
    uint64_t z = (*state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

uint64_t gcd(uint64_t a, uint64_t b) {
    while (b != 0) {
        uint64_t t = a % b;
        a = b;
        b = t;
    }
    return a;
}

// The blocks of a grid in the order of an ExecutionOrder: the k-th block to run.
class BlockOrder {
  public:
    BlockOrder(const unsigned int grid[3], ExecutionOrder order)
        : gx_(grid[0]), gy_(grid[1]), count_(uint64_t(grid[0]) * grid[1] * grid[2]), order_(order) {
        if (order.kind != OrderKind::Random || count_ < 2) return;
        uint64_t state = order.seed;
        if (count_ <= (uint64_t(1) << 22)) {
            // Fisher-Yates with splitmix64: a uniform permutation, the same for a seed.
            permutation_.resize(size_t(count_));
            for (uint64_t i = 0; i < count_; ++i) permutation_[size_t(i)] = uint32_t(i);
            for (uint64_t i = count_ - 1; i > 0; --i) {
                uint64_t j = splitmix64(&state) % (i + 1);
                std::swap(permutation_[size_t(i)], permutation_[size_t(j)]);
            }
        } else {
            // Too many blocks to list: (a * k + b) mod count, a coprime with count.
            multiplier_ = splitmix64(&state) % count_ | 1;
            while (gcd(multiplier_, count_) != 1) multiplier_ += 2;
            offset_ = splitmix64(&state) % count_;
        }
    }
    uint64_t count() const { return count_; }
    bool reverse_lanes() const { return order_.kind != OrderKind::Forward; }
    uint3 block(uint64_t k) const {
        uint64_t linear = k;
        if (order_.kind == OrderKind::Reverse) {
            linear = count_ - 1 - k;
        } else if (order_.kind == OrderKind::Random && count_ >= 2) {
            if (!permutation_.empty()) {
                linear = permutation_[size_t(k)];
            } else {
                linear = uint64_t((static_cast<unsigned __int128>(multiplier_) * k % count_ + offset_) % count_);
            }
        }
        // CUDA's linear block order: x fastest, then y, then z.
        return uint3{unsigned(linear % gx_), unsigned(linear / gx_ % gy_), unsigned(linear / (uint64_t(gx_) * gy_))};
    }

  private:
    uint64_t gx_, gy_, count_;
    ExecutionOrder order_;
    std::vector<uint32_t> permutation_;
    uint64_t multiplier_ = 1, offset_ = 0;
};

}  // namespace

uint64_t shuffle_down(unsigned int mask, uint64_t value, unsigned int delta, int width) {
    Execution& e = execution;
    Block& b = *e.block;
    Lane& l = b.lanes[size_t(e.lane)];
    int index = e.lane;
    l.state = LaneState::AtShuffle;
    l.mask = mask;
    l.delta = delta;
    l.width = width <= 0 || width > 32 ? 32 : width;
    l.value = value;
    l.shuffles += 1;
    yield_to_scheduler();
    // Resumed by release_warp, which set the result and the lane coordinates' owner.
    Block& after = *execution.block;
    execution.lane = index;
    set_coordinates(after, after.lanes[size_t(index)]);
    return after.lanes[size_t(index)].result;
}

void sync_threads() {
    Execution& e = execution;
    Block& b = *e.block;
    int index = e.lane;
    b.lanes[size_t(index)].state = LaneState::AtBarrier;
    yield_to_scheduler();
    Block& after = *execution.block;
    execution.lane = index;
    set_coordinates(after, after.lanes[size_t(index)]);
}

bool guarded_copy(void* destination, const void* source, size_t bytes) {
    Execution& e = execution;
    if (sigsetjmp(e.fault_jump, 1) != 0) {
        e.in_kernel = false;
        return false;
    }
    e.in_kernel = true;
    // Byte by byte through a volatile pointer: no library call the fault could land in.
    const volatile unsigned char* from = static_cast<const volatile unsigned char*>(source);
    unsigned char* to = static_cast<unsigned char*>(destination);
    for (size_t i = 0; i < bytes; ++i) to[i] = from[i];
    e.in_kernel = false;
    return true;
}

void note_running_work(const char* label) { running_work.store(label); }

void install_fault_handlers() {
    static bool installed = false;
    if (installed) return;
    installed = true;
    struct sigaction action;
    memset(&action, 0, sizeof(action));
    action.sa_sigaction = on_fault;
    action.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_NODEFER;
    sigemptyset(&action.sa_mask);
    sigaction(SIGSEGV, &action, &previous_segv);
    sigaction(SIGBUS, &action, &previous_bus);
    sigaction(SIGFPE, &action, &previous_fpe);
}

bool parse_order(const char* text, ExecutionOrder* out) {
    std::string t = text == nullptr ? "" : text;
    if (t.empty() || t == "forward") {
        *out = ExecutionOrder{OrderKind::Forward, 0};
        return true;
    }
    if (t == "reverse") {
        *out = ExecutionOrder{OrderKind::Reverse, 0};
        return true;
    }
    const std::string prefix = "random:";
    if (t.compare(0, prefix.size(), prefix) == 0 && t.size() > prefix.size()) {
        const char* digits = t.c_str() + prefix.size();
        for (const char* p = digits; *p != '\0'; ++p) {
            if (*p < '0' || *p > '9') return false;
        }
        errno = 0;
        char* end = nullptr;
        unsigned long long seed = strtoull(digits, &end, 10);
        if (errno != 0 || end == nullptr || *end != '\0') return false;
        *out = ExecutionOrder{OrderKind::Random, uint64_t(seed)};
        return true;
    }
    return false;
}

std::string order_text(ExecutionOrder order) {
    switch (order.kind) {
        case OrderKind::Forward: return "forward";
        case OrderKind::Reverse: return "reverse";
        case OrderKind::Random: return format("random:%llu", static_cast<unsigned long long>(order.seed));
    }
    return "forward";
}

void set_execution_order(ExecutionOrder order) {
    order_seed.store(order.seed);
    order_kind.store(int(order.kind));
}

ExecutionOrder execution_order() { return ExecutionOrder{OrderKind(order_kind.load()), order_seed.load()}; }

void set_shared_poison(bool on) { shared_poison.store(on); }
bool shared_poison_on() { return shared_poison.load(); }

void shared_reached(void* address, size_t bytes) {
    Execution& e = execution;
    if (!e.in_kernel || e.block == nullptr || !shared_poison.load()) return;
    for (auto& [where, serial] : e.shared_poisoned) {
        if (where != address) continue;
        if (serial != e.block_serial) {
            serial = e.block_serial;
            memset(address, kSharedPoison, bytes);
        }
        return;
    }
    e.shared_poisoned.emplace_back(address, e.block_serial);
    memset(address, kSharedPoison, bytes);
}

bool run_kernel(const KernelEntry& kernel, const LaunchShape& shape, void* const* args,
                const std::string& launch_label, KernelFault* fault) {
    Execution& e = execution;
    Block block;
    block.kernel = &kernel;
    block.args = args;
    block.block_dim = dim3{shape.block[0], shape.block[1], shape.block[2]};
    block.grid_dim = dim3{shape.grid[0], shape.grid[1], shape.grid[2]};
    size_t threads = size_t(shape.block[0]) * shape.block[1] * shape.block[2];
    block.lanes.resize(threads);
    // Lanes in CUDA's linear order: x fastest, then y, then z.
    for (size_t i = 0; i < threads; ++i) {
        Lane& l = block.lanes[i];
        l.thread_idx = uint3{unsigned(i % shape.block[0]), unsigned((i / shape.block[0]) % shape.block[1]),
                             unsigned(i / (size_t(shape.block[0]) * shape.block[1]))};
    }
    Block* outer = e.block;  // a launch never nests, but keep the thread's state sane
    e.block = &block;
    volatile bool ok = true;
    if (sigsetjmp(e.fault_jump, 1) == 0) {
        BlockOrder order(shape.grid, execution_order());
        block.reverse_lanes = order.reverse_lanes();
        for (uint64_t k = 0; k < order.count() && ok; ++k) {
            {
                {
                    block.block_idx = order.block(k);
                    block.next_unstarted = 0;
                    block.error.clear();
                    e.block_serial += 1;
                    for (Lane& l : block.lanes) {
                        l.state = LaneState::Unstarted;
                        l.fiber = -1;
                        l.shuffles = 0;
                    }
                    for (Fiber& f : block.fibers) {
                        f.sp = nullptr;
                        f.idle = true;
                    }
                    e.in_kernel = true;
                    run_block(block);
                    e.in_kernel = false;
                    if (!block.error.empty()) {
                        fault->result = block.error_result;
                        fault->message = format("%s: %s", launch_label.c_str(), block.error.c_str());
                        ok = false;
                    }
                }
            }
        }
    } else {
        // Back from the fault handler: the lanes' fibers are abandoned where they stood.
        const char* what = e.signal == SIGFPE ? "an arithmetic fault (integer division by zero?)" : nullptr;
        std::string where;
        if (e.lane >= 0) where = lane_name(block, size_t(e.lane));
        if (what != nullptr) {
            fault->result = LAUNCH_FAILED;
            fault->message = format("%s: %s in %s", launch_label.c_str(), what, where.c_str());
        } else {
            fault->result = ILLEGAL_ADDRESS;
            fault->message = format("%s: illegal %s at %s, by %s", launch_label.c_str(),
                                    e.fault_write ? "write" : "read", describe_address(e.fault_address).c_str(),
                                    where.c_str());
        }
        ok = false;
    }
    e.in_kernel = false;
    e.lane = -1;
    e.fiber = -1;
    for (Fiber& f : block.fibers) e.stacks.give(f.stack);
    e.block = outer;
    return ok;
}

}  // namespace standin
