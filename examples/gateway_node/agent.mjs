// A calculator agent in Node.js with the official openai package and no lightning-rl code.
// Run by lrl.command(["node", "agent.mjs"], upstream=...) (or by hand against `lightning-rl gateway`):
// the OpenAI client reads OPENAI_BASE_URL and OPENAI_API_KEY, which point at the rollout, so every
// call is recorded with the engine's token ids. The task comes as JSON on stdin (or LIGHTNING_RL_TASK);
// the last line printed is the reward.
import { readFileSync } from "node:fs";
import OpenAI from "openai";

const task = JSON.parse(process.env.LIGHTNING_RL_TASK ?? readFileSync(0, "utf8"));
const client = new OpenAI({ maxRetries: 0 });
const model = process.env.AGENT_MODEL ?? "policy";
const temperature = Number(process.env.AGENT_TEMPERATURE ?? "1.0");
const seed = process.env.AGENT_SEED === undefined ? undefined : Number(process.env.AGENT_SEED);

const stream = await client.chat.completions.create({
  model,
  stream: true,
  max_tokens: 8,
  temperature,
  seed,
  messages: [{ role: "user", content: `What is ${task.a}+${task.b}?` }],
});
let answer = "";
for await (const chunk of stream) answer += chunk.choices[0]?.delta?.content ?? "";
console.log(JSON.stringify({ answer }));
console.log(answer.trim() === String(task.a + task.b) ? 1 : 0);
