"""Redaction functions the redaction tests name as ``module:function`` (LIGHTNING_RL_REDACT, gateway --redact)."""

SECRET = "Zq9-SECRET-4471"  # what must never reach a store, a spill file or a span processor
CANARY = "plain-canary-5150"  # text that must reach them: proves the files are searchable as bytes


def scrub(text: str) -> str:
    return text.replace(SECRET, "[card]")


def broken(text: str) -> str:
    raise RuntimeError(f"cannot parse {text[:20]}")


def not_a_str(text: str) -> bytes:
    return text.encode()
