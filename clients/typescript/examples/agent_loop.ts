// A minimal agent loop on contextsvc with a local fake model.
//   node dist/examples/agent_loop.js 127.0.0.1:50051
// With CONTEXTSVC_TOKEN set it sends that bearer token; with CONTEXTSVC_CA_FILE (a PEM bundle) it
// connects over TLS trusting those roots.
import { readFileSync } from "node:fs";
import { ContextClient, type Plain } from "../src/index.js";

const PROFILE = { model: "fake-model", context_window: 8192, system_prompt: "You are a coding agent." };

/** Asks for one tool call, then answers; reports prompt tokens like a provider would. */
function fakeModel(messages: Plain[]): [Plain, number] {
  const promptTokens = Math.floor(messages.reduce((n, m) => n + m.content.length, 0) / 4) + 3 * messages.length;
  const last = messages[messages.length - 1]!;
  if (last.role === "user") {
    const call = { id: "call-1", name: "read_file", arguments_json: JSON.stringify({ path: "main.py" }) };
    return [{ role: "assistant", content: "", tool_calls: [call] }, promptTokens];
  }
  return [{ role: "assistant", content: `main.py has ${last.content.length} characters.` }, promptTokens];
}

const caFile = process.env.CONTEXTSVC_CA_FILE;
const client = new ContextClient(process.argv[2] ?? "127.0.0.1:50051", {
  token: process.env.CONTEXTSVC_TOKEN,
  tls: caFile ? { ca: readFileSync(caFile) } : false,
});
const sid = (await client.createSession({ name: "agent-loop" })).id as string;
await client.appendMessages(sid, [{ role: "user", content: "How long is main.py?" }]);
let phase = "pre_turn";
for (let i = 0; i < 8; i++) {
  // bounded: at most 8 model calls in this turn
  const view = await client.buildContext(sid, { profile: PROFILE, phase });
  const [reply, promptTokens] = fakeModel(view.messages);
  await client.recordBaseline(sid, view.view_id, promptTokens);
  phase = "mid_turn";
  if (!reply.tool_calls) {
    await client.appendMessages(sid, [reply], { turn_complete: true });
    console.log("answer:", reply.content);
    break;
  }
  await client.appendMessages(sid, [reply, { role: "tool", tool_call_id: "call-1", content: "print('hello')\n" }]);
}
const { messages } = await client.listMessages(sid);
console.log("done:", messages.length, "messages in the display history");
client.close();
