// moecachectl's verb table, help and completion for bash, zsh and fish; the verbs themselves are in verbs/.
#include "verbs.h"

#include <algorithm>
#include <iterator>
#include <string_view>

namespace moecache::ctl {
namespace {

int cmd_completion(const Options&, const std::vector<std::string>& args) {
    if (args.size() != 1) return usage_error("usage: moecachectl completion bash|zsh|fish");
    if (args[0] == "bash")
        fmt::print("{}", bash_completion());
    else if (args[0] == "zsh")
        fmt::print("{}", zsh_completion());
    else if (args[0] == "fish")
        fmt::print("{}", fish_completion());
    else
        return usage_error("usage: moecachectl completion bash|zsh|fish");
    return kExitOk;
}

int cmd_help(const Options&, const std::vector<std::string>& args);

const std::vector<Command> kCommands = {
    {"status", "[--http HOST:PORT]",
     "the daemon at a glance, and whether it helps: per model, where routed experts were, storage read a token",
     "Reads org.moecache1.Manager.GetStatus. --json prints every key (docs/dbus.md). \"is it helping?\" has a line\n"
     "per model (helping: where the experts its runtime routed in decode were, VRAM / RAM / storage, and what the\n"
     "runtime read from storage a token; idle; blind: no runtime reports its routing; cannot help, and why) and one\n"
     "per reason that holds for the daemon (the VRAM pools' savings per GPU, a slow miss path, runtimes without a\n"
     "mapping of the model, memory pressure).\n"
     "Without D-Bus (a container, the bundle) it reads moecached's /status over HTTP instead: --http names the\n"
     "address ([metrics] listen), else MOECACHE_METRICS, else 127.0.0.1:8474.",
     cmd_status},
    {"models", "", "the models moecached manages, with how much of their experts is cached and locked",
     "CACHED and LOCKED are shares of the routed experts' bytes; IN VRAM counts experts a CUDA hook's pool holds.",
     cmd_models},
    {"inspect", "MODEL.gguf",
     "what a GGUF file holds: MoE layers, experts, bytes, what is cached now (no daemon needed)",
     "MODEL may be any part of a split model (NAME-00002-of-00005.gguf): all parts are opened as one.\n"
     "--json prints the stable form scripts read (docs/inspect-json.md).",
     cmd_inspect},
    {"experts", "MODEL [--top N]", "the hottest experts of a model and where each one lives",
     "TIER: ram (locked by moecached), vram (held by a CUDA hook's pool), vram+ram (both), fetching, ssd.\n"
     "HEAT is decayed use; --top 0 lists every expert.",
     cmd_experts},
    {"budget", "[lock|reserve|MODEL AMOUNT]", "show the budgets, or set one (until restart or reload)",
     "AMOUNT: \"48GiB\", \"512MiB\", \"60%\" (of RAM). lock bounds all locked bytes; reserve is RAM never\n"
     "locked; a model's own budget bounds that model (\"none\" removes it). To keep a change, write it\n"
     "in /etc/moecache/moecached.toml.",
     cmd_budget},
    {"pin", "MODEL EXPERTS...", "always keep these experts in RAM (within budgets)",
     "EXPERTS: \"12\" (every expert of block 12), \"12:3\" (expert 3), \"12:0-7\" (experts 0 to 7), as\n"
     "[[model]] pin in the configuration, which is where a pin survives a restart.",
     cmd_pin},
    {"unpin", "MODEL EXPERTS...", "let the policy decide for these experts again", "EXPERTS as for pin.", cmd_unpin},
    {"prefetch", "MODEL [EXPERTS...] [--no-wait]", "read experts from storage into RAM now, hottest first",
     "Without EXPERTS: every expert of the model. Waits until read, with a progress bar on a terminal;\n"
     "--no-wait returns once queued, --timeout S bounds the wait. Prefetched pages are cached, not\n"
     "locked: the policy locks what is hot.",
     cmd_prefetch},
    {"wait", "MODEL [--timeout S] [--settle S]", "wait until the model's placement is done (a runtime's readiness)",
     "Returns once nothing of the model is being read from storage and every VRAM pool serving it holds\n"
     "what moecached directed it to keep, and that has held for --settle seconds (2): a warm start, or\n"
     "the decode model after a prompt model of its family, is then in place before the first request.\n"
     "Exit 1 after --timeout seconds (300), saying what is still pending.",
     cmd_wait},
    {"evict", "MODEL (EXPERTS...|--all)", "unlock experts and drop them from RAM",
     "Pinned experts are refused (unpin first); with --all they are skipped. The policy brings back\n"
     "what stays hot.",
     cmd_evict},
    {"profile", "export MODEL [FILE] | import MODEL FILE", "save or load a model's heat (which experts are hot)",
     "A profile is JSON; '-' is standard output or input. moecached saves profiles itself in\n"
     "/var/lib/moecache/profiles and starts warm from them; export and import move heat between\n"
     "machines or keep a known-good one.",
     cmd_profile},
    {"trace", "start FILE | stop", "record every router decision moecached receives, for replay",
     "FILE is created by moecachectl (as you) and handed to the daemon, which appends JSON lines to it\n"
     "(docs/trace.md) until 'trace stop'. One trace at a time.",
     cmd_trace},
    {"register", "PATH", "start managing a GGUF file (until unregister or restart)",
     "For good, add a [[model]] table to the configuration instead.", cmd_register},
    {"unregister", "MODEL", "stop managing a model registered with 'register'",
     "Configured models go by removing them from the configuration (and systemctl reload moecached);\n"
     "models a runtime registered go with the runtime.",
     cmd_unregister},
    {"completion", "bash|zsh|fish", "print the completion script for a shell",
     "Installed for bash (/usr/share/bash-completion/completions/moecachectl), zsh\n"
     "(/usr/share/zsh/vendor-completions/_moecachectl) and fish "
     "(/usr/share/fish/vendor_completions.d/moecachectl.fish);\n"
     "or: source <(moecachectl completion bash), moecachectl completion fish | source, and for zsh\n"
     "moecachectl completion zsh > ~/.zfunc/_moecachectl with ~/.zfunc in fpath.",
     cmd_completion},
    {"help", "[COMMAND]", "this text, or more about one command", "", cmd_help},
};

int cmd_help(const Options&, const std::vector<std::string>& args) {
    if (!args.empty()) {
        const Command* c = find_command(args[0]);
        if (!c) return usage_error(fmt::format("no command '{}'", args[0]));
        fmt::print("usage: moecachectl {} {}\n\n{}.\n", c->name, c->args, c->summary);
        if (*c->help) fmt::print("\n{}\n", c->help);
        return kExitOk;
    }
    fmt::print("usage: moecachectl [--json] [--bus BUS] COMMAND [ARGS]\n\n"
               "Controls moecached, which keeps the hot experts of Mixture-of-Experts models in RAM and VRAM.\n"
               "Reading is open to everyone; changes need root or the group moecache.\n\nCommands:\n");
    for (const auto& c : kCommands) fmt::print("  {:<12} {}\n", c.name, c.summary);
    fmt::print("\nOptions:\n"
               "  --json        print JSON for scripts instead of tables\n"
               "  --bus BUS     system (default), session, or a D-Bus address (unix:path=...); also $MOECACHE_BUS\n"
               "  --no-progress no progress bar\n\n"
               "'moecachectl help COMMAND' tells more about one. Exit codes: 0 done, 1 failed (the message says\n"
               "why), 2 bad usage or argument, 3 moecached not reachable, 4 not allowed, 5 no such model.\n");
    return kExitOk;
}

}  // namespace

int usage_error(const std::string& message) {
    fmt::print(stderr, "moecachectl: {}\n(see 'moecachectl help')\n", message);
    return kExitUsage;
}

const std::vector<Command>& commands() { return kCommands; }

const Command* find_command(const std::string& name) {
    for (const auto& c : kCommands)
        if (name == c.name) return &c;
    return nullptr;
}

std::string bash_completion() {
    std::string verbs;
    for (const auto& c : kCommands) verbs += std::string(verbs.empty() ? "" : " ") + c.name;
    return fmt::format(R"BASH(# bash completion for moecachectl
_moecachectl_models() {{
    moecachectl --json models 2>/dev/null | sed -n 's/^ *"path": "\(.*\)",*$/\1/p'
}}
_moecachectl() {{
    local cur prev words cword
    _init_completion 2>/dev/null || {{ cur=${{COMP_WORDS[COMP_CWORD]}}; prev=${{COMP_WORDS[COMP_CWORD-1]}}; words=("${{COMP_WORDS[@]}}"); cword=$COMP_CWORD; }}
    local verbs="{}"
    local i verb="" n=0
    for ((i = 1; i < cword; i++)); do
        case "${{words[i]}}" in
            --bus) ((i++)) ;;
            -*) ;;
            *) if [[ -z $verb ]]; then verb=${{words[i]}}; else ((n++)); fi ;;
        esac
    done
    if [[ $prev == --bus ]]; then COMPREPLY=($(compgen -W "system session" -- "$cur")); return; fi
    if [[ -z $verb ]]; then COMPREPLY=($(compgen -W "$verbs --json --bus --no-progress" -- "$cur")); return; fi
    case $verb in
        inspect|register) COMPREPLY=($(compgen -f -X '!*.gguf' -- "$cur") $(compgen -d -- "$cur")) ;;
        experts|pin|unpin|prefetch|wait|evict|unregister)
            if ((n == 0)); then COMPREPLY=($(compgen -W "$(_moecachectl_models)" -- "$cur"));
            else case $verb in
                experts) COMPREPLY=($(compgen -W "--top" -- "$cur")) ;;
                evict) COMPREPLY=($(compgen -W "--all" -- "$cur")) ;;
                prefetch) COMPREPLY=($(compgen -W "--no-wait --timeout" -- "$cur")) ;;
                wait) COMPREPLY=($(compgen -W "--timeout --settle" -- "$cur")) ;;
            esac; fi ;;
        budget) if ((n == 0)); then COMPREPLY=($(compgen -W "lock reserve $(_moecachectl_models)" -- "$cur")); fi ;;
        profile)
            if ((n == 0)); then COMPREPLY=($(compgen -W "export import" -- "$cur"));
            elif ((n == 1)); then COMPREPLY=($(compgen -W "$(_moecachectl_models)" -- "$cur"));
            else COMPREPLY=($(compgen -f -- "$cur")); fi ;;
        trace) if ((n == 0)); then COMPREPLY=($(compgen -W "start stop" -- "$cur")); else COMPREPLY=($(compgen -f -- "$cur")); fi ;;
        completion) COMPREPLY=($(compgen -W "bash zsh fish" -- "$cur")) ;;
        status) COMPREPLY=($(compgen -W "--http" -- "$cur")) ;;
        help) COMPREPLY=($(compgen -W "$verbs" -- "$cur")) ;;
    esac
}}
complete -F _moecachectl moecachectl
)BASH",
                       verbs);
}

namespace {

// Text inside a shell's single quotes: each ' closed, escaped and reopened.
std::string single_quoted(std::string_view text, std::string_view quote_escape) {
    std::string out;
    for (char c : text) {
        if (c == '\'')
            out += quote_escape;
        else
            out += c;
    }
    return out;
}

// The verbs that take a model first, and the options verbs take ("--name", or "--name=" where it
// takes a value).
constexpr std::string_view kModelVerbs[] = {"experts", "pin", "unpin", "prefetch", "wait", "evict", "unregister"};
bool is_model_verb(std::string_view verb) {
    return std::find(std::begin(kModelVerbs), std::end(kModelVerbs), verb) != std::end(kModelVerbs);
}
struct VerbOptions {
    std::string_view verb;
    std::vector<std::string_view> options;
};
const std::vector<VerbOptions> kVerbOptions = {
    {"status", {"--http="}},
    {"experts", {"--top="}},
    {"evict", {"--all"}},
    {"prefetch", {"--no-wait", "--timeout="}},
    {"wait", {"--timeout=", "--settle="}},
};

}  // namespace

std::string zsh_completion() {
    std::string verbs, options;
    for (const auto& c : kCommands) verbs += fmt::format("    '{}:{}'\n", c.name, single_quoted(c.summary, "'\\''"));
    for (const auto& v : kVerbOptions) {
        // Here the model verbs' options (status, no model verb, has its own line below).
        if (!is_model_verb(v.verb)) continue;
        std::string specs;
        for (std::string_view o : v.options)
            specs += o.back() == '='
                         ? fmt::format(" '{}[{}]:value:'", o.substr(0, o.size() - 1), o.substr(2, o.size() - 3))
                         : fmt::format(" '{}'", o);
        options += fmt::format("        {}) _arguments{} ;;\n", v.verb, specs);
    }
    const std::string model_verbs = fmt::format("{}", fmt::join(kModelVerbs, "|"));
    return fmt::format(R"ZSH(#compdef moecachectl
# zsh completion for moecachectl (moecachectl completion zsh)
_moecachectl_models() {{
    local -a models
    models=(${{(f)"$(moecachectl --json models 2>/dev/null | sed -n 's/^ *"path": "\(.*\)",*$/\1/p')"}})
    compadd -a models
}}
_moecachectl() {{
    local -a verbs
    verbs=(
{}    )
    local state
    _arguments -C \
        '--json[print JSON for scripts]' \
        '--bus[the D-Bus bus moecached is on]:bus:(system session)' \
        '--no-progress[no progress bars]' \
        '1: :->verb' \
        '*:: :->args'
    case $state in
    verb) _describe -t commands 'moecachectl command' verbs ;;
    args)
        case $words[1] in
        inspect|register) _files -g '*.gguf' ;;
        {})
            if (( CURRENT == 2 )); then _moecachectl_models
            else case $words[1] in
{}            esac; fi ;;
        budget) (( CURRENT == 2 )) && {{ compadd lock reserve; _moecachectl_models }} ;;
        profile) case $CURRENT in 2) compadd export import ;; 3) _moecachectl_models ;; *) _files ;; esac ;;
        trace) (( CURRENT == 2 )) && compadd start stop || _files ;;
        completion) compadd bash zsh fish ;;
        status) _arguments '--http[moecached'\''s metrics address, without D-Bus]:HOST\:PORT:' ;;
        help) _describe -t commands 'moecachectl command' verbs ;;
        esac ;;
    esac
}}
_moecachectl "$@"
)ZSH",
                       verbs, model_verbs, options);
}

std::string fish_completion() {
    std::string out = R"FISH(# fish completion for moecachectl (moecachectl completion fish)
function __moecachectl_models
    moecachectl --json models 2>/dev/null | string match -r -g '^\s*"path": "(.*)",?$'
end
complete -c moecachectl -f
complete -c moecachectl -l json -d 'print JSON for scripts'
complete -c moecachectl -l bus -x -a 'system session' -d 'the D-Bus bus moecached is on'
complete -c moecachectl -l no-progress -d 'no progress bars'
)FISH";
    std::string all;
    for (const auto& c : kCommands) {
        out += fmt::format("complete -c moecachectl -n __fish_use_subcommand -a {} -d '{}'\n", c.name,
                           single_quoted(c.summary, "\\'"));
        all += std::string(all.empty() ? "" : " ") + c.name;
    }
    out += fmt::format("complete -c moecachectl -n '__fish_seen_subcommand_from {}' -a '(__moecachectl_models)'\n",
                       fmt::join(kModelVerbs, " "));
    out += "complete -c moecachectl -n '__fish_seen_subcommand_from inspect register' -F\n";
    out += "complete -c moecachectl -n '__fish_seen_subcommand_from budget' -a 'lock reserve (__moecachectl_models)'\n";
    out +=
        "complete -c moecachectl -n '__fish_seen_subcommand_from profile' -a 'export import (__moecachectl_models)' "
        "-F\n";
    out += "complete -c moecachectl -n '__fish_seen_subcommand_from trace' -a 'start stop' -F\n";
    out += "complete -c moecachectl -n '__fish_seen_subcommand_from completion' -a 'bash zsh fish'\n";
    out += fmt::format("complete -c moecachectl -n '__fish_seen_subcommand_from help' -a '{}'\n", all);
    for (const auto& v : kVerbOptions)
        for (std::string_view o : v.options) {
            const bool value = o.back() == '=';
            const auto name = o.substr(2, o.size() - 2 - (value ? 1 : 0));
            out += fmt::format("complete -c moecachectl -n '__fish_seen_subcommand_from {}' -l {}{}\n", v.verb, name,
                               value ? " -x" : "");
        }
    return out;
}

}  // namespace moecache::ctl
