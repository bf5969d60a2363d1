// moecachectl inspect
#include "../verbs.h"

namespace moecache::ctl {

int cmd_inspect(const Options& o, const std::vector<std::string>& args) {
    return guarded("inspect", [&] {
        const auto a = parse_args(args, {}, {}, "inspect");
        want_positionals(a, 1, 1, "inspect", "MODEL.gguf");
        auto report = inspect_model(a.positional[0]);
        if (!report) throw Failure{kExitFailed, report.error().what()};
        if (o.json) fmt::print("{}\n", inspect_json(*report).dump(2));
        else fmt::print("{}", inspect_table(*report));
        return kExitOk;
    });
}

}  // namespace moecache::ctl
