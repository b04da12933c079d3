// The plain shapes (see plain.ts) of the responses of contextsvc.v1, as TypeScript types. They
// follow protos/contextsvc/v1/*.proto field for field (test/types.test.ts fails to compile when a
// field is added, renamed or removed there): snake_case names, `number` for 64-bit integers,
// `Date` for timestamps, enums as short lower-case names (null when unset), `null` for an unset
// message or optional field. A message field the server always sets (BuildContextResponse.estimate,
// RecordBaselineResponse.calibration, Message.flags, Event.time, ...) is typed without `null`.
import type { JsonObject } from "@bufbuild/protobuf";

export type { JsonObject };

/** Role of a message's author (contextsvc.v1.Role). */
export type Role = "system" | "user" | "assistant" | "tool";
/** Buffer of ListMessages (contextsvc.v1.Buffer). */
export type MessageBuffer = "display" | "context";
/** When in a turn a view is built (contextsvc.v1.Phase). */
export type Phase = "pre_turn" | "mid_turn";
/** How a token estimate was obtained (contextsvc.v1.EstimateMethod). */
export type EstimateMethod = "calibrated" | "fallback" | "baseline_delta" | "exact";
/** Why a compression ran or was refused (contextsvc.v1.CompressionReason). */
export type CompressionReason =
  | "preturn"
  | "midturn"
  | "postturn"
  | "forced"
  | "loop_guard"
  | "conflict"
  | "no_progress"
  | "failed";
/** How a compression shrank the context (contextsvc.v1.CompressionMethod). */
export type CompressionMethod = "summary" | "hard_truncate" | "clear_tool_results";

// ------------------------------------------------------------------------------ resources.proto

export interface Session {
  id: string;
  profile_id: string;
  user_id: string;
  name: string;
  pinned: boolean;
  create_time: Date;
  update_time: Date;
  context_tokens: number;
  display_message_count: number;
  metadata: JsonObject | null;
  context_message_count: number;
  context_truncated: boolean;
  preview: string;
}

export interface Image {
  /** Raw bytes: empty unless the response carries them (a view for a vision model). */
  data: Uint8Array;
  blob_id: string;
  mime_type: string;
  width: number;
  height: number;
  token_count: number;
}

export interface ToolCall {
  id: string;
  name: string;
  arguments_json: string;
}

export interface MessageFlags {
  is_context: boolean | null;
  is_display: boolean | null;
  is_summary: boolean;
  is_compression: boolean;
  is_compression_critical: boolean;
  is_plan: boolean;
  is_recall: boolean;
  is_pinned: boolean;
}

export interface SequenceRange {
  first: number;
  last: number;
}

export interface Message {
  sequence_number: number;
  role: Role | null;
  content: string;
  images: Image[];
  tool_calls: ToolCall[];
  tool_call_id: string;
  name: string;
  thinking: string;
  flags: MessageFlags;
  metadata: JsonObject | null;
  create_time: Date | null;
  token_count: number;
  replaces: SequenceRange | null;
  truncated_in_view: boolean;
}

export interface TokenSegments {
  system: number;
  records: number;
  summaries: number;
  pinned: number;
  messages: number;
  images: number;
  incoming: number;
  recall: number;
}

export interface TokenEstimate {
  total: number;
  text: number;
  images: number;
  method: EstimateMethod | null;
  window: number;
  budget: number;
  fraction: number;
  segments: TokenSegments;
  margin: number;
}

export interface Calibration {
  model: string;
  overhead: number;
  tokens_per_char: number;
  observations: number;
  fitted: boolean;
  per_message: number;
  per_tool_call: number;
  margin: number;
  family: string;
  class_ratios: Record<string, number>;
}

// -------------------------------------------------------------------------------- events.proto

export interface CompressionStage {
  method: CompressionMethod | null;
  messages_removed: number;
  messages_added: number;
  tokens_before: number;
  tokens_after: number;
}

export interface CompressionPlan {
  would_compress: boolean;
  messages_to_drop: number;
  messages_to_keep: number;
  turns_kept: number;
  tokens_before: number;
  tokens_kept: number;
  first_sequence: number;
  last_sequence: number;
  detail: string;
}

export interface CompressionStarted {
  reason: CompressionReason | null;
  context_tokens: number;
  max_context_tokens: number;
  plan: CompressionPlan | null;
}

/** What a committed compaction did: the fields a Compress response and its event share. */
export interface CompactionOutcome {
  method: CompressionMethod | null;
  summary: string;
  messages_before: number;
  messages_after: number;
  context_tokens_before: number;
  context_tokens_after: number;
  breadcrumbs: string[];
  stages: CompressionStage[];
}

export interface ContextCompressed extends CompactionOutcome {
  reason: CompressionReason | null;
  max_context_tokens: number;
  summary_sequence: number;
}

export interface CompressionRefused {
  reason: CompressionReason | null;
  trigger: CompressionReason | null;
  detail: string;
}

export interface BaselineRecorded {
  view_id: string;
  prompt_tokens: number;
  estimated_tokens: number;
  model: string;
}

export interface ContextTruncated {
  view_id: string;
  prompt_tokens: number;
  estimated_tokens: number;
}

export interface MemoryFlushDue {
  context_tokens: number;
  threshold_tokens: number;
  margin: number;
}

export interface MessagesAppended {
  sequence_numbers: number[];
  context_tokens: number;
  request_id: string;
  turn_complete: boolean;
}

export interface SessionDeleted {
  reason: string;
  detail: string;
}

/** The members of Event's `payload` oneof, by name. */
export interface EventPayloads {
  compression_started: CompressionStarted;
  context_compressed: ContextCompressed;
  baseline_recorded: BaselineRecorded;
  context_truncated: ContextTruncated;
  memory_flush_due: MemoryFlushDue;
  messages_appended: MessagesAppended;
  session_deleted: SessionDeleted;
  compression_refused: CompressionRefused;
}

/** The kind of an event: the name of its `payload` member. */
export type EventKind = keyof EventPayloads;

interface EventBase {
  event_id: number;
  session_id: string;
  time: Date;
}

/**
 * One event. `payload` names its kind and the member of that name holds it, so checking
 * `payload` narrows: `if (e.payload === "messages_appended") e.messages_appended.sequence_numbers`.
 * `payload` is null for a kind this client does not know yet (a newer server).
 */
export type Event =
  | { [K in EventKind]: EventBase & { payload: K } & { [P in K]: EventPayloads[K] } }[EventKind]
  | (EventBase & { payload: null });

// ----------------------------------------------------------------------- context_service.proto

export interface ListSessionsResponse {
  sessions: Session[];
  next_page_token: string;
  total_size: number;
}

export interface AppendMessagesResponse {
  sequence_numbers: number[];
  context_tokens: number;
  window_fraction: number;
}

export interface ListMessagesResponse {
  messages: Message[];
  next_before_sequence: number;
  next_page_token: string;
}

/** What a build's automatic compression did: a Compress response plus why it ran. */
export interface CompressionReport extends CompressResponse {
  reason: CompressionReason | null;
}

export interface BuildContextResponse {
  messages: Message[];
  view_id: string;
  estimate: TokenEstimate;
  /** Set when the build compressed the context first. */
  compression: CompressionReport | null;
  notices: string[];
  injected_chunk_ids: string[];
}

export interface EstimateTokensResponse {
  estimate: TokenEstimate;
}

export interface RecordBaselineResponse {
  recorded: boolean;
  truncated: boolean;
  calibration: Calibration;
  truncation_reason: string;
  lower_bound: number;
}

export interface CompressResponse extends CompactionOutcome {
  compressed: boolean;
  plan: CompressionPlan;
}

export interface HistoryChunk {
  text: string;
  first_sequence: number;
  last_sequence: number;
  start_time: Date | null;
  end_time: Date | null;
  breadcrumbs: string[];
  score: number;
  chunk_id: string;
}

export interface SearchHistoryResponse {
  chunks: HistoryChunk[];
}

export interface ExpandSummaryResponse {
  messages: Message[];
}
