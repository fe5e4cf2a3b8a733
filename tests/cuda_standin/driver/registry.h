// The host builds of the kernels, by name, with each kernel's parameter list as the
// compiler sees it. build.rs generates one registration file per `.cu` file from the
// `__global__` functions it finds there; the types come from the kernel itself
// (decltype), so `cuLaunchKernel` reads `kernelParams[k]` as exactly the declared C type.
#pragma once

#include <stddef.h>
#include <stdint.h>

#include <tuple>
#include <type_traits>
#include <utility>

namespace standin {

struct ParamInfo {
    size_t size;
    size_t align;
    bool is_pointer;
    // For pointers: the size and alignment of what they point at (0 for void).
    size_t pointee_size;
    size_t pointee_align;
    // For pointers: whether what they point at is const (`const float*`): the kernel only
    // reads through it. A pointer to non-const counts as a write of its allocation.
    bool pointee_const;
};

// Calls the kernel with its arguments read from `args[k]`, one per parameter.
typedef void (*KernelThunk)(void* const* args);

struct KernelEntry {
    const char* name;
    const char* file;
    // The parameter list as written in the source, for messages.
    const char* signature;
    KernelThunk thunk;
    const ParamInfo* params;
    size_t param_count;
};

template <typename T>
constexpr ParamInfo param_info() {
    using P = std::remove_cv_t<T>;
    if constexpr (std::is_pointer_v<P>) {
        constexpr bool is_const = std::is_const_v<std::remove_pointer_t<P>>;
        using Pointee = std::remove_cv_t<std::remove_pointer_t<P>>;
        if constexpr (std::is_void_v<Pointee>) {
            return ParamInfo{sizeof(P), alignof(P), true, 0, 1, is_const};
        } else {
            return ParamInfo{sizeof(P), alignof(P), true, sizeof(Pointee), alignof(Pointee), is_const};
        }
    } else {
        static_assert(std::is_trivially_copyable_v<P>, "kernel parameters are plain values");
        return ParamInfo{sizeof(P), alignof(P), false, 0, 0, false};
    }
}

template <typename F>
struct KernelTraits;

template <typename... A>
struct KernelTraits<void (*)(A...)> {
    static constexpr size_t count = sizeof...(A);
    // One extra element so that a kernel without parameters still has an array.
    static constexpr ParamInfo params[sizeof...(A) + 1] = {param_info<A>()..., ParamInfo{0, 0, false, 0, 0, false}};

    template <void (*F)(A...), size_t... I>
    static void call(void* const* args, std::index_sequence<I...>) {
        F(*static_cast<std::remove_reference_t<A>*>(args[I])...);
    }

    template <void (*F)(A...)>
    static void thunk(void* const* args) {
        call<F>(args, std::index_sequence_for<A...>{});
    }
};

template <auto F>
KernelEntry make_entry(const char* name, const char* file, const char* signature) {
    using Traits = KernelTraits<decltype(F)>;
    return KernelEntry{name, file, signature, &Traits::template thunk<F>, Traits::params, Traits::count};
}

// Adds a file's kernels to the registry (at load time, from a static initialiser).
struct Registration {
    Registration(const KernelEntry* entries, size_t count);
};

// The host build of kernel `name`, or null.
const KernelEntry* find_kernel(const char* name);

}  // namespace standin

#define STANDIN_KERNEL(name, file, signature) ::standin::make_entry<&name>(#name, file, signature)
