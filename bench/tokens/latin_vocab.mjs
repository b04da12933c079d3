// Print cl100k's tokens made only of ASCII letters (with or without one leading space).
// Usage: node latin_vocab.mjs > TOKENS.json   -> ["the", " and", ...] in id (merge rank) order
import { decode } from 'gpt-tokenizer/encoding/cl100k_base';

const LETTERS = /^ ?[A-Za-z]+$/;
const out = [];
for (let id = 0; id < 100256; id++) {
  let text;
  try {
    text = decode([id]);
  } catch {
    continue; // an id the vocabulary does not use
  }
  if (text && LETTERS.test(text)) out.push(text);
}
process.stdout.write(JSON.stringify(out));
