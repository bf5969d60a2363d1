#include "moecache/process_role.h"

#include <algorithm>
#include <cstring>

namespace moecache {
namespace {

std::string_view base(std::string_view path) {
    const size_t slash = path.rfind('/');
    return slash == std::string_view::npos ? path : path.substr(slash + 1);
}

bool is_llama_server(std::string_view exe) { return base(exe).substr(0, 12) == "llama-server"; }

// "--load-mode X" or "--load-mode=X": X, else "".
std::string load_mode_arg(const std::vector<std::string>& argv) {
    std::string mode;
    for (size_t i = 1; i < argv.size(); ++i) {
        const std::string& a = argv[i];
        if ((a == "--load-mode" || a == "-lm") && i + 1 < argv.size())
            mode = argv[++i];
        else if (a.rfind("--load-mode=", 0) == 0)
            mode = a.substr(12);
        else if (a == "--no-mmap")
            mode = "none";
        else if (a == "--mmap")
            mode = "mmap";
        else if (a == "-dio" || a == "--direct-io")
            mode = "dio";
    }
    return mode;
}

bool has_model(const std::vector<std::string>& argv) {
    for (const auto& a : argv)
        if (a == "-m" || a == "--model" || a.rfind("--model=", 0) == 0 || a == "-hf" || a == "--hf-repo" ||
            a == "-mu" || a == "--model-url" || a == "--models-dir" || a == "--models-preset")
            return true;
    return false;
}

}  // namespace

ProcessRole process_role(const std::vector<std::string>& argv, const char* load_mode_env, const char* model_env) {
    ProcessRole r;
    if (argv.empty()) return r;
    r.load_mode = load_mode_arg(argv);
    if (r.load_mode.empty() && load_mode_env != nullptr) r.load_mode = load_mode_env;
    const std::string_view exe = base(argv[0]);
    const std::string_view verb = argv.size() > 1 ? std::string_view(argv[1]) : std::string_view();
    if (exe == "ollama") {
        if (verb == "serve")
            r.kind = ProcessRole::Kind::OllamaServer;
        else if (verb == "gpu-discover") {
            r.kind = ProcessRole::Kind::Probe;
            r.why = "ollama's GPU discovery (ollama gpu-discover)";
        } else if (verb == "runner") {
            r.kind = ProcessRole::Kind::OldOllamaRunner;
            r.why =
                "ollama's own runner (ollama before 0.30.0): it ignores LLAMA_ARG_*, so its experts stay where ollama "
                "places them and the hook sees no expert copies; ollama 0.30.0 or newer runs llama.cpp's server";
        }
        return r;
    }
    if (is_llama_server(exe)) {
        bool list = false;
        for (const auto& a : argv) list = list || a == "--list-devices";
        if (list) {
            r.kind = ProcessRole::Kind::Probe;
            r.why = "a device listing (llama-server --list-devices)";
        } else if (!has_model(argv) && (model_env == nullptr || *model_env == '\0')) {
            r.kind = ProcessRole::Kind::Probe;
            r.why =
                "llama-server without a model (a device probe such as ollama's discovery, or a router that starts "
                "others)";
        }
    }
    return r;
}

std::vector<std::string> split_cmdline(std::string_view text) {
    std::vector<std::string> out;
    size_t at = 0;
    while (at < text.size() && out.size() < 4096) {
        const size_t end = std::min(text.find('\0', at), text.size());
        out.emplace_back(text.substr(at, end - at));
        at = end + 1;
    }
    return out;
}

std::string private_copy_advice(const ProcessRole& role) {
    return "this runtime was started with --load-mode " + role.load_mode +
           ", so its model is read into its own memory, which moecache can neither see nor serve (ollama does so on "
           "CPU-only hosts and under host memory pressure unless the model sets use_mmap, and uses dio on integrated "
           "GPUs): keep the mapping with `PARAMETER use_mmap true` in the Modelfile (or \"use_mmap\": true in the "
           "request's options), or MOECACHE_KEEP_MAPPING=1 in the runner's environment";
}

std::string command_line_problem(const ProcessRole& role) {
    if (role.private_copy()) return private_copy_advice(role);
    return role.kind == ProcessRole::Kind::OldOllamaRunner ? role.why : "";
}

bool keep_mapping_asked(const char* asked) {
    return asked != nullptr && (std::strcmp(asked, "1") == 0 || std::strcmp(asked, "on") == 0 ||
                                std::strcmp(asked, "yes") == 0 || std::strcmp(asked, "true") == 0);
}

std::string keep_mapping(int argc, char** argv, const char* asked) {
    static char kMmap[] = "mmap";
    if (!keep_mapping_asked(asked)) return "";
    for (int i = 1; i + 1 < argc; ++i) {
        if (std::strcmp(argv[i], "--load-mode") != 0 && std::strcmp(argv[i], "-lm") != 0) continue;
        const char* v = argv[i + 1];
        if (std::strcmp(v, "none") == 0 || std::strcmp(v, "dio") == 0) {
            std::string was = v;
            argv[i + 1] = kMmap;
            return was;
        }
    }
    return "";
}

}  // namespace moecache
