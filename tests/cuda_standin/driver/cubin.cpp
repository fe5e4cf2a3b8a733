// Reads what the stand-in needs from NVRTC's output, a CUBIN: an ELF64 file of machine
// EM_CUDA whose entry functions are the kernels, each with a `.nv.info.<kernel>` section
// whose EIATTR_KPARAM_INFO records give every parameter's size. cuModuleLoadData checks
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
    std::vector<std::string> functions;
    for (size_t i = 0; i < header.shnum; ++i) {
        Elf64Section s = section(i);
        std::string name = section_name(s);
        if (s.type == kShtSymtab) {
            Elf64Section strings = section(s.link);
            for (size_t k = 0; k < s.size / sizeof(Elf64Symbol); ++k) {
                Elf64Symbol sym;
                memcpy(&sym, bytes + s.offset + k * sizeof(Elf64Symbol), sizeof(sym));
                if ((sym.info & 0xf) == kSttFunc) {
                    functions.emplace_back(reinterpret_cast<const char*>(bytes + strings.offset + sym.name));
                }
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
                at += 4 + (fmt == kFormatSval ? value : 0);
            }
            param_bytes[kernel] = total;
        }
    }
    for (const std::string& f : functions) {
        auto found = param_bytes.find(f);
        cubin->kernels.push_back(CubinKernel{f, found == param_bytes.end() ? 0 : found->second});
    }
    return true;
}

}  // namespace standin
