/* The kernel types moecache's BPF programs read, and nothing else: pinned in the repository so that
 * the build never depends on the kernel of the machine that builds it. Every struct is marked
 * preserve_access_index, so each field access is a CO-RE relocation that libbpf resolves against
 * the running kernel's BTF at load time: only names matter here, not layouts. Fields that moved or
 * changed type between kernels have one "flavour" per shape (name___suffix; libbpf ignores the
 * suffix) and the programs pick the one the running kernel has with bpf_core_field_exists().
 * Checked against Linux 6.1 (Debian 12) and 6.18. */
#ifndef MOECACHE_VMLINUX_H
#define MOECACHE_VMLINUX_H

typedef signed char __s8;
typedef unsigned char __u8;
typedef short __s16;
typedef unsigned short __u16;
typedef int __s32;
typedef unsigned int __u32;
typedef long long __s64;
typedef unsigned long long __u64;
typedef __u16 __be16;
typedef __u32 __be32;
typedef __u32 __wsum;
typedef _Bool bool;
enum { false = 0, true = 1 };
typedef __u32 dev_t;

/* From include/uapi/linux/bpf.h: the map types and flags the programs name. */
enum bpf_map_type {
	BPF_MAP_TYPE_HASH = 1,
	BPF_MAP_TYPE_ARRAY = 2,
	BPF_MAP_TYPE_RINGBUF = 27,
};
enum {
	BPF_ANY = 0,
	BPF_RB_NO_WAKEUP = 1,
	BPF_RB_FORCE_WAKEUP = 2,
};
enum {
	BPF_RB_AVAIL_DATA = 0,
};
enum {
	BPF_F_NO_PREALLOC = 1,
};

#pragma clang attribute push(__attribute__((preserve_access_index)), apply_to = record)

struct super_block {
	dev_t s_dev;
};

struct inode {
	unsigned long i_ino;
	struct super_block *i_sb;
};

struct address_space {
	struct inode *host;
};

/* Linux >= 6.18: flags is a memdesc_flags_t, a struct around one word. */
struct memdesc_flags___moecache {
	unsigned long f;
};
struct folio___memdesc {
	struct memdesc_flags___moecache flags;
};

/* Every folio kernel: flags as a word, the page-cache fields, and the second page's words where
 * a large folio keeps its size. */
struct folio {
	unsigned long flags;
	struct address_space *mapping;
	unsigned long index;
	unsigned long _flags_1;
	unsigned int _nr_pages;   /* 64-bit kernels, >= 6.9 or so */
};

/* Older folio kernels (5.18 .. 6.5 or so): the size in fields of their own. */
struct folio___old {
	unsigned char _folio_order;
	unsigned int _folio_nr_pages;
};

#pragma clang attribute pop

/* The value is relocated to the running kernel's (bpf_core_enum_value). */
enum pageflags {
	PG_head = 6,
};

#endif /* MOECACHE_VMLINUX_H */
