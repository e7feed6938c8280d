"""OpenAI's request and response shapes for /v1/chat/completions and /v1/completions: one parser of a request
body (batch lines and the online server alike) and the renderers of a response body.

- `body.parse_body(url, body)` validates a request body and returns the core's SamplingParams and the prompt;
- `fields` holds one small validator per body field (table-driven; each error names its field);
- `tools` is the grammar of tool calls (also used by the LangChain chat model);
- `render` builds the response body's choices and usage from stored or fresh results.

The batch line's envelope (custom_id, method, url) is the job layer's: spec_batch.jobs.batch_input.
"""

from .body import CHAT, COMPLETIONS, ENDPOINTS, BodyError, ParsedBody, parse_body

__all__ = ["CHAT", "COMPLETIONS", "ENDPOINTS", "BodyError", "ParsedBody", "parse_body"]
