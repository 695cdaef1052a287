"""Chat templates: render a conversation to prompt text, byte-identical to transformers' `apply_chat_template`.

Templates come from model repositories, so they are untrusted code: they run in jinja2's
`ImmutableSandboxedEnvironment`, with the same globals and filters transformers gives them
(`utils/chat_template_utils.py`), because templates are written against exactly that environment. The sandbox
stops a template from reaching Python; a budget (RenderLimits: seconds and characters) stops one from running or
growing without end: every call the template makes, every namespace assignment, every repetition (`*`) and every
piece of output is checked against it.
"""

from __future__ import annotations

import contextvars
import dataclasses
import json
import sys
import time
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ..errors import ChatTemplateError

# Older jinja2 releases have known sandbox escapes; transformers refuses them for the same reason.
MIN_JINJA2 = (3, 1, 6)

# transformers appends this to the final message, renders, then cuts the text at it (continue_final_message).
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "

# Names a message's reasoning is passed under; the first is the one templates read.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")

# Names the renderer passes itself; template variables may not reuse them.
_RESERVED = ("messages", "tools", "documents", "add_generation_prompt")


@dataclasses.dataclass(frozen=True)
class RenderLimits:
    """How long one rendering may run and how much text it may produce (and build with `*`)."""

    seconds: float = 10.0
    characters: int = 4_000_000


_BUDGET: contextvars.ContextVar[tuple[float, RenderLimits] | None] = contextvars.ContextVar("_BUDGET", default=None)


def _check_budget(produced: int = 0) -> None:
    budget = _BUDGET.get()
    if budget is None:
        return
    deadline, limits = budget
    if time.monotonic() > deadline:
        raise ChatTemplateError(f"the chat template ran longer than {limits.seconds:g} s: it was stopped")
    if produced > limits.characters:
        raise ChatTemplateError(f"the chat template produced more than {limits.characters} characters: it was stopped")


class _BoundedEnvironment(ImmutableSandboxedEnvironment):
    """The sandbox, with every call and every `*` checked against the rendering's budget."""

    intercepted_binops = frozenset({"*"})

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 - jinja's names
        _check_budget()
        return super().call(__context, __obj, *args, **kwargs)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        _check_budget()
        if operator == "*" and isinstance(right, int) and hasattr(left, "__len__") and not isinstance(left, bool):
            _check_budget(len(left) * right)
        if operator == "*" and isinstance(left, int) and hasattr(right, "__len__") and not isinstance(right, bool):
            _check_budget(len(right) * left)
        return super().call_binop(context, operator, left, right)


def render_chat_template(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = False,
    continue_final_message: bool | str = False,
    tools: Sequence[Mapping[str, Any]] | None = None,
    documents: Sequence[Mapping[str, Any]] | None = None,
    variables: Mapping[str, Any] | None = None,
    limits: RenderLimits = RenderLimits(),
) -> str:
    """Render `messages` with the jinja `template` source, as transformers' `apply_chat_template(tokenize=False)`.

    `variables` are extra template variables: the tokenizer's special tokens (`bos_token`, ...) and the caller's
    keyword arguments, the latter winning. `continue_final_message` (True, or the name of the field to continue)
    leaves the last message open so the model continues it instead of starting a new one.
    """
    if not messages:
        raise ChatTemplateError("cannot render an empty conversation: pass at least one message")
    if continue_final_message and add_generation_prompt:
        raise ChatTemplateError(
            "continue_final_message and add_generation_prompt cannot both be set: continue the last message, "
            "or open a new assistant message, not both"
        )
    variables = dict(variables or {})
    if clash := [name for name in _RESERVED if name in variables]:
        raise ChatTemplateError(f"template variables {clash} clash with the renderer's own arguments; rename them")
    if tools is not None:
        for tool in tools:
            if not isinstance(tool, Mapping):
                raise ChatTemplateError(
                    f"tools must be JSON-schema dicts, got a {type(tool).__name__}: {tool!r}"
                )
    if documents is not None:
        for document in documents:
            if not isinstance(document, Mapping):
                raise ChatTemplateError(f"documents must be dicts with 'title' and 'text', got {document!r}")

    # OpenAI-style clients send `content=None` next to tool_calls; templates handle a missing key but would render
    # "None" or crash on a None, so (as transformers does) None-valued keys are dropped.
    chat = []
    for message in messages:
        if not isinstance(message, Mapping):
            raise ChatTemplateError(f"each message must be a dict with 'role' and 'content', got {message!r}")
        chat.append(_plain({key: value for key, value in message.items() if value is not None}))
    chat = _alias_reasoning_fields(chat)

    final_text = None
    if continue_final_message:
        final_text = _tag_final_message(chat, continue_final_message, template)

    compiled = compile_chat_template(template)
    token = _BUDGET.set((time.monotonic() + limits.seconds, limits))
    try:
        pieces, size = [], 0
        for piece in compiled.generate(
            messages=chat,
            tools=_plain(list(tools)) if tools is not None else None,
            documents=_plain(list(documents)) if documents is not None else None,
            add_generation_prompt=add_generation_prompt,
            **_plain(variables),
        ):
            size += len(piece)
            _check_budget(size)
            pieces.append(piece)
        rendered = "".join(pieces)
    except ChatTemplateError:
        raise
    except Exception as exc:  # the template is untrusted code: any failure in it is a template error
        raise ChatTemplateError(f"chat template failed to render: {type(exc).__name__}: {exc}") from exc
    finally:
        _BUDGET.reset(token)

    if final_text is not None:
        rendered = _cut_at_continue_tag(rendered, final_text)
    return rendered


@lru_cache(maxsize=64)
def compile_chat_template(template: str) -> jinja2.Template:
    """Compile a chat template once per distinct source (templates are re-rendered for every request)."""
    if not isinstance(template, str):
        raise ChatTemplateError(f"a chat template must be a jinja source string, got {type(template).__name__}")
    version = tuple(int(part) for part in jinja2.__version__.split(".")[:3] if part.isdigit())
    if version < MIN_JINJA2:
        raise ChatTemplateError(
            f"jinja2 {jinja2.__version__} has known sandbox escapes; chat templates need jinja2>=3.1.6 "
            "(pip install -U jinja2)"
        )
    env = _BoundedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    try:
        return env.from_string(template)
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"chat template does not compile: {type(exc).__name__}: {exc}") from exc


# ---- the environment's globals and filters, as transformers defines them -------------------------------------


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False
) -> str:
    # Jinja's own tojson escapes HTML characters (< > & ') and takes no options; templates expect plain json.dumps.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _TemplateDict:
    """`dict` as templates see it: callable and `fromkeys`, without the type object's attributes to break out by."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """`namespace()` that refuses underscore-prefixed attributes, which could reach CPython internals."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - same signature trick as jinja's Namespace
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        _check_budget(len(value) if isinstance(value, str) else 0)  # a loop growing a string needs no call
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore-prefixed attributes on a namespace, got {name!r}"
            )


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: marks assistant text for training masks; renders its body as is.

    Templates written for transformers' assistant-mask feature use the tag; without the extension they would not
    even compile. We never build masks, so the body is passed through unchanged.
    """

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


# ---- input preparation, as transformers' render_jinja_template does it ---------------------------------------


def _plain(value: Any) -> Any:
    """A copy of `value` made of plain JSON types only, so templates never reach methods of rich objects.

    Callers put arrays, images or pydantic models in messages; the sandbox does not know their methods are unsafe,
    so like transformers we rebuild everything, turning unknown objects into an inert "<TypeName>" placeholder.
    """
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):  # subclasses (enums...) carry extra methods: strip back to the base type
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(key): _plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_plain(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_plain(item) for item in value)
    numpy = sys.modules.get("numpy")  # numpy scalars can only exist if numpy was imported
    if numpy is not None and isinstance(value, numpy.generic):
        return _plain(value.item())  # np.bool_(False) would otherwise become a truthy placeholder
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):  # pydantic
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _alias_reasoning_fields(chat: list[dict]) -> list[dict]:
    # Templates read `reasoning_content` (gpt-oss ones read `thinking`): fill both from whichever name was given.
    # The dict literal's key order matters, because templates may iterate over or tojson a message.
    aliased = []
    for message in chat:
        reasoning = next((message[key] for key in _REASONING_FIELDS if message.get(key) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        aliased.append(message)
    return aliased


def _tag_final_message(chat: list[dict], continue_final_message: bool | str, template: str) -> str:
    """Append the continue tag to the last message's text; return that text (to check it survived rendering)."""
    field = continue_final_message if isinstance(continue_final_message, str) else "content"
    final = chat[-1].get(field)
    if final is None:
        raise ChatTemplateError(f"continue_final_message is set but the final message has no {field!r} to continue")
    fields = [field]
    if field in _REASONING_FIELDS:  # reasoning is copied under several names: tag every copy
        fields = [name for name in _REASONING_FIELDS if chat[-1].get(name) == final]
    if not any(name in template for name in fields):
        raise ChatTemplateError(
            f"continue_final_message is set to {field!r}, but the chat template never mentions that field"
        )
    if isinstance(final, (list, tuple)):  # content blocks: continue the last text block
        for block in reversed(final):
            if isinstance(block, Mapping) and "text" in block:
                text = block["text"]
                block["text"] = text + _CONTINUE_TAG
                return text
        raise ChatTemplateError("continue_final_message is set but the final message has no text block to continue")
    for name in fields:
        chat[-1][name] = chat[-1][name] + _CONTINUE_TAG
    return final


def _cut_at_continue_tag(rendered: str, final_text: str) -> str:
    tag = _CONTINUE_TAG.strip()
    if final_text.strip() not in rendered or tag not in rendered:
        raise ChatTemplateError(
            "continue_final_message is set but the final message does not appear in the rendered chat: the "
            f"template rewrites it. Final message: {final_text.strip()!r}"
        )
    at = rendered.rindex(tag)
    if rendered[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return rendered[:at]
    # The template trimmed the message's trailing space (and our tag's); trim what precedes the tag to match.
    return rendered[:at].rstrip()
