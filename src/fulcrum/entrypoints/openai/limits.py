"""Request limits the API schema states and the server enforces (no imports: the CLI reads these
without loading pydantic)."""

MAX_N = 16  # choices per request; --max-n may only lower it
MAX_LOGPROBS = 20  # top_logprobs / logprobs; --max-logprobs may only lower it
MAX_STOP_STRINGS = 16
MAX_STOP_LEN = 1024  # characters per stop string
MAX_PROMPTS_PER_REQUEST = 256  # prompts in one /v1/completions request
