// The C++ face of the Rust half (src/model.rs), which runs a network's ONNX model with
// ONNX Runtime (whose C header is in no package this project can reach, so the stand-in
// calls it through the `ort` crate).
#include "standin.h"

#include <cstring>

namespace {

// Mirrors model.rs's #[repr(C)] structs.
struct RawTensor {
    char const* name;
    int32_t is_input;
    int32_t data_type;
    int32_t nb_dims;
    int64_t dims[8];
};

struct RawBinding {
    char const* name;
    int32_t data_type;
    int32_t nb_dims;
    int64_t dims[8];
    void* data;
    size_t bytes;
};

}  // namespace

extern "C" {
void* celer_trt_standin_ort_load(uint8_t const* onnx, size_t len, char* why, size_t why_len);
int32_t celer_trt_standin_ort_io_count(void const* model);
int32_t celer_trt_standin_ort_io(void const* model, int32_t index, RawTensor* out);
int32_t celer_trt_standin_ort_run(void const* model, RawBinding const* inputs, size_t n_inputs, RawBinding* outputs,
                                  size_t n_outputs, char* why, size_t why_len);
void celer_trt_standin_ort_free(void* model);
}

namespace standin {

namespace {

Dims to_dims(int32_t nb, int64_t const* d) {
    Dims out{};
    out.nbDims = nb < 0 ? 0 : (nb > Dims::MAX_DIMS ? Dims::MAX_DIMS : nb);
    for (int32_t i = 0; i < out.nbDims; ++i) out.d[i] = d[i];
    return out;
}

RawBinding to_raw(OrtModel::Binding const& b) {
    RawBinding raw{};
    raw.name = b.name.c_str();
    raw.data_type = static_cast<int32_t>(b.type);
    raw.nb_dims = b.dims.nbDims;
    for (int32_t i = 0; i < b.dims.nbDims && i < 8; ++i) raw.dims[i] = b.dims.d[i];
    raw.data = b.data;
    raw.bytes = b.bytes;
    return raw;
}

}  // namespace

OrtModel* OrtModel::load(std::vector<uint8_t> const& onnx, std::string* why) {
    char message[1024] = {0};
    void* handle = celer_trt_standin_ort_load(onnx.data(), onnx.size(), message, sizeof message);
    if (handle == nullptr) {
        *why = message;
        return nullptr;
    }
    auto* model = new OrtModel(handle);
    int32_t n = celer_trt_standin_ort_io_count(handle);
    for (int32_t i = 0; i < n; ++i) {
        RawTensor raw{};
        if (celer_trt_standin_ort_io(handle, i, &raw) != 0) continue;
        TensorInfo t;
        t.name = raw.name;
        t.is_input = raw.is_input != 0;
        t.type = static_cast<DataType>(raw.data_type);
        t.dims = to_dims(raw.nb_dims, raw.dims);
        model->io_.push_back(t);
    }
    return model;
}

OrtModel::~OrtModel() { celer_trt_standin_ort_free(handle_); }

bool OrtModel::run(std::vector<Binding> const& inputs, std::vector<Binding>* outputs, std::string* why) {
    std::vector<RawBinding> in, out;
    for (Binding const& b : inputs) in.push_back(to_raw(b));
    for (Binding const& b : *outputs) out.push_back(to_raw(b));
    char message[1024] = {0};
    if (celer_trt_standin_ort_run(handle_, in.data(), in.size(), out.data(), out.size(), message, sizeof message) != 0) {
        *why = message;
        return false;
    }
    for (size_t i = 0; i < out.size(); ++i) (*outputs)[i].dims = to_dims(out[i].nb_dims, out[i].dims);
    return true;
}

}  // namespace standin
