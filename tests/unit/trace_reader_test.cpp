// Router traces read back: what moecache-tracegen writes comes back decision for decision, and a
// hostile trace is refused with the file, the line and what is wrong.
#include "temp_dir.h"

#include "moecache/sim/trace.h"
#include "moecache/tracegen/tracegen.h"

#include <gtest/gtest.h>

namespace moecache::sim {
namespace {

TEST(TraceReader, AGeneratedTraceComesBackDecisionForDecision) {
    test::TempDir dir;
    tracegen::Spec s;
    s.n_layers = 4;
    s.n_experts = 32;
    s.n_used = 4;
    s.tokens = 100;
    s.skew = {1.5, 1.0};
    auto r = tracegen::generate(s);
    ASSERT_TRUE(r);
    ASSERT_TRUE(tracegen::write_trace(*r, dir.file("t.jsonl"), "k", 1000, 20));
    auto t = read_trace(dir.file("t.jsonl"));
    ASSERT_TRUE(t) << t.error().what();
    ASSERT_EQ(t->models.size(), 1u);
    EXPECT_EQ(t->models[0].key, "k");
    EXPECT_EQ(t->models[0].n_experts, 32u);
    EXPECT_EQ(t->models[0].bytes_per_expert, std::vector<uint64_t>(4, 1000));
    ASSERT_EQ(t->decisions.size(), 400u);
    for (size_t i = 0; i < t->decisions.size(); ++i) {
        const auto& d = t->decisions[i];
        EXPECT_EQ(d.t_us, i / 4 * 20);
        EXPECT_EQ(d.layer, i % 4);
        EXPECT_EQ(d.tokens, 1u);
        const auto want = r->at(i / 4, static_cast<uint32_t>(i % 4));
        EXPECT_EQ(d.experts, std::vector<uint32_t>(want.begin(), want.end()));
    }
}

// A batch's ranking (decisions of 0 tokens right after it, moecache/batch_report.h) comes back as
// the batch's `more`, not as decisions of its own: what was routed is the batch's experts alone. A
// decision of 0 tokens after a decoded token, or in another layer, stays a decision.
TEST(TraceReader, ABatchsRankingComesBackWithTheBatch) {
    test::TempDir dir;
    const std::string p = dir.file("r.jsonl");
    test::write_file(p, R"({"moecache_trace":1,"tick_seconds":1})" "\n"
                        R"({"model":3,"key":"k","path":"","n_experts":8,"blocks":[5,7],"bytes_per_expert":[10,10]})" "\n"
                        R"({"t":0,"m":3,"b":5,"n":64,"e":[0,1,2]})" "\n"
                        R"({"t":0,"m":3,"b":5,"n":0,"e":[0,1,2,3,4]})" "\n"
                        R"({"t":0,"m":3,"b":5,"n":0,"e":[0]})" "\n"
                        R"({"t":1,"m":3,"b":7,"n":1,"e":[6]})" "\n"
                        R"({"t":1,"m":3,"b":7,"n":0,"e":[5]})" "\n");
    auto t = read_trace(p);
    ASSERT_TRUE(t) << t.error().what();
    ASSERT_EQ(t->decisions.size(), 3u);
    EXPECT_EQ(t->decisions[0].experts, (std::vector<uint32_t>{0, 1, 2}));
    EXPECT_EQ(t->decisions[0].more, (std::vector<std::vector<uint32_t>>{{0, 1, 2, 3, 4}, {0}}));
    EXPECT_TRUE(t->decisions[1].more.empty());
    EXPECT_EQ(t->decisions[2].tokens, 0u);
    EXPECT_EQ(t->decisions[2].experts, (std::vector<uint32_t>{5}));
}

TEST(TraceReader, AHostileTraceIsRefusedWithItsLineAndWhy) {
    test::TempDir dir;
    const std::string head = R"({"moecache_trace":1,"tick_seconds":1})" "\n";
    const std::string model = R"({"model":3,"key":"k","path":"","n_experts":8,"blocks":[5,7],"bytes_per_expert":[10,10]})" "\n";
    auto refused = [&](const std::string& text, const std::string& line, const std::string& what) {
        const std::string p = dir.file("bad.jsonl");
        test::write_file(p, text);
        auto t = read_trace(p);
        ASSERT_FALSE(t) << "accepted: " << text;
        EXPECT_NE(t.error().what().find(p + ":" + line + ":"), std::string::npos) << t.error().what();
        EXPECT_NE(t.error().what().find(what), std::string::npos) << t.error().what();
    };
    refused("{\"t\":0}\n", "1", "not a moecache trace");
    refused(head + model + "{\"t\":0,\"m\":3,\"b\":5,\"n\":1,\"e\":[1,2\n", "3", "not JSON");
    refused(head + "[1,2]\n", "2", "not a JSON object");
    refused(head + R"({"t":0,"m":3,"b":5,"n":1,"e":[1]})" "\n", "2", "which no line before described");
    refused(head + model + R"({"t":0,"m":3,"b":6,"n":1,"e":[1]})" "\n", "3", "not a MoE block");
    refused(head + model + R"({"t":0,"m":3,"b":7,"n":1,"e":[8]})" "\n", "3", "expert 8 is not one");
    refused(head + model + R"({"t":0,"m":3,"b":7,"n":1,"e":[-1]})" "\n", "3", "expert -1 is not one");
    refused(head + model + R"({"t":0,"m":3,"b":7,"n":1,"e":[0,1,2,3,4,5,6,7,0]})" "\n", "3", "at most 8");
    refused(head + model + R"({"t":-5,"m":3,"b":7,"n":1,"e":[1]})" "\n", "3", "\"t\" must be");
    refused(head + model + R"({"t":0,"m":3,"b":7,"n":"one","e":[1]})" "\n", "3", "\"n\" must be");
    refused(head + R"({"model":1,"n_experts":0,"blocks":[1],"bytes_per_expert":[1]})" "\n", "2", "at least 1");
    refused(head + R"({"model":1,"n_experts":4,"blocks":[1,2],"bytes_per_expert":[1]})" "\n", "2", "as long as");
    refused(head + R"({"model":1,"n_experts":99999999,"blocks":[1],"bytes_per_expert":[1]})" "\n", "2", "n_experts");
    refused(head + R"({"model":1,"n_experts":1048576,"blocks":[1,2,3,4,5],"bytes_per_expert":[1,1,1,1,1]})" "\n", "2",
            "more than the");
    refused(head + R"({"model":1,"n_experts":4,"blocks":[1],"bytes_per_expert":[18446744073709551615]})" "\n", "2",
            "byte counts up to");
    refused(head + model + R"({"model":3,"key":"k","path":"","n_experts":9,"blocks":[5,7],"bytes_per_expert":[10,10]})" "\n",
            "3", "another shape");
    // Unknown keys and blank lines are fine; the same model described twice is fine.
    test::write_file(dir.file("ok.jsonl"), head + model + "\n" + model + R"({"t":9,"m":3,"b":7,"n":2,"e":[0,7],"x":1})" "\n");
    auto ok = read_trace(dir.file("ok.jsonl"));
    ASSERT_TRUE(ok) << ok.error().what();
    ASSERT_EQ(ok->decisions.size(), 1u);
    EXPECT_EQ(ok->decisions[0].layer, 1u);
    EXPECT_EQ(ok->decisions[0].tokens, 2u);
    EXPECT_FALSE(read_trace(dir.file("missing.jsonl")));
    test::write_file(dir.file("empty.jsonl"), "");
    EXPECT_FALSE(read_trace(dir.file("empty.jsonl")));
}

}  // namespace
}  // namespace moecache::sim
