#!/usr/bin/env python3
"""Requests to a running llama-server, one after another, as a user's client makes them.

    serve_requests.py URL PROMPTS_JSON OUT_JSON [--n-predict N] [--disk DEV] [--raw]

PROMPTS_JSON: a list of prompt strings; --ban FIRST-LAST: token ids the sampler never picks. Each is sent as a chat request (URL/v1/chat/completions,
the user's message; --raw: URL/completion, the text as it is) with stream on, greedy (temperature
0), EOS ignored, no prompt cache, and the time of every streamed token is recorded.
Per request in OUT_JSON: the server's own timings (prompt and decode tok/s), the arrival time of
each token, decode tok/s over tokens 25-50 and after 50 ("steady"), the greedy text, and the bytes
DEV (a block device name in /proc/diskstats) read between the first token and the last.
Standard library only: it runs on the GPU machine's python3.
"""
import argparse
import json
import sys
import time
import urllib.request


def sectors_read(dev):
    if not dev:
        return 0
    with open("/proc/diskstats") as f:
        for line in f:
            p = line.split()
            if len(p) > 5 and p[2] == dev:
                return int(p[5])
    return 0


def rate(times, a, b):
    """Tokens a..b (0-based arrival index) per second; None when the run is too short."""
    if a < 0 or b <= a or len(times) <= b or times[b] <= times[a]:
        return None
    return (b - a) / (times[b] - times[a])


def one(url, prompt, n_predict, dev, seed, raw, ban):
    common = {"temperature": 0, "top_k": 1, "ignore_eos": True, "cache_prompt": False, "stream": True, "seed": seed}
    if ban:
        common["logit_bias"] = [[t, False] for t in ban]
    if raw:
        path, body = "/completion", dict(common, prompt=prompt, n_predict=n_predict)
    else:
        path, body = "/v1/chat/completions", dict(common, messages=[{"role": "user", "content": prompt}],
                                                  max_tokens=n_predict, timings_per_token=False)
    req = urllib.request.Request(url.rstrip("/") + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    t0 = time.monotonic()
    times, pieces, timings, first_sectors = [], [], {}, None
    with urllib.request.urlopen(req, timeout=3600) as r:
        for raw in r:
            line = raw.decode("utf-8", "replace").strip()
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                break
            ev = json.loads(line[6:])
            if "choices" in ev:  # a chat chunk: the token in its delta
                choice = (ev["choices"] or [{}])[0]
                content = (choice.get("delta") or {}).get("content")
            else:
                content = ev.get("content")
            if content:
                if first_sectors is None:
                    first_sectors = sectors_read(dev)
                times.append(time.monotonic() - t0)
                pieces.append(content)
            if ev.get("timings"):
                timings = ev["timings"]
            if raw and ev.get("stop"):
                break
    last_sectors = sectors_read(dev)
    n = len(times)
    return {
        "prompt_tokens": timings.get("prompt_n"),
        "prompt_tps": timings.get("prompt_per_second"),
        "decode_tokens": timings.get("predicted_n", n),
        "decode_tps": timings.get("predicted_per_second"),
        "first_token_s": times[0] if times else None,
        "tps_25_50": rate(times, 25, 50),
        "tps_steady": rate(times, 50, n - 1) if n > 60 else rate(times, 1, n - 1),
        "disk_bytes_decode": (last_sectors - (first_sectors or last_sectors)) * 512,
        "token_times": times,
        "text": "".join(pieces),
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("url")
    ap.add_argument("prompts")
    ap.add_argument("out")
    ap.add_argument("--n-predict", type=int, default=128)
    ap.add_argument("--disk", default="")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--raw", action="store_true", help="/completion with the prompt as it is")
    ap.add_argument("--ban", default="", help="FIRST-LAST: token ids never to sample (a generated model's byte "
                    "tokens: alone they are not UTF-8, which llama-server's output parser refuses mid-stream)")
    a = ap.parse_args()
    prompts = json.load(open(a.prompts))
    ban = []
    if a.ban:
        lo, hi = (int(x) for x in a.ban.split("-"))
        ban = list(range(lo, hi + 1))
    out = []
    for p in prompts:
        try:
            out.append(one(a.url, p, a.n_predict, a.disk, a.seed, a.raw, ban))
        except Exception as e:  # a request that failed is a row that says so, not a lost run
            out.append({"error": f"{type(e).__name__}: {e}"})
            print(f"serve_requests: {e}", file=sys.stderr)
    json.dump(out, open(a.out, "w"))


if __name__ == "__main__":
    main()
