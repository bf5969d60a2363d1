// moecachectl's verbs. Each takes its arguments (after the verb) and the global options, prints
// a table for people or JSON for scripts, and returns the exit code (see kExit*).
#pragma once

#include <string>
#include <vector>

namespace moecache::ctl {

// Exit codes, the same for every verb.
inline constexpr int kExitOk = 0;
inline constexpr int kExitFailed = 1;        // the daemon refused or the work failed: the message says why
inline constexpr int kExitUsage = 2;         // bad usage or a bad argument
inline constexpr int kExitUnreachable = 3;   // no moecached on the bus (not running, no bus)
inline constexpr int kExitDenied = 4;        // not allowed: changes need root or the admin group
inline constexpr int kExitNotFound = 5;      // no such model (or expert, or trace)

struct Options {
    std::string bus = "system";  // "system", "session" or a D-Bus address
    bool json = false;
    bool progress = true;        // draw progress on a terminal (prefetch)
};

struct Command {
    const char* name;
    const char* args;     // the synopsis after the name
    const char* summary;  // one line
    const char* help;     // what `moecachectl help NAME` adds
    int (*run)(const Options&, const std::vector<std::string>&);
};

// Every verb, in the order `help` lists them.
const std::vector<Command>& commands();
const Command* find_command(const std::string& name);

// The completion scripts (moecachectl completion bash|zsh|fish), made from the verb table.
std::string bash_completion();
std::string zsh_completion();
std::string fish_completion();

int usage_error(const std::string& message);

}  // namespace moecache::ctl
