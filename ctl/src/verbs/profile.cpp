// moecachectl profile
#include "../verbs.h"

namespace moecache::ctl {

namespace {

// The bus carries at most 32 MiB in a call (dbus-daemon's max_message_size on the system bus); a
// larger file is no profile of a model moecached could hold, and the bus would only drop the
// connection. Read no further than that (a device or a pipe may never end).
constexpr size_t kMaxImport = 32u << 20;

std::string read_input(const std::string& file) {
    std::ifstream f;
    std::istream* in = &std::cin;
    if (file != "-") {
        f.open(file, std::ios::binary);
        if (!f) throw Failure{kExitFailed, fmt::format("cannot read {}: {}", file, std::strerror(errno))};
        in = &f;
    }
    std::string text(kMaxImport + 1, '\0');
    in->read(text.data(), static_cast<std::streamsize>(text.size()));
    text.resize(static_cast<size_t>(in->gcount()));
    if (text.size() > kMaxImport)
        throw Failure{kExitUsage, fmt::format("{} is larger than {} MiB: a heat profile sent over D-Bus is at most that "
                                              "(one exported by moecachectl is far smaller)", file, kMaxImport >> 20)};
    return text;
}

}  // namespace

int cmd_profile(const Options& o, const std::vector<std::string>& args) {
    return guarded("profile", [&] {
        const auto a = parse_args(args, {}, {}, "profile");
        if (a.positional.size() < 2 || (a.positional[0] != "export" && a.positional[0] != "import"))
            throw Failure{kExitUsage, "usage: moecachectl profile export MODEL [FILE] | profile import MODEL FILE"};
        const bool exp = a.positional[0] == "export";
        if ((exp && a.positional.size() > 3) || (!exp && a.positional.size() != 3))
            throw Failure{kExitUsage, "usage: moecachectl profile export MODEL [FILE] | profile import MODEL FILE"};
        auto conn = connect(o);
        ManagerProxy mgr(*conn);
        const auto ref = resolve_model(mgr, a.positional[1]);
        ModelProxy model(*conn, ref.object);
        if (exp) {
            const std::string text = model.ExportProfile();
            if (a.positional.size() == 2 || a.positional[2] == "-") {
                fmt::print("{}\n", text);
                return kExitOk;
            }
            const std::string& path = a.positional[2];
            std::ofstream f(path, std::ios::binary | std::ios::trunc);
            if (!(f << text << "\n") || !f.flush())
                throw Failure{kExitFailed, fmt::format("cannot write {}: {}", path, std::strerror(errno))};
            if (o.json) print_json({{"model", ref.id}, {"file", path}, {"bytes", text.size() + 1}});
            else fmt::print("heat profile of {} written to {}\n", ref.path, path);
            return kExitOk;
        }
        const std::string text = read_input(a.positional[2]);
        model.ImportProfile(text);
        if (o.json) print_json({{"model", ref.id}, {"imported", a.positional[2]}});
        else fmt::print("heat profile {} imported into {}\n", a.positional[2], ref.path);
        return kExitOk;
    });
}

}  // namespace moecache::ctl
