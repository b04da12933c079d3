// Count tokens for a long-running caller: one JSON request per stdin line, one answer per line.
// Request: {"t": "o200k" | "cl100k" | "llama3" | "claude", "x": ["text", ...]}
// Answer:  [count, ...]   (one count per text, in order)
// Used by bench/fidelity/soak.py, which asks for the true size of every view it is served.
import { createInterface } from 'node:readline';
import { countTokens as o200k } from 'gpt-tokenizer';
import { countTokens as cl100k } from 'gpt-tokenizer/encoding/cl100k_base';
import llama3 from 'llama3-tokenizer-js';
import { getTokenizer } from '@anthropic-ai/tokenizer';

let claude = null; // built on first use and kept: building it is what costs 100-400 ms
const counters = {
  o200k: (text) => o200k(text),
  cl100k: (text) => cl100k(text),
  llama3: (text) => llama3.encode(text, { bos: false, eos: false }).length,
  claude: (text) => {
    claude ??= getTokenizer();
    return claude.encode(text.normalize('NFKC'), 'all').length;
  },
};

const lines = createInterface({ input: process.stdin, crlfDelay: Infinity });
for await (const line of lines) {
  if (!line.trim()) continue;
  const { t, x } = JSON.parse(line);
  const count = counters[t];
  if (!count) throw new Error(`unknown tokenizer ${t}`);
  process.stdout.write(JSON.stringify(x.map(count)) + '\n');
}
claude?.free();
