// The response types of src/types.ts against the contract. The checks are types: when a field is
// added to, renamed in or removed from protos/contextsvc/v1 (and src/gen regenerated), this file
// stops compiling (`tsc`, run by `npm test` and CI) until src/types.ts follows.
import assert from "node:assert/strict";
import { test } from "node:test";
import { create, type DescMessage, type MessageShape } from "@bufbuild/protobuf";
import * as svc from "../src/gen/contextsvc/v1/context_service_pb.js";
import * as ev from "../src/gen/contextsvc/v1/events_pb.js";
import * as res from "../src/gen/contextsvc/v1/resources_pb.js";
import { fromPlain, toPlain, type Event, type EventPayloads } from "../src/index.js";
import type * as t from "../src/types.js";

/** "argumentsJson" -> "arguments_json": protobuf-es's local names back to the proto names. */
type Snake<S extends string> = S extends `${infer C}${infer Rest}`
  ? `${C extends Lowercase<C> ? C : `_${Lowercase<C>}`}${Snake<Rest>}`
  : "";
/** The proto field names of a message (a oneof counts once, under its own name). */
type ProtoKeys<D extends DescMessage> = Snake<Exclude<keyof MessageShape<D>, "$typeName" | "$unknown"> & string>;
type Equal<A, B> = (<T>() => T extends A ? 1 : 2) extends <T>() => T extends B ? 1 : 2 ? true : false;
/** true when the plain type has exactly the message's fields. */
type Fields<Plain, D extends DescMessage> = Equal<keyof Plain, ProtoKeys<D>>;
/** true when the literal union is exactly the enum's values (UNSPECIFIED is null). */
type Values<Union, E extends object> = Equal<Union, Lowercase<Exclude<keyof E, "UNSPECIFIED"> & string>>;
/** Fails to compile unless T is true. */
type Check<T extends true> = T;

export type ContractChecks = [
  Check<Fields<t.Session, typeof res.SessionSchema>>,
  Check<Fields<t.Image, typeof res.ImageSchema>>,
  Check<Fields<t.ToolCall, typeof res.ToolCallSchema>>,
  Check<Fields<t.MessageFlags, typeof res.MessageFlagsSchema>>,
  Check<Fields<t.SequenceRange, typeof res.SequenceRangeSchema>>,
  Check<Fields<t.Message, typeof res.MessageSchema>>,
  Check<Fields<t.TokenSegments, typeof res.TokenSegmentsSchema>>,
  Check<Fields<t.TokenEstimate, typeof res.TokenEstimateSchema>>,
  Check<Fields<t.Calibration, typeof res.CalibrationSchema>>,
  Check<Fields<t.CompressionStage, typeof ev.CompressionStageSchema>>,
  Check<Fields<t.CompressionPlan, typeof ev.CompressionPlanSchema>>,
  Check<Fields<t.CompressionStarted, typeof ev.CompressionStartedSchema>>,
  Check<Fields<t.ContextCompressed, typeof ev.ContextCompressedSchema>>,
  Check<Fields<t.CompressionRefused, typeof ev.CompressionRefusedSchema>>,
  Check<Fields<t.BaselineRecorded, typeof ev.BaselineRecordedSchema>>,
  Check<Fields<t.ContextTruncated, typeof ev.ContextTruncatedSchema>>,
  Check<Fields<t.MemoryFlushDue, typeof ev.MemoryFlushDueSchema>>,
  Check<Fields<t.MessagesAppended, typeof ev.MessagesAppendedSchema>>,
  Check<Fields<t.SessionDeleted, typeof ev.SessionDeletedSchema>>,
  Check<Fields<Event, typeof ev.EventSchema>>,
  Check<Equal<keyof EventPayloads, Snake<NonNullable<MessageShape<typeof ev.EventSchema>["payload"]["case"]>>>>,
  Check<Fields<t.ListSessionsResponse, typeof svc.ListSessionsResponseSchema>>,
  Check<Fields<t.AppendMessagesResponse, typeof svc.AppendMessagesResponseSchema>>,
  Check<Fields<t.ListMessagesResponse, typeof svc.ListMessagesResponseSchema>>,
  Check<Fields<t.CompressionReport, typeof svc.CompressionReportSchema>>,
  Check<Fields<t.BuildContextResponse, typeof svc.BuildContextResponseSchema>>,
  Check<Fields<t.EstimateTokensResponse, typeof svc.EstimateTokensResponseSchema>>,
  Check<Fields<t.RecordBaselineResponse, typeof svc.RecordBaselineResponseSchema>>,
  Check<Fields<t.CompressResponse, typeof svc.CompressResponseSchema>>,
  Check<Fields<t.HistoryChunk, typeof svc.HistoryChunkSchema>>,
  Check<Fields<t.SearchHistoryResponse, typeof svc.SearchHistoryResponseSchema>>,
  Check<Fields<t.ExpandSummaryResponse, typeof svc.ExpandSummaryResponseSchema>>,
  Check<Values<t.Role, typeof res.Role>>,
  Check<Values<t.MessageBuffer, typeof svc.Buffer>>,
  Check<Values<t.Phase, typeof svc.Phase>>,
  Check<Values<t.EstimateMethod, typeof res.EstimateMethod>>,
  Check<Values<t.CompressionReason, typeof ev.CompressionReason>>,
  Check<Values<t.CompressionMethod, typeof ev.CompressionMethod>>,
];

test("an Event's payload names the member that holds it, and narrows the type", () => {
  const msg = create(ev.EventSchema, {
    eventId: 7n,
    sessionId: "s",
    payload: { case: "messagesAppended", value: { sequenceNumbers: [3n], contextTokens: 12n, requestId: "r" } },
  });
  const e = toPlain(ev.EventSchema, msg) as Event;
  assert.equal(e.payload, "messages_appended");
  if (e.payload !== "messages_appended") throw new Error("not narrowed");
  assert.deepEqual(e.messages_appended.sequence_numbers, [3]);
  assert.equal(e.messages_appended.request_id, "r");
  assert.equal(e.event_id, 7);
  const unknown = toPlain(ev.EventSchema, create(ev.EventSchema, { eventId: 8n })) as Event;
  assert.equal(unknown.payload, null);
});

test("fromPlain takes back what toPlain gives, the oneof's name included", () => {
  const msg = create(ev.EventSchema, {
    eventId: 7n,
    sessionId: "s",
    payload: { case: "messagesAppended", value: { sequenceNumbers: [3n, 4n], requestId: "r" } },
  });
  const plain = toPlain(ev.EventSchema, msg);
  assert.equal(plain.payload, "messages_appended");
  assert.deepEqual(toPlain(ev.EventSchema, fromPlain(ev.EventSchema, plain)), plain);
  const deleted = fromPlain(ev.EventSchema, { event_id: 8, payload: "session_deleted" });
  assert.equal(deleted.payload.case, "sessionDeleted");
  assert.equal(fromPlain(ev.EventSchema, { event_id: 9, payload: null }).payload.case, undefined);
  assert.throws(() => fromPlain(ev.EventSchema, { payload: "no_such_event" }), /payload/);
});
