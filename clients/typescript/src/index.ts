// ContextClient: one async method per contextsvc RPC, in plain JS shapes (see plain.ts).
import { randomUUID } from "node:crypto";
import { setTimeout as sleep } from "node:timers/promises";
import type { DescMessage } from "@bufbuild/protobuf";
import { Code, ConnectError, createClient, type Client, type Interceptor } from "@connectrpc/connect";
import { createGrpcTransport, Http2SessionManager } from "@connectrpc/connect-node";
import {
  AppendMessagesRequestSchema,
  BuildContextRequestSchema,
  CompressRequestSchema,
  ContextService,
  CreateSessionRequestSchema,
  EstimateTokensRequestSchema,
  ListMessagesRequestSchema,
  ListSessionsRequestSchema,
  UpdateSessionRequestSchema,
} from "./gen/contextsvc/v1/context_service_pb.js";
import { EventSchema } from "./gen/contextsvc/v1/events_pb.js";
import { ContextError, toContextError, UnauthenticatedError, UnavailableError } from "./errors.js";
import { fromPlain, toPlain, type Plain } from "./plain.js";
import type {
  AppendMessagesResponse,
  BuildContextResponse,
  CompressResponse,
  EstimateTokensResponse,
  Event,
  ExpandSummaryResponse,
  ListMessagesResponse,
  ListSessionsResponse,
  RecordBaselineResponse,
  SearchHistoryResponse,
  Session,
} from "./types.js";

export * from "./errors.js";
export type * from "./types.js";
export { fromPlain, toPlain, enumFromPlain, enumToPlain, type Plain } from "./plain.js";

/** Retries of calls failing with UNAVAILABLE (only those); the same numbers pace `events()` reconnects. */
export interface RetryPolicy {
  /** Attempts per call, the first included (1 = no retry). Default 4. */
  maxAttempts: number;
  /** Wait before the first retry when the server sent no RetryInfo, in ms. Default 100. */
  initialBackoffMs: number;
  /** Longest wait between attempts (a RetryInfo delay is capped by it too), in ms. Default 5000. */
  maxBackoffMs: number;
  /** Growth of the wait per attempt. Default 2. */
  multiplier: number;
  /** Consecutive failed reconnects after which `events()` throws UnavailableError. Default 10. */
  maxReconnects: number;
}

export const DEFAULT_RETRY: RetryPolicy = {
  maxAttempts: 4,
  initialBackoffMs: 100,
  maxBackoffMs: 5000,
  multiplier: 2,
  maxReconnects: 10,
};

export interface TlsOptions {
  /** PEM roots; the system roots when unset. */
  ca?: string | Buffer;
  /** PEM client certificate and key, for mutual TLS. */
  cert?: string | Buffer;
  key?: string | Buffer;
  /** Expected server name when it differs from the target host. */
  servername?: string;
}

/**
 * Largest request sent unless `maxSendBytes` says otherwise: the server's default receive limit
 * (`limits.grpc_max_receive_bytes`, 64 MiB). A larger one is refused here as RESOURCE_EXHAUSTED, as
 * the server would: sent, Node's HTTP/2 stream stalls on the server's flow control after it
 * refused the call, until the deadline, and holds up the connection's other calls meanwhile.
 */
export const MAX_SEND_BYTES = 64 * 1024 * 1024;

export interface ClientOptions {
  /** Sent as `authorization: Bearer <token>` on every call. */
  token?: string;
  /** true = TLS with the system roots; an object sets roots, client certificate or server name. */
  tls?: boolean | TlsOptions;
  /** Default deadline of one call in ms (retries included); 0 = none. Default 30000. */
  timeoutMs?: number;
  retry?: Partial<RetryPolicy>;
  /** Largest request in bytes; set it to the server's `limits.grpc_max_receive_bytes`. Default MAX_SEND_BYTES. */
  maxSendBytes?: number;
  /** Extra interceptors (logging, tracing). */
  interceptors?: Interceptor[];
}

export interface CallOptions {
  /** Deadline of this call in ms, overriding the client's default. */
  timeoutMs?: number;
  signal?: AbortSignal;
}

/** ErrorInfo reasons of an UNAVAILABLE the server sends before it starts a call: any call may be retried. */
const NOT_STARTED_REASONS = new Set(["SHUTTING_DOWN", "STORE_NOT_READY"]);

function backoff(policy: RetryPolicy, attempt: number, hintMs?: number): number {
  if (hintMs !== undefined && hintMs > 0) return Math.min(hintMs, policy.maxBackoffMs);
  const ceiling = Math.min(policy.maxBackoffMs, policy.initialBackoffMs * policy.multiplier ** attempt);
  return ceiling / 2 + Math.random() * (ceiling / 2);
}

/** The error of a call its caller's signal cancelled. */
function abortedError(cause: unknown): ContextError {
  return new ContextError("the call was cancelled by its signal", { code: "CANCELLED", cause });
}

export class ContextClient {
  readonly retry: RetryPolicy;
  readonly timeoutMs: number;
  private readonly rpc: Client<typeof ContextService>;
  private readonly sessions: Http2SessionManager;
  private closed = false;
  private readonly badToken: boolean;

  /** `target` is `host:port` (or a full `http://` / `https://` URL). */
  constructor(target: string, options: ClientOptions = {}) {
    this.retry = { ...DEFAULT_RETRY, ...options.retry };
    this.timeoutMs = options.timeoutMs ?? 30_000;
    const tls = options.tls;
    const scheme = tls ? "https" : "http";
    const baseUrl = /^https?:\/\//.test(target) ? target : `${scheme}://${target}`;
    const interceptors: Interceptor[] = [...(options.interceptors ?? [])];
    // A token no header can carry (anything but visible ASCII once trimmed, as Node's Headers trim
    // it) failed as an untyped UNKNOWN "invalid header value" or "ByteString" error: it is a wrong
    // token, TOKEN_INVALID as the service, the gateway and the other clients call it.
    this.badToken = options.token !== undefined && !/^[\x20-\x7e]*$/.test(options.token.trim());
    if (options.token) {
      const header = `Bearer ${options.token}`;
      interceptors.unshift((next) => async (req) => {
        req.header.set("authorization", header);
        return next(req);
      });
    }
    const nodeOptions = typeof tls === "object" ? { ...tls } : {};
    this.sessions = new Http2SessionManager(baseUrl, {}, nodeOptions);
    const transport = createGrpcTransport({
      baseUrl,
      interceptors,
      nodeOptions,
      sessionManager: this.sessions,
      writeMaxBytes: options.maxSendBytes ?? MAX_SEND_BYTES,
    });
    this.rpc = createClient(ContextService, transport);
  }

  /**
   * Closes the HTTP/2 connection; the process can then exit. Calls in flight, open `events()`
   * iterators and every later call fail with a ContextError, code "CANCELLED" (as the Go client's
   * closed connection): a closed client never reconnects.
   */
  close(): void {
    this.closed = true;
    this.sessions.abort();
  }

  private closedError(): ContextError {
    return new ContextError("the ContextClient is closed", { code: "CANCELLED" });
  }

  /** Why no call can be made now (closed, or a token no header can carry); undefined when one can. */
  private refusal(): ContextError | undefined {
    if (this.closed) return this.closedError();
    if (this.badToken) {
      return new UnauthenticatedError("the API token holds characters no token has", {
        code: "UNAUTHENTICATED",
        reason: "TOKEN_INVALID",
      });
    }
    return undefined;
  }

  /**
   * One unary call, its deadline spread over retries on UNAVAILABLE. A call that is not idempotent
   * (`idempotent` false) is retried only when the server says it never started it.
   */
  private async call<T>(
    fn: (opts: { timeoutMs?: number; signal?: AbortSignal }) => Promise<T>,
    opts: CallOptions = {},
    idempotent = true,
  ): Promise<T> {
    const budget = opts.timeoutMs ?? this.timeoutMs;
    const deadline = budget > 0 ? Date.now() + budget : undefined;
    for (let attempt = 1; ; attempt++) {
      // Connect's session manager would open a new connection for a call after close().
      const refused = this.refusal();
      if (refused) throw refused;
      const remaining = deadline === undefined ? undefined : Math.max(deadline - Date.now(), 1);
      try {
        return await fn({ timeoutMs: remaining, signal: opts.signal });
      } catch (raw) {
        // Cancelled by the caller: Connect's own error stayed untranslated (a ConnectError, or the
        // AbortError of a wait between retries), where the Go client says CANCELLED too.
        if (opts.signal?.aborted) throw abortedError(raw);
        if (this.closed) throw this.closedError();
        const err = toContextError(raw);
        if (!(err instanceof UnavailableError) || err.code !== "UNAVAILABLE" || attempt >= this.retry.maxAttempts) {
          throw err;
        }
        // The server may have applied it: a second run could create a second session or fork twice.
        if (!idempotent && !NOT_STARTED_REASONS.has(err.reason)) throw err;
        const wait = backoff(this.retry, attempt - 1, err.retryDelayMs);
        if (deadline !== undefined && Date.now() + wait >= deadline) throw err;
        try {
          await sleep(wait, undefined, { signal: opts.signal });
        } catch (aborted) {
          throw abortedError(aborted);
        }
      }
    }
  }

  /** The response in plain shape, typed as the caller's T (src/types.ts, checked against the contract). */
  private plain<T>(desc: DescMessage, msg: unknown): T {
    return toPlain(desc, msg) as T;
  }

  async createSession(
    req: { profile_id?: string; name?: string; metadata?: Plain } = {},
    opts?: CallOptions,
  ): Promise<Session> {
    const m = fromPlain(CreateSessionRequestSchema, req);
    const res = await this.call((o) => this.rpc.createSession(m, o), opts, false);
    return this.plain<Session>(ContextService.method.createSession.output, res);
  }

  async getSession(sessionId: string, opts?: CallOptions): Promise<Session> {
    const res = await this.call((o) => this.rpc.getSession({ sessionId }, o), opts);
    return this.plain<Session>(ContextService.method.getSession.output, res);
  }

  async listSessions(
    req: { page_size?: number; page_token?: string; profile_id?: string; query?: string } = {},
    opts?: CallOptions,
  ): Promise<ListSessionsResponse> {
    const m = fromPlain(ListSessionsRequestSchema, req);
    const res = await this.call((o) => this.rpc.listSessions(m, o), opts);
    return this.plain<ListSessionsResponse>(ContextService.method.listSessions.output, res);
  }

  /** Updates the fields given; the update mask is derived from them. */
  async updateSession(
    sessionId: string,
    changes: { name?: string; pinned?: boolean; metadata?: Plain },
    opts?: CallOptions,
  ): Promise<Session> {
    const given = Object.fromEntries(Object.entries(changes).filter(([, v]) => v !== undefined));
    const m = fromPlain(UpdateSessionRequestSchema, { session: { id: sessionId, ...given } });
    m.updateMask = { $typeName: "google.protobuf.FieldMask", paths: Object.keys(given).sort() };
    const res = await this.call((o) => this.rpc.updateSession(m, o), opts);
    return this.plain<Session>(ContextService.method.updateSession.output, res);
  }

  async deleteSession(sessionId: string, opts?: CallOptions): Promise<void> {
    await this.call((o) => this.rpc.deleteSession({ sessionId }, o), opts, false);
  }

  /**
   * Appends messages (`{role: "user", content: "…", images: [pngBytes]}`). Without `request_id`
   * one is generated, so a retried append is applied once.
   */
  async appendMessages(
    sessionId: string,
    messages: Plain[],
    req: { request_id?: string; turn_complete?: boolean } = {},
    opts?: CallOptions,
  ): Promise<AppendMessagesResponse> {
    const m = fromPlain(AppendMessagesRequestSchema, {
      session_id: sessionId,
      messages,
      request_id: req.request_id || randomUUID(),
      turn_complete: req.turn_complete ?? false,
    });
    const res = await this.call((o) => this.rpc.appendMessages(m, o), opts);
    return this.plain<AppendMessagesResponse>(ContextService.method.appendMessages.output, res);
  }

  /**
   * One page of a buffer, newest page first: `buffer` "display" (default) or "context". Pass the
   * response's `next_page_token` as `page_token` for the next (older) page ("" on the last one);
   * the context buffer pages only by token. `before_sequence` pages the display buffer only.
   */
  async listMessages(
    sessionId: string,
    req: { buffer?: string; page_size?: number; before_sequence?: number; page_token?: string } = {},
    opts?: CallOptions,
  ): Promise<ListMessagesResponse> {
    const m = fromPlain(ListMessagesRequestSchema, { session_id: sessionId, ...req });
    const res = await this.call((o) => this.rpc.listMessages(m, o), opts);
    return this.plain<ListMessagesResponse>(ContextService.method.listMessages.output, res);
  }

  /** `phase`: "pre_turn" (default) or "mid_turn". */
  async buildContext(
    sessionId: string,
    req: { profile?: Plain; incoming?: Plain; phase?: string; auto_compress?: boolean } = {},
    opts?: CallOptions,
  ): Promise<BuildContextResponse> {
    const m = fromPlain(BuildContextRequestSchema, { session_id: sessionId, ...req });
    const res = await this.call((o) => this.rpc.buildContext(m, o), opts);
    return this.plain<BuildContextResponse>(ContextService.method.buildContext.output, res);
  }

  async estimateTokens(
    req: { session_id?: string; messages?: Plain[]; model?: string; profile?: Plain },
    opts?: CallOptions,
  ): Promise<EstimateTokensResponse> {
    const m = fromPlain(EstimateTokensRequestSchema, req);
    const res = await this.call((o) => this.rpc.estimateTokens(m, o), opts);
    return this.plain<EstimateTokensResponse>(ContextService.method.estimateTokens.output, res);
  }

  async recordBaseline(
    sessionId: string,
    viewId: string,
    promptTokens: number,
    opts?: CallOptions,
  ): Promise<RecordBaselineResponse> {
    const res = await this.call(
      (o) => this.rpc.recordBaseline({ sessionId, viewId, promptTokens: BigInt(promptTokens) }, o),
      opts,
      false,
    );
    return this.plain<RecordBaselineResponse>(ContextService.method.recordBaseline.output, res);
  }

  async compress(
    sessionId: string,
    req: { profile?: Plain; reason?: string; dry_run?: boolean } = {},
    opts?: CallOptions,
  ): Promise<CompressResponse> {
    const m = fromPlain(CompressRequestSchema, { session_id: sessionId, ...req });
    const res = await this.call((o) => this.rpc.compress(m, o), opts, req.dry_run === true);
    return this.plain<CompressResponse>(ContextService.method.compress.output, res);
  }

  async searchHistory(
    sessionId: string,
    query: string,
    req: { limit?: number } = {},
    opts?: CallOptions,
  ): Promise<SearchHistoryResponse> {
    const res = await this.call((o) => this.rpc.searchHistory({ sessionId, query, limit: req.limit ?? 0 }, o), opts);
    return this.plain<SearchHistoryResponse>(ContextService.method.searchHistory.output, res);
  }

  async expandSummary(sessionId: string, sequenceNumber: number, opts?: CallOptions): Promise<ExpandSummaryResponse> {
    const res = await this.call(
      (o) => this.rpc.expandSummary({ sessionId, sequenceNumber: BigInt(sequenceNumber) }, o),
      opts,
    );
    return this.plain<ExpandSummaryResponse>(ContextService.method.expandSummary.output, res);
  }

  async forkSession(sessionId: string, req: { at_sequence?: number } = {}, opts?: CallOptions): Promise<Session> {
    const res = await this.call(
      (o) => this.rpc.forkSession({ sessionId, atSequence: BigInt(req.at_sequence ?? 0) }, o),
      opts,
      false,
    );
    return this.plain<Session>(ContextService.method.forkSession.output, res);
  }

  /**
   * Events of one session (or of every session the caller may read; `sessionId` ""), as plain
   * objects with `event_id`, `session_id`, `time`, `payload` (the kind, e.g. "messages_appended")
   * and that kind's fields under its name.
   *
   * A stream that drops (UNAVAILABLE, or closed by the server) is reopened after the last event id
   * seen, so within the server's retention window no event is lost or repeated. Waits between
   * reconnects back off exponentially up to `retry.maxBackoffMs`; after `retry.maxReconnects`
   * consecutive failures the iterator throws UnavailableError. Other errors are thrown at once.
   * The iterator ends after a `session_deleted` event of its session, or when `signal` aborts.
   * However iteration ends (`break`, `return`, a throw, the signal) the open call is cancelled, so
   * the server's stream slot is freed at once (the server counts open streams per user).
   */
  async *events(sessionId = "", opts: { afterEventId?: number; signal?: AbortSignal } = {}): AsyncGenerator<Event> {
    let last = BigInt(opts.afterEventId ?? 0);
    let failures = 0;
    const outer = opts.signal;
    for (;;) {
      const refused = this.refusal();
      if (refused) throw refused;
      let hint: number | undefined;
      // One controller per call: aborted by the caller's signal, and by us when iteration ends.
      const call = new AbortController();
      const forward = (): void => call.abort(outer?.reason);
      if (outer?.aborted) forward();
      else outer?.addEventListener("abort", forward, { once: true });
      try {
        for await (const ev of this.rpc.streamEvents({ sessionId, afterEventId: last }, { signal: call.signal })) {
          failures = 0;
          last = ev.eventId;
          const plain = toPlain(EventSchema, ev) as Event;
          yield plain;
          if (sessionId && plain.payload === "session_deleted") return;
        }
      } catch (raw) {
        if (opts.signal?.aborted) return;
        if (this.closed) throw this.closedError();
        if (raw instanceof ConnectError && raw.code === Code.Canceled && opts.signal?.aborted) return;
        const err = toContextError(raw);
        if (!(err instanceof ContextError) || err.code !== "UNAVAILABLE") throw err;
        hint = err.retryDelayMs;
        if (failures >= this.retry.maxReconnects) throw err;
      } finally {
        // Runs on break/return at the `yield` too: without it the HTTP/2 stream stays open.
        outer?.removeEventListener("abort", forward);
        call.abort();
      }
      if (failures >= this.retry.maxReconnects) {
        throw new UnavailableError(`event stream closed ${failures} times in a row`, { code: "UNAVAILABLE" });
      }
      try {
        await sleep(backoff(this.retry, failures, hint), undefined, { signal: opts.signal });
      } catch {
        return; // aborted while waiting
      }
      failures++;
    }
  }
}
