// The ggml type table (core's ggml_type.cpp) against the ggml.h that node-llama-cpp ships in its
// llama.cpp release (llama/gitRelease.bundle): every type ggml has is known here by its id and
// name, every type it retired is named as retired, and no type here is one ggml does not have.
#include "moecache/ggml_type.h"
#include "run.h"
#include "temp_dir.h"

#include <gtest/gtest.h>

#include <unistd.h>

#include <cctype>
#include <map>
#include <regex>
#include <sstream>

namespace moecache {
namespace {

std::string upper(std::string s) {
    for (auto& c : s) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
    return s;
}

TEST(GgmlTypes, TheTableAgreesWithTheGgmlThatNodeLlamaCppShips) {
    const std::string bundle = std::string(MOECACHE_NODE_DIR) + "/node_modules/node-llama-cpp/llama/gitRelease.bundle";
    if (::access(bundle.c_str(), R_OK) != 0)
        GTEST_SKIP() << "node-llama-cpp is not installed (no " << bundle
                     << "): the README's test command installs it; its ggml.h is what the table is checked against";
    test::TempDir dir;
    const std::string repo = dir.file("ggml");
    ASSERT_EQ(test::run({"/usr/bin/git", "init", "-q", repo}).exit_code, 0);
    const auto fetched = test::run({"/usr/bin/git", "-C", repo, "fetch", "-q", bundle});
    ASSERT_EQ(fetched.exit_code, 0) << fetched.err;
    const auto header = test::run({"/usr/bin/git", "-C", repo, "show", "FETCH_HEAD:ggml/include/ggml.h"});
    ASSERT_EQ(header.exit_code, 0) << header.err;

    const std::regex active(R"(^\s*GGML_TYPE_(\w+)\s*=\s*(\d+)\s*,)");
    const std::regex retired(R"(^\s*//\s*GGML_TYPE_(\w+)\s*=\s*(\d+)\s*,)");
    std::map<uint32_t, std::string> have, gone;
    std::istringstream in(header.out);
    for (std::string line; std::getline(in, line);) {
        std::smatch m;
        if (std::regex_search(line, m, active) && m[1] != "COUNT")
            have[static_cast<uint32_t>(std::stoul(m[2]))] = m[1];
        else if (std::regex_search(line, m, retired))
            gone[static_cast<uint32_t>(std::stoul(m[2]))] = m[1];
    }
    ASSERT_GE(have.size(), 30u) << "ggml.h's enum ggml_type was not found where it was:\n" << header.out.substr(0, 400);
    for (const auto& [id, name] : have) {
        const auto info = ggml_type_info(id);
        ASSERT_TRUE(info) << "ggml type " << id << " (" << name << ") is missing from core/src/gguf/ggml_type.cpp";
        EXPECT_EQ(upper(std::string(info->name)), upper(name)) << "type " << id;
    }
    for (const auto& [id, name] : gone) {
        const auto r = ggml_retired_type_name(id);
        ASSERT_TRUE(r) << "ggml retired type " << id << " (" << name << "): not named as retired";
        EXPECT_EQ(upper(std::string(*r)), upper(name)) << "retired type " << id;
    }
    for (const auto& t : ggml_known_types())
        EXPECT_TRUE(have.count(t.id)) << "type " << t.id << " (" << t.name << ") is not one this ggml has";
}

}  // namespace
}  // namespace moecache
