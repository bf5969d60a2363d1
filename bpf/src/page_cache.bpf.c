// SPDX-License-Identifier: GPL-2.0
/* moecache's page-cache telemetry: which pages of the watched model files enter the page cache
 * (reads from storage), leave it (evictions) and are faulted in by a process. Attached to the
 * filemap tracepoints as BTF raw tracepoints (tp_btf), so no tracefs mount is needed. Filtered in
 * the kernel to the files in the `watched` map; what passes goes to the `events` ring buffer, and a
 * record the ring has no room for is counted in `dropped`, never waited for. */
#include "vmlinux.h"

#include <bpf/bpf_core_read.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_tracing.h>

#include "moecache/bpf/page_cache_event.h"

char LICENSE[] SEC("license") = "GPL";

/* Set by the loader before load: faults and mappings by this process (the daemon's own mlock
 * populating its mapping) are not news. Its reads from storage are reported: they are prefetch. */
const volatile __u32 ignore_tgid = 0;
/* The reader is woken only once this many bytes wait in the ring; below that it polls on its own
 * clock. A wakeup per record would cost every reader of a model file an interrupt and a context
 * switch of the daemon per folio: a consumer that keeps up is woken by each record otherwise. */
const volatile __u64 wakeup_bytes = 0;
/* Except for a miss: a page added by another process than ignore_tgid (a runtime reading from
 * storage, page by page under MADV_RANDOM) wakes the reader at once, at most once per this many
 * nanoseconds (0: never), so that the daemon can read the rest of the expert before the runtime
 * faults on it, without polling on a fast clock in case a miss comes. */
const volatile __u64 miss_wakeup_ns = 0;
__u64 last_miss_wakeup; /* when a miss last woke the reader; a race between CPUs costs a wakeup */

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 4096);
	__type(key, struct mc_file_key);
	__type(value, struct mc_file_watch);
} watched SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, 1 << 22); /* the loader sets the size from the configuration */
} events SEC(".maps");

/* Records sent and dropped, per kind. Read by the loader through the mapped .bss. */
__u64 sent[MC_PC_KINDS];
__u64 dropped[MC_PC_KINDS];

static __always_inline __u32 folio_pages(struct folio *folio)
{
	unsigned long flags;
	if (bpf_core_field_exists(((struct folio___memdesc *)0)->flags.f))
		flags = BPF_CORE_READ((struct folio___memdesc *)folio, flags.f);
	else
		flags = BPF_CORE_READ(folio, flags);
	if (!(flags & (1UL << bpf_core_enum_value(enum pageflags, PG_head))))
		return 1;
	if (bpf_core_field_exists(folio->_nr_pages))
		return BPF_CORE_READ(folio, _nr_pages);
	if (bpf_core_field_exists(((struct folio___old *)0)->_folio_nr_pages))
		return BPF_CORE_READ((struct folio___old *)folio, _folio_nr_pages);
	if (bpf_core_field_exists(((struct folio___old *)0)->_folio_order))
		return 1U << (BPF_CORE_READ((struct folio___old *)folio, _folio_order) & 31);
	return 1U << (BPF_CORE_READ(folio, _flags_1) & 31);
}

static __always_inline int emit(__u8 kind, struct address_space *mapping, __u64 index, __u64 nr_pages)
{
	if (!mapping)
		return 0;
	struct inode *host = BPF_CORE_READ(mapping, host);
	if (!host)
		return 0;
	struct mc_file_key key = {};
	key.ino = BPF_CORE_READ(host, i_ino);
	key.dev = BPF_CORE_READ(host, i_sb, s_dev);
	struct mc_file_watch *w = bpf_map_lookup_elem(&watched, &key);
	if (!w)
		return 0;
	__u32 tgid = bpf_get_current_pid_tgid() >> 32;
	if ((kind == MC_PC_FAULT || kind == MC_PC_MAP) && tgid == ignore_tgid)
		return 0;
	struct mc_page_cache_event *e = bpf_ringbuf_reserve(&events, sizeof(*e), 0);
	if (!e) {
		__sync_fetch_and_add(&dropped[kind & (MC_PC_KINDS - 1)], 1);
		return 0;
	}
	e->index = index;
	e->nr_pages = nr_pages > 0xffffffffULL ? 0xffffffffU : (__u32)nr_pages;
	e->file_id = w->file_id;
	e->tgid = tgid;
	e->kind = kind;
	e->pad[0] = e->pad[1] = e->pad[2] = 0;
	__u64 flags = BPF_RB_NO_WAKEUP;
	if (bpf_ringbuf_query(&events, BPF_RB_AVAIL_DATA) >= wakeup_bytes) {
		flags = BPF_RB_FORCE_WAKEUP;
	} else if (kind == MC_PC_ADD && miss_wakeup_ns != 0 && tgid != ignore_tgid) {
		__u64 now = bpf_ktime_get_ns();
		if (now - last_miss_wakeup >= miss_wakeup_ns) {
			last_miss_wakeup = now;
			flags = BPF_RB_FORCE_WAKEUP;
		}
	}
	bpf_ringbuf_submit(e, flags);
	__sync_fetch_and_add(&sent[kind & (MC_PC_KINDS - 1)], 1);
	return 0;
}

SEC("tp_btf/mm_filemap_add_to_page_cache")
int BPF_PROG(mc_page_added, struct folio *folio)
{
	return emit(MC_PC_ADD, BPF_CORE_READ(folio, mapping), BPF_CORE_READ(folio, index), folio_pages(folio));
}

SEC("tp_btf/mm_filemap_delete_from_page_cache")
int BPF_PROG(mc_page_deleted, struct folio *folio)
{
	return emit(MC_PC_DELETE, BPF_CORE_READ(folio, mapping), BPF_CORE_READ(folio, index), folio_pages(folio));
}

/* Linux >= 6.11. The loader leaves these out where the kernel lacks the tracepoints. */
SEC("tp_btf/mm_filemap_fault")
int BPF_PROG(mc_fault, struct address_space *mapping, unsigned long index)
{
	return emit(MC_PC_FAULT, mapping, index, 1);
}

SEC("tp_btf/mm_filemap_map_pages")
int BPF_PROG(mc_map_pages, struct address_space *mapping, unsigned long start, unsigned long last)
{
	return emit(MC_PC_MAP, mapping, start, last >= start ? last - start + 1 : 1);
}
