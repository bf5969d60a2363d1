// Generates text from a GGUF model with node-llama-cpp (llama.cpp, CPU) and prints JSON:
//   node generate.mjs --model M.gguf [--tokens N] [--threads T] [--seed S] [--prompt TEXT]
//                     [--max-seconds T] [--warmup N]
// Decoding samples at temperature 1: synthetic models loop under greedy decoding. The end-of-text
// token is never sampled (--eos true allows it): a run decodes the tokens it was asked for, so that
// its figures and the tests that count them do not depend on where a sample happens to stop.
// --max-seconds stops decoding after T seconds (a squeezed run may crawl); --warmup N (50) splits
// the decode speed into the first N tokens and the rest ("steady").
import {getLlama, LlamaCompletion, TokenBias} from "node-llama-cpp";
import {readFileSync} from "node:fs";

// This process's anonymous resident memory (what a memory cgroup must hold beside the model's pages).
const rssAnon = () => {
    const m = /RssAnon:\s+(\d+) kB/.exec(readFileSync("/proc/self/status", "utf8"));
    return m ? Number(m[1]) * 1024 : 0;
};

const args = Object.fromEntries(process.argv.slice(2).reduce((acc, a, i, all) => {
    if (a.startsWith("--")) acc.push([a.slice(2), all[i + 1]?.startsWith("--") ? "true" : all[i + 1]]);
    return acc;
}, []));
if (!args.model) {
    console.error("usage: node generate.mjs --model M.gguf [--tokens N] [--threads T] [--seed S]");
    process.exit(2);
}
const tokens = Number(args.tokens ?? 64);
const threads = Number(args.threads ?? 1);
const maxSeconds = Number(args["max-seconds"] ?? 0);
const warmup = Number(args.warmup ?? 50);

const llama = await getLlama({gpu: false, build: "never", logLevel: "error"});
const t0 = performance.now();
const model = await llama.loadModel({modelPath: args.model, gpuLayers: 0,
                                     useMmap: args.mmap !== "false", useMlock: args.mlock === "true"});
const context = await model.createContext({contextSize: Math.max(256, tokens + 64), threads, batchSize: 64});
const t1 = performance.now();
const completion = new LlamaCompletion({contextSequence: context.getSequence()});
let first = null;
let produced = 0;
const stamps = [];  // ms since the first token, per token
const stop = new AbortController();
const options = (round) => ({
    maxTokens: tokens - produced,
    temperature: 1.0,
    topK: 0,
    topP: 1.0,
    seed: Number(args.seed ?? 1) + round,
    tokenBias: args.eos === "true" || model.tokens.eos == null ? undefined : TokenBias.for(model).set(model.tokens.eos, "never"),
    signal: stop.signal,
    stopOnAbortSignal: true,
    onToken(tokens) {
        const now = performance.now();
        if (first === null) first = now;
        for (let i = 0; i < tokens.length; i++) stamps.push(now - first);
        produced += tokens.length;
        if (maxSeconds > 0 && (now - first) / 1000 >= maxSeconds) stop.abort();
    },
});
// Where a sample ends the text early anyway, decoding goes on from it (another seed) until it has
// the tokens asked for.
const prompt = args.prompt ?? "the";
let text = "";
for (let round = 0; round < 1000 && produced < tokens && !stop.signal.aborted; ++round) {
    const before = produced;
    text += await completion.generateCompletion(prompt + text, options(round));
    if (produced === before || args.eos === "true") break;
}
const t2 = performance.now();
const decodeSeconds = first === null ? 0 : (t2 - first) / 1000;
// tokens/s between token a and token b (0-based, b exclusive), from the stamps
const rate = (a, b) => (b - 1 > a && stamps[b - 1] > stamps[a]) ? (b - 1 - a) * 1000 / (stamps[b - 1] - stamps[a]) : 0;
console.log(JSON.stringify({
    model: args.model,
    load_seconds: (t1 - t0) / 1000,
    generate_seconds: (t2 - t1) / 1000,
    tokens: produced,
    decode_tokens_per_second: produced > 1 && decodeSeconds > 0 ? (produced - 1) / decodeSeconds : 0,
    warmup_tokens: Math.min(warmup, stamps.length),
    warmup_tokens_per_second: rate(0, Math.min(warmup, stamps.length)),
    steady_tokens_per_second: rate(Math.min(warmup, stamps.length), stamps.length),
    // the second half of the warm-up: has the speed reached the steady one by then?
    late_warmup_tokens_per_second: rate(Math.floor(Math.min(warmup, stamps.length) / 2), Math.min(warmup, stamps.length)),
    rss_anon_bytes: rssAnon(),
    token_ms: args["token-ms"] === "true" ? stamps.map(x => Math.round(x * 10) / 10) : undefined,
    text,
}));
await context.dispose();
await model.dispose();
await llama.dispose();
