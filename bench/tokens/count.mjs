// Count tokens of many texts with real tokenizers, offline.
// Usage: node count.mjs TEXTS.json > COUNTS.json   (TEXTS.json: a JSON array of strings)
// Prints {"o200k": [..], "cl100k": [..], "llama3": [..], "claude": [..]}, one count per text.
// The Claude tokenizer is built once and reused: its countTokens() builds a new one per call,
// which is what makes it take 100-400 ms a text.
import { readFileSync } from 'node:fs';
import { countTokens as o200k } from 'gpt-tokenizer';
import { countTokens as cl100k } from 'gpt-tokenizer/encoding/cl100k_base';
import llama3 from 'llama3-tokenizer-js';
import { getTokenizer } from '@anthropic-ai/tokenizer';

const texts = JSON.parse(readFileSync(process.argv[2], 'utf8'));
const claude = getTokenizer();
const out = { o200k: [], cl100k: [], llama3: [], claude: [] };
for (const text of texts) {
  out.o200k.push(o200k(text));
  out.cl100k.push(cl100k(text));
  out.llama3.push(llama3.encode(text, { bos: false, eos: false }).length);
  out.claude.push(claude.encode(text.normalize('NFKC'), 'all').length);
}
claude.free();
process.stdout.write(JSON.stringify(out));
