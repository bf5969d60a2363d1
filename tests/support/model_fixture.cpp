#include "model_fixture.h"

#include <stdexcept>

namespace moecache::test {

std::vector<std::string> write_model(const mkmodel::ModelSpec& spec, const std::string& path, uint32_t splits,
                                     uint32_t alignment) {
    mkmodel::GgufWriter w;
    if (auto r = mkmodel::build_model(spec, w); !r) throw std::runtime_error(r.error().what());
    mkmodel::WriteOptions opt;
    opt.splits = splits;
    opt.alignment = alignment;
    auto files = w.write(path, opt);
    if (!files) throw std::runtime_error(files.error().what());
    std::vector<std::string> out;
    for (const auto& f : *files) out.push_back(f.path);
    return out;
}

mkmodel::ModelSpec small_spec() {
    mkmodel::ModelSpec s;
    s.n_layers = 4;
    s.n_experts = 16;
    s.n_experts_used = 2;
    s.n_embd = 256;
    s.n_ff_exp = 256;
    s.n_vocab = 2048;
    return s;
}

}  // namespace moecache::test
