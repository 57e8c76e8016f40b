// A calculator agent in Node.js with the official openai package and no lightning-rl code.
// Run by lrl.command(["node", "agent.mjs"], upstream=...) (or by hand against `lightning-rl gateway`):
// the OpenAI client reads OPENAI_BASE_URL and OPENAI_API_KEY, which point at the rollout, so every
// call is recorded with the engine's token ids. The task ({"a": 12, "b": 30}) comes as JSON on stdin
// (or in LIGHTNING_RL_TASK); the last line printed is the reward.
//
// Two turns, streamed: the model is asked to call the calculator tool, the agent runs the tool, and
// the model answers from its result. AGENT_FORCE_TOOL=1 names the tool in tool_choice (vLLM then
// guides the call's JSON), so the tool path runs whatever the model would have said.
import { readFileSync } from "node:fs";
import OpenAI from "openai";

const task = JSON.parse(process.env.LIGHTNING_RL_TASK ?? readFileSync(0, "utf8"));
const client = new OpenAI({ maxRetries: 0 });
const model = process.env.AGENT_MODEL ?? "policy";
const sampling = {
  temperature: Number(process.env.AGENT_TEMPERATURE ?? "1.0"),
  ...(process.env.AGENT_SEED === undefined ? {} : { seed: Number(process.env.AGENT_SEED) }),
};
const calculator = {
  type: "function",
  function: {
    name: "calculator",
    description: "Evaluate an arithmetic expression.",
    strict: true,
    parameters: {
      type: "object",
      properties: { expression: { type: "string", pattern: "^[0-9]{1,3}[+][0-9]{1,3}$" } },
      required: ["expression"],
      additionalProperties: false,
    },
  },
};

// One streamed turn: the text and the tool calls, assembled from the chunks.
async function turn(messages, extra) {
  const stream = await client.chat.completions.create({ model, stream: true, messages, ...sampling, ...extra });
  let content = "";
  const calls = [];
  for await (const chunk of stream) {
    const delta = chunk.choices[0]?.delta ?? {};
    content += delta.content ?? "";
    for (const c of delta.tool_calls ?? []) {
      calls[c.index] ??= { id: "", type: "function", function: { name: "", arguments: "" } };
      if (c.id) calls[c.index].id = c.id;
      calls[c.index].function.name += c.function?.name ?? "";
      calls[c.index].function.arguments += c.function?.arguments ?? "";
    }
  }
  return { content, calls: calls.filter(Boolean) };
}

const messages = [{ role: "user", content: `What is ${task.a}+${task.b}?` }];
const force = process.env.AGENT_FORCE_TOOL === "1";
const first = await turn(messages, {
  tools: [calculator],
  max_tokens: 80,
  ...(force ? { tool_choice: { type: "function", function: { name: "calculator" } } } : {}),
});
let answer = first.content;
if (first.calls.length) {
  messages.push({ role: "assistant", content: first.content, tool_calls: first.calls });
  for (const call of first.calls) {
    let result;
    try {
      const { expression } = JSON.parse(call.function.arguments);
      const [x, y] = expression.split("+").map(Number);
      result = String(x + y);
    } catch (err) {
      result = `error: ${err.message}`;
    }
    messages.push({ role: "tool", tool_call_id: call.id, content: result });
  }
  answer = (await turn(messages, { max_tokens: 8 })).content;
}
console.log(JSON.stringify({ answer, tool_calls: first.calls.length }));
console.log(answer.trim() === String(task.a + task.b) ? 1 : 0);
