// The route probe's pure parts: reading /proc/PID/maps text, planning sentinels and VMA cuts, and
// the routing statistics. Maps text and expert maps are built here; nothing touches /proc.
#include "moecache/process_maps.h"
#include "moecache/routeprobe/routing_stats.h"
#include "moecache/routeprobe/sentinel_plan.h"

#include "temp_dir.h"

#include <gtest/gtest.h>

#include <sys/stat.h>
#include <sys/sysmacros.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <string>
#include <vector>

namespace moecache::routeprobe {
namespace {

// ---- /proc/PID/maps ----------------------------------------------------------------------

constexpr InodeId kModel{0xfe, 0x01, 1234567};

TEST(ProcessMaps, ReadsAllFieldsOfAFileLine) {
    const auto found = find_mappings("7f12a000-7f12c000 r--s 00001000 fe:01 1234567   /models/m.gguf\n", kModel);
    ASSERT_EQ(found.size(), 1u);
    EXPECT_EQ(found[0].start, 0x7f12a000u);
    EXPECT_EQ(found[0].end, 0x7f12c000u);
    EXPECT_EQ(found[0].file_offset, 0x1000u);
    EXPECT_EQ(found[0].perms, "r--s");
}

TEST(ProcessMaps, FullWidthAddressesAndLargeOffsets) {
    const auto found = find_mappings(
        "7fffd0000000-7fffe0001000 r--p 1f0000000 fe:01 1234567 /m.gguf\n", kModel);
    ASSERT_EQ(found.size(), 1u);
    EXPECT_EQ(found[0].start, uintptr_t{0x7fffd0000000});
    EXPECT_EQ(found[0].end, uintptr_t{0x7fffe0001000});
    EXPECT_EQ(found[0].file_offset, uint64_t{0x1f0000000});
}

TEST(ProcessMaps, PathsWithSpacesAndDeletedFilesAreFoundByInode) {
    const std::string maps =
        "10000-11000 r--p 00000000 fe:01 1234567   /home/a user/my models/m.gguf\n"
        "20000-22000 r--s 00002000 fe:01 1234567   /tmp/m.gguf (deleted)\n"
        "30000-31000 r--p 00000000 fe:01 1234567\n";  // no path at all
    const auto found = find_mappings(maps, kModel);
    ASSERT_EQ(found.size(), 3u);
    EXPECT_EQ(found[0].start, 0x10000u);
    EXPECT_EQ(found[1].start, 0x20000u);
    EXPECT_EQ(found[1].file_offset, 0x2000u);
    EXPECT_EQ(found[2].start, 0x30000u);
}

TEST(ProcessMaps, DeviceNumbersAreHexAndInodesDecimal) {
    // NVMe partitions sit on major 259 = 0x103; the kernel prints "%02x:%02x".
    const std::string line = "10000-11000 r--p 00000000 103:0a 4096 /m.gguf\n";
    EXPECT_EQ(find_mappings(line, InodeId{259, 10, 4096}).size(), 1u);
    EXPECT_TRUE(find_mappings(line, InodeId{103, 10, 4096}).empty()) << "device read as decimal";
    EXPECT_TRUE(find_mappings(line, InodeId{259, 10, 0x4096}).empty()) << "inode read as hex";
}

TEST(ProcessMaps, OtherFilesAndAnonymousMappingsAreLeftOut) {
    const std::string maps =
        "55d0a000-55d0b000 r--p 00000000 fe:01 999 /usr/bin/node\n"
        "55d0c000-55d2d000 rw-p 00000000 00:00 0                          [heap]\n"
        "7f0000000000-7f0000100000 rw-p 00000000 00:00 0 \n"
        "7f0000100000-7f0000200000 r--s 00000000 fe:02 1234567 /other-fs/same-inode.gguf\n"
        "7f0000200000-7f0000300000 r--s 00000000 fe:01 1234568 /neighbour.gguf\n"
        "7f0000300000-7f0000400000 r--s 00000000 fe:01 1234567 /m.gguf\n"
        "7ffd1000-7ffd3000 rw-p 00000000 00:00 0                          [stack]\n"
        "ffffffffff600000-ffffffffff601000 --xp 00000000 00:00 0          [vsyscall]\n";
    const auto found = find_mappings(maps, kModel);
    ASSERT_EQ(found.size(), 1u);
    EXPECT_EQ(found[0].start, uintptr_t{0x7f0000300000});
}

TEST(ProcessMaps, SeveralMappingsOfOneFileInTextOrder) {
    // A model mapped twice (two runtimes' contexts), the second time from a non-zero offset.
    const std::string maps =
        "7f0000000000-7f0000010000 r--s 00000000 fe:01 1234567 /m.gguf\n"
        "7f0000010000-7f0000020000 ---p 00000000 00:00 0\n"
        "7f0000020000-7f0000030000 r--p 00010000 fe:01 1234567 /m.gguf\n"
        "7f1000000000-7f1000004000 r--p 00abc000 fe:01 1234567 /m.gguf\n";
    const auto found = find_mappings(maps, kModel);
    ASSERT_EQ(found.size(), 3u);
    EXPECT_EQ(found[0].file_offset, 0u);
    EXPECT_EQ(found[1].file_offset, 0x10000u);
    EXPECT_EQ(found[1].perms, "r--p");
    EXPECT_EQ(found[2].start, uintptr_t{0x7f1000000000});
    EXPECT_EQ(found[2].file_offset, 0xabc000u);
    // File byte 0xabc123 is 0x123 into the third mapping.
    EXPECT_TRUE(found[2].covers(0xabc123, 1));
    EXPECT_EQ(found[2].address_of(0xabc123), uintptr_t{0x7f1000000123});
    EXPECT_FALSE(found[0].covers(0xabc123, 1));
}

TEST(ProcessMaps, MalformedLinesAreSkippedAndTheRestStillRead) {
    const std::string maps =
        "\n"
        "garbage\n"
        "7f12a000 7f12c000 r--s 00000000 fe:01 1234567 /m.gguf\n"     // no '-'
        "7f12g000-7f12c000 r--s 00000000 fe:01 1234567 /m.gguf\n"     // not hex
        "7f12a000-7f12c000 r--s\n"                                    // cut short
        "7f12a000-7f12c000 r--s 00000000\n"                           // no device
        "7f12a000-7f12c000 r--s 00000000 fe01 1234567 /m.gguf\n"      // device without ':'
        "7f12a000-7f12c000 r--s 00000000 fe:01 /m.gguf\n"             // no inode
        "7f12c000-7f12a000 r--s 00000000 fe:01 1234567 /m.gguf\n"     // end before start
        "7f12a000-7f12a000 r--s 00000000 fe:01 1234567 /m.gguf\n"     // empty
        "17f12a0000000000000-7f12c000 r--s 0 fe:01 1234567 /m.gguf\n"  // more than 64 bits
        "7f12a000-7f12c000 r--s -0001000 fe:01 1234567 /m.gguf\n"     // negative offset
        "50000-51000 r--s 00000000 fe:01 1234567 /m.gguf";            // good, no final newline
    const auto found = find_mappings(maps, kModel);
    ASSERT_EQ(found.size(), 1u);
    EXPECT_EQ(found[0].start, 0x50000u);
    EXPECT_EQ(found[0].end, 0x51000u);
    EXPECT_TRUE(find_mappings("", kModel).empty());
}

TEST(ProcessMaps, CoversAndAddressOfHonourTheFileOffset) {
    const FileMapping m{0x100000, 0x103000, 0x2000, "r--s"};  // file bytes [0x2000, 0x5000)
    EXPECT_TRUE(m.covers(0x2000, 0x3000));
    EXPECT_TRUE(m.covers(0x4fff, 1));
    EXPECT_TRUE(m.covers(0x3000, 0));
    EXPECT_FALSE(m.covers(0x1fff, 1));
    EXPECT_FALSE(m.covers(0x1fff, 0x10));
    EXPECT_FALSE(m.covers(0x4fff, 2));
    EXPECT_FALSE(m.covers(0x5000, 1));
    EXPECT_EQ(m.address_of(0x2000), 0x100000u);
    EXPECT_EQ(m.address_of(0x4abc), 0x102abcu);
}

TEST(ProcessMaps, MergeJoinsPiecesOfOneSplitMapping) {
    // What madvise leaves of one mapping, listed out of order.
    std::vector<FileMapping> pieces = {
        {0x12000, 0x15000, 0x7000, "r--s"},
        {0x10000, 0x11000, 0x5000, "r--s"},
        {0x11000, 0x12000, 0x6000, "r--s"},
    };
    const auto merged = merge_adjacent(pieces);
    ASSERT_EQ(merged.size(), 1u);
    EXPECT_EQ(merged[0].start, 0x10000u);
    EXPECT_EQ(merged[0].end, 0x15000u);
    EXPECT_EQ(merged[0].file_offset, 0x5000u);
    EXPECT_TRUE(merged[0].covers(0x5000, 0x5000));
}

TEST(ProcessMaps, MergeKeepsApartWhatDoesNotContinue) {
    const std::vector<FileMapping> in = {
        {0x10000, 0x11000, 0x0000, "r--s"},
        {0x11000, 0x12000, 0x1000, "rw-s"},  // other permissions
        {0x12000, 0x13000, 0x9000, "rw-s"},  // adjacent addresses, but another part of the file
        {0x14000, 0x15000, 0xb000, "rw-s"},  // the file continues, the addresses do not
    };
    const auto merged = merge_adjacent(in);
    ASSERT_EQ(merged.size(), 4u);
    for (size_t i = 0; i < in.size(); ++i) {
        EXPECT_EQ(merged[i].start, in[i].start);
        EXPECT_EQ(merged[i].end, in[i].end);
    }
    EXPECT_TRUE(merge_adjacent({}).empty());
}

TEST(ProcessMaps, IdentifyFileGivesDeviceAndInode) {
    test::TempDir dir;
    const auto path = dir.file("m.gguf");
    test::write_file(path, "GGUF");
    struct stat st {};
    ASSERT_EQ(::stat(path.c_str(), &st), 0);
    const auto id = identify_file(path);
    ASSERT_TRUE(id) << id.error().what();
    EXPECT_EQ(id->dev_major, major(st.st_dev));
    EXPECT_EQ(id->dev_minor, minor(st.st_dev));
    EXPECT_EQ(id->inode, static_cast<uint64_t>(st.st_ino));

    // The identity finds a line written the way the kernel writes it.
    const auto line = fmt::format("7f0000000000-7f0000001000 r--s 00000000 {:02x}:{:02x} {} {}\n", id->dev_major,
                                  id->dev_minor, id->inode, path);
    EXPECT_EQ(find_mappings(line, *id).size(), 1u);

    const auto missing = identify_file(dir.file("absent.gguf"));
    ASSERT_FALSE(missing);
    EXPECT_EQ(missing.error().errnum, ENOENT);
    EXPECT_NE(missing.error().message.find("absent.gguf"), std::string::npos);
}

// ---- sentinel plan -----------------------------------------------------------------------

constexpr uint64_t kPage = 4096;
constexpr uintptr_t kBase = 0x7f0000000000;  // where file 0 is mapped, from file offset 0

struct TensorSpec {
    uint64_t offset;
    uint64_t bytes_per_expert;
    uint32_t file = 0;
};

// One layer per entry of `layers`, each with the given expert tensors.
ExpertMap make_map(uint32_t n_experts, const std::vector<std::vector<TensorSpec>>& layers, uint32_t n_files = 1) {
    ExpertMap map;
    map.architecture = "test";
    map.n_experts = n_experts;
    map.n_experts_used = 2;
    map.n_blocks = static_cast<uint32_t>(layers.size());
    for (uint32_t f = 0; f < n_files; ++f) map.files.push_back({fmt::format("/models/m-{}.gguf", f), 1u << 30});
    for (uint32_t l = 0; l < layers.size(); ++l) {
        MoeLayer layer;
        layer.index = l;
        for (uint32_t t = 0; t < layers[l].size(); ++t) {
            const auto& s = layers[l][t];
            layer.tensors.push_back({fmt::format("blk.{}.ffn_{}_exps.weight", l, t), s.file, s.offset,
                                     s.bytes_per_expert, {}});
            layer.bytes_per_expert += s.bytes_per_expert;
        }
        map.layers.push_back(std::move(layer));
    }
    return map;
}

std::vector<std::vector<FileMapping>> whole_file_mapping(uint64_t size = 1u << 30, std::string perms = "r--s") {
    return {{FileMapping{kBase, kBase + size, 0, std::move(perms)}}};
}

uintptr_t page_down(uintptr_t a) { return a / kPage * kPage; }
uintptr_t page_up(uintptr_t a) { return (a + kPage - 1) / kPage * kPage; }

// Every property the plan promises, checked against the map and the mappings it was made from.
void check_plan(const SentinelPlan& plan, const ExpertMap& map, const std::vector<std::vector<FileMapping>>& mappings) {
    size_t n_sets = 0;
    for (const auto& layer : map.layers) n_sets += layer.tensors.size();
    ASSERT_EQ(plan.sets.size(), n_sets);
    EXPECT_EQ(plan.n_sentinels, n_sets * map.n_experts);
    EXPECT_EQ(plan.page_size, kPage);
    std::vector<AddressRange> all;
    for (const auto& set : plan.sets) {
        const auto& t = map.layers.at(set.layer_slot).tensors.at(set.tensor);
        SCOPED_TRACE(t.name);
        const auto& m = mappings.at(t.file).front();
        ASSERT_TRUE(m.covers(t.offset, t.bytes_per_expert * map.n_experts));
        const uintptr_t tensor_begin = m.address_of(t.offset);
        const uintptr_t tensor_end = tensor_begin + t.bytes_per_expert * map.n_experts;
        ASSERT_EQ(set.pages.size(), map.n_experts);
        ASSERT_EQ(set.pieces.size(), map.n_experts);
        for (uint32_t e = 0; e < map.n_experts; ++e) {
            SCOPED_TRACE(fmt::format("expert {}", e));
            const uintptr_t begin = tensor_begin + e * t.bytes_per_expert, end = begin + t.bytes_per_expert;
            const uintptr_t page = set.pages[e];
            const auto piece = set.pieces[e];
            // The sentinel is a whole page of this expert's slice, near its centre.
            EXPECT_EQ(page % kPage, 0u);
            EXPECT_GE(page, begin);
            EXPECT_LE(page + kPage, end);
            const uintptr_t mid = begin + t.bytes_per_expert / 2;
            EXPECT_LE(page, mid);
            EXPECT_LT(mid, page + kPage + kPage) << "sentinel far from the centre";
            // Its VMA: whole pages, holding the sentinel, and only pages that hold bytes of this
            // slice (a page shared with the previous slice goes with this one).
            EXPECT_EQ(piece.begin % kPage, 0u);
            EXPECT_EQ(piece.end % kPage, 0u);
            EXPECT_LE(piece.begin, page);
            EXPECT_LE(page + kPage, piece.end);
            EXPECT_EQ(piece.begin, e == 0 ? page_up(begin) : page_down(begin));
            EXPECT_EQ(piece.end, page_down(end));
            EXPECT_GE(piece.begin, m.start);
            EXPECT_LE(piece.end, m.end);
            // The pieces of one tensor follow each other without a gap.
            if (e > 0) {
                EXPECT_EQ(piece.begin, set.pieces[e - 1].end);
            }
            all.push_back(piece);
        }
        // Together they are the whole pages of the tensor, and nothing outside it (what lies
        // between expert tensors keeps the mapping's own flags).
        EXPECT_EQ(set.pieces.front().begin, page_up(tensor_begin));
        EXPECT_EQ(set.pieces.back().end, page_down(tensor_end));
        EXPECT_TRUE(std::is_sorted(set.pages.begin(), set.pages.end()));
    }
    // plan.pieces: the same pieces, in address order, none overlapping, so that flag[i % 2]
    // differs between any two that touch.
    ASSERT_EQ(plan.pieces.size(), all.size());
    auto by_begin = [](const AddressRange& a, const AddressRange& b) { return a.begin < b.begin; };
    std::sort(all.begin(), all.end(), by_begin);
    for (size_t i = 0; i < all.size(); ++i) {
        EXPECT_EQ(plan.pieces[i].begin, all[i].begin);
        EXPECT_EQ(plan.pieces[i].end, all[i].end);
        if (i > 0) {
            EXPECT_LE(plan.pieces[i - 1].end, plan.pieces[i].begin);
        }
    }
    uint64_t min_slice = UINT64_MAX;
    for (const auto& layer : map.layers)
        for (const auto& t : layer.tensors) min_slice = std::min(min_slice, t.bytes_per_expert);
    EXPECT_EQ(plan.min_slice_bytes, min_slice);
}

TEST(SentinelPlan, SentinelsAndPiecesForAlignedAndUnalignedSlices) {
    // Tensor offsets and slice sizes at and around page boundaries; ggml aligns tensors to 32 bytes.
    const uint64_t offsets[] = {0, 32, 4064, 4096, 0x123460};
    const uint64_t sizes[] = {kPage, 2 * kPage, 2 * kPage + 32, 5 * kPage + 1000, 3'063'808, 3'063'808 + 32};
    for (const uint64_t off : offsets)
        for (const uint64_t size : sizes) {
            // Every slice needs a page of its own (that rule has its own test): one of two pages
            // always has one, one of a page only where it is aligned.
            if (size < 2 * kPage && off % kPage != 0) continue;
            SCOPED_TRACE(fmt::format("offset {} slice {}", off, size));
            const auto map = make_map(8, {{{off, size}}});
            const auto mappings = whole_file_mapping();
            const auto plan = plan_sentinels(map, mappings, kPage);
            ASSERT_TRUE(plan) << plan.error().what();
            check_plan(*plan, map, mappings);
        }
}

TEST(SentinelPlan, CentrePageOfAKnownLayout) {
    // Slices of 5 pages + 1000 bytes (21480) from offset 32: expert 1 is [21512, 42992), its
    // centre byte 32252 lies in page [28672, 32768); the page [20480, 24576) it shares with
    // expert 0 starts its piece, the one it shares with expert 2 starts expert 2's.
    const auto map = make_map(4, {{{32, 5 * kPage + 1000}}});
    const auto plan = plan_sentinels(map, whole_file_mapping(), kPage);
    ASSERT_TRUE(plan) << plan.error().what();
    const auto& set = plan->sets.at(0);
    EXPECT_EQ(set.pages.at(1), kBase + 28672);
    EXPECT_EQ(set.pieces.at(0).begin, kBase + 4096);  // the tensor's first partial page is left out
    EXPECT_EQ(set.pieces.at(1).begin, kBase + 20480);
    EXPECT_EQ(set.pieces.at(1).end, kBase + 40960);
    EXPECT_EQ(set.pieces.at(2).begin, kBase + 40960);
    EXPECT_EQ(set.pieces.at(3).end, kBase + 81920);  // the last partial page (to 85952) too
}

TEST(SentinelPlan, SeveralLayersTensorsAndFiles) {
    // Tensors listed out of address order, in two files, of different slice sizes, with dense
    // bytes between them; file 1 mapped from a non-zero offset.
    const auto map = make_map(16,
                              {{{0x200020, 3 * kPage}, {0x20, 2 * kPage + 64}, {0x800000, 4 * kPage}},
                               {{0x10040, 2 * kPage, 1}, {0x400000, 6 * kPage + 96, 1}, {0x100000, 3 * kPage, 1}}},
                              2);
    const uintptr_t base1 = 0x7f8000000000;
    const std::vector<std::vector<FileMapping>> mappings = {
        {FileMapping{kBase, kBase + 0x1000000, 0, "r--p"}},
        {FileMapping{base1, base1 + 0x800000, 0x10000, "r-xs"}},
    };
    const auto plan = plan_sentinels(map, mappings, kPage);
    ASSERT_TRUE(plan) << plan.error().what();
    check_plan(*plan, map, mappings);
    EXPECT_EQ(plan->min_slice_bytes, 2 * kPage);
    EXPECT_EQ(plan->sets.at(3).pieces.at(0).begin, base1 + 0x1000) << "file offset of the mapping ignored";
}

TEST(SentinelPlan, TensorsThatTouchGetPiecesThatTouch) {
    // Page-aligned tensors back to back: the last piece of one ends where the next begins, and
    // their positions in plan.pieces differ by one, so they get different flags.
    const auto map = make_map(4, {{{0, 2 * kPage}, {8 * kPage, 2 * kPage}}});
    const auto plan = plan_sentinels(map, whole_file_mapping(), kPage);
    ASSERT_TRUE(plan) << plan.error().what();
    ASSERT_EQ(plan->pieces.size(), 8u);
    for (size_t i = 0; i < plan->pieces.size(); ++i) {
        EXPECT_EQ(plan->pieces[i].begin, kBase + 2 * kPage * i);
        EXPECT_EQ(plan->pieces[i].end, kBase + 2 * kPage * (i + 1));
    }
}

TEST(SentinelPlan, ASliceWithoutAWholePageOfItsOwnIsRefused) {
    struct Case {
        uint64_t offset, bytes;
    };
    // Each has at least one expert none of whose pages is its own.
    const Case cases[] = {
        {0, 100},
        {0, kPage - 32},
        {32, kPage},              // straddles two pages, shares both
        {100, 2 * kPage - 200},   // 8000 bytes, still no page alone
        {0, kPage + 1024},        // expert 0 has [0, 4096); expert 1, [5120, 10240), none
    };
    for (const auto& c : cases) {
        SCOPED_TRACE(fmt::format("offset {} slice {}", c.offset, c.bytes));
        const auto map = make_map(4, {{{c.offset, c.bytes}}});
        const auto plan = plan_sentinels(map, whole_file_mapping(), kPage);
        ASSERT_FALSE(plan);
        EXPECT_NE(plan.error().message.find("blk.0.ffn_0_exps.weight"), std::string::npos) << plan.error().message;
        EXPECT_NE(plan.error().message.find("less than a whole page"), std::string::npos) << plan.error().message;
    }
    // The smallest slices that pass: one aligned page each, or two pages from any offset.
    for (const Case c : {Case{0, kPage}, Case{4096, kPage}, Case{32, 2 * kPage}, Case{4064, 2 * kPage}}) {
        SCOPED_TRACE(fmt::format("offset {} slice {}", c.offset, c.bytes));
        const auto map = make_map(4, {{{c.offset, c.bytes}}});
        const auto mappings = whole_file_mapping();
        const auto plan = plan_sentinels(map, mappings, kPage);
        ASSERT_TRUE(plan) << plan.error().what();
        check_plan(*plan, map, mappings);
    }
}

TEST(SentinelPlan, PageSizeMustBeAPowerOfTwo) {
    const auto map = make_map(4, {{{0, 4 * kPage}}});
    for (const uint64_t bad : {uint64_t{0}, uint64_t{3000}, uint64_t{4097}}) {
        const auto plan = plan_sentinels(map, whole_file_mapping(), bad);
        ASSERT_FALSE(plan) << bad;
        EXPECT_NE(plan.error().message.find("power of two"), std::string::npos);
    }
    // A larger page size (arm64 with 16 KiB pages) plans whole 16 KiB pages.
    const auto big = make_map(4, {{{0, 32 * kPage}}});
    const auto plan = plan_sentinels(big, whole_file_mapping(), 4 * kPage);
    ASSERT_TRUE(plan) << plan.error().what();
    for (const auto p : plan->sets.at(0).pages) EXPECT_EQ(p % (4 * kPage), 0u);
}

TEST(SentinelPlan, AModelWithoutExpertsIsRefused) {
    const auto plan = plan_sentinels(make_map(4, {}), whole_file_mapping(), kPage);
    ASSERT_FALSE(plan);
    EXPECT_NE(plan.error().message.find("no routed experts"), std::string::npos);
}

TEST(SentinelPlan, ATensorOutsideOneReadOnlyMappingIsRefused) {
    const auto map = make_map(4, {{{0x10000, 4 * kPage}}});  // file bytes [0x10000, 0x20000)
    auto refused = [&](const std::vector<std::vector<FileMapping>>& mappings, const char* why) {
        SCOPED_TRACE(why);
        const auto plan = plan_sentinels(map, mappings, kPage);
        ASSERT_FALSE(plan);
        EXPECT_NE(plan.error().message.find("blk.0.ffn_0_exps.weight"), std::string::npos);
        EXPECT_NE(plan.error().message.find("/models/m-0.gguf"), std::string::npos);
    };
    refused({}, "file not mapped at all");
    refused({{}}, "no mapping of the file");
    refused(whole_file_mapping(1u << 30, "rw-p"), "writable private mapping");
    refused(whole_file_mapping(1u << 30, "rw-s"), "writable shared mapping");
    refused(whole_file_mapping(1u << 30, "---p"), "not readable");
    refused(whole_file_mapping(0x1ffff), "mapping ends one byte early");
    refused({{FileMapping{kBase, kBase + 0x20000, 0x20000, "r--s"}}}, "mapping of the bytes after the tensor");
    refused({{FileMapping{kBase, kBase + 0x10000, 0x11000, "r--s"}}}, "mapping starts inside the tensor");
    // The tensor split over two VMAs (as after madvise) is refused, and planned once they are merged.
    const std::vector<FileMapping> split = {{kBase + 0x18000, kBase + 0x100000, 0x18000, "r--s"},
                                            {kBase, kBase + 0x18000, 0, "r--s"}};
    refused({split}, "split mapping");
    const std::vector<std::vector<FileMapping>> merged = {merge_adjacent(split)};
    const auto plan = plan_sentinels(map, merged, kPage);
    ASSERT_TRUE(plan) << plan.error().what();
    check_plan(*plan, map, merged);
    // A writable mapping elsewhere does not hide a read-only one that holds the tensor.
    const std::vector<std::vector<FileMapping>> both = {
        {FileMapping{kBase, kBase + 0x100000, 0, "r--s"}, FileMapping{0x7f9000000000, 0x7f9000100000, 0, "rw-p"}}};
    const auto ok = plan_sentinels(map, both, kPage);
    ASSERT_TRUE(ok) << ok.error().what();
    EXPECT_EQ(ok->sets.at(0).pieces.at(0).begin, kBase + 0x10000);
}

TEST(SentinelPlan, OverlappingExpertTensorsAreRefused) {
    // Two tensors claiming the same bytes: the map is inconsistent.
    const auto map = make_map(4, {{{0, 4 * kPage}, {16 * kPage, 4 * kPage}}});
    ASSERT_TRUE(plan_sentinels(map, whole_file_mapping(), kPage));
    const auto overlapping = make_map(4, {{{0, 4 * kPage}, {12 * kPage, 4 * kPage}}});
    const auto plan = plan_sentinels(overlapping, whole_file_mapping(), kPage);
    ASSERT_FALSE(plan);
    EXPECT_NE(plan.error().message.find("overlap"), std::string::npos) << plan.error().message;
}

// ---- routing statistics ------------------------------------------------------------------

TEST(RoutingStats, SpearmanOfIdenticalAndReversedRankings) {
    const std::vector<double> x = {3, 1, 4, 1.5, 9, 2.6};
    EXPECT_NEAR(spearman(x, x).value(), 1.0, 1e-12);
    // Any increasing transform keeps the ranks.
    std::vector<double> cubed;
    for (const double v : x) cubed.push_back(v * v * v + 7);
    EXPECT_NEAR(spearman(x, cubed).value(), 1.0, 1e-12);
    std::vector<double> negated;
    for (const double v : x) negated.push_back(-v);
    EXPECT_NEAR(spearman(x, negated).value(), -1.0, 1e-12);
    EXPECT_NEAR(spearman({1, 2, 3, 4, 5}, {50, 40, 30, 20, 10}).value(), -1.0, 1e-12);
}

TEST(RoutingStats, SpearmanWithTiesByHand) {
    // x = {1, 2, 2, 3}: ranks {1, 2.5, 2.5, 4}; y = {1, 3, 2, 4}: ranks {1, 3, 2, 4}.
    // Deviations from the mean rank 2.5: dx = {-1.5, 0, 0, 1.5}, dy = {-1.5, 0.5, -0.5, 1.5}.
    // Sxy = 4.5, Sxx = 4.5, Syy = 5, so rho = 4.5 / sqrt(4.5 * 5) = sqrt(0.9). (The shortcut
    // 1 - 6 sum(d^2) / (n (n^2 - 1)) would give 0.95: it holds only without ties.)
    EXPECT_NEAR(spearman({1, 2, 2, 3}, {1, 3, 2, 4}).value(), std::sqrt(0.9), 1e-12);
    // Without ties the shortcut and the definition agree: d = {0, 1, -1, 0, 0}, 1 - 6 * 2 / 120.
    EXPECT_NEAR(spearman({10, 20, 30, 40, 50}, {1, 3, 2, 4, 5}).value(), 0.9, 1e-12);
    // Ties on both sides: x ranks {1.5, 1.5, 3, 4}, y ranks {1, 2, 3.5, 3.5}.
    // dx = {-1, -1, 0.5, 1.5}, dy = {-1.5, -0.5, 1, 1}: Sxy = 4, Sxx = 4.5, Syy = 4.5.
    EXPECT_NEAR(spearman({5, 5, 7, 9}, {0, 1, 2, 2}).value(), 4.0 / 4.5, 1e-12);
}

TEST(RoutingStats, SpearmanIsUndefinedForConstantOrMismatchedInput) {
    EXPECT_FALSE(spearman({1, 1, 1}, {1, 2, 3}));
    EXPECT_FALSE(spearman({1, 2, 3}, {4, 4, 4}));
    EXPECT_FALSE(spearman({1, 2, 3}, {1, 2}));
    EXPECT_FALSE(spearman({1}, {1}));
    EXPECT_FALSE(spearman({}, {}));
}

TEST(RoutingStats, CoverageOfTheHottestExperts) {
    const std::vector<uint64_t> counts = {10, 50, 0, 30, 10, 0, 0, 0};  // 100 routings, any order
    EXPECT_DOUBLE_EQ(coverage(counts, 0.125), 0.5);   // 1 expert
    EXPECT_DOUBLE_EQ(coverage(counts, 0.25), 0.8);    // 2
    EXPECT_DOUBLE_EQ(coverage(counts, 0.26), 0.9);    // 2.08 experts, rounded up to 3
    EXPECT_DOUBLE_EQ(coverage(counts, 0.375), 0.9);   // exactly 3: no rounding up past it
    EXPECT_DOUBLE_EQ(coverage(counts, 0.5), 1.0);
    EXPECT_DOUBLE_EQ(coverage(counts, 1.0), 1.0);
    EXPECT_DOUBLE_EQ(coverage(counts, 0.01), 0.5);    // at least one expert
    EXPECT_DOUBLE_EQ(coverage({25, 25, 25, 25}, 0.5), 0.5);
    EXPECT_DOUBLE_EQ(coverage({0, 0, 0}, 0.5), 0.0);
    EXPECT_DOUBLE_EQ(coverage({}, 0.5), 0.0);
}

TEST(RoutingStats, HeldOutCoverageChoosesOnOneHalfAndMeasuresTheOther) {
    // The first half makes experts 1 and 2 look hottest; the second half routes mostly to 3.
    const std::vector<uint64_t> first = {1, 5, 3, 0};
    const std::vector<uint64_t> second = {10, 20, 30, 40};
    EXPECT_DOUBLE_EQ(held_out_coverage(first, second, 0.5), 0.5);   // (20 + 30) / 100
    EXPECT_DOUBLE_EQ(held_out_coverage(first, second, 0.25), 0.2);  // expert 1 only
    EXPECT_DOUBLE_EQ(held_out_coverage(second, first, 0.5), 3.0 / 9.0);  // experts 3, 2 of the first half
    EXPECT_DOUBLE_EQ(held_out_coverage(first, second, 1.0), 1.0);
    // Choosing and measuring on one sample is the in-sample coverage, never below the held-out one.
    EXPECT_DOUBLE_EQ(held_out_coverage(second, second, 0.5), coverage(second, 0.5));
    EXPECT_DOUBLE_EQ(held_out_coverage(first, first, 0.25), coverage(first, 0.25));
    EXPECT_LE(held_out_coverage(first, second, 0.5), coverage(second, 0.5));
    EXPECT_DOUBLE_EQ(held_out_coverage(first, second, 0.01), 0.2) << "at least one expert";
    // 0.28 * 25 is 7.000000000000001 in doubles: still 7 experts, not 8.
    std::vector<uint64_t> descending(25);
    for (size_t i = 0; i < descending.size(); ++i) descending[i] = 25 - i;  // sum 325, top 7: 154
    EXPECT_DOUBLE_EQ(held_out_coverage(descending, descending, 0.28), 154.0 / 325.0);
    EXPECT_DOUBLE_EQ(coverage(descending, 0.28), 154.0 / 325.0);
    // Degenerate halves.
    EXPECT_DOUBLE_EQ(held_out_coverage({}, {}, 0.5), 0.0);
    EXPECT_DOUBLE_EQ(held_out_coverage(first, {0, 0, 0, 0}, 0.5), 0.0);
}

}  // namespace
}  // namespace moecache::routeprobe
