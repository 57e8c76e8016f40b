// A Node.js agent instrumented with the OpenTelemetry JS SDK: its own spans (a planning step and a
// calculator tool call) go over OTLP/HTTP (protobuf) to the gateway, which adds them to its rollout;
// its LLM call goes through the gateway as usual. The exporter reads OTEL_EXPORTER_OTLP_TRACES_ENDPOINT
// and OTEL_EXPORTER_OTLP_TRACES_HEADERS, which lrl.command sets to the rollout's. No lightning-rl code.
import { readFileSync } from "node:fs";
import { context, trace } from "@opentelemetry/api";
import { OTLPTraceExporter } from "@opentelemetry/exporter-trace-otlp-proto";
import { SimpleSpanProcessor, TracerProvider } from "@opentelemetry/sdk-trace";
import OpenAI from "openai";

const task = JSON.parse(process.env.LIGHTNING_RL_TASK ?? readFileSync(0, "utf8"));
const provider = new TracerProvider({ spanProcessors: [new SimpleSpanProcessor({ exporter: new OTLPTraceExporter() })] });
const tracer = provider.getTracer("node-otlp-agent");
const client = new OpenAI({ maxRetries: 0 });

const plan = tracer.startSpan("plan", { attributes: { "task.a": task.a, "task.b": task.b } });
const inPlan = trace.setSpan(context.active(), plan);
const tool = tracer.startSpan("calculator", {
  attributes: {
    "gen_ai.tool.name": "calculator",
    "gen_ai.tool.call.id": "node-call-1",
    "gen_ai.tool.call.arguments": JSON.stringify({ expression: `${task.a}+${task.b}` }),
  },
}, inPlan);
const result = String(task.a + task.b);
tool.setAttribute("gen_ai.tool.call.result", result);
tool.end();
const reply = await client.chat.completions.create({
  model: process.env.AGENT_MODEL ?? "policy",
  max_tokens: 8,
  temperature: 0,
  messages: [{ role: "user", content: `The calculator says ${task.a}+${task.b}=${result}. Repeat the number.` }],
});
plan.end();
await provider.forceFlush();
await provider.shutdown();
console.log(JSON.stringify({ reply: reply.choices[0].message.content }));
console.log(1);
