// Generates text from a GGUF model with node-llama-cpp (llama.cpp, CPU) and prints JSON:
//   node generate.mjs --model M.gguf [--tokens N] [--threads T] [--seed S] [--prompt TEXT]
// Decoding samples at temperature 1: synthetic models loop under greedy decoding.
import {getLlama, LlamaCompletion} from "node-llama-cpp";

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

const llama = await getLlama({gpu: false, build: "never", logLevel: "error"});
const t0 = performance.now();
const model = await llama.loadModel({modelPath: args.model, gpuLayers: 0,
                                     useMmap: args.mmap !== "false", useMlock: args.mlock === "true"});
const context = await model.createContext({contextSize: Math.max(256, tokens + 64), threads, batchSize: 64});
const t1 = performance.now();
const completion = new LlamaCompletion({contextSequence: context.getSequence()});
let first = null;
let produced = 0;
const text = await completion.generateCompletion(args.prompt ?? "the", {
    maxTokens: tokens,
    temperature: 1.0,
    topK: 0,
    topP: 1.0,
    seed: Number(args.seed ?? 1),
    onToken(tokens) {
        if (first === null) first = performance.now();
        produced += tokens.length;
    },
});
const t2 = performance.now();
const decodeSeconds = first === null ? 0 : (t2 - first) / 1000;
console.log(JSON.stringify({
    model: args.model,
    load_seconds: (t1 - t0) / 1000,
    generate_seconds: (t2 - t1) / 1000,
    tokens: produced,
    decode_tokens_per_second: produced > 1 && decodeSeconds > 0 ? (produced - 1) / decodeSeconds : 0,
    text,
}));
await context.dispose();
await model.dispose();
await llama.dispose();
