#!/usr/bin/env python3
"""The block count of a GGUF model (its "<arch>.block_count" key): gguf_blocks.py FILE.
Standard library only: it runs on the GPU machine's python3."""
import struct
import sys

SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}

with open(sys.argv[1], "rb") as f:
    magic, version, n_tensors, n_kv = struct.unpack("<4sIQQ", f.read(24))
    if magic != b"GGUF":
        sys.exit(f"{sys.argv[1]}: not a GGUF file")

    def string():
        n, = struct.unpack("<Q", f.read(8))
        return f.read(n).decode("utf-8", "replace")

    def skip(t):
        if t == 8:
            string()
        elif t == 9:
            et, n = struct.unpack("<IQ", f.read(12))
            for _ in range(n):
                skip(et)
        else:
            f.read(SIZES[t])

    for _ in range(n_kv):
        key = string()
        t, = struct.unpack("<I", f.read(4))
        if key.endswith(".block_count") and t in (4, 5):
            print(struct.unpack("<I", f.read(4))[0])
            sys.exit()
        skip(t)
sys.exit(f"{sys.argv[1]}: no block_count")
