// Runs clients/scenario/scenario.json with the TypeScript client; writes the transcript as JSON.
//   node dist/examples/scenario.js 127.0.0.1:50051 transcript.json
import { readFileSync, writeFileSync } from "node:fs";
import path from "node:path";
import { fileURLToPath } from "node:url";
import { ContextClient, type Plain } from "../src/index.js";

const here = path.dirname(fileURLToPath(import.meta.url));
const scenario = JSON.parse(readFileSync(path.resolve(here, "../../../scenario/scenario.json"), "utf8")) as {
  steps: { op: string; args: Plain }[];
};

function messages(raw: Plain[]): Plain[] {
  return raw.map((m) => ({ ...m, images: (m.images ?? []).map((b: string) => Buffer.from(b, "base64")) }));
}

async function run(address: string): Promise<Plain[]> {
  const c = new ContextClient(address, { timeoutMs: 30_000 });
  const transcript: Plain[] = [];
  let sid = "";
  let viewId = "";
  let summarySeq = 0;
  for (const { op, args: a } of scenario.steps) {
    let result: unknown;
    switch (op) {
      case "create_session":
        result = await c.createSession({ name: a.name, metadata: a.metadata });
        sid = (result as Plain).id;
        break;
      case "append_messages":
        result = await c.appendMessages(sid, messages(a.messages), { turn_complete: a.turn_complete });
        break;
      case "build_context":
        result = await c.buildContext(sid, { profile: a.profile, auto_compress: a.auto_compress, incoming: a.incoming });
        viewId = (result as Plain).view_id;
        break;
      case "record_baseline":
        result = await c.recordBaseline(sid, viewId, a.prompt_tokens);
        break;
      case "compress":
        result = await c.compress(sid, { profile: a.profile, reason: a.reason });
        break;
      case "events": {
        const events: Plain[] = [];
        for await (const e of c.events(sid, { afterEventId: a.after_event_id })) {
          events.push(e);
          if (e.payload === a.until) {
            if (e.payload === "context_compressed") summarySeq = e.context_compressed.summary_sequence;
            break;
          }
        }
        result = events;
        break;
      }
      case "list_messages":
        result = await c.listMessages(sid, { buffer: a.buffer });
        break;
      case "search_history":
        result = await c.searchHistory(sid, a.query, { limit: a.limit });
        break;
      case "expand_summary":
        result = await c.expandSummary(sid, summarySeq);
        break;
      case "fork_session":
        result = await c.forkSession(sid, { at_sequence: a.at_sequence });
        sid = (result as Plain).id;
        break;
      default:
        throw new Error(`unknown op ${op}`);
    }
    transcript.push({ op, result });
  }
  c.close();
  return transcript;
}

const [address, out] = process.argv.slice(2);
if (!address || !out) throw new Error("usage: scenario.js ADDRESS OUT");
const transcript = await run(address);
writeFileSync(
  out,
  JSON.stringify(transcript, (_k, v: unknown) => (v instanceof Uint8Array ? Buffer.from(v).toString("base64") : v), 1),
);
