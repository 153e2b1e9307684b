// Drives `aimu serve`'s POST /ag-ui with the AG-UI project's own client (@ag-ui/client's
// HttpAgent), as a frontend would. Prints one JSON line per event the client accepted, then
// one line {"end": ...} with the agent's messages. Usage:
//   node ag_ui_client.mjs MODE URL THREAD [TEXT]
// MODE: run (one run of TEXT), abort (abortRun() at the first text delta), approve (a run
// that pauses on an approval, then a run whose resume entry approves it), back (a run with
// no new message: what a page that came back gets).
import { createRequire } from "node:module";

const require = createRequire(`${process.env.AIMU_NPM_CLIENTS}/`);
const { HttpAgent } = require("@ag-ui/client");

const [mode, url, threadId, text] = process.argv.slice(2);
const agent = new HttpAgent({ url: `${url}/ag-ui`, threadId });
const print = (line) => process.stdout.write(`${JSON.stringify(line)}\n`);

async function run(options = {}) {
  const subscriber = {
    onEvent({ event }) {
      print({ event });
      if (mode === "abort" && event.type === "TEXT_MESSAGE_CONTENT") agent.abortRun();
    },
  };
  try {
    const result = await agent.runAgent(options, subscriber);
    return { result: result.result ?? null, error: null };
  } catch (error) {
    return { result: null, error: String(error && error.name) };
  }
}

let outcome;
if (mode !== "back") agent.addMessage({ id: `u-${Date.now()}`, role: "user", content: text });
outcome = await run();
if (mode === "approve") {
  const interrupts = agent.pendingInterrupts;
  print({ interrupts });
  outcome = await run({
    resume: interrupts.map((i) => ({
      interruptId: i.id, status: "resolved", payload: { approved: true },
    })),
  });
}
print({ end: { ...outcome, messages: agent.messages, pending: agent.pendingInterrupts } });
