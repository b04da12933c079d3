// Typed errors decoded from the google.rpc.Status details the server sends (ErrorInfo reason,
// BadRequest field violations, RetryInfo delay, QuotaFailure subject). The classes mirror the
// Python hierarchy (contextsvc/errors.py): catch the specific one (ContextTooLargeError) or its family.
import { Code, ConnectError } from "@connectrpc/connect";
import {
  BadRequestSchema,
  ErrorInfoSchema,
  QuotaFailureSchema,
  RetryInfoSchema,
} from "./gen/google/rpc/error_details_pb.js";

export interface FieldViolation {
  field: string;
  description: string;
}

export class ContextError extends Error {
  /** The gRPC status code name, e.g. "FAILED_PRECONDITION". */
  readonly code: string;
  /** ErrorInfo reason, e.g. "CONTEXT_TOO_LARGE" (the status code name when the server sent none). */
  readonly reason: string;
  readonly domain: string;
  readonly metadata: Record<string, string>;
  readonly violations: FieldViolation[];
  /** RetryInfo delay in milliseconds, when the server asked for one. */
  readonly retryDelayMs: number | undefined;
  readonly cause: unknown;

  constructor(
    message: string,
    init: {
      code: string;
      reason?: string;
      domain?: string;
      metadata?: Record<string, string>;
      violations?: FieldViolation[];
      retryDelayMs?: number;
      cause?: unknown;
      /** QuotaFailure subject (kept by ResourceExhaustedError). */
      subject?: string;
    },
  ) {
    super(message);
    this.name = new.target.name;
    this.code = init.code;
    this.reason = init.reason || init.code;
    this.domain = init.domain ?? "";
    this.metadata = init.metadata ?? {};
    this.violations = init.violations ?? [];
    this.retryDelayMs = init.retryDelayMs;
    this.cause = init.cause;
  }
}

export class NotFoundError extends ContextError {}
export class InvalidArgumentError extends ContextError {}
/** An appendMessages `request_id` used before with other messages (REQUEST_ID_REUSED): nothing was appended. */
export class RequestIdReusedError extends InvalidArgumentError {}
export class FailedPreconditionError extends ContextError {}
export class NothingToCompactError extends FailedPreconditionError {}
export class ContextTooLargeError extends FailedPreconditionError {}
/** The session's stored history lost records: reads work, writes are refused until an operator repairs it. */
export class SessionDamagedError extends FailedPreconditionError {}
/** An events() watcher fell further behind than the server keeps events: read the session again, then resume. */
export class EventsExpiredError extends FailedPreconditionError {}
export class ConflictError extends ContextError {}
export class UnavailableError extends ContextError {}
export class UnimplementedError extends ContextError {}
export class UnauthenticatedError extends ContextError {}
export class InternalError extends ContextError {}

/**
 * RESOURCE_EXHAUSTED: a per-user quota or rate limit was hit (reason "QUOTA_EXCEEDED"), or a
 * message passed a size limit. Not retried by the client: wait `retryDelayMs` (the server's
 * RetryInfo, else its `retry_after_seconds`) before trying again.
 */
export class ResourceExhaustedError extends ContextError {
  /** The limit that was hit, e.g. "streams_per_user" ("" when the server named none). */
  readonly limit: string;
  /** Whose quota it was, e.g. "user:anonymous" (QuotaFailure subject; "" when not sent). */
  readonly subject: string;

  constructor(message: string, init: ConstructorParameters<typeof ContextError>[1]) {
    const meta = init.metadata ?? {};
    let retryDelayMs = init.retryDelayMs;
    const seconds = Number(meta.retry_after_seconds);
    if (retryDelayMs === undefined && meta.retry_after_seconds && Number.isFinite(seconds) && seconds >= 0) {
      retryDelayMs = Math.round(seconds * 1000);
    }
    super(message, { ...init, retryDelayMs });
    this.limit = meta.limit ?? "";
    this.subject = init.subject ?? "";
  }
}

type ErrorClass = new (message: string, init: ConstructorParameters<typeof ContextError>[1]) => ContextError;

const BY_REASON: Record<string, ErrorClass> = {
  NOT_FOUND: NotFoundError,
  INVALID_ARGUMENT: InvalidArgumentError,
  FAILED_PRECONDITION: FailedPreconditionError,
  NOTHING_TO_COMPACT: NothingToCompactError,
  CONTEXT_TOO_LARGE: ContextTooLargeError,
  REQUEST_ID_REUSED: RequestIdReusedError,
  SESSION_DAMAGED: SessionDamagedError,
  EVENTS_EXPIRED: EventsExpiredError,
  CONFLICT: ConflictError,
  UNAVAILABLE: UnavailableError,
  UNIMPLEMENTED: UnimplementedError,
  UNAUTHENTICATED: UnauthenticatedError,
  INTERNAL: InternalError,
  QUOTA_EXCEEDED: ResourceExhaustedError,
};

const BY_CODE: Partial<Record<Code, ErrorClass>> = {
  [Code.NotFound]: NotFoundError,
  [Code.PermissionDenied]: NotFoundError,
  [Code.InvalidArgument]: InvalidArgumentError,
  [Code.OutOfRange]: InvalidArgumentError,
  [Code.FailedPrecondition]: FailedPreconditionError,
  [Code.Aborted]: ConflictError,
  [Code.AlreadyExists]: ConflictError,
  [Code.Unavailable]: UnavailableError,
  [Code.DeadlineExceeded]: UnavailableError,
  [Code.Unimplemented]: UnimplementedError,
  [Code.Unauthenticated]: UnauthenticatedError,
  [Code.Internal]: InternalError,
  [Code.ResourceExhausted]: ResourceExhaustedError,
};

/** "FailedPrecondition" -> "FAILED_PRECONDITION", the name every other client uses (google.rpc.Code's). */
export function codeName(code: Code): string {
  // Connect spells code 1 "Canceled"; gRPC, google.rpc.Code and the Go and Python clients "CANCELLED".
  if (code === Code.Canceled) return "CANCELLED";
  return (Code[code] ?? "Unknown").replace(/(?<!^)([A-Z])/g, "_$1").toUpperCase();
}

// Node's HTTP/2 stack reports a cut connection as a reset or cancelled stream, which Connect
// surfaces as CANCELED/ABORTED/UNKNOWN/INTERNAL without any status from the server. Those are
// network failures: report them as UNAVAILABLE so they are retried like a refused connection.
const NETWORK = /ECONNRESET|ECONNREFUSED|EPIPE|ETIMEDOUT|EHOSTUNREACH|socket hang up|GOAWAY|stream closed with error code|session closed|stream was destroyed/i;
const NETWORK_CODES = new Set([Code.Canceled, Code.Aborted, Code.Unknown, Code.Internal]);

// A failed TLS handshake (a server certificate the client does not trust, a name mismatch, an
// alert from the peer) reaches Connect as a socket error it reports as INTERNAL. The Go and Python
// clients see UNAVAILABLE there, as gRPC does for any connection it could not set up: so do we.
// Node's codes: OpenSSL's verify errors (DEPTH_ZERO_SELF_SIGNED_CERT, CERT_HAS_EXPIRED, ...),
// ERR_TLS_* (ERR_TLS_CERT_ALTNAME_INVALID) and ERR_SSL_* (ERR_SSL_TLSV1_ALERT_UNKNOWN_CA).
const TLS_CODE = new RegExp(
  "^(?:ERR_TLS_|ERR_SSL_|UNABLE_TO_|CERT_)|" +
    "^(?:DEPTH_ZERO_SELF_SIGNED_CERT|SELF_SIGNED_CERT_IN_CHAIN|HOSTNAME_MISMATCH|INVALID_CA|INVALID_PURPOSE|EPROTO)$",
);
const TLS_MESSAGE = /certificate|handshake|\bSSL\b|\bTLS\b/i;

function causeOf(err: ConnectError): { code?: unknown; message?: unknown } | undefined {
  const cause = err.cause;
  return typeof cause === "object" && cause !== null ? (cause as { code?: unknown; message?: unknown }) : undefined;
}

function isNetworkFailure(err: ConnectError): boolean {
  if (!NETWORK_CODES.has(err.code) || err.details.length > 0 || err.metadata.has("grpc-status")) return false;
  const cause = causeOf(err);
  return NETWORK.test(err.rawMessage) || (typeof cause?.message === "string" && NETWORK.test(cause.message));
}

/** A connection that failed its TLS handshake (no status from a server: it never got that far). */
function isTlsFailure(err: ConnectError): boolean {
  if (!NETWORK_CODES.has(err.code) || err.details.length > 0 || err.metadata.has("grpc-status")) return false;
  const cause = causeOf(err);
  if (typeof cause?.code === "string" && TLS_CODE.test(cause.code)) return true;
  return TLS_MESSAGE.test(err.rawMessage) && typeof cause?.code === "string";
}

/**
 * The typed error of a failed call (anything not a ConnectError is returned unchanged). Call it
 * only when the caller did not abort the call itself: a cancelled call looks like a cut connection.
 */
export function toContextError(err: unknown): unknown {
  if (err instanceof ContextError || !(err instanceof ConnectError)) return err;
  if (isNetworkFailure(err)) {
    return new UnavailableError(err.rawMessage, { code: "UNAVAILABLE", reason: "", cause: err });
  }
  if (isTlsFailure(err)) {
    const code = causeOf(err)?.code;
    return new UnavailableError(`TLS handshake failed: ${err.rawMessage} (${String(code)})`, {
      code: "UNAVAILABLE",
      reason: "",
      cause: err,
    });
  }
  const info = err.findDetails(ErrorInfoSchema)[0];
  const bad = err.findDetails(BadRequestSchema)[0];
  const retry = err.findDetails(RetryInfoSchema)[0];
  const quota = err.findDetails(QuotaFailureSchema)[0];
  const reason = info?.reason ?? "";
  const Kind = BY_REASON[reason] ?? BY_CODE[err.code] ?? ContextError;
  let retryDelayMs: number | undefined;
  if (retry?.retryDelay) {
    retryDelayMs = Number(retry.retryDelay.seconds) * 1000 + Math.round(retry.retryDelay.nanos / 1e6);
  }
  return new Kind(err.rawMessage, {
    code: codeName(err.code),
    reason,
    domain: info?.domain ?? "",
    metadata: { ...(info?.metadata ?? {}) },
    violations: (bad?.fieldViolations ?? []).map((v) => ({ field: v.field, description: v.description })),
    retryDelayMs,
    cause: err,
    subject: quota?.violations[0]?.subject ?? "",
  });
}
