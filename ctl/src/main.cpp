// moecachectl: global options, then thin dispatch to the verbs in commands.cpp.
#include "moecache/build_info.h"
#include "moecache/ctl/commands.h"

#include <cstdlib>
#include <cstdio>
#include <string>
#include <vector>

int main(int argc, char** argv) {
    using namespace moecache::ctl;
    Options o;
    if (const char* bus = std::getenv("MOECACHE_BUS"); bus && *bus) o.bus = bus;
    // Global options may come anywhere (before or after the verb); the rest is the verb's.
    std::vector<std::string> rest;
    for (int i = 1; i < argc; ++i) {
        const std::string a = argv[i];
        if (a == "--json") o.json = true;
        else if (a == "--no-progress") o.progress = false;
        else if (a == "--bus") {
            if (i + 1 >= argc) return usage_error("--bus needs a value: system, session or an address");
            o.bus = argv[++i];
        } else if (a.rfind("--bus=", 0) == 0) o.bus = a.substr(6);
        else if (a == "-h" || a == "--help") rest.insert(rest.begin(), "help");
        else if (a == "--version") {
            std::printf("moecachectl %s\n", moecache::version_line().c_str());
            return 0;
        }
        else rest.push_back(a);
    }
    if (rest.empty()) return usage_error("a COMMAND is needed");
    const Command* c = find_command(rest[0]);
    if (!c) return usage_error("unknown command '" + rest[0] + "'");
    return c->run(o, std::vector<std::string>(rest.begin() + 1, rest.end()));
}
