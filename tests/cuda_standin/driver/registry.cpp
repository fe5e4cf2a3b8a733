// The registry of the kernels' host builds, filled at load time by the registration
// files that build.rs generates (one per .cu file).
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <map>
#include <string>

#include "registry.h"

namespace standin {
namespace {
std::map<std::string, const KernelEntry*>& registry() {
    static std::map<std::string, const KernelEntry*>* kernels = new std::map<std::string, const KernelEntry*>();
    return *kernels;
}
}  // namespace

Registration::Registration(const KernelEntry* entries, size_t count) {
    for (size_t i = 0; i < count; ++i) {
        auto [it, inserted] = registry().emplace(entries[i].name, &entries[i]);
        if (!inserted) {
            // Two files define the same extern "C" kernel: NVRTC modules could each hold
            // one, but the stand-in could not tell which host build a launch means.
            fprintf(stderr, "cuda stand-in: kernel %s is defined in both %s and %s\n", entries[i].name,
                    it->second->file, entries[i].file);
            abort();
        }
    }
}

const KernelEntry* find_kernel(const char* name) {
    auto it = registry().find(name);
    return it == registry().end() ? nullptr : it->second;
}

}  // namespace standin
