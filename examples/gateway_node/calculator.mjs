// The main demo's calculator agent (examples/calculator_rl/train.py, answer()), in Node.js with the
// official openai package and no lightning-rl code: the same prompt, tool and sampling, so the demo
// model, warm-started on that format, can learn it through the gateway (make demo-gateway).
// It answers with its calculator call's result, or with its words when it makes no call; the last
// line printed is the reward (1 for the exact sum). OPENAI_BASE_URL/OPENAI_API_KEY point at the
// rollout; the task ({"a": 12, "b": 30}) comes on stdin.
import { readFileSync } from "node:fs";
import OpenAI from "openai";

const task = JSON.parse(process.env.LIGHTNING_RL_TASK ?? readFileSync(0, "utf8"));
const client = new OpenAI({ maxRetries: 0 });
const calculator = {
  type: "function",
  function: {
    name: "calculator",
    description: "Evaluate an arithmetic expression.",
    parameters: { type: "object", properties: { expression: { type: "string" } }, required: ["expression"] },
  },
};

function evaluate(expression) {
  const match = /^\s*(-?\d+)\s*([+\-*])\s*(-?\d+)\s*$/.exec(expression);
  if (!match) return `error: cannot evaluate ${JSON.stringify(expression)}`;
  const [x, op, y] = [Number(match[1]), match[2], Number(match[3])];
  return String(op === "+" ? x + y : op === "-" ? x - y : x * y);
}

const response = await client.chat.completions.create({
  model: process.env.AGENT_MODEL ?? "policy",
  temperature: Number(process.env.AGENT_TEMPERATURE ?? "1.0"),
  max_tokens: 64,
  tools: [calculator],
  messages: [
    { role: "system", content: "Be exact." },
    { role: "user", content: `What is ${task.a}+${task.b}?` },
  ],
});
const message = response.choices[0].message;
let said = message.content ?? "";
const call = message.tool_calls?.[0];
if (call) {
  let expression = "";
  try {
    expression = String(JSON.parse(call.function.arguments).expression ?? "");
  } catch {}
  said = evaluate(expression); // the agent answers with its tool's result
}
console.log(JSON.stringify({ said, tool_call: Boolean(call) }));
console.log(said.trim() === String(task.a + task.b) ? 1 : 0);
