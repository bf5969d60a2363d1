#!/usr/bin/env python3
"""Where a decoding token's time goes on the GPU, from libmoecache-gputrace.so's records
(bench/gpu_trace.cpp): per token, the time the link carried host-to-device copies, the time
kernels ran (the hook's own copy kernels apart), device-to-device copies, the time the device did
nothing, and the gap between each read-back of the router's ids and the device's next work (the
host's turn: its wait, the runtime's and the hook's work before the next copy).

  bench/gpu-timeline.py --layers N TRACE [TRACE ...]

The window is from the first to the last read-back (a device-to-host copy of at most 64 KiB, one a
layer and token where llama.cpp copies the experts its router picked), so a trace of
`llama-bench -p 0 -n T` is its decoding; --skip drops that share of the read-backs first (a pool
warming up)."""
import argparse
import bisect
import statistics
import sys

H2D, D2H, D2D, P2P = 1, 2, 8, 10


def union(spans, lo, hi):
    """Total length of the union of [s, e) spans clipped to [lo, hi)."""
    total, end = 0, lo
    for s, e in sorted(spans):
        s, e = max(s, lo), min(e, hi)
        if e <= s:
            continue
        if s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def intersect_len(a, b, lo, hi):
    """Length of (union of a) intersected with (union of b), within [lo, hi)."""
    return union(a, lo, hi) + union(b, lo, hi) - union(a + b, lo, hi)


def read(path):
    copies, kernels, mine, memsets = [], [], [], []
    for line in open(path, errors="replace"):
        f = line.split()
        if not f:
            continue
        try:
            if f[0] == "C":
                copies.append((int(f[1]), int(f[3]), int(f[4]), int(f[5])))  # kind, bytes, start, end
            elif f[0] == "K":
                span = (int(f[1]), int(f[2]))
                (mine if len(f) > 4 and f[4].startswith("moecache_copy") else kernels).append(span)
            elif f[0] == "S":
                memsets.append((int(f[1]), int(f[2])))
        except (IndexError, ValueError):
            continue
    return copies, kernels, mine, memsets


def summarize(path, layers, skip):
    copies, kernels, mine, memsets = read(path)
    readbacks = sorted((s, e) for k, b, s, e in copies if k == D2H and b <= 65536)
    if len(readbacks) < 2 * layers:
        return None, f"{path}: {len(readbacks)} read-backs, fewer than two tokens' worth"
    readbacks = readbacks[int(len(readbacks) * skip):]
    lo, hi = readbacks[0][0], readbacks[-1][0]
    tokens = (len(readbacks) - 1) / layers  # the window holds that many layers' periods
    h2d = [(s, e) for k, b, s, e in copies if k == H2D]
    d2d = [(s, e) for k, b, s, e in copies if k in (D2D, P2P)]
    h2d_bytes = sum(b for k, b, s, e in copies if k == H2D and s >= lo and e <= hi)
    everything = h2d + d2d + kernels + mine + memsets + [(s, e) for k, b, s, e in copies if k == D2H]
    ms = lambda ns: ns / 1e6 / tokens
    starts = sorted(s for s, e in everything)
    gaps = []
    for s, e in readbacks[:-1]:
        i = bisect.bisect_left(starts, e)
        if i < len(starts):
            gaps.append(starts[i] - e)
    h2d_busy = union(h2d, lo, hi)
    row = {
        "trace": path,
        "tokens": tokens,
        "token_ms": ms(hi - lo),
        "h2d_ms": ms(h2d_busy),
        "h2d_gb_per_token": h2d_bytes / 1e9 / tokens,
        "h2d_gb_s": h2d_bytes / h2d_busy if h2d_busy else 0.0,
        "kernels_ms": ms(union(kernels, lo, hi)),
        "hook_kernels_ms": ms(union(mine, lo, hi)),
        "d2d_ms": ms(union(d2d, lo, hi)),
        "h2d_under_kernels_ms": ms(intersect_len(h2d, kernels + mine, lo, hi)),
        "idle_ms": ms((hi - lo) - union(everything, lo, hi)),
        "readback_gap_us": statistics.median(gaps) / 1e3 if gaps else 0.0,
        "readback_gaps_ms": ms(sum(gaps)),
    }
    return row, None


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, required=True, help="MoE layers a token (read-backs a token)")
    ap.add_argument("--skip", type=float, default=0.25, help="share of the read-backs to drop first (0.25)")
    ap.add_argument("traces", nargs="+")
    a = ap.parse_args()
    cols = [("tokens", "%.0f"), ("token_ms", "%.2f"), ("h2d_ms", "%.2f"), ("h2d_gb_per_token", "%.3f"),
            ("h2d_gb_s", "%.1f"), ("kernels_ms", "%.2f"), ("hook_kernels_ms", "%.2f"), ("d2d_ms", "%.2f"),
            ("h2d_under_kernels_ms", "%.2f"), ("idle_ms", "%.2f"), ("readback_gap_us", "%.1f"),
            ("readback_gaps_ms", "%.2f")]
    print("| trace | " + " | ".join(c for c, _ in cols) + " |")
    print("|---" * (len(cols) + 1) + "|")
    bad = 0
    for t in a.traces:
        row, why = summarize(t, a.layers, a.skip)
        if row is None:
            print(why, file=sys.stderr)
            bad += 1
            continue
        print("| " + t.rsplit("/", 1)[-1] + " | " + " | ".join(f % row[c] for c, f in cols) + " |")
    return 1 if bad == len(a.traces) else 0


if __name__ == "__main__":
    sys.exit(main())
