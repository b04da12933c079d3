// The contextsvc inspector: a plain ES module, no build step. It talks to the gateway only:
// GET /api/sessions for the list, and the session's WebSocket (docs/websocket.md) for the rest.

const COOKIE = "contextsvc_token";
const SEGMENTS = ["system", "records", "summaries", "pinned", "messages", "images", "incoming"];
const $ = (sel) => document.querySelector(sel);

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (value === undefined || value === null || value === false) continue;
    if (key === "class") node.className = value;
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else if (key === "dataset") Object.assign(node.dataset, value);
    else if (key === "style") node.style.cssText = value; // CSSOM: allowed by the page's CSP
    else node.setAttribute(key, value === true ? "" : value);
  }
  for (const child of children.flat(2)) {
    if (child === undefined || child === null || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

// replaceChildren without the null/false placeholders of conditional children.
function fill(node, ...children) {
  node.replaceChildren(...children.flat().filter((c) => c !== null && c !== undefined && c !== false));
}

const fmt = (n) => Number(n || 0).toLocaleString("en-US");

function setStatus(state, text) {
  const status = $("#status");
  status.dataset.state = state;
  status.textContent = text;
}

function askToken() {
  const token = window.prompt("API token (stored in a cookie for this site):", "");
  if (token === null) return false;
  // Secure over https: cookies are not scoped by port or scheme, and without it the token would
  // also go to a plain-http page of the same host. (Over http a Secure cookie would not be kept.)
  const secure = location.protocol === "https:" ? "; Secure" : "";
  document.cookie = `${COOKIE}=${encodeURIComponent(token.trim())}; path=/; SameSite=Strict${secure}`;
  return true;
}

// ---- sessions list -------------------------------------------------------------------------------

let searchTimer = 0;
let listRequest = 0;

async function loadSessions() {
  const query = $("#session-search").value.trim();
  const message = $("#list-message");
  const mine = ++listRequest;
  let response;
  let body;
  try {
    response = await fetch(`/api/sessions?query=${encodeURIComponent(query)}`, { credentials: "same-origin" });
    body = await response.json();
  } catch (err) {
    if (mine === listRequest) message.textContent = `Cannot reach the gateway: ${err}`;
    return;
  }
  if (mine !== listRequest) return; // a newer search answered (or will answer) instead
  if (response.status === 401 || response.status === 403) {
    message.textContent = "The service wants an API token: use the Token button.";
    fill($("#sessions"));
    return;
  }
  if (!response.ok) {
    message.textContent = `${body.code}: ${body.message}`;
    return;
  }
  const sessions = body.sessions.slice().sort(
    (a, b) => Number(b.pinned) - Number(a.pinned) || String(b.update_time).localeCompare(String(a.update_time)),
  );
  message.textContent = `${fmt(body.total_size)} session${body.total_size === 1 ? "" : "s"}${query ? ` matching “${query}”` : ""}`;
  fill($("#sessions"),
    ...sessions.map((s) =>
      el("li", { dataset: { id: s.id, pinned: String(s.pinned) } },
        el("a", { href: `/sessions/${s.id}` },
          el("div", {},
            s.pinned ? el("span", { class: "pin", title: "pinned" }, "📌") : null,
            el("span", { class: "name" }, s.name || "(unnamed)"),
            " ",
            el("span", { class: "muted" }, `${fmt(s.context_tokens)} tokens · ${fmt(s.display_message_count)} messages · ${s.profile_id}`),
          ),
          el("div", { class: "snippet" }, s.preview || ""),
          el("div", { class: "muted" }, s.id),
        ),
      ),
    ),
  );
}

function showList() {
  $("#list-page").hidden = false;
  $("#session-search").addEventListener("input", () => {
    clearTimeout(searchTimer);
    searchTimer = setTimeout(loadSessions, 250);
  });
  loadSessions();
}

// ---- one session ---------------------------------------------------------------------------------

const state = {
  sessionId: "",
  ws: null,
  lastEventId: 0,
  replaying: false,
  refreshTimer: 0,
  retry: 0,
  nextId: 1,
  closedFor: 0,
  view: null,
  // Rows shown per buffer, oldest first, and the token of the page before them ("" = none older).
  buffers: { display: { rows: [], older: "" }, context: { rows: [], older: "" } },
  // A compaction rewrote the buffers: the next view replaces what was paged in.
  stale: false,
  pagingId: 0,
};

function send(frame) {
  if (!state.ws || state.ws.readyState !== WebSocket.OPEN) return false;
  state.ws.send(JSON.stringify({ id: state.nextId++, ...frame }));
  return true;
}

function refreshSoon() {
  clearTimeout(state.refreshTimer);
  state.refreshTimer = setTimeout(() => send({ type: "get_view" }), 120);
}

function describe(frame) {
  switch (frame.type) {
    case "messages_appended":
      return `#${frame.sequence_numbers.join(", #")} → ${fmt(frame.context_tokens)} tokens`;
    case "compression_started":
      return `${frame.reason}: ${fmt(frame.context_tokens)} of ${fmt(frame.max_context_tokens)} tokens`;
    case "context_compressed":
      return `${frame.method}: ${fmt(frame.context_tokens_before)} → ${fmt(frame.context_tokens_after)} tokens`;
    case "compression_refused":
      return `${frame.reason}: ${frame.detail}`;
    case "memory_flush_due":
      return `${fmt(frame.context_tokens)} tokens, compaction at ${fmt(frame.threshold_tokens)}`;
    case "baseline_recorded":
      return `${fmt(frame.prompt_tokens)} real vs ${fmt(frame.estimated_tokens)} estimated (${frame.model})`;
    case "context_truncated":
      return `provider counted ${fmt(frame.prompt_tokens)}, estimate ${fmt(frame.estimated_tokens)}`;
    case "replay_start":
      return `${frame.count} missed event${frame.count === 1 ? "" : "s"}`;
    case "error":
      return `${frame.code}: ${frame.message}`;
    case "compact_result":
      return frame.compressed
        ? `${fmt(frame.context_tokens_before)} → ${fmt(frame.context_tokens_after)} tokens`
        : "not compressed (see compression_refused)";
    case "message_ack":
      return `stored as #${frame.sequence_numbers.join(", #")}`;
    default:
      return "";
  }
}

function logEvent(frame, extra = "") {
  const item = el("li", { dataset: { type: frame.type, eventId: frame.event_id || "" }, class: extra },
    el("span", { class: "t" }, frame.type), " ", describe(frame),
    frame.event_id ? el("div", { class: "muted" }, `event ${frame.event_id}`) : null,
  );
  const list = $("#events");
  list.prepend(item);
  while (list.children.length > 200) list.lastChild.remove();
}

function tag(kind, text, title) {
  return el("span", { class: `tag ${kind}`, title }, text);
}

function messageRow(m, { cutInView = false, inContextColumn = false } = {}) {
  const flags = m.flags || {};
  const meta = m.metadata || {};
  const cleared = meta.cleared_from !== undefined;
  const classes = ["row", `role-${m.role}`];
  if (flags.is_summary) classes.push("summary");
  if (!inContextColumn && flags.is_context === false) classes.push("demoted");
  if (cleared) classes.push("cleared");
  const row = el("li", { class: classes.join(" "), dataset: { seq: m.sequence_number } });
  const head = el("div", { class: "head" },
    el("span", { class: "role" }, m.role), m.sequence_number ? `#${m.sequence_number}` : "",
    m.name ? `· ${m.name}` : "", m.token_count ? `· ${fmt(m.token_count)} tok` : "",
    flags.is_pinned ? tag("pinned", "pinned", "never summarized or truncated") : null,
    flags.is_summary ? tag("summary", m.replaces ? `summary of #${m.replaces.first}–#${m.replaces.last}` : "summary") : null,
    flags.is_compression ? tag("", "compression record") : null,
    !inContextColumn && flags.is_context === false ? tag("demoted", "not in context", "compressed out of the model's context") : null,
    cleared ? tag("cleared", `cleared result of #${meta.cleared_from} (${fmt(meta.cleared_chars)} chars)`) : null,
    cutInView ? tag("cut", "cut in view", "over the per-message budget: shortened in the view only") : null,
    m.images && m.images.length ? tag("", `${m.images.length} image${m.images.length === 1 ? "" : "s"}`) : null,
    m.tool_calls && m.tool_calls.length ? tag("", `calls ${m.tool_calls.map((c) => c.name).join(", ")}`) : null,
  );
  const body = el("div", { class: "body" }, m.content || (m.tool_calls || []).map((c) => `${c.name}(${c.arguments_json})`).join("\n"));
  row.append(head, body);
  if ((m.content || "").length > 600) {
    head.append(el("button", { type: "button", class: "more secondary", onclick: () => row.classList.toggle("open") }, "more"));
  }
  if (flags.is_summary && inContextColumn) {
    head.append(el("button", {
      type: "button", class: "expand secondary",
      onclick: () => send({ type: "expand", sequence_number: m.sequence_number }),
    }, "Expand"));
  }
  return row;
}

function renderMeter(view, compression) {
  const estimate = view.estimate || {};
  const window_ = estimate.window || 1;
  const segments = estimate.segments || {};
  const meter = $("#meter");
  meter.dataset.total = String(estimate.total || 0);
  meter.dataset.window = String(estimate.window || 0);
  const parts = SEGMENTS.filter((name) => segments[name] > 0).map((name) =>
    el("div", {
      class: `seg seg-${name}`, title: `${name}: ${fmt(segments[name])} tokens`,
      style: `width:${Math.min(100, (100 * segments[name]) / window_)}%`,
    }),
  );
  const lines = [];
  if (compression) {
    lines.push(el("div", { class: "line threshold", title: `threshold ${compression.threshold}`, style: `left:${compression.threshold * 100}%` }));
    lines.push(el("div", { class: "line target", title: `target ${compression.target}`, style: `left:${compression.target * 100}%` }));
  }
  if (estimate.budget) {
    lines.push(el("div", { class: "line budget", title: `budget ${fmt(estimate.budget)}`, style: `left:${(100 * estimate.budget) / window_}%` }));
  }
  fill(meter, ...parts, ...lines);
  fill($("#meter-legend"),
    el("span", { class: "total", id: "meter-total" },
      `${fmt(estimate.total)} / ${fmt(estimate.window)} tokens (${((estimate.fraction || 0) * 100).toFixed(1)}%)`),
    ...SEGMENTS.map((name) => el("span", {}, el("span", { class: `sw seg-${name}` }), `${name} ${fmt(segments[name])}`)),
    compression ? el("span", {}, el("span", { class: "sw", style: "background:var(--warn)" }), `threshold ${Math.round(compression.threshold * 100)}%`) : null,
    compression ? el("span", {}, el("span", { class: "sw", style: "background:var(--ok)" }), `target ${Math.round(compression.target * 100)}%`) : null,
    el("span", { class: "muted" }, `estimate: ${estimate.method || "?"}`),
  );
}

// Between compactions both buffers only grow at the end, so a fresh view (the newest rows) joins
// the rows already shown where its first row is; the token for older rows stays theirs.
function mergeWindow(name, rows, token) {
  const buffer = state.buffers[name];
  const first = rows[0];
  const at = !state.stale && first ? buffer.rows.findIndex((m) => m.sequence_number === first.sequence_number) : -1;
  if (at > 0) {
    buffer.rows = buffer.rows.slice(0, at).concat(rows);
  } else {
    buffer.rows = rows;
    buffer.older = token || "";
  }
}

function olderButton(name) {
  const buffer = state.buffers[name];
  if (!buffer.older) return null;
  return el("li", { class: "older" },
    el("button", {
      type: "button", class: "secondary", id: `${name}-older`,
      onclick: (event) => {
        event.target.disabled = true;
        event.target.textContent = "Loading…";
        state.pagingId = state.nextId; // send() numbers frames from it
        send({ type: "get_messages", buffer: name, page_token: buffer.older });
      },
    }, "Load older"));
}

function renderBuffers() {
  const frame = state.view;
  if (!frame) return;
  const display = state.buffers.display;
  const context = state.buffers.context;
  const cut = new Set(frame.view.messages.filter((m) => m.truncated_in_view).map((m) => m.sequence_number));
  fill($("#display"), olderButton("display"), ...display.rows.map((m) => messageRow(m)));
  const prompt = frame.view.messages.find((m) => m.role === "system" && !m.sequence_number);
  const rows = context.rows.map((m) => messageRow(m, { cutInView: cut.has(m.sequence_number), inContextColumn: true }));
  if (prompt && !context.older) {
    const row = messageRow(prompt, { inContextColumn: true });
    row.querySelector(".head").append(tag("prompt", "system prompt, injected at every build"));
    rows.unshift(row);
  }
  fill($("#context"), olderButton("context"), ...rows);
  $("#display-count").textContent = `(${display.rows.length}${display.older ? "+" : ""})`;
  $("#context-count").textContent = `(${context.rows.length}${context.older ? "+" : ""} rows, view of ${frame.view.messages.length})`;
}

function renderPage(frame) {
  const buffer = state.buffers[frame.buffer];
  if (!buffer || frame.page_token !== buffer.older) return; // the buffer was replaced meanwhile
  buffer.rows = frame.messages.concat(buffer.rows);
  buffer.older = frame.next_page_token || "";
  renderBuffers();
}

function renderView(frame) {
  state.view = frame;
  mergeWindow("display", frame.display, frame.display_page_token);
  mergeWindow("context", frame.context, frame.context_page_token);
  state.stale = false;
  const session = frame.session;
  $("#session-name").textContent = session.name || session.id;
  $("#session-meta").textContent =
    `${session.id} · profile ${session.profile_id} · ${fmt(session.display_message_count)} displayed, ` +
    `${fmt(session.context_message_count)} in context${session.context_truncated ? " · last prompt looked truncated" : ""}`;
  renderMeter(frame.view, frame.compression);
  renderBuffers();
  fill($("#notices"), ...frame.view.notices.map((n) => el("li", {}, n)));
}

// How a compaction would run, as a dry run names it (CompressResponse.method).
const PREVIEW_METHODS = {
  summary: "a summary of the older turns",
  clear_tool_results: "clearing old tool results",
  hard_truncate: "dropping the older turns (no summary)",
};

function renderPreview(frame) {
  const body = $("#preview-body");
  const plan = frame.plan || {};
  const how = PREVIEW_METHODS[frame.method];
  let text;
  if (!plan.would_compress) {
    text = el("p", {}, `Nothing to compress: ${plan.detail || "the context is already small"}.`);
  } else if (frame.method === "clear_tool_results") {
    // Clearing needs no summarizer: the dry run gives its exact counts.
    const stage = (frame.stages || [])[0] || {};
    text = el("p", {},
      `By ${how}: would clear ${fmt(stage.messages_removed)} tool results; `,
      `context ${fmt(frame.context_tokens_before)} → ${fmt(frame.context_tokens_after)} tokens.`);
  } else {
    text = el("p", {},
      how ? `By ${how}: ` : "",
      `Would move ${fmt(plan.messages_to_drop)} rows out of the context (#${plan.first_sequence}–#${plan.last_sequence}), `,
      `keep ${fmt(plan.messages_to_keep)} rows (${plan.turns_kept} turns, ${fmt(plan.tokens_kept)} tokens); `,
      `context now ${fmt(plan.tokens_before)} tokens.`);
  }
  fill(body, text);
  $("#compress-confirm").disabled = !plan.would_compress;
  $("#preview").hidden = false;
}

function renderExpanded(frame) {
  const row = document.querySelector(`#context .row[data-seq="${frame.sequence_number}"]`);
  if (!row) return;
  row.querySelector(".expanded")?.remove();
  row.classList.add("open");
  row.append(el("div", { class: "expanded" },
    el("div", { class: "muted" }, `${frame.messages.length} original messages`),
    el("ol", { class: "rows" }, ...frame.messages.map((m) => messageRow(m))),
  ));
}

function renderSearch(frame) {
  fill($("#search-results"),
    ...(frame.chunks.length ? frame.chunks.map((c) =>
      el("li", {},
        el("div", { class: "muted" }, `#${c.first_sequence}–#${c.last_sequence} · score ${Number(c.score).toFixed(2)}`),
        el("pre", {}, c.text)))
      : [el("li", { class: "muted" }, `No match for “${frame.query}”.`)]),
  );
}

const EVENT_TYPES = new Set([
  "messages_appended", "compression_started", "context_compressed", "compression_refused",
  "memory_flush_due", "baseline_recorded", "context_truncated", "session_deleted",
]);

function onFrame(frame) {
  if (frame.event_id) state.lastEventId = Math.max(state.lastEventId, frame.event_id);
  if (EVENT_TYPES.has(frame.type)) {
    if (frame.type === "context_compressed") state.stale = true;
    logEvent(frame, state.replaying ? "replayed" : "");
    if (!state.replaying) refreshSoon();
    return;
  }
  switch (frame.type) {
    case "session_sync":
      state.retry = 0;
      setStatus("live", "live");
      $("#session-name").textContent = frame.session.name || frame.session.id;
      send({ type: "get_view" });
      break;
    case "replay_start":
      state.replaying = true;
      setStatus("replaying", `replaying ${frame.count}`);
      logEvent(frame);
      break;
    case "replay_end":
      state.replaying = false;
      setStatus("live", "live");
      logEvent(frame);
      refreshSoon();
      break;
    case "view":
      renderView(frame);
      break;
    case "messages_page":
      renderPage(frame);
      break;
    case "compact_preview":
      renderPreview(frame);
      break;
    case "compact_result":
    case "message_ack":
      logEvent(frame);
      break;
    case "expanded":
      renderExpanded(frame);
      break;
    case "search_results":
      renderSearch(frame);
      break;
    case "auth_required":
      if (askToken()) {
        const token = decodeURIComponent((document.cookie.match(/(?:^|; )contextsvc_token=([^;]*)/) || [])[1] || "");
        state.ws.send(JSON.stringify({ type: "auth", api_token: token }));
      }
      break;
    case "error":
      logEvent(frame);
      if (frame.id !== undefined && frame.id === state.pagingId) {
        // The page could not be read (e.g. the buffer changed under its token): start again from a fresh view.
        state.stale = true;
        refreshSoon();
      }
      break;
    default:
      break;
  }
}

function connect() {
  const scheme = location.protocol === "https:" ? "wss" : "ws";
  const query = state.lastEventId ? `?last_event_id=${state.lastEventId}` : "";
  setStatus("connecting", "connecting…");
  const ws = new WebSocket(`${scheme}://${location.host}/ws/sessions/${encodeURIComponent(state.sessionId)}${query}`);
  state.ws = ws;
  ws.addEventListener("message", (msg) => {
    try {
      onFrame(JSON.parse(msg.data));
    } catch (err) {
      console.error("bad frame", err);
    }
  });
  ws.addEventListener("close", (ev) => {
    state.closedFor = ev.code;
    document.body.dataset.closeCode = String(ev.code);
    if (ev.code === 4004) {
      setStatus("closed", "session not found (4004)");
      $("#session-name").textContent = "Session not found";
      return;
    }
    if (ev.code === 4003) {
      setStatus("closed", "access denied (4003) — set a token");
      return;
    }
    const wait = Math.min(10000, 500 * 2 ** state.retry++);
    setStatus("closed", `disconnected (${ev.code}); retrying in ${Math.round(wait / 1000)} s`);
    setTimeout(connect, wait);
  });
}

function showSession(id) {
  state.sessionId = id;
  $("#session-page").hidden = false;
  $("#compress-button").addEventListener("click", () => send({ type: "compact", dry_run: true }));
  $("#compress-cancel").addEventListener("click", () => { $("#preview").hidden = true; });
  $("#compress-confirm").addEventListener("click", () => {
    $("#preview").hidden = true;
    send({ type: "compact" });
  });
  $("#composer").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const input = $("#message-input");
    if (input.value.trim() && send({ type: "message", content: input.value, turn_complete: true })) input.value = "";
  });
  $("#search-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const query = $("#history-query").value.trim();
    if (query) send({ type: "search", query });
  });
  connect();
}

$("#token-button").addEventListener("click", () => {
  if (askToken()) location.reload();
});

const match = location.pathname.match(/^\/sessions\/([^/]+)$/);
if (match) showSession(decodeURIComponent(match[1]));
else showList();

// For tests and debugging: the socket's state.
window.inspector = state;
