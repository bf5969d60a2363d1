// moecachectl experts
#include "../verbs.h"

namespace moecache::ctl {

int cmd_experts(const Options& o, const std::vector<std::string>& args) {
    return guarded("experts", [&] {
        const auto a = parse_args(args, {}, {"--top"}, "experts");
        want_positionals(a, 1, 1, "experts", "MODEL [--top N]");
        uint32_t top = 20;
        if (a.opts.count("--top")) {
            const std::string& v = a.opts.at("--top");
            if (v.empty() || v.size() > 9 || !std::all_of(v.begin(), v.end(), ::isdigit))
                throw Failure{kExitUsage, fmt::format("--top '{}': a count (0: all)", v)};
            top = static_cast<uint32_t>(std::stoul(v));
        }
        auto conn = connect(o);
        ManagerProxy mgr(*conn);
        const auto ref = resolve_model(mgr, a.positional[0]);
        ModelProxy model(*conn, ref.object);
        const auto experts = model.Experts(top);
        if (o.json) {
            json j = json::array();
            for (const auto& e : experts)
                j.push_back({{"block", e.get<0>()}, {"expert", e.get<1>()}, {"tier", e.get<2>()}, {"heat", e.get<3>()},
                             {"uses", e.get<4>()}, {"bytes", e.get<5>()}, {"cached_bytes", e.get<6>()},
                             {"locked_bytes", e.get<7>()}, {"pinned", e.get<8>()}, {"vram_pools", e.get<9>()}});
            print_json(j);
            return kExitOk;
        }
        Table t({"BLOCK", "EXPERT", "TIER", "HEAT", "USES", "SIZE", "CACHED", "PINNED", "VRAM"}, "rr rrrr r");
        for (const auto& e : experts)
            t.add({std::to_string(e.get<0>()), std::to_string(e.get<1>()), e.get<2>(), fmt::format("{:.2f}", e.get<3>()),
                   std::to_string(e.get<4>()), format_bytes(e.get<5>()), percent(e.get<6>(), e.get<5>()), e.get<8>() ? "yes" : "",
                   e.get<9>() ? std::to_string(e.get<9>()) : ""});
        fmt::print("{}", t.render());
        return kExitOk;
    });
}

}  // namespace moecache::ctl
