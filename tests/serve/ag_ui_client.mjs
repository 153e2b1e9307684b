// Drives `aimu serve`'s POST /ag-ui with the AG-UI project's own client (@ag-ui/client's
// HttpAgent), as a frontend would. Prints one JSON line per event the client accepted, then
// one line {"end": ...} with the agent's messages. Usage:
//   node ag_ui_client.mjs MODE URL THREAD [TEXT]
// MODE: run (one run of TEXT), abort (abortRun() at the first text delta), approve (a run
// that pauses on an approval, then a run whose resume entry approves it), back (a run with
// no new message: what a page that came back gets), tools (two threads, THREAD-stop and
// THREAD-page: on -stop, TEXT runs a server-side tool and the client aborts once it reads
// a line on stdin, sent while the tool runs; on -page, "locate" calls the page's own tool
// locate, answered "Bergen" by a following run, then that result sent again: refused;
// on -left, a result for an unknown call is refused, and the call's own then goes on).
import { createRequire } from "node:module";

const require = createRequire(`${process.env.AIMU_NPM_CLIENTS}/`);
const { HttpAgent } = require("@ag-ui/client");

const [mode, url, threadId, text] = process.argv.slice(2);
const agent = new HttpAgent({ url: `${url}/ag-ui`, threadId });
const print = (line) => process.stdout.write(`${JSON.stringify(line)}\n`);

const LOCATE = {
  name: "locate", description: "Where the user is, from the browser",
  parameters: { type: "object", properties: { precise: { type: "boolean" } } },
};

let stdin = null;  // read in mode tools only (reading it keeps other modes from ending)

async function run(options = {}, on = agent) {
  let outcome = null;
  const subscriber = {
    onEvent({ event }) {
      print({ event });
      if (mode === "abort" && event.type === "TEXT_MESSAGE_CONTENT") on.abortRun();
      if (event.type === "RUN_FINISHED") outcome = event.outcome ?? null;
      if (mode === "tools" && on.threadId.endsWith("-stop") && event.type === "TOOL_CALL_END") {
        print({ waiting: event.toolCallId });
        stdin.next().then(() => on.abortRun());  // the test says: the tool runs now
      }
    },
  };
  try {
    const result = await on.runAgent(options, subscriber);
    return { result: result.result ?? null, error: null, outcome };
  } catch (error) {
    return { result: null, error: String(error && (error.message || error.name)), outcome };
  }
}

async function tools() {
  stdin = process.stdin[Symbol.asyncIterator]();
  const stop = new HttpAgent({ url: `${url}/ag-ui`, threadId: `${threadId}-stop` });
  stop.addMessage({ id: "u-stop", role: "user", content: text });
  print({ stopped: await run({}, stop) });
  const page = new HttpAgent({ url: `${url}/ag-ui`, threadId: `${threadId}-page`,
                               initialState: { theme: "dark" } });
  page.addMessage({ id: "u-page", role: "user", content: "locate" });
  const asked = await run({ tools: [LOCATE] }, page);
  print({ asked });
  const answers = asked.outcome.pendingToolCallIds.map((toolCallId, i) => ({
    id: `t-${i}`, role: "tool", toolCallId, content: "Bergen",
  }));
  for (const answer of answers) page.addMessage(answer);
  const sent = page.messages.slice();
  print({ answered: await run({ tools: [LOCATE] }, page), messages: page.messages,
          state: page.state });
  const again = new HttpAgent({ url: `${url}/ag-ui`, threadId: `${threadId}-page`,
                                initialMessages: sent });
  print({ again: await run({ tools: [LOCATE] }, again) });
  // A result for a call the thread never had is refused; the call's own then goes on.
  const left = new HttpAgent({ url: `${url}/ag-ui`, threadId: `${threadId}-left` });
  left.addMessage({ id: "u-left", role: "user", content: "locate" });
  print({ left: await run({ tools: [LOCATE] }, left) });
  const [call] = left.messages.at(-1).toolCalls;
  const bogus = new HttpAgent({ url: `${url}/ag-ui`, threadId: `${threadId}-left`,
                                initialMessages: [...left.messages, {
                                  id: "t-bogus", role: "tool", toolCallId: "no-such-call",
                                  content: "Paris" }] });
  print({ bogus: await run({ tools: [LOCATE] }, bogus) });
  left.addMessage({ id: "t-left", role: "tool", toolCallId: call.id, content: "Oslo" });
  print({ end: await run({ tools: [LOCATE] }, left) });
  process.exit(0);
}
if (mode === "tools") await tools();

let outcome;
if (mode !== "back") agent.addMessage({ id: `u-${Date.now()}`, role: "user", content: text });
outcome = await run();
if (mode === "approve") {
  const interrupts = agent.pendingInterrupts;
  print({ interrupts, messages: agent.messages });
  outcome = await run({
    resume: interrupts.map((i) => ({
      interruptId: i.id, status: "resolved", payload: { approved: true },
    })),
  });
}
print({ end: { ...outcome, messages: agent.messages, pending: agent.pendingInterrupts } });
