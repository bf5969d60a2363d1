// What a process was started as (core/src/util/process_role.cpp): ollama's processes, llama.cpp's
// device probes and runtimes, how each loads its model, and keeping the mapping in argv.
#include "moecache/process_role.h"
#include "moecache/file_util.h"

#include <gtest/gtest.h>

#include <set>
#include <string>
#include <vector>

namespace moecache {
namespace {

using Kind = ProcessRole::Kind;

ProcessRole role(std::vector<std::string> argv, const char* load_mode = nullptr, const char* model = nullptr) {
    return process_role(argv, load_mode, model);
}

TEST(ProcessRole, OllamasProcessesAndLlamaCppsProbesAreToldApart) {
    EXPECT_EQ(role({"/usr/local/bin/ollama", "serve"}).kind, Kind::OllamaServer);
    EXPECT_EQ(role({"/usr/local/bin/ollama", "gpu-discover", "--lib-dir", "/usr/lib/ollama"}).kind, Kind::Probe);
    const auto old = role({"/usr/local/bin/ollama", "runner", "--model", "/blobs/sha256-1", "--port", "4000"});
    EXPECT_EQ(old.kind, Kind::OldOllamaRunner);
    EXPECT_NE(old.why.find("before 0.30.0"), std::string::npos) << old.why;
    EXPECT_EQ(role({"/usr/lib/ollama/llama-server", "--list-devices", "--offline", "--verbose"}).kind, Kind::Probe);
    // ollama's discovery: a server without a model, killed once it has printed its devices.
    EXPECT_EQ(
        role({"llama-server", "--port", "50000", "--host", "127.0.0.1", "--no-webui", "--offline", "--verbose"}).kind,
        Kind::Probe);
    EXPECT_EQ(role({"llama-server", "--port", "50000"}, nullptr, "/m.gguf").kind, Kind::Runtime) << "LLAMA_ARG_MODEL";
    EXPECT_EQ(role({"/usr/lib/ollama/llama-server", "--model", "/blobs/sha256-1", "--port", "4000"}).kind,
              Kind::Runtime);
    EXPECT_EQ(role({"llama-server", "-hf", "org/model"}).kind, Kind::Runtime);
    EXPECT_EQ(role({"llama-bench", "-m", "m.gguf"}).kind, Kind::Runtime);
    EXPECT_EQ(role({"python3", "serve.py"}).kind, Kind::Runtime) << "anything else may be a runtime";
    EXPECT_EQ(role({}).kind, Kind::Runtime);
}

TEST(ProcessRole, TheLoadModeComesFromTheCommandLineBeforeTheEnvironment) {
    EXPECT_EQ(role({"llama-server", "-m", "m", "--load-mode", "none"}, "mmap").load_mode, "none")
        << "ollama's argument wins";
    EXPECT_TRUE(role({"llama-server", "-m", "m", "--load-mode", "none"}).private_copy());
    EXPECT_TRUE(role({"llama-server", "-m", "m", "--load-mode=dio"}).private_copy());
    EXPECT_TRUE(role({"llama-cli", "-m", "m", "--no-mmap"}).private_copy());
    EXPECT_TRUE(role({"llama-cli", "-m", "m", "-lm", "mlock"}).private_copy());
    EXPECT_FALSE(role({"llama-cli", "-m", "m", "-lm", "mmap+mlock"}).private_copy());
    EXPECT_EQ(role({"llama-cli", "-m", "m", "--direct-io"}).load_mode, "dio");
    EXPECT_EQ(role({"llama-server", "-m", "m"}, "mmap").load_mode, "mmap");
    EXPECT_FALSE(role({"llama-server", "-m", "m"}, "mmap").private_copy());
    EXPECT_EQ(role({"llama-server", "-m", "m"}).load_mode, "");
    EXPECT_FALSE(role({"llama-server", "-m", "m", "--load-mode"}).private_copy()) << "no value: nothing said";
    const auto none = role({"llama-server", "-m", "m", "--load-mode", "none"});
    const std::string advice = private_copy_advice(none);
    EXPECT_NE(advice.find("--load-mode none"), std::string::npos) << advice;
    EXPECT_NE(advice.find("use_mmap true"), std::string::npos) << advice;
    EXPECT_NE(advice.find("MOECACHE_KEEP_MAPPING=1"), std::string::npos) << advice;
}

TEST(ProcessRole, KeepingTheMappingRewritesOnlyALoadModeOfNoneOrDio) {
    std::string a0 = "llama-server", a1 = "--load-mode", a2 = "none", a3 = "--port", a4 = "none";
    char* argv[] = {a0.data(), a1.data(), a2.data(), a3.data(), a4.data(), nullptr};
    EXPECT_EQ(keep_mapping(5, argv), "none");
    EXPECT_STREQ(argv[2], "mmap");
    EXPECT_STREQ(argv[4], "none") << "another option's value of the same word stays";
    EXPECT_EQ(keep_mapping(5, argv), "") << "nothing left to keep";
    std::string b2 = "dio";
    char* dio[] = {a0.data(), a1.data(), b2.data(), nullptr};
    EXPECT_EQ(keep_mapping(3, dio), "dio");
    EXPECT_STREQ(dio[2], "mmap");
    std::string c2 = "mlock";
    char* mlock[] = {a0.data(), a1.data(), c2.data(), nullptr};
    EXPECT_EQ(keep_mapping(3, mlock), "") << "a lock the user chose: left as asked";
    std::string d1 = "-lm";
    std::string d2 = "none";
    char* short_form[] = {a0.data(), d1.data(), d2.data(), nullptr};
    EXPECT_EQ(keep_mapping(3, short_form), "none");
    EXPECT_STREQ(short_form[2], "mmap");
    char* cut[] = {a0.data(), a1.data(), nullptr};
    EXPECT_EQ(keep_mapping(2, cut), "");
}

TEST(ProcessRole, ACommandLineIsSplitAtItsNuls) {
    using namespace std::string_literals;
    EXPECT_EQ(split_cmdline("llama-server\0-m\0/m.gguf\0"s),
              (std::vector<std::string>{"llama-server", "-m", "/m.gguf"}));
    EXPECT_EQ(split_cmdline("a\0\0b"s), (std::vector<std::string>{"a", "", "b"}));
    EXPECT_TRUE(split_cmdline("").empty());
}

}  // namespace
}  // namespace moecache

namespace moecache {
namespace {

// Which folder on the way to a configured path (a glob up to its first wildcard) is closed.
TEST(ClosedDirectory, TheFirstFolderThatCannotBeEnteredIsNamed) {
    const auto closed = [](std::set<std::string> shut) {
        return [shut](const std::string& d) { return !shut.count(d); };
    };
    const std::string blobs = "/usr/share/ollama/.ollama/models/blobs/sha256-*";
    EXPECT_EQ(first_closed_directory(blobs, closed({"/usr/share/ollama"})), "/usr/share/ollama");
    EXPECT_EQ(first_closed_directory(blobs, closed({"/usr/share/ollama/.ollama/models/blobs", "/usr/share/ollama"})),
              "/usr/share/ollama")
        << "the first on the way";
    EXPECT_EQ(first_closed_directory(blobs, closed({"/usr/share/ollama/.ollama/models/blobs"})),
              "/usr/share/ollama/.ollama/models/blobs");
    EXPECT_EQ(first_closed_directory(blobs, closed({})), "");
    EXPECT_EQ(first_closed_directory("/srv/m*/x.gguf", closed({"/srv/m1"})), "") << "below a wildcard is the glob's";
    EXPECT_EQ(first_closed_directory("/srv/m*/x.gguf", closed({"/srv"})), "/srv");
    EXPECT_EQ(first_closed_directory("relative/*.gguf", closed({"relative"})), "") << "absolute paths only";
    EXPECT_EQ(first_closed_directory("", closed({})), "");
}

}  // namespace
}  // namespace moecache
