// moecachectl: thin dispatch to the verbs in src/.
#include "moecache/ctl/inspect.h"

#include <fmt/format.h>

#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

namespace {

constexpr const char* kUsage = R"(usage: moecachectl COMMAND [ARGS]

Commands:
  inspect MODEL [--json]   Show what a GGUF model holds: architecture, files, MoE layers,
                           experts per layer and per token, bytes per expert, routed-expert
                           bytes against everything else, and per layer how much of its
                           experts is in the page cache now. MODEL may be any part of a split
                           model (NAME-00002-of-00005.gguf): all parts are opened as one.
                           --json prints the stable form that scripts read (docs/inspect-json.md).
  help                     Show this text.

Exit codes: 0 done, 1 the command failed (the message says why), 2 bad usage.
)";

int usage_error(const std::string& msg) {
    fmt::print(stderr, "moecachectl: {}\n(see 'moecachectl help')\n", msg);
    return 2;
}

int cmd_inspect(const std::vector<std::string>& args) {
    std::string model;
    bool json = false;
    for (const auto& a : args) {
        if (a == "--json") json = true;
        else if (a == "-h" || a == "--help") { fmt::print("{}", kUsage); return 0; }
        else if (!a.empty() && a[0] == '-') return usage_error(fmt::format("inspect: unknown option '{}'", a));
        else if (model.empty()) model = a;
        else return usage_error("inspect takes one MODEL");
    }
    if (model.empty()) return usage_error("inspect needs a MODEL (a .gguf file)");
    auto report = moecache::ctl::inspect_model(model);
    if (!report) {
        fmt::print(stderr, "moecachectl: inspect: {}\n", report.error().what());
        return 1;
    }
    if (json)
        fmt::print("{}\n", moecache::ctl::inspect_json(*report).dump(2));
    else
        fmt::print("{}", moecache::ctl::inspect_table(*report));
    return 0;
}

}  // namespace

int main(int argc, char** argv) {
    if (argc < 2) return usage_error("a COMMAND is needed");
    const std::string cmd = argv[1];
    std::vector<std::string> args(argv + 2, argv + argc);
    if (cmd == "help" || cmd == "-h" || cmd == "--help") {
        fmt::print("{}", kUsage);
        return 0;
    }
    if (cmd == "inspect") return cmd_inspect(args);
    return usage_error(fmt::format("unknown command '{}'", cmd));
}
