"""The server's settings, from `nexttoken serve`'s flags (cli.py)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ServerSettings:
    model_name: str  # the name the model is reported by (--served-model-name's first)
    api_key: str | None = None
    max_n: int = 8  # choices per request
    max_seqs_per_request: int = 256  # prompts x n: one request may not create more sequences than this
    max_body_bytes: int = 32 << 20  # room for a few inline photos (base64 is 4/3 of their bytes)
    body_timeout_s: float = 30.0  # a request body not fully sent by then gets 408
    shutdown_timeout_s: float = 10.0  # on SIGTERM / SIGINT: what is still running after this is aborted (503)
    tool_call_parser: str | None = None  # vLLM's --tool-call-parser name; None: read off the chat template
    webui: bool = True  # the chat page at / (webui/); --no-webui leaves it out
    reasoning_parser: str | None = None  # vLLM's --reasoning-parser name; None: read off the chat template
    reasoning_budget: int | None = None  # thinking tokens at most, unless a request says otherwise (None: no limit)
    default_chat_template_kwargs: dict = field(default_factory=dict)  # under each request's chat_template_kwargs
    pooling: str = "last"  # embeddings' pooling: the model folder's own (sentence-transformers) where it has one
    structured_whitespace: str = "flexible"  # JSON's layout under a JSON constraint, unless a request sets its own
    generation_config: str = "auto"  # "auto": the model's generation_config.json defaults apply; "vllm": not
    strict_json_schema: bool = True  # schemas as clients write them (closed objects, bounded digits); False: literal
    host: str = "127.0.0.1"  # the address it is bound to: a Host header naming it is this server
    allowed_hosts: tuple[str, ...] = ()  # more names the Host header may carry ("*": any)
    allowed_origins: tuple[str, ...] = ()  # web origins allowed to call it from a browser (CORS; "*": any)
    special_tokens_in_content: bool = True  # "<|im_start|>" in a message is the special token (False: plain text)
    max_waiting_seqs: int = 1024  # sequences queued for a slot; a request that would queue more gets 429
    grammar_compile_timeout_s: float = 10.0  # a request waits this long for its grammar's compile, then gets 400
    aliases: tuple[str, ...] = ()  # more names requests may give the model (--served-model-name's others)
    otlp_traces_endpoint: str | None = None  # an OTLP/HTTP collector: one span per request (http/tracing.py)
    # Images in requests (server/images.py): how many, how large, and whether http(s) image URLs are fetched
    max_images_per_request: int = 8
    max_image_pixels: int = 4096 * 4096  # width x height of one image
    max_image_bytes: int = 20 * 1024 * 1024  # one image's encoded bytes (a fetched one's too)
    allow_remote_images: bool = False  # fetch http(s) image URLs (a request-forgery risk: docs/serving.md)
    allow_private_image_urls: bool = False  # ... from loopback, private and other non-public addresses too
    remote_image_timeout_s: float = 10.0  # one fetch, connect to last byte

    @property
    def served_names(self) -> tuple[str, ...]:
        """Every name a request's `model` may give the base model, the reported one first."""
        return (self.model_name, *self.aliases)
