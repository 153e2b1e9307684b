// Drives `aimu serve`'s /api/chat with the AI SDK's own client (npm `ai`): its
// DefaultChatTransport sends and reconnects, every chunk is checked by its UI message chunk
// schema, and readUIMessageStream builds the UI message as useChat would. Prints one JSON line
// per chunk, then {"end": {message, error}}. Usage:
//   node ai_sdk_client.mjs MODE URL CHAT [TEXT [TOOL_TEXT]]
// MODE: run (send TEXT), abort (abort the fetch at the first text delta; then, given
// TOOL_TEXT, send it on chat CHAT-tool and abort once a line comes on stdin after the
// first tool-input-available: the test sends it while the server-side tool runs), approve (send TEXT,
// which pauses on an approval, then send the approval response as useChat does), reconnect
// (GET the chat's run in progress; prints {"end": null} on 204), deny (send TEXT, which
// pauses on an approval, then deny it with a reason as useChat's addToolApprovalResponse
// does).
import { createRequire } from "node:module";
import { pathToFileURL } from "node:url";

const require = createRequire(`${process.env.AIMU_NPM_CLIENTS}/`);
const { DefaultChatTransport, readUIMessageStream } = await import(
  pathToFileURL(require.resolve("ai")).href
);

const [mode, url, chatId, text, toolText] = process.argv.slice(2);
const transport = new DefaultChatTransport({ api: `${url}/api/chat` });
const print = (line) => process.stdout.write(`${JSON.stringify(line)}\n`);
const user = { id: "u1", role: "user", parts: [{ type: "text", text }] };

async function read(stream, controller, message, midTool = false) {
  const printed = stream.pipeThrough(new TransformStream({
    transform(chunk, out) {
      print({ chunk });
      out.enqueue(chunk);
      if (mode === "abort" && !midTool && chunk.type === "text-delta") controller.abort();
      if (midTool && chunk.type === "tool-input-available") {
        print({ waiting: chunk.toolCallId });
        process.stdin[Symbol.asyncIterator]().next().then(() => controller.abort());
      }
    },
  }));
  let last = message;
  let error = null;
  let detail = null;
  try {
    for await (const snapshot of readUIMessageStream({ stream: printed, message,
                                                        terminateOnError: true })) {
      last = snapshot;
    }
  } catch (caught) {
    error = String(caught && caught.name);
    detail = String(caught && caught.message);
  }
  return { message: last, error, ...(detail === null ? {} : { detail }) };
}

async function send(messages, message, { chat = chatId, midTool = false, body } = {}) {
  const controller = new AbortController();
  try {
    const stream = await transport.sendMessages({
      chatId: chat, messages, trigger: "submit-message", messageId: undefined,
      abortSignal: controller.signal, body,
    });
    return await read(stream, controller, message, midTool);
  } catch (caught) {
    return { message, error: String(caught && caught.name), detail: String(caught.message) };
  }
}

// The page's own tool, declared in the request body (aimu's `tools`), answered as
// useChat's addToolResult does: the part's state output-available, with its output.
const LOCATE = { name: "locate", description: "Where the user is, from the browser" };

async function clientTool() {
  const chat = `${chatId}-page`;
  const ask = { id: "u3", role: "user", parts: [{ type: "text", text: "locate" }] };
  const called = await send([ask], undefined, { chat, body: { tools: [LOCATE] } });
  print({ called });
  const parts = called.message.parts.map((part) => part.state === "input-available"
    ? { ...part, state: "output-available", output: "Bergen" } : part);
  const answered = { ...called.message, parts };
  print({ located: await send([ask, answered], answered, { chat, body: { tools: [LOCATE] } }) });
  return await send([ask, answered], answered, { chat });  // the same output again
}

let end;
if (mode === "reconnect") {
  const stream = await transport.reconnectToStream({ chatId });
  end = stream === null ? null : await read(stream, new AbortController());
} else {
  end = await send([user]);
  if (mode === "abort" && toolText) {
    print({ stopped: end });
    const tooled = { id: "u2", role: "user", parts: [{ type: "text", text: toolText }] };
    end = await send([tooled], undefined, { chat: `${chatId}-tool`, midTool: true });
  }
  if (mode === "approve" || mode === "deny") {
    const asked = end.message;
    const decision = mode === "approve" ? { approved: true }
      : { approved: false, reason: "not today" };
    const parts = asked.parts.map((part) => part.state === "approval-requested"
      ? { ...part, state: "approval-responded", approval: { ...part.approval, ...decision } }
      : part);
    const answered = { ...asked, parts };
    print({ asked });
    end = await send([user, answered], answered);
    print({ [mode === "approve" ? "approved" : "denied"]: end });
    if (mode === "approve") end = await clientTool();
  }
}
print({ end });
process.exit(0);  // stdin, if it was read, would keep the process waiting
