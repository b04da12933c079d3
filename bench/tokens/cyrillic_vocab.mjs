// Print each vocabulary's tokens made only of Cyrillic letters (with or without one leading
// space), in rank order (a token's id is its merge rank in these byte-level BPE vocabularies).
// Usage: node cyrillic_vocab.mjs > TOKENS.json   -> {"o200k": [..], "cl100k": [..], "llama3": [..], "claude": [..]}
import { decode as o200k } from 'gpt-tokenizer';
import { decode as cl100k } from 'gpt-tokenizer/encoding/cl100k_base';
import llama3 from 'llama3-tokenizer-js';
import { getTokenizer } from '@anthropic-ai/tokenizer';

const CYRILLIC = /^ ?[\u0400-\u052f]+$/u;
const out = {};
function scan(name, size, decode) {
  const seen = new Set();
  for (let id = 0; id < size; id++) {
    let text;
    try {
      text = decode(id);
    } catch {
      continue; // an id the vocabulary does not use
    }
    if (text && CYRILLIC.test(text)) seen.add(text);
  }
  out[name] = [...seen];
}
scan('o200k', 200000, (id) => o200k([id]));
scan('cl100k', 100256, (id) => cl100k([id]));
scan('llama3', 128000, (id) => llama3.decode([id]));
const claude = getTokenizer();
const utf8 = new TextDecoder('utf-8', { fatal: true }); // a partial character is not a letter token
scan('claude', 65000, (id) => utf8.decode(claude.decode(new Uint32Array([id]))));
claude.free();
process.stdout.write(JSON.stringify(out));
