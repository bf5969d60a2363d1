/* What moecache's page-cache programs (bpf/src/page_cache.bpf.c) and their loader share: fixed-width
 * types only, no kernel or libc headers, the same layout on both sides. */
#ifndef MOECACHE_BPF_PAGE_CACHE_EVENT_H
#define MOECACHE_BPF_PAGE_CACHE_EVENT_H

#ifdef __cplusplus
#include <cstdint>
typedef std::uint8_t mc_u8;
typedef std::uint32_t mc_u32;
typedef std::uint64_t mc_u64;
#else
typedef __u8 mc_u8;
typedef __u32 mc_u32;
typedef __u64 mc_u64;
#endif

/* What happened to a range of a watched file's pages. */
enum mc_page_cache_kind {
	MC_PC_ADD = 0,    /* pages entered the page cache: read from storage (or being read) */
	MC_PC_DELETE = 1, /* pages left the page cache: evicted, dropped or truncated */
	MC_PC_FAULT = 2,  /* a page fault that reached the file (filemap_fault) */
	MC_PC_MAP = 3,    /* a page fault served from the page cache, mapping a window around it */
	MC_PC_KINDS = 4,
};

/* Key of the watch map: the file's identity as the kernel has it. dev is the kernel's dev_t of
 * the inode's super block ((major << 20) | minor), not the userspace encoding stat() returns. */
struct mc_file_key {
	mc_u64 ino;
	mc_u32 dev;
	mc_u32 pad;
};

/* Value of the watch map: the loader's number for the file, carried by its events. */
struct mc_file_watch {
	mc_u32 file_id;
	mc_u32 pad;
};

/* One ring-buffer record: pages [index, index + nr_pages) of file file_id. */
struct mc_page_cache_event {
	mc_u64 index;
	mc_u32 nr_pages;
	mc_u32 file_id;
	mc_u32 tgid; /* the process the event happened in (a reader, a faulting process, kswapd) */
	mc_u8 kind;  /* enum mc_page_cache_kind */
	mc_u8 pad[3];
};

#endif
