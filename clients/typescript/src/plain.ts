// Plain JavaScript shapes for protobuf messages, the same rules in every contextsvc client:
// objects keyed by the proto field names (snake_case), 64-bit integers as `number` (every count,
// id and sequence number of this API stays far below 2^53), `Date` for timestamps, plain objects
// for Struct metadata, enums as short lower-case names ("user", "summary"; null when unset),
// null for an unset message or proto3 optional field, and a real oneof's set member under its
// name plus the oneof's name holding which one it is (e.g. `payload: "messages_appended"`).
import {
  create,
  type DescEnum,
  type DescField,
  type DescMessage,
  type MessageShape,
  ScalarType,
} from "@bufbuild/protobuf";
import { timestampDate, timestampFromDate, type Timestamp } from "@bufbuild/protobuf/wkt";

/** A message in plain shape. */
export type Plain = Record<string, any>;

function enumPrefix(e: DescEnum): string {
  return e.name.replace(/(?<!^)([A-Z])/g, "_$1").toUpperCase() + "_";
}

export function enumToPlain(e: DescEnum, n: number): string | null {
  const v = e.values.find((x) => x.number === n);
  if (!v || n === 0) return null;
  return v.name.startsWith(enumPrefix(e)) ? v.name.slice(enumPrefix(e).length).toLowerCase() : v.name.toLowerCase();
}

export function enumFromPlain(e: DescEnum, value: string | number | null | undefined): number {
  if (value === null || value === undefined) return 0;
  if (typeof value === "number") return value;
  const name = enumPrefix(e) + value.toUpperCase();
  const found = e.values.find((x) => x.name === name || x.name === value);
  if (!found) {
    const choices = e.values.filter((x) => x.number !== 0).map((x) => enumToPlain(e, x.number));
    throw new TypeError(`${e.name}: unknown value ${JSON.stringify(value)} (one of ${choices.join(", ")})`);
  }
  return found.number;
}

const LONG = new Set([ScalarType.INT64, ScalarType.UINT64, ScalarType.SINT64, ScalarType.FIXED64, ScalarType.SFIXED64]);

function scalarToPlain(t: ScalarType, v: unknown): unknown {
  return LONG.has(t) ? Number(v as bigint) : v;
}

// A lone UTF-16 surrogate ("\ud800"): no UTF-8 text holds one, and protobuf-es's encoder would
// silently send U+FFFD in its place, changing the caller's text where the Python client refuses it
// and the Go client's INVALID_ARGUMENT does.
const LONE_SURROGATE = /[\uD800-\uDBFF](?![\uDC00-\uDFFF])|(?<![\uD800-\uDBFF])[\uDC00-\uDFFF]/;

function checkText(where: string, v: unknown): void {
  if (typeof v === "string" && LONE_SURROGATE.test(v)) {
    throw new TypeError(`${where}: a string holds a lone surrogate: not UTF-8 text`);
  }
}

/** Every string inside a Struct's JSON value (metadata), bounded by the value's own size. */
function checkJsonText(where: string, v: unknown): void {
  const stack: unknown[] = [v];
  while (stack.length > 0) {
    const x = stack.pop();
    if (typeof x === "string") checkText(where, x);
    else if (Array.isArray(x)) stack.push(...x);
    else if (x !== null && typeof x === "object") {
      for (const [k, y] of Object.entries(x)) {
        checkText(where, k);
        stack.push(y);
      }
    }
  }
}

function scalarFromPlain(t: ScalarType, v: unknown, where = "string"): unknown {
  if (t === ScalarType.STRING) checkText(where, v);
  return LONG.has(t) ? BigInt(v as number | bigint | string) : v;
}

function messageToPlain(desc: DescMessage, v: any): unknown {
  if (desc.typeName === "google.protobuf.Timestamp") return timestampDate(v as Timestamp);
  if (desc.typeName === "google.protobuf.Struct") return v; // protobuf-es keeps Struct fields as JSON objects
  return toPlain(desc, v);
}

function fieldToPlain(f: DescField, v: any): unknown {
  switch (f.fieldKind) {
    case "scalar":
      return v === undefined ? null : scalarToPlain(f.scalar, v);
    case "enum":
      return v === undefined ? null : enumToPlain(f.enum, v);
    case "message":
      return v === undefined ? null : messageToPlain(f.message, v);
    case "list":
      return (v as unknown[]).map((x) =>
        f.listKind === "message"
          ? messageToPlain(f.message, x)
          : f.listKind === "enum"
            ? enumToPlain(f.enum, x as number)
            : scalarToPlain(f.scalar, x),
      );
    case "map": {
      const out: Plain = {};
      for (const [k, x] of Object.entries(v as Plain)) {
        out[k] =
          f.mapKind === "message"
            ? messageToPlain(f.message, x)
            : f.mapKind === "enum"
              ? enumToPlain(f.enum, x as number)
              : scalarToPlain(f.scalar, x);
      }
      return out;
    }
  }
}

/** A protobuf-es message as a plain object. */
export function toPlain(desc: DescMessage, msg: any): Plain {
  const out: Plain = {};
  for (const f of desc.fields) {
    if (f.oneof) {
      const o = msg[f.oneof.localName] as { case?: string; value?: unknown };
      if (o.case === f.localName) out[f.name] = fieldToPlain(f, o.value);
      continue;
    }
    out[f.name] = fieldToPlain(f, msg[f.localName]);
  }
  for (const o of desc.oneofs) {
    const c = (msg[o.localName] as { case?: string }).case;
    out[o.name] = c === undefined ? null : (o.fields.find((f) => f.localName === c)?.name ?? null);
  }
  return out;
}

function messageFromPlain(desc: DescMessage, v: any, where: string = desc.typeName): unknown {
  if (desc.typeName === "google.protobuf.Timestamp") return timestampFromDate(v instanceof Date ? v : new Date(v));
  if (desc.typeName === "google.protobuf.Struct") {
    checkJsonText(where, v);
    return v;
  }
  if (desc.typeName === "contextsvc.v1.Image" && v instanceof Uint8Array) return fromPlain(desc, { data: v });
  return fromPlain(desc, v);
}

function fieldFromPlain(f: DescField, v: any): unknown {
  const where = `${f.parent.name}.${f.name}`;
  switch (f.fieldKind) {
    case "scalar":
      return scalarFromPlain(f.scalar, v, where);
    case "enum":
      return enumFromPlain(f.enum, v);
    case "message":
      return messageFromPlain(f.message, v, where);
    case "list":
      return (v as unknown[]).map((x) =>
        f.listKind === "message"
          ? messageFromPlain(f.message, x)
          : f.listKind === "enum"
            ? enumFromPlain(f.enum, x as string)
            : scalarFromPlain(f.scalar, x, where),
      );
    case "map":
      checkJsonText(where, v);
      return v;
  }
}

/** A protobuf-es message from a plain object (unknown keys are an error; null/undefined = unset). */
export function fromPlain<Desc extends DescMessage>(desc: Desc, plain: Plain | undefined | null): MessageShape<Desc> {
  const msg: any = create(desc);
  if (plain === undefined || plain === null) return msg as MessageShape<Desc>;
  for (const [key, value] of Object.entries(plain)) {
    const f = desc.fields.find((x) => x.name === key || x.localName === key);
    const oneof = f ? undefined : desc.oneofs.find((o) => o.name === key);
    if (oneof) {
      // toPlain names a oneof's set member under the oneof's name (`payload: "messages_appended"`).
      if (value === undefined || value === null) continue;
      const member = oneof.fields.find((x) => x.name === value || x.localName === value);
      if (!member) {
        const choices = oneof.fields.map((x) => x.name).join(", ");
        throw new TypeError(`${desc.name}.${key}: unknown member ${JSON.stringify(value)} (one of ${choices})`);
      }
      const given = plain[member.name] ?? plain[member.localName];
      if ((given === undefined || given === null) && member.fieldKind === "message") {
        msg[oneof.localName] = { case: member.localName, value: fieldFromPlain(member, {}) };
      }
      continue;
    }
    if (!f) throw new TypeError(`${desc.name} has no field ${JSON.stringify(key)}`);
    if (value === undefined || value === null) continue;
    if (f.oneof) {
      msg[f.oneof.localName] = { case: f.localName, value: fieldFromPlain(f, value) };
    } else {
      msg[f.localName] = fieldFromPlain(f, value);
    }
  }
  return msg as MessageShape<Desc>;
}
