// Reads what the stand-in needs from NVRTC's output, a CUBIN: an ELF64 file of machine
// EM_CUDA whose entry functions are the kernels, each with a `.nv.info.<kernel>` section
// whose EIATTR_KPARAM_INFO records give every parameter's size (and EIATTR_MAX_THREADS
// its __launch_bounds__), and whose global `.nv.info` gives each kernel's registers per
// thread (EIATTR_REGCOUNT, by symbol index). cuModuleLoadData checks
// those sizes against the host build's parameter types, so a stand-in built from other
// sources than the ones NVRTC compiled cannot go unnoticed.
#include <string.h>

#include <map>

#include "standin.h"

namespace standin {
namespace {

constexpr uint16_t kEmCuda = 190;
constexpr uint8_t kOsAbiCuda12 = 0x33;
constexpr uint8_t kOsAbiCuda13 = 0x41;
constexpr uint32_t kShtSymtab = 2;
constexpr uint8_t kSttFunc = 2;
// .nv.info attributes (EIATTR_*) and value formats (EIFMT_*).
constexpr uint8_t kFormatSval = 4;
constexpr uint8_t kAttrKparamInfo = 0x17;
constexpr uint8_t kAttrCbankParamSize = 0x19;
// __launch_bounds__'s maximum threads per block: three 32-bit values (x, y, z).
constexpr uint8_t kAttrMaxThreads = 0x05;
// In the global .nv.info: a function's symbol index and its registers per thread.
constexpr uint8_t kAttrRegcount = 0x2f;

struct Elf64Header {
    unsigned char ident[16];
    uint16_t type, machine;
    uint32_t version;
    uint64_t entry, phoff, shoff;
    uint32_t flags;
    uint16_t ehsize, phentsize, phnum, shentsize, shnum, shstrndx;
};
struct Elf64Section {
    uint32_t name, type;
    uint64_t flags, addr, offset, size;
    uint32_t link, info;
    uint64_t addralign, entsize;
};
struct Elf64Symbol {
    uint32_t name;
    unsigned char info, other;
    uint16_t shndx;
    uint64_t value, size;
};

}  // namespace

bool read_cubin(const void* image, std::string* why, Cubin* cubin) {
    const unsigned char* bytes = static_cast<const unsigned char*>(image);
    if (memcmp(bytes, "\x7f" "ELF", 4) != 0) {
        if (memcmp(bytes, "//", 2) == 0 || memcmp(bytes, ".version", 8) == 0) {
            *why = "the image is PTX text; the stand-in takes the CUBINs NVRTC makes for a real architecture";
        } else {
            *why = "the image is neither a CUBIN (ELF) nor PTX";
        }
        return false;
    }
    Elf64Header header;
    memcpy(&header, bytes, sizeof(header));
    if (header.ident[4] != 2 || header.machine != kEmCuda) {
        *why = format("an ELF of class %u for machine %u, not a 64-bit CUDA CUBIN (machine %u)", header.ident[4],
                      header.machine, kEmCuda);
        return false;
    }
    // Two ELF ABIs (checked on NVRTC 12.2's and 13.5's output): CUDA 12 writes OS/ABI 0x33,
    // ABI version 7, the SM in bits 0-7 of e_flags (0x5a055a: sm_90); CUDA 13 writes
    // OS/ABI 0x41, version 8, the SM in bits 8-15 (0x6005a04: sm_90).
    uint8_t os_abi = header.ident[7];
    if (os_abi == kOsAbiCuda12) {
        cubin->cuda_major = 12;
        cubin->arch = format("sm_%u", header.flags & 0xff);
    } else if (os_abi == kOsAbiCuda13) {
        cubin->cuda_major = 13;
        cubin->arch = format("sm_%u", (header.flags >> 8) & 0xff);
    } else {
        *why = format("a CUBIN of an ELF ABI the stand-in does not know (OS/ABI 0x%x, version %u)", os_abi,
                      header.ident[8]);
        return false;
    }
    auto section = [&](size_t i) {
        Elf64Section s;
        memcpy(&s, bytes + header.shoff + i * header.shentsize, sizeof(s));
        return s;
    };
    Elf64Section names = section(header.shstrndx);
    auto section_name = [&](const Elf64Section& s) {
        return std::string(reinterpret_cast<const char*>(bytes + names.offset + s.name));
    };
    std::map<std::string, size_t> param_bytes;
    std::map<std::string, unsigned> registers;
    std::map<uint32_t, std::string> symbols;  // by index in the symbol table
    std::vector<std::pair<uint32_t, uint32_t>> register_counts;  // (symbol, registers)
    std::map<std::string, unsigned> max_threads;
    std::vector<std::string> functions;
    for (size_t i = 0; i < header.shnum; ++i) {
        Elf64Section s = section(i);
        std::string name = section_name(s);
        if (s.type == kShtSymtab) {
            Elf64Section strings = section(s.link);
            for (size_t k = 0; k < s.size / sizeof(Elf64Symbol); ++k) {
                Elf64Symbol sym;
                memcpy(&sym, bytes + s.offset + k * sizeof(Elf64Symbol), sizeof(sym));
                const char* symbol = reinterpret_cast<const char*>(bytes + strings.offset + sym.name);
                symbols[uint32_t(k)] = symbol;
                if ((sym.info & 0xf) == kSttFunc) functions.emplace_back(symbol);
            }
        } else if (name == ".nv.info") {
            for (size_t at = 0; at + 4 <= s.size;) {
                const unsigned char* entry = bytes + s.offset + at;
                uint16_t value;
                memcpy(&value, entry + 2, 2);
                if (entry[0] == kFormatSval && entry[1] == kAttrRegcount && value >= 8 && at + 12 <= s.size) {
                    uint32_t symbol_and_count[2];
                    memcpy(symbol_and_count, entry + 4, sizeof(symbol_and_count));
                    register_counts.emplace_back(symbol_and_count[0], symbol_and_count[1]);
                }
                at += 4 + (entry[0] == kFormatSval ? value : 0);
            }
        } else if (name.rfind(".nv.info.", 0) == 0) {
            // Entries: format, attribute, then a 16-bit value or (SVAL) a size and data.
            std::string kernel = name.substr(strlen(".nv.info."));
            size_t at = 0;
            size_t total = 0;
            while (at + 4 <= s.size) {
                const unsigned char* entry = bytes + s.offset + at;
                uint8_t fmt = entry[0], attr = entry[1];
                uint16_t value;
                memcpy(&value, entry + 2, 2);
                if (attr == kAttrCbankParamSize) total = value;
                if (attr == kAttrMaxThreads && fmt == kFormatSval && value >= 12 && at + 16 <= s.size) {
                    uint32_t xyz[3];
                    memcpy(xyz, entry + 4, sizeof(xyz));
                    max_threads[kernel] = xyz[0] * xyz[1] * xyz[2];
                }
                at += 4 + (fmt == kFormatSval ? value : 0);
            }
            param_bytes[kernel] = total;
        }
    }
    for (const auto& [symbol, count] : register_counts) {
        auto named = symbols.find(symbol);
        if (named != symbols.end()) registers[named->second] = count;
    }
    for (const std::string& f : functions) {
        auto found = param_bytes.find(f);
        auto regs = registers.find(f);
        auto bound = max_threads.find(f);
        cubin->kernels.push_back(CubinKernel{f, found == param_bytes.end() ? 0 : found->second,
                                             regs == registers.end() ? 0 : regs->second,
                                             bound == max_threads.end() ? 0 : bound->second});
    }
    return true;
}

}  // namespace standin
