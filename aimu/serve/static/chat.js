// The aimu web chat: one session at a time, the reply streaming over the runs API.
// No framework and no build step: fetch() for JSON, and for the event stream too (an
// EventSource cannot send the bearer token), resuming with Last-Event-ID after a drop.
"use strict";

const $ = (id) => document.getElementById(id);
const state = {
  token: sessionStorage.getItem("aimu-token") || "",
  session: null,
  run: null,          // {id, lastEventId, bubble, controller}
  lastStatus: null,   // how the session's last run ended
  queued: [],         // messages typed as a run ended, or that a server could not send into it
  typed: 0,           // messages the person has sent: a view they changed is not replaced
  view: 0,            // counts the times the view was drawn from the store: an older answer loses
};

const TOKEN_IN_HASH = /(?:^#|&)token=([^&]+)/.exec(location.hash);
if (TOKEN_IN_HASH) {  // #token=... never reaches the server or its logs
  state.token = decodeURIComponent(TOKEN_IN_HASH[1]);
  sessionStorage.setItem("aimu-token", state.token);
  history.replaceState(null, "", location.pathname + location.search);
}

// Paths relative to the page, so the app also works mounted under a prefix.
const at = (path) => new URL(path.replace(/^\//, ""), document.baseURI);

class ApiError extends Error {
  constructor(status, message) { super(message); this.status = status; }
}

function headers(extra = {}) {
  const h = { ...extra };
  if (state.token) h.Authorization = `Bearer ${state.token}`;
  return h;
}

async function api(method, path, body) {
  const init = { method, headers: headers(body === undefined ? {} : { "Content-Type": "application/json" }) };
  if (body !== undefined) init.body = JSON.stringify(body);
  const response = await fetch(at(path), init);
  if (response.status === 401) { askToken(); throw new ApiError(401, "this server needs its token"); }
  if (response.status === 204) return null;
  const data = await response.json().catch(() => ({}));
  if (!response.ok) throw new ApiError(response.status, data.error || response.statusText);
  return data;
}

function askToken() {
  const dialog = $("token-dialog");
  if (!dialog.open) dialog.showModal();
}

function notice(text) { $("notice").textContent = text || ""; }
function setStatus(text) { $("status").textContent = text; }

// One word per status, in the header and the session list alike.
const STATUS_WORDS = {
  cancelled: "stopped", timed_out: "timed out", in_progress: "unfinished",
  incomplete: "cut off", max_rounds: "round limit", blocked: "blocked",
};
function statusWord(status) { return status ? STATUS_WORDS[status] || status : "idle"; }
// How a conversation whose last run ended this way ends on screen.
const END_MARKS = {
  cancelled: "(stopped)", timed_out: "(timed out)", interrupted: "(interrupted)",
  incomplete: "(cut off)", failed: "(failed)", max_rounds: "(stopped at the round limit)",
  blocked: "(blocked by a guardrail)",
};
function plural(count, word) { return `${count} ${word}${count === 1 ? "" : "s"}`; }

// -- sessions -----------------------------------------------------------------------

async function loadSessions() {
  const { sessions } = await api("GET", "/sessions");
  // The one just used first: a list by name would push it below the fold.
  sessions.sort((a, b) => b.updated - a.updated || a.name.localeCompare(b.name));
  const list = $("session-list");
  list.replaceChildren();
  for (const info of sessions) {
    const item = document.createElement("li");
    const button = document.createElement("button");
    button.type = "button";
    button.dataset.session = info.name;
    button.textContent = info.name;
    const meta = document.createElement("small");
    const status = info.run_id ? "running" : info.status ? statusWord(info.status) : "";
    meta.textContent = plural(info.message_count, "message") + (status ? ` · ${status}` : "");
    button.append(meta);
    if (info.name === state.session) button.setAttribute("aria-current", "true");
    button.addEventListener("click", () => openSession(info.name));
    item.append(button);
    list.append(item);
  }
  return sessions;
}

async function openSession(name) {
  if (state.run) state.run.controller.abort();  // stop following; the run goes on
  state.run = null;
  state.session = name;
  localStorage.setItem("aimu-session", name);
  const url = new URL(location.href);
  url.searchParams.set("session", name);
  history.replaceState(null, "", url);
  $("session-title").textContent = name;
  $("sessions").classList.remove("open");
  $("messages").replaceChildren();
  $("approvals").replaceChildren();
  $("approvals").hidden = true;
  state.lastStatus = null;
  setStatus("idle");
  state.view += 1;
  const view = state.view, typed = state.typed;
  try {
    const [session, ends] = await Promise.all([
      api("GET", `/sessions/${encodeURIComponent(name)}`), runEnds(name),
    ]);
    // Another session was opened meanwhile, or a run's end drew this one from the store.
    if (state.session !== name || state.view !== view) return;
    if (state.typed !== typed) {
      showBefore(session, ends);  // typed while it loaded: that message and its run stay
    } else if (session.run_id) {
      // A run in progress: show what came before it, then replay the run's events.
      state.lastStatus = session.status;
      drawBeforeRun(session, ends);
      follow(session.run_id, null, true);
    } else {
      renderSession(session, ends);
      if (session.paused_run_id) await showApprovals(session.paused_run_id);
    }
  } catch (error) {
    // Not there yet (a new session), or the server asked for its token (its dialog is up).
    if (!(error instanceof ApiError && [401, 404].includes(error.status))) notice(error.message);
  }
  updateControls();
  loadSessions().catch(() => {});
}

// -- the conversation ---------------------------------------------------------------

function bubble(role, text, mark) {
  const div = document.createElement("div");
  div.className = `msg ${role}`;
  div.dataset.role = role;
  const body = document.createElement("span");
  body.className = "text";
  body.textContent = text || "";
  div.append(body);
  if (mark) addMark(div, mark);
  $("messages").append(div);
  scrollDown();
  return div;
}

function addMark(div, mark) {
  const span = document.createElement("span");
  span.className = "mark";
  span.textContent = mark;
  div.append(span);
  scrollDown();
}

function scrollDown() { const m = $("messages"); m.scrollTop = m.scrollHeight; }

function describeCall(call) {
  const fn = call.function || call;
  let args = fn.arguments;
  if (typeof args === "string") {  // the OpenAI wire form: shown like the parsed form
    try { args = JSON.parse(args); } catch { /* shown as it came */ }
  }
  if (typeof args !== "string") args = JSON.stringify(args);
  return `→ ${fn.name}(${args})`;
}

function describeResult(name, content) {
  return `${name || "tool"}: ${typeof content === "string" ? content : JSON.stringify(content)}`;
}

// The stored session as the page shows it; a live run ends by showing this too, so a
// reload shows exactly what was on screen. ``ends`` marks the earlier runs' ends.
function renderSession(session, ends) {
  state.view += 1;
  $("messages").replaceChildren();
  drawEnded(session, ends);
  state.lastStatus = session.status;
  setStatus(session.paused_run_id ? "paused" : statusWord(session.status));
}

// Show how a run ended after ``shown``, the messages on screen so far: on its partial
// reply (marked (stopped) as every partial reply is), else on its own.
function endMark(shown, mark, status) {
  const last = shown[shown.length - 1];
  if (last && last.role === "assistant" && last.aimu_partial) {
    const marks = $("messages").querySelectorAll(".msg.assistant .mark");
    if (marks.length) marks[marks.length - 1].textContent = mark;
  } else if (status === "incomplete" && last && last.role === "assistant") {
    addMark($("messages").lastElementChild, mark);
  } else {
    bubble("assistant", "", mark);
  }
}

function drawEnded(session, ends) {
  renderTranscript(session.messages, ends);
  const mark = END_MARKS[session.status];
  if (mark) endMark(session.messages, mark, session.status);
}

// What came before the session's run in progress (its events are replayed after it).
function drawBeforeRun(session, ends) {
  const before = session.messages.slice(0, session.run_messages_from ?? undefined);
  renderTranscript(before, ends);
  if (ends.has(before.length)) endMark(before, ends.get(before.length));
}

// The stored conversation drawn above what is on screen already: the messages typed
// while the session loaded, and the run they started (shown whole when it ends).
function showBefore(session, ends) {
  const live = [...$("messages").childNodes];
  $("messages").replaceChildren();
  if (session.run_id) drawBeforeRun(session, ends);
  else drawEnded(session, ends);
  $("messages").append(...live);
}

// Where each run of the session but its latest ended, and how, from the store's run
// records: message index -> the mark shown before that message (where the next run's
// messages begin). Records without a position (an older aimu) mark nothing.
async function runEnds(name) {
  const ends = new Map();
  let runs;
  try {
    ({ runs } = await api("GET", `/runs?session=${encodeURIComponent(name)}&limit=100`));
  } catch {
    return ends;  // the last run is still marked, from the session's status
  }
  const top = runs.filter((r) => r.parent === null && r.messages_from !== null).reverse();
  top.slice(0, -1).forEach((run, i) => {
    const died = (run.reason || "").startsWith("its process died");
    const mark = died ? "(its server died)" : END_MARKS[run.status];
    if (mark) ends.set(top[i + 1].messages_from, mark);
  });
  return ends;
}

// The transcript keeps a turn's calls together, then their results; the page shows each
// call followed by its result, as they came live (so a run's end reorders nothing).
function renderTranscript(messages, ends = new Map()) {
  const shown = new Set();
  messages.forEach((message, index) => {
    if (index > 0 && ends.has(index)) endMark(messages.slice(0, index), ends.get(index));
    if (message.role === "system" || shown.has(message)) return;
    if (message.role === "tool") { bubble("tool", describeResult(message.name, message.content)); return; }
    if (message.role === "assistant") {
      if (message.content || message.aimu_partial) {
        bubble("assistant", message.content, message.aimu_partial ? "(stopped)" : null);
      }
      const results = [];
      for (let next = index + 1; next < messages.length && messages[next].role === "tool"; next++) {
        results.push(messages[next]);
      }
      for (const call of message.tool_calls || []) {
        bubble("tool", describeCall(call));
        const result = results.find((r) => r.tool_call_id === call.id && !shown.has(r));
        if (result) {
          shown.add(result);
          bubble("tool", describeResult(result.name, result.content));
        }
      }
      return;
    }
    bubble(message.role, message.content);
  });
}

// -- runs -----------------------------------------------------------------------------

const QUEUED = "(queued: sent when this run ends)";

async function startRun(text) {
  const session = state.session;
  state.typed += 1;
  bubble("user", text);
  try {
    const started = await api("POST", `/sessions/${encodeURIComponent(session)}/runs`, { task: text });
    follow(started.run_id, null, false);
  } catch (error) {
    notice(error.message);
  }
}

async function submit(text) {
  text = text.trim();
  if (!text) return;
  notice("");
  if (!state.session) await chosenSession;  // the page is still choosing its session
  if (!state.session) await openSession("default");
  if (state.run) {
    // Input typed during a run joins it at its next step boundary.
    const runId = state.run.id;
    try {
      await api("POST", `/runs/${runId}/send`, { text });
      bubble("user", text);
    } catch (error) {
      if (error.status === 501 || error.status === 409) {
        // The run ended meanwhile (409), or runs on a server that cannot take it (501):
        // the text becomes the next run, now if this one is over already.
        if (state.run && state.run.id === runId) {
          state.queued.push(text);
          bubble("user", text, QUEUED);
        } else {
          await startRun(text);
        }
      } else {
        notice(error.message);
      }
    }
    return;
  }
  await startRun(text);
}

function follow(runId, after, replaying) {
  const controller = new AbortController();
  const run = {
    id: runId, lastEventId: after, bubble: null, controller, ended: false, calls: new Map(),
    connected: false,  // its events were read once: a 404 after that means its server restarted
  };
  state.run = run;
  setStatus("running");
  updateControls();
  loadSessions().catch(() => {});  // the list says running too
  stream(run, replaying).catch((error) => {
    if (!controller.signal.aborted) notice(error.message);
  });
}

async function stream(run, replaying) {
  let attempts = 0;
  while (!run.ended && !run.controller.signal.aborted) {
    try {
      const extra = run.lastEventId ? { "Last-Event-ID": run.lastEventId } : {};
      const response = await fetch(at(`/runs/${run.id}/events`), {
        headers: headers({ Accept: "text/event-stream", ...extra }),
        signal: run.controller.signal,
      });
      if (response.status === 401) { askToken(); return; }
      if (response.status === 404 && run.connected) { runLost(run); return; }
      if (!response.ok) {
        const data = await response.json().catch(() => ({}));
        throw new ApiError(response.status, data.error || response.statusText);
      }
      attempts = 0;
      run.connected = true;
      await readEvents(response, run, replaying);
    } catch (error) {
      if (run.controller.signal.aborted || error instanceof ApiError) throw error;
      attempts += 1;  // the connection dropped: reconnect and continue after the last id
      await new Promise((resolve) => setTimeout(resolve, Math.min(5000, 250 * attempts)));
    }
  }
}

// The server the page reconnected to does not know the run it followed: its server
// restarted. A run that died with it is resumed, by a POST (a GET never revives a run);
// then the session is drawn from the store and the run going on (that one, or the one a
// recovering server went on with) is followed from its start.
async function runLost(run) {
  const name = state.session;
  try {
    const session = await api("GET", `/sessions/${encodeURIComponent(name)}`);
    if (state.run !== run) return;
    if (!session.run_id && session.status === "in_progress") {
      await api("POST", `/sessions/${encodeURIComponent(name)}/resume`, {}).catch((error) => {
        if (!(error instanceof ApiError && error.status === 409)) throw error;  // another page did
      });
    }
  } catch (error) {
    notice(error.message);
  }
  if (state.run === run && state.session === name) await openSession(name);
}

async function readEvents(response, run, replaying) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      let id = null, data = "";
      for (const line of block.split("\n")) {
        if (line.startsWith("id:")) id = line.slice(3).trim();
        else if (line.startsWith("data:")) data += line.slice(5).trim();
      }
      if (!data) continue;
      if (id) run.lastEventId = id;
      onEvent(run, JSON.parse(data), replaying);
    }
  }
}

// In an agent tree (agent.as_tool()), an agent called carries the path above it: when
// another agent goes on, its words start a bubble of their own, labelled who it is.
function whoSpeaks(run, event) {
  if (!("source" in event)) return;
  const nested = Array.isArray(event.path) && event.path.length > 0;
  const who = nested ? [...event.path, event.source].join(" › ") : "";
  if (who === (run.who || "")) return;
  endBubble(run);
  run.who = who;
}

function labelled(run, div) {
  if (run.who) {
    const label = document.createElement("span");
    label.className = "who";
    label.textContent = run.who;
    div.prepend(label);
  }
  return div;
}

function onEvent(run, event, replaying) {
  if (state.run !== run) return;
  whoSpeaks(run, event);
  if (run.who && (event.type === "run_started" || event.type === "run_finished")) {
    if (event.type === "run_finished" && run.bubble && END_MARKS[event.status]) {
      addMark(run.bubble, END_MARKS[event.status]);
    }
    endBubble(run);
    return;  // an agent called: its task and end are its caller's tool call and result
  }
  switch (event.type) {
    case "run_started":
      if (replaying && event.task !== null) bubble("user", event.task);
      run.bubble = null;
      break;
    case "text": {
      if (!run.bubble) {
        run.bubble = labelled(run, bubble("assistant", ""));
        run.bubble.classList.add("streaming");
      }
      run.bubble.querySelector(".text").textContent += event.text;
      scrollDown();
      break;
    }
    case "turn_retried":
      // The reply's stream broke and was asked again: of its text, `kept` stays (all of
      // it when continued, none when restarted); what follows is appended.
      if (run.bubble) run.bubble.querySelector(".text").textContent = event.kept;
      break;
    case "tool_call":
      endBubble(run);
      run.calls.set(event.call_id, labelled(run, bubble("tool", describeCall({ name: event.name, arguments: event.arguments }))));
      break;
    case "tool_progress":
      showProgress(run.calls.get(event.call_id), event);
      break;
    case "tool_result":
      showProgress(run.calls.get(event.call_id), null);  // done: how far it was is moot
      labelled(run, bubble("tool", describeResult(event.name, event.content)));
      break;
    case "run_finished":
      // Marked at once; the stored session replaces the view when the handle finishes.
      if (END_MARKS[event.status]) {
        if (run.bubble) addMark(run.bubble, END_MARKS[event.status]);
        else bubble("assistant", "", END_MARKS[event.status]);
      }
      if (event.status === "failed") notice(`the run failed: ${event.error}`);
      endBubble(run);
      break;
    case "handle_finished":
      run.ended = true;
      finishRun(run, event);
      break;
    default:
      break;
  }
}

// How far a running call said it is, beside the call ("1/3 page 1 of 3"); null clears it.
function showProgress(call, event) {
  if (!call) return;
  let note = call.querySelector(".progress");
  if (!event) { if (note) note.remove(); return; }
  if (!note) {
    note = document.createElement("span");
    note.className = "progress";
    call.append(note);
  }
  const amount = event.total ? `${event.progress}/${event.total}` : `${event.progress}`;
  note.textContent = event.message ? `${amount} ${event.message}` : amount;
  scrollDown();
}

function endBubble(run) {
  if (run.bubble) run.bubble.classList.remove("streaming");
  run.bubble = null;
}

async function finishRun(run, event) {
  endBubble(run);
  state.run = null;
  state.lastStatus = event.status;
  setStatus(statusWord(event.status));
  updateControls();
  const next = state.queued.shift();
  const name = state.session;
  const typed = state.typed;
  try {
    // Show what was stored, as a reload would: tool calls in the stored order, a
    // stopped call's result, the same status word as the session list.
    const [session, ends] = await Promise.all([
      api("GET", `/sessions/${encodeURIComponent(name)}`), runEnds(name),
    ]);
    if (state.session === name && !state.run && state.typed === typed) {
      renderSession(session, ends);
      for (const text of state.queued) bubble("user", text, QUEUED);
      updateControls();
    }
  } catch (error) {
    notice(error.message);
  }
  if (event.status === "paused" && state.session === name) await showApprovals(run.id);
  loadSessions().catch(() => {});
  if (next !== undefined) startRun(next);
}

// -- approvals -------------------------------------------------------------------------

async function showApprovals(runId) {
  const run = await api("GET", `/runs/${runId}`);
  const box = $("approvals");
  box.replaceChildren();
  for (const call of run.pending || []) {
    const row = document.createElement("div");
    row.className = "approval";
    const what = document.createElement("code");
    what.textContent = `${call.name}(${JSON.stringify(call.arguments)})`;
    const approve = document.createElement("button");
    approve.type = "button";
    approve.textContent = call.external ? "Send result" : "Approve";
    approve.dataset.call = call.call_id;
    const deny = document.createElement("button");
    deny.type = "button";
    deny.textContent = "Deny";
    deny.addEventListener("click", () => decide(runId, call, false, row));
    if (call.external) {
      // A client-side tool's call (a page's tool, run elsewhere): a person types its result.
      const result = document.createElement("input");
      result.type = "text";
      result.setAttribute("aria-label", `Result of ${call.name}`);
      approve.addEventListener("click", () => decide(runId, call, true, row, result.value));
      result.addEventListener("keydown", (event) => {
        if (event.key === "Enter") decide(runId, call, true, row, result.value);
      });
      row.append(what, result, approve, deny);
    } else {
      approve.addEventListener("click", () => decide(runId, call, true, row));
      row.append(what, approve, deny);
    }
    box.append(row);
  }
  box.hidden = !box.children.length;
  const first = box.querySelector("button");
  if (first) first.focus();
}

async function decide(runId, call, approve, row, result) {
  // The pause shown: if the session was replaced since, the server refuses (409).
  try {
    const path = `/runs/${runId}/approvals/${encodeURIComponent(call.call_id)}`;
    const answer = await api("POST", path, {
      approve, reason: approve ? null : "denied in the web chat", pause_id: call.pause_id,
      ...(result === undefined ? {} : { result }),
    });
    row.remove();
    $("approvals").hidden = !$("approvals").children.length;
    if (answer.resumed_run_id) follow(answer.resumed_run_id, null, false);
  } catch (error) {
    notice(error.message);
  }
}

// -- controls ------------------------------------------------------------------------------

function updateControls() {
  const running = Boolean(state.run);
  $("stop").disabled = !running;
  $("interrupt").disabled = !running;
  const resumable = ["cancelled", "interrupted", "failed", "max_rounds", "in_progress", "timed_out"];
  $("resume").disabled = running || !state.session || !resumable.includes(state.lastStatus);
  if (!running && $("status").textContent === "running") setStatus("idle");
}

async function control(action) {
  const run = state.run;
  if (!run) return;
  notice("");
  const body = action === "cancel" ? { reason: "Stop pressed in the web chat" } : {};
  try {
    await api("POST", `/runs/${run.id}/${action}`, body);
    // Unless the run's end arrived on the event stream meanwhile.
    if (state.run === run) setStatus(action === "cancel" ? "stopping…" : "interrupting…");
  } catch (error) {
    notice(error.message);
  }
}

async function resume() {
  notice("");
  try {
    const started = await api("POST", `/sessions/${encodeURIComponent(state.session)}/resume`, {});
    // A resume continues the stopped turn: its stored partial text stays on screen.
    follow(started.run_id, null, false);
  } catch (error) {
    notice(error.message);
  }
}

// -- wiring ----------------------------------------------------------------------------------

$("composer").addEventListener("submit", (event) => {
  event.preventDefault();
  const input = $("input");
  const text = input.value;
  input.value = "";
  submit(text);
});
// A phone's keyboard has no Shift+Enter: there Enter is a new line and Send sends.
const TOUCH = matchMedia("(pointer: coarse)").matches;
if (!TOUCH) $("input").placeholder = "Message (Enter sends, Shift+Enter for a new line)";
$("input").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing && !TOUCH) {
    event.preventDefault();
    $("composer").requestSubmit();
  }
});
document.addEventListener("keydown", (event) => {
  if (event.key === "Escape" && state.run && !$("token-dialog").open) {
    event.preventDefault();
    control("cancel");
  }
});
$("stop").addEventListener("click", () => control("cancel"));
$("interrupt").addEventListener("click", () => control("interrupt"));
$("resume").addEventListener("click", resume);
$("new-session").addEventListener("submit", (event) => {
  event.preventDefault();
  const input = $("new-session-name");
  if (!input.checkValidity() || !input.value) { notice("a session name is 1-128 of A-Z a-z 0-9 . _ -"); return; }
  openSession(input.value);
  input.value = "";
  $("input").focus();
});
$("toggle-sessions").addEventListener("click", () => {
  const open = $("sessions").classList.toggle("open");
  $("toggle-sessions").setAttribute("aria-expanded", String(open));
});
$("token-form").addEventListener("submit", () => {
  state.token = $("token-input").value;
  sessionStorage.setItem("aimu-token", state.token);
  start();
});

// The session start() opens: a message sent before it is chosen waits for it (it went
// to "default", then the page opened the chosen one).
let sessionChosen;
const chosenSession = new Promise((resolve) => { sessionChosen = resolve; });

async function start() {
  try {
    // The session the address names, or the last one used; else the most recent one.
    const named = new URL(location.href).searchParams.get("session")
      || localStorage.getItem("aimu-session");
    const view = state.view;
    const sessions = named ? null : await loadSessions();
    const wanted = named || (sessions[0] && sessions[0].name) || "default";
    // A session the person opened while the list loaded (the new-session box, the list)
    // is their choice: the page does not take it back.
    const opened = state.view === view ? openSession(wanted) : null;
    sessionChosen();  // chosen once openSession has returned (its first part is synchronous)
    await opened;
    // Ready to type at once, unless the person is already typing somewhere else (the
    // new-session box): moving the focus then would send their keys to the message box.
    const active = document.activeElement;
    if (active === null || active === document.body) $("input").focus();
    document.body.dataset.ready = "";  // loaded: the page's tests wait for this
  } catch (error) {
    sessionChosen();
    if (!(error instanceof ApiError && error.status === 401)) notice(error.message);
  }
}

start();
