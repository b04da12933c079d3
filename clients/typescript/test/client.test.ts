// ContextClient against a real `contextsvc serve` process (node's test runner).
import assert from "node:assert/strict";
import { execFileSync } from "node:child_process";
import { mkdtempSync, readFileSync, rmSync } from "node:fs";
import net from "node:net";
import os from "node:os";
import path from "node:path";
import { after, before, test } from "node:test";
import { create } from "@bufbuild/protobuf";
import { Code, ConnectError } from "@connectrpc/connect";
import {
  ContextClient,
  ContextError,
  ContextTooLargeError,
  EventsExpiredError,
  FailedPreconditionError,
  InternalError,
  InvalidArgumentError,
  NotFoundError,
  NothingToCompactError,
  RequestIdReusedError,
  ResourceExhaustedError,
  SessionDamagedError,
  toContextError,
  UnauthenticatedError,
  UnavailableError,
  type Plain,
} from "../src/index.js";
import { ErrorInfoSchema } from "../src/gen/google/rpc/error_details_pb.js";
import { startServer, TcpProxy, until, type Server } from "./support.js";

const FAST = { maxAttempts: 8, initialBackoffMs: 50, maxBackoffMs: 500, maxReconnects: 20 };
const PNG_1X1 = Buffer.from(
  "89504e470d0a1a0a0000000d4948445200000001000000010806000000" +
    "1f15c4890000000d49444154789c6360f8cfc0000003010100c9fe92ef0000000049454e44ae426082",
  "hex",
);

let server: Server;

/**
 * Runs `open` (which opens an event stream), again after the server's delay when it refuses with
 * the stream quota, at most `retries` times: the server frees a cancelled stream's slot a moment
 * after the cancel arrives, not before the next call on the same connection.
 */
async function pastQuota<T>(open: () => Promise<T>, retries = 3): Promise<T> {
  for (let refused = 0; ; refused++) {
    try {
      return await open();
    } catch (e) {
      if (!(e instanceof ResourceExhaustedError) || refused >= retries) throw e;
      await new Promise((r) => setTimeout(r, e.retryDelayMs ?? 1000));
    }
  }
}
let client: ContextClient;

before(async () => {
  server = await startServer();
  client = new ContextClient(server.address, { timeoutMs: 10_000, retry: FAST });
});
after(() => server.stop());

test("every RPC in plain shapes", async () => {
  const s = await client.createSession({ name: "demo", metadata: { team: "core", n: 2 } });
  assert.equal(s.name, "demo");
  assert.deepEqual(s.metadata, { team: "core", n: 2 });
  assert.ok(s.create_time instanceof Date);
  const sid = s.id as string;
  const appended = await client.appendMessages(
    sid,
    [
      { role: "user", content: "read main.py", images: [PNG_1X1] },
      { role: "assistant", content: "", tool_calls: [{ id: "c1", name: "read", arguments_json: "{}" }] },
      { role: "tool", tool_call_id: "c1", content: "print('hi')", metadata: { source: "fs" } },
    ],
    { turn_complete: true },
  );
  assert.deepEqual(appended.sequence_numbers, [1, 2, 3]);
  assert.equal(typeof appended.context_tokens, "number");
  const page = await client.listMessages(sid, { buffer: "context" });
  assert.deepEqual(page.messages.map((m: Plain) => m.role), ["user", "assistant", "tool"]);
  assert.equal(page.messages[0]!.images[0]!.mime_type, "image/png");
  assert.equal(page.messages[2]!.flags.is_context, true);
  const view = await client.buildContext(sid, { profile: { model: "m", system_prompt: "be brief" }, phase: "pre_turn" });
  assert.equal(view.messages[0]!.content, "be brief");
  assert.equal(view.compression, null);
  const recorded = await client.recordBaseline(sid, view.view_id, view.estimate.total);
  assert.equal(recorded.recorded, true);
  assert.equal(recorded.calibration.model, "m");
  const est = await client.estimateTokens({ messages: [{ role: "user", content: "x".repeat(100) }], model: "m" });
  assert.ok(est.estimate.total > 0);
  const renamed = await client.updateSession(sid, { name: "renamed", pinned: true });
  assert.equal(renamed.name, "renamed");
  assert.equal(renamed.pinned, true);
  assert.deepEqual(renamed.metadata, s.metadata);
  const listed = await client.listSessions({ query: "renamed" });
  assert.deepEqual(listed.sessions.map((x: Plain) => x.id), [sid]);
  const fork = await client.forkSession(sid, { at_sequence: 2 });
  assert.equal(fork.display_message_count, 2);
  assert.deepEqual((await client.searchHistory(sid, "main")).chunks, []);
  await client.deleteSession(fork.id);
  await assert.rejects(client.getSession(fork.id), (e: unknown) => e instanceof NotFoundError && e.code === "NOT_FOUND");
});

test("typed errors carry the ErrorInfo reason", async () => {
  const sid = (await client.createSession()).id as string;
  await assert.rejects(client.compress(sid), (e: unknown) => {
    assert.ok(e instanceof NothingToCompactError && e instanceof FailedPreconditionError);
    assert.ok(!(e instanceof ContextTooLargeError));
    assert.equal(e.reason, "NOTHING_TO_COMPACT");
    assert.equal(e.domain, "contextsvc.dev");
    return true;
  });
  await assert.rejects(client.appendMessages(sid, [{ role: "user", content: "x" }, { content: "no role" }]), (e: unknown) => {
    assert.ok(e instanceof InvalidArgumentError);
    assert.ok(e.violations[0]!.field.startsWith("messages[1]"));
    return true;
  });
  await assert.rejects(client.appendMessages(sid, [{ role: "robot" }]), /unknown value "robot"/);
  // The same request id with other messages: its own class, as the Python client's RequestIdReused.
  await client.appendMessages(sid, [{ role: "user", content: "x" }], { request_id: "turn-1" });
  await assert.rejects(client.appendMessages(sid, [{ role: "user", content: "y" }], { request_id: "turn-1" }), (e: unknown) => {
    assert.ok(e instanceof RequestIdReusedError && e instanceof InvalidArgumentError, String(e));
    assert.equal(e.reason, "REQUEST_ID_REUSED");
    return true;
  });
});

test("every reason with a class of its own in the Python hierarchy has one here", () => {
  const cases: [Code, string, Function, Function][] = [
    [Code.InvalidArgument, "REQUEST_ID_REUSED", RequestIdReusedError, InvalidArgumentError],
    [Code.FailedPrecondition, "SESSION_DAMAGED", SessionDamagedError, FailedPreconditionError],
    [Code.FailedPrecondition, "EVENTS_EXPIRED", EventsExpiredError, FailedPreconditionError],
  ];
  for (const [code, reason, kind, family] of cases) {
    const info = create(ErrorInfoSchema, { reason, domain: "contextsvc.dev" });
    const err = toContextError(new ConnectError("m", code, undefined, [{ desc: ErrorInfoSchema, value: info }]));
    assert.ok(err instanceof kind && err instanceof family, `${reason}: ${String(err)}`);
  }
});

test("the deadline is enforced", async () => {
  // A peer that accepts the connection and never answers: the call can only end by its deadline
  // (a 1 ms deadline against the real server sometimes lost the race to a warm loopback call).
  const accepted = new Set<net.Socket>();
  const silent = net.createServer((socket) => void accepted.add(socket));
  await new Promise<void>((resolve) => silent.listen(0, "127.0.0.1", resolve));
  const port = (silent.address() as net.AddressInfo).port;
  const c = new ContextClient(`127.0.0.1:${port}`, { retry: { ...FAST, maxAttempts: 1 } });
  try {
    const began = Date.now();
    await assert.rejects(c.listSessions({}, { timeoutMs: 200 }), (e: unknown) => {
      assert.ok(e instanceof UnavailableError);
      assert.equal(e.code, "DEADLINE_EXCEEDED");
      return true;
    });
    assert.ok(Date.now() - began < 5_000);
  } finally {
    c.close();
    for (const socket of accepted) socket.destroy();
    silent.close();
  }
});

test("a closed client fails its calls and its event iterators with CANCELLED and never reconnects", async () => {
  const c = new ContextClient(server.address, { timeoutMs: 10_000, retry: FAST });
  const s = await c.createSession({ name: "closing" });
  await c.appendMessages(s.id, [{ role: "user", content: "one" }]);
  const events = c.events(s.id, { afterEventId: 1 }); // from the start of the retained log
  assert.equal((await events.next()).value?.payload, "messages_appended"); // the stream is open
  c.close();
  const closedError = (e: unknown): boolean => {
    assert.ok(e instanceof ContextError, String(e));
    assert.equal(e.code, "CANCELLED");
    assert.equal(e.reason, "CANCELLED");
    return true;
  };
  await assert.rejects(events.next(), closedError);
  // Before: the call opened a new connection and succeeded, so close() did not close the client.
  await assert.rejects(c.getSession(s.id), closedError);
  await assert.rejects(c.events(s.id).next(), closedError);
});

test("a token no header can carry is UNAUTHENTICATED, reason TOKEN_INVALID, for calls and events", async () => {
  // Node refused such a header with an untyped error the client reported as UNKNOWN.
  for (const token of ["tok\u0000en", "t\u4e2dken"]) {
    const c = new ContextClient(server.address, { token, timeoutMs: 10_000, retry: FAST });
    const invalid = (e: unknown): boolean => {
      assert.ok(e instanceof UnauthenticatedError, String(e));
      assert.equal(e.reason, "TOKEN_INVALID");
      assert.equal(e.code, "UNAUTHENTICATED");
      return true;
    };
    try {
      await assert.rejects(c.listSessions(), invalid);
      await assert.rejects(c.events("").next(), invalid);
    } finally {
      c.close();
    }
  }
});

test("a call its signal aborts fails with a ContextError CANCELLED, in the call or between retries", async () => {
  const cancelled = (e: unknown): boolean => {
    assert.ok(e instanceof ContextError, String(e)); // was Connect's own ConnectError / an AbortError
    assert.equal(e.code, "CANCELLED");
    return true;
  };
  const ac = new AbortController();
  const pending = client.listSessions({}, { signal: ac.signal });
  ac.abort();
  await assert.rejects(pending, cancelled);
  // Nothing listens there: the client waits between retries, and the abort ends the wait.
  const silent = net.createServer();
  await new Promise<void>((resolve) => silent.listen(0, "127.0.0.1", resolve));
  const port = (silent.address() as net.AddressInfo).port;
  await new Promise<void>((resolve) => silent.close(() => resolve()));
  const down = new ContextClient(`127.0.0.1:${port}`, { retry: { ...FAST, initialBackoffMs: 5_000, maxBackoffMs: 5_000 } });
  try {
    const waiting = new AbortController();
    const call = down.listSessions({}, { signal: waiting.signal, timeoutMs: 30_000 });
    setTimeout(() => waiting.abort(), 300);
    await assert.rejects(call, cancelled);
  } finally {
    down.close();
  }
});

test("text with a lone surrogate is refused, not sent with U+FFFD in its place", async () => {
  const s = await client.createSession({ name: "surrogates" });
  for (const message of [
    { role: "user", content: "a\ud800b" },
    { role: "user", content: "ok", metadata: { note: ["x", "\udc00"] } },
    { role: "assistant", content: "", tool_calls: [{ id: "c\ud83d", name: "ls", arguments_json: "{}" }] },
  ]) {
    await assert.rejects(client.appendMessages(s.id, [message]), (e: unknown) => {
      assert.ok(e instanceof TypeError, String(e));
      assert.match(e.message, /lone surrogate/);
      return true;
    });
  }
  await assert.rejects(client.createSession({ name: "\ud800" }), TypeError);
  // A well-formed pair (an emoji) is text like any other.
  await client.appendMessages(s.id, [{ role: "user", content: "\ud83e\udd80" }]);
  const page = await client.listMessages(s.id);
  assert.deepEqual(page.messages.map((m) => m.content), ["\u{1f980}"]);
});

test("a cancelled call's code is named CANCELLED, as in gRPC and the other clients", () => {
  const e = toContextError(new ConnectError("cancelled", Code.Canceled, new Headers({ "grpc-status": "1" })));
  assert.ok(e instanceof ContextError);
  assert.equal(e.code, "CANCELLED");
});

test("a request over the server's size limit is RESOURCE_EXHAUSTED at once and the connection stays usable", async () => {
  // 17 messages of 4 Mi characters, each within its own limit, are more than the server reads
  // (limits.grpc_max_receive_bytes, 64 MiB). The Python and Go clients get the server's
  // RESOURCE_EXHAUSTED at once; Node's HTTP/2 stream used to stall on flow control instead, until
  // the deadline, holding up every later call on the connection.
  const c = new ContextClient(server.address, { timeoutMs: 8_000, retry: FAST });
  try {
    const sid = (await c.createSession()).id;
    const big = { role: "user", content: "y".repeat(4 * 1024 * 1024) };
    const began = Date.now();
    await assert.rejects(c.appendMessages(sid, Array(17).fill(big)), (e: unknown) => {
      assert.ok(e instanceof ResourceExhaustedError, String(e));
      assert.equal(e.code, "RESOURCE_EXHAUSTED");
      return true;
    });
    assert.ok(Date.now() - began < 4_000, `took ${Date.now() - began} ms`);
    assert.equal((await c.getSession(sid, { timeoutMs: 2_000 })).id, sid);
  } finally {
    c.close();
  }
});

test("a bearer token is sent on every call", async () => {
  let seen = "";
  const c = new ContextClient(server.address, {
    token: "t0ken",
    interceptors: [
      (next) => async (req) => {
        seen = req.header.get("authorization") ?? "";
        return next(req);
      },
    ],
  });
  assert.ok((await c.createSession()).id);
  assert.equal(seen, "Bearer t0ken");
});

test("UNAVAILABLE is retried until the server is reachable again", async () => {
  const proxy = await new TcpProxy(server.address).start();
  const c = new ContextClient(proxy.address, { timeoutMs: 10_000, retry: FAST });
  const sid = (await c.createSession()).id as string;
  await proxy.stopListening();
  setTimeout(() => void proxy.start(), 400);
  const appended = await c.appendMessages(sid, [{ role: "user", content: "after the outage" }]);
  assert.deepEqual(appended.sequence_numbers, [1]);
  await proxy.stopListening();
  const once = new ContextClient(proxy.address, { timeoutMs: 5000, retry: { maxAttempts: 1 } });
  await assert.rejects(once.getSession(sid), UnavailableError);
});

test("calls that are not idempotent are not retried on a bare UNAVAILABLE", async () => {
  const proxy = await new TcpProxy(server.address).start();
  const c = new ContextClient(proxy.address, { timeoutMs: 10_000, retry: FAST });
  const sid = (await c.createSession()).id as string;
  await proxy.stopListening();
  // Back after 1 s: a retried call would get through; CreateSession and ForkSession must not.
  setTimeout(() => void proxy.start(), 1000);
  await assert.rejects(c.createSession(), UnavailableError);
  await assert.rejects(c.forkSession(sid), UnavailableError);
  // An idempotent call in the same outage waits it out.
  assert.equal((await c.getSession(sid)).id, sid);
  await proxy.stopListening();
});

test("request ids make appends idempotent; one is generated when not given", async () => {
  const sid = (await client.createSession()).id as string;
  const ac = new AbortController();
  const seen: Plain[] = [];
  const watching = (async () => {
    for await (const e of client.events(sid, { signal: ac.signal })) {
      seen.push(e);
      if (seen.length === 2) break;
    }
  })();
  await new Promise((r) => setTimeout(r, 300));
  const first = await client.appendMessages(sid, [{ role: "user", content: "a" }], { request_id: "r-1" });
  const again = await client.appendMessages(sid, [{ role: "user", content: "a" }], { request_id: "r-1" });
  assert.deepEqual(first.sequence_numbers, [1]);
  assert.deepEqual(again.sequence_numbers, [1]);
  await client.appendMessages(sid, [{ role: "user", content: "b" }]);
  await watching;
  const ids = seen.map((e) => e.messages_appended.request_id as string);
  assert.equal(ids[0], "r-1");
  assert.match(ids[1]!, /^[0-9a-f-]{36}$/);
});

test("events resume after a dropped stream without gaps or duplicates", async () => {
  const sid = (await client.createSession()).id as string;
  const proxy = await new TcpProxy(server.address).start();
  const watcher = new ContextClient(proxy.address, { retry: FAST });
  const seen: Plain[] = [];
  const watching = (async () => {
    for await (const e of watcher.events(sid)) seen.push(e);
  })();
  await new Promise((r) => setTimeout(r, 300));
  for (let i = 0; i < 3; i++) await client.appendMessages(sid, [{ role: "user", content: `m${i}` }]);
  await until(() => seen.length === 3);
  proxy.drop();
  for (let i = 3; i < 6; i++) await client.appendMessages(sid, [{ role: "user", content: `m${i}` }]);
  proxy.drop();
  await until(() => seen.length === 6);
  await client.deleteSession(sid);
  await watching;
  await proxy.stopListening();
  assert.deepEqual(seen.map((e) => e.payload), [...Array(6).fill("messages_appended"), "session_deleted"]);
  assert.deepEqual(seen.slice(0, 6).map((e) => e.messages_appended.sequence_numbers[0]), [1, 2, 3, 4, 5, 6]);
  const ids = seen.map((e) => e.event_id as number);
  assert.deepEqual(ids, [...new Set(ids)].sort((a, b) => a - b));
});

test("events give up after the reconnect cap", async () => {
  const proxy = await new TcpProxy(server.address).start();
  await proxy.stopListening();
  const c = new ContextClient(proxy.address, { retry: { initialBackoffMs: 10, maxBackoffMs: 20, maxReconnects: 3 } });
  await assert.rejects(async () => {
    for await (const _ of c.events()) void _;
  }, UnavailableError);
});

test("listMessages pages the context buffer by page_token", async () => {
  const sid = (await client.createSession()).id;
  for (let i = 0; i < 5; i++) await client.appendMessages(sid, [{ role: "user", content: `m${i}` }]);
  const pages: string[][] = [];
  let token = "";
  do {
    const page = await client.listMessages(sid, { buffer: "context", page_size: 2, page_token: token });
    assert.equal(page.next_before_sequence, 0);
    pages.push(page.messages.map((m) => m.content));
    token = page.next_page_token;
  } while (token && pages.length < 10);
  // Newest page first, each page oldest first: reversed, the pages concatenate to the buffer.
  assert.deepEqual(pages, [["m3", "m4"], ["m1", "m2"], ["m0"]]);
});

test("breaking out of events() cancels the stream, so the per-user stream quota is not used up", async () => {
  const quota = await startServer({ env: { CONTEXTSVC_QUOTAS__STREAMS_PER_USER: "2" } });
  const c = new ContextClient(quota.address, { timeoutMs: 10_000, retry: FAST });
  try {
    const sid = (await c.createSession()).id;
    // The first loop waits for a live event; the others replay the events after it.
    let firstId = 0;
    for (let i = 0; i < 6; i++) {
      const appending =
        i === 0
          ? new Promise((r) => setTimeout(r, 300)).then(() => c.appendMessages(sid, [{ role: "user", content: "m0" }]))
          : c.appendMessages(sid, [{ role: "user", content: `m${i}` }]);
      if (i > 0) await appending;
      // No signal: only the generator's own cleanup can close the call on `break`.
      const got = await pastQuota(async () => {
        let id: number | undefined;
        for await (const e of c.events(sid, { afterEventId: firstId })) {
          id = e.event_id;
          break;
        }
        return id;
      });
      await appending;
      assert.ok(got !== undefined && got > firstId, `loop ${i}: an event after ${firstId}`);
      if (i === 0) firstId = got;
    }
  } finally {
    c.close();
    quota.stop();
  }
});

test("RESOURCE_EXHAUSTED is a ResourceExhaustedError with the limit and the RetryInfo delay", async () => {
  const quota = await startServer({ env: { CONTEXTSVC_QUOTAS__STREAMS_PER_USER: "1" } });
  const c = new ContextClient(quota.address, { timeoutMs: 10_000, retry: FAST });
  const ac = new AbortController();
  try {
    const sid = (await c.createSession()).id;
    let heldId = 0;
    const holding = (async () => {
      for await (const e of c.events(sid, { signal: ac.signal })) heldId = e.event_id;
    })();
    await new Promise((r) => setTimeout(r, 300));
    await c.appendMessages(sid, [{ role: "user", content: "held" }]);
    await until(() => heldId > 0);
    await assert.rejects(
      async () => {
        for await (const _ of c.events(sid)) void _;
      },
      (e: unknown) => {
        assert.ok(e instanceof ResourceExhaustedError, String(e));
        assert.equal(e.code, "RESOURCE_EXHAUSTED");
        assert.equal(e.reason, "QUOTA_EXCEEDED");
        assert.equal(e.limit, "streams_per_user");
        assert.equal(e.subject, "user:anonymous");
        assert.equal(e.retryDelayMs, 1000);
        assert.ok(e.cause instanceof ConnectError);
        return true;
      },
    );
    ac.abort();
    await holding;
    // The aborted stream gives its slot back.
    await c.appendMessages(sid, [{ role: "user", content: "x" }]);
    const kind = await pastQuota(async () => {
      const signal = AbortSignal.timeout(5000);
      for await (const e of c.events(sid, { afterEventId: heldId, signal })) return e.payload;
      return undefined;
    });
    assert.equal(kind, "messages_appended");
  } finally {
    ac.abort();
    c.close();
    quota.stop();
  }
});

// openssl makes the throwaway certificate (the test environment has it, as the server's TLS tests do).
test("a TLS server whose certificate is not trusted is UNAVAILABLE, not INTERNAL", async () => {
  const dir = mkdtempSync(path.join(os.tmpdir(), "contextsvc-tls-"));
  const [crt, key] = [path.join(dir, "server.crt"), path.join(dir, "server.key")];
  execFileSync("openssl", [
    "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=localhost",
    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1", "-keyout", key, "-out", crt,
  ], { stdio: "ignore" });
  const tls = await startServer({ args: ["--tls-cert", crt, "--tls-key", key] });
  const untrusted = new ContextClient(tls.address, { tls: true, timeoutMs: 5000, retry: { maxAttempts: 1 } });
  const trusted = new ContextClient(tls.address, { tls: { ca: readFileSync(crt) }, timeoutMs: 5000 });
  try {
    await assert.rejects(untrusted.listSessions(), (e: unknown) => {
      assert.ok(e instanceof UnavailableError && !(e instanceof InternalError), String(e));
      assert.equal(e.code, "UNAVAILABLE");
      assert.match(e.message, /certificate/);
      assert.ok(e.cause instanceof ConnectError);
      return true;
    });
    // The same server, its certificate trusted: the failure above was the handshake, not the server.
    assert.ok((await trusted.createSession()).id);
  } finally {
    untrusted.close();
    trusted.close();
    tls.stop();
    rmSync(dir, { recursive: true, force: true });
  }
});
