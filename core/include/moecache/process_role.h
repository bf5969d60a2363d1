// What a process was started as, from its command line: what moecache's preloaded libraries do in
// it, and what the daemon says of a client. A preload reaches every process its environment reaches:
// ollama's server, its GPU discovery (`llama-server --list-devices`, a model-less `llama-server`,
// `ollama gpu-discover`) and its model runner alike. Only a runtime with a model gets a pool and a
// daemon link; a probe is left alone (no VRAM claimed, nothing said to the daemon).
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace moecache {

struct ProcessRole {
    enum class Kind {
        Runtime,          // runs a model (or may: anything not known to be one of the others)
        Probe,            // a device listing or discovery run: no model
        OllamaServer,     // `ollama serve`: starts the runners, makes no CUDA calls of its own
        OldOllamaRunner,  // `ollama runner`: ollama before 0.30.0, which ignores LLAMA_ARG_*
    };
    Kind kind = Kind::Runtime;
    // How a llama.cpp runtime loads its model: "--load-mode VALUE" or "-lm VALUE" (none, mmap, mlock,
    // mmap+mlock, dio) on its command line, else LLAMA_ARG_LOAD_MODE; --no-mmap, --mmap and
    // --direct-io as the modes they stand for; "" when nothing says (llama.cpp's default maps).
    std::string load_mode;
    std::string why;  // one line: what it is, for Probe and OldOllamaRunner
    // The model is read into the runtime's own memory: moecache can neither see nor serve it.
    [[nodiscard]] bool private_copy() const {
        return load_mode == "none" || load_mode == "dio" || load_mode == "mlock";
    }
};

// `argv` as the process has it; `load_mode_env` and `model_env`: LLAMA_ARG_LOAD_MODE and
// LLAMA_ARG_MODEL (null: unset).
ProcessRole process_role(const std::vector<std::string>& argv, const char* load_mode_env, const char* model_env);

// The NUL-separated text of /proc/PID/cmdline as arguments (at most 4096 of them).
std::vector<std::string> split_cmdline(std::string_view text);

// Why a runtime loads its model into private memory, and what keeps the mapping: one line naming
// ollama's reasons (it turns mmap off on CPU-only hosts and under host memory pressure unless the
// model sets use_mmap, and reads with dio on integrated GPUs).
std::string private_copy_advice(const ProcessRole& role);

// Why moecache cannot help a process, from its command line ("" when nothing is wrong): a model read
// into private memory (private_copy_advice), or ollama's old runner.
std::string command_line_problem(const ProcessRole& role);

// MOECACHE_KEEP_MAPPING=1: turns `--load-mode none|dio` (or -lm) on a runtime's command line into
// `--load-mode mmap` in place (argv's pointers, before main reads them); returns what it replaced
// ("" for nothing). A preload's constructor calls it: ollama passes --load-mode none itself, and a
// command-line argument wins over LLAMA_ARG_LOAD_MODE. `mlock` (read into locked memory) is left as
// asked: mapping it would drop a lock the user chose.
// `asked`: MOECACHE_KEEP_MAPPING's value; anything but 1, on, yes or true (or unset) rewrites nothing.
std::string keep_mapping(int argc, char** argv, const char* asked = "1");
[[nodiscard]] bool keep_mapping_asked(const char* asked);

}  // namespace moecache
