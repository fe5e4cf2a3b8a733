// The ONNX parser (nvonnxparser::IParser, created through libnvonnxparser's factory): it
// reads the model with ONNX Runtime, which refuses what it cannot load, and gives the
// network the model's inputs and outputs and its bytes (the plan carries them). It must be
// destroyed before its network, which the network checks.
#include "standin.h"

#include <fstream>
#include <iterator>
#include <memory>

namespace standin {

namespace {

using nvonnxparser::ErrorCode;

class ParserError final : public nvonnxparser::StubIParserError {
public:
    ParserError(ErrorCode code, std::string desc, std::string file)
        : code_(code), desc_(std::move(desc)), file_(std::move(file)) {}
    ErrorCode code() const override { return code_; }
    char const* desc() const override { return desc_.c_str(); }
    char const* file() const override { return file_.c_str(); }
    int line() const override { return 0; }
    char const* func() const override { return "parse"; }
    int node() const override { return -1; }
    char const* nodeName() const override { return ""; }
    char const* nodeOperator() const override { return ""; }
    char const* const* localFunctionStack() const override { return nullptr; }
    int32_t localFunctionStackSize() const override { return 0; }
    ~ParserError() override = default;

private:
    ErrorCode code_;
    std::string desc_;
    std::string file_;
};

class OnnxParser final : public nvonnxparser::StubIParser {
public:
    OnnxParser(Network* network, ILogger* logger) : network_(network), logger_(logger) {
        network_attach_parser(network_);
    }
    ~OnnxParser() noexcept override { network_detach_parser(network_); }

    bool parseFromFile(char const* path, int verbosity) noexcept override {
        if (path == nullptr) return error(ErrorCode::kINVALID_VALUE, "no file name", "");
        std::ifstream file(path, std::ios::binary);
        if (!file) return error(ErrorCode::kINVALID_VALUE, std::string("cannot open ") + path, path);
        std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
        return parse(bytes.data(), bytes.size(), path);
    }

    bool parse(void const* data, size_t size, char const* path) noexcept override {
        std::string file = path != nullptr ? path : "";
        if (data == nullptr || size == 0) return error(ErrorCode::kINVALID_VALUE, "no model bytes", file);
        Network* network = as_network_checked();
        if (network == nullptr) return error(ErrorCode::kINTERNAL_ERROR, "the network is gone", file);
        if (network_has_model(network)) {
            return error(ErrorCode::kINVALID_GRAPH, "the network already holds a parsed model", file);
        }
        auto const* p = static_cast<uint8_t const*>(data);
        std::vector<uint8_t> onnx(p, p + size);
        std::string why;
        std::unique_ptr<OrtModel> model(OrtModel::load(onnx, &why));
        if (!model) return error(ErrorCode::kMODEL_DESERIALIZE_FAILED, why, file);
        for (TensorInfo const& t : model->io()) {
            if (element_bytes(t.type) == 0) {
                return error(ErrorCode::kUNSUPPORTED_GRAPH,
                             "`" + t.name + "` is " + type_name(t.type) + ", which the stand-in does not run", file);
            }
        }
        network_set_model(network, stem(file), model->io(), std::move(onnx));
        return true;
    }

    bool supportsOperator(char const*) const noexcept override { return true; }
    int getNbErrors() const noexcept override { return static_cast<int>(errors_.size()); }
    nvonnxparser::IParserError const* getError(int index) const noexcept override {
        return index >= 0 && size_t(index) < errors_.size() ? errors_[size_t(index)].get() : nullptr;
    }
    void clearErrors() noexcept override { errors_.clear(); }
    void setFlags(nvonnxparser::OnnxParserFlags flags) noexcept override { flags_ = flags; }
    nvonnxparser::OnnxParserFlags getFlags() const noexcept override { return flags_; }

private:
    bool error(ErrorCode code, std::string const& desc, std::string const& file) {
        errors_.push_back(std::make_unique<ParserError>(code, desc, file));
        log(logger_, Severity::kERROR, "ONNX parser: " + (file.empty() ? "" : file + ": ") + desc);
        return false;
    }

    Network* as_network_checked() const { return is_live(network_) ? network_ : nullptr; }

    static std::string stem(std::string const& path) {
        std::string name = path.substr(path.find_last_of('/') + 1);
        size_t dot = name.rfind('.');
        return dot == std::string::npos || dot == 0 ? name : name.substr(0, dot);
    }

    Network* network_;
    ILogger* logger_;
    nvonnxparser::OnnxParserFlags flags_ = 0;
    std::vector<std::unique_ptr<ParserError>> errors_;
};

}  // namespace

}  // namespace standin

extern "C" int32_t standin_cpp_parser_version(void) { return static_cast<int32_t>(NV_ONNX_PARSER_VERSION); }

extern "C" void* standin_cpp_create_parser(void* network, void* logger, int32_t version) {
    auto* log = static_cast<nvinfer1::ILogger*>(logger);
    if (version / 10000 != NV_ONNX_PARSER_VERSION / 10000 || version > NV_ONNX_PARSER_VERSION) {
        standin::refuse(log, "createNvOnnxParser: the caller was compiled against ONNX parser headers " +
                                 std::to_string(version) + ", this parser is " + std::to_string(NV_ONNX_PARSER_VERSION));
        return nullptr;
    }
    standin::Network* ours = standin::as_network(static_cast<nvinfer1::INetworkDefinition*>(network));
    if (ours == nullptr) {
        standin::refuse(log, "createNvOnnxParser: the network was not created by this TensorRT's builder");
        return nullptr;
    }
    try {
        return static_cast<nvonnxparser::IParser*>(new standin::OnnxParser(ours, log));
    } catch (...) {
        return nullptr;
    }
}
