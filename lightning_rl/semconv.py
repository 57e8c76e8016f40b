"""Span names and attribute keys: the OpenTelemetry GenAI conventions plus our namespace."""

# OpenTelemetry GenAI semantic conventions (development status; JSON strings for messages).
GEN_AI_OPERATION_NAME = "gen_ai.operation.name"
GEN_AI_PROVIDER_NAME = "gen_ai.provider.name"
GEN_AI_REQUEST_MODEL = "gen_ai.request.model"
GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
GEN_AI_REQUEST_TEMPERATURE = "gen_ai.request.temperature"
GEN_AI_REQUEST_TOP_P = "gen_ai.request.top_p"
GEN_AI_REQUEST_SEED = "gen_ai.request.seed"
GEN_AI_RESPONSE_ID = "gen_ai.response.id"
GEN_AI_RESPONSE_MODEL = "gen_ai.response.model"
GEN_AI_RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"
GEN_AI_USAGE_INPUT_TOKENS = "gen_ai.usage.input_tokens"
GEN_AI_USAGE_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
GEN_AI_INPUT_MESSAGES = "gen_ai.input.messages"
GEN_AI_OUTPUT_MESSAGES = "gen_ai.output.messages"
GEN_AI_TOOL_DEFINITIONS = "gen_ai.tool.definitions"
GEN_AI_AGENT_NAME = "gen_ai.agent.name"
GEN_AI_TOOL_NAME = "gen_ai.tool.name"
GEN_AI_TOOL_CALL_ID = "gen_ai.tool.call.id"
GEN_AI_EVALUATION_RESULT = "gen_ai.evaluation.result"
GEN_AI_EVALUATION_NAME = "gen_ai.evaluation.name"
GEN_AI_EVALUATION_SCORE_VALUE = "gen_ai.evaluation.score.value"
SERVER_ADDRESS = "server.address"
SERVER_PORT = "server.port"

OP_CHAT = "chat"
OP_TEXT_COMPLETION = "text_completion"
OP_INVOKE_AGENT = "invoke_agent"
OP_EXECUTE_TOOL = "execute_tool"
LLM_OPERATIONS = frozenset({OP_CHAT, OP_TEXT_COMPLETION})

# Our namespace.
ROLLOUT_ID = "lightning_rl.rollout.id"
PROMPT_TOKEN_IDS = "lightning_rl.prompt_token_ids"
RESPONSE_TOKEN_IDS = "lightning_rl.response_token_ids"
RESPONSE_LOGPROBS = "lightning_rl.response_logprobs"
TOKEN_IDS_SOURCE = "lightning_rl.token_ids.source"
POLICY_VERSION = "lightning_rl.policy.version"
# Set only when a publish landed while the call ran: the version live at its end. vLLM swaps a LoRA in
# place, so the tokens after the swap came from the newer weights (their log-probs say so).
POLICY_VERSION_END = "lightning_rl.policy.version_end"
LLM_CALL_INDEX = "lightning_rl.llm_call.index"
REWARD_VALUE = "lightning_rl.reward.value"
STREAMED = "lightning_rl.streamed"
SAMPLING_PARAMS = "lightning_rl.sampling_params"
CHOICE_INDEX = "lightning_rl.choice.index"
INCOMPLETE = "lightning_rl.incomplete"
FRAMEWORK_RUN_ID = "lightning_rl.framework.run_id"  # e.g. LangChain's run id of this LLM call
TOOL_ARGUMENTS = "gen_ai.tool.call.arguments"
TOOL_RESULT = "gen_ai.tool.call.result"
LANGGRAPH_NODE = "lightning_rl.langgraph.node"
# A tool call made through an MCP client session (adapters/mcp.py): OpenTelemetry's MCP attributes, and the
# server's name as it introduced itself (OpenTelemetry has no attribute for it).
MCP_METHOD_NAME = "mcp.method.name"
MCP_PROTOCOL_VERSION = "mcp.protocol.version"
MCP_SERVER_NAME = "lightning_rl.mcp.server.name"
# A call of a coding-agent CLI through the gateway (gateway/coding_agents.py): the model name it asked for, when
# the gateway sent it as its rollout's policy; the CLI's own id of the (sub-)agent that made it; and its line:
# "subagent", "compaction" (the call that summarises a context) or "compacted" (a call on a summarised context).
ASKED_MODEL = "lightning_rl.request.model_asked"
GEN_AI_AGENT_ID = "gen_ai.agent.id"
CALL_LINEAGE = "lightning_rl.call.lineage"

# Values of TOKEN_IDS_SOURCE.
SOURCE_ENGINE = "engine"
SOURCE_RETOKENIZED = "retokenized"
SOURCE_MISSING = "missing"

# An HTTP request header: a request that carries it is not an agent's LLM call (the group judge's), so the
# HTTP-layer capture (adapters/http_clients.py) neither records nor counts it.
NO_CAPTURE_HEADER = "x-lightning-rl-no-capture"
