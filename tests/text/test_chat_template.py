"""Chat templates: renderings equal the shared references and transformers' `apply_chat_template`; the sandbox holds."""

from __future__ import annotations

import json
import shutil
import warnings
from datetime import datetime

import pytest
from conftest import requires_shared

from nexttoken.text.chat_template import render_chat_template
from nexttoken.errors import ChatTemplateError
from nexttoken.text.tokenizer import Tokenizer

pytestmark = requires_shared

FAMILIES = ["llama-3.2-instruct", "qwen2.5-instruct", "llama-2-chat", "phi-3-mini-instruct"]
# Llama 3.2's template prints today's date unless given one.
KWARGS = {"llama-3.2-instruct": {"date_string": "26 Jul 2024"}}

SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
CONVERSATIONS = {
    "user": [{"role": "user", "content": "Hi there!"}],
    "system-user": [SYSTEM, {"role": "user", "content": "Write a haiku about tokenizers."}],
    "multi-turn": [
        SYSTEM,
        {"role": "user", "content": "Hello! What is 2+2?"},
        {"role": "assistant", "content": "2+2 equals 4."},
        {"role": "user", "content": "  And 3+3? Answer in 日本語 with 🦙, \"quoted\" <tags> & café.\n"},
        {"role": "assistant", "content": "3+3 は 6 です。"},
    ],
    "no-system": [
        {"role": "user", "content": "Tell me a joke."},
        {"role": "assistant", "content": "Why did the chicken cross the road?"},
        {"role": "user", "content": "Why?"},
    ],
}

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city (°C).",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "e.g. Zürich"}},
            "required": ["city"],
        },
    },
}
TOOL_CHAT = [
    {"role": "user", "content": "Weather in Zürich?"},
    {
        "role": "assistant",
        "content": None,  # OpenAI clients send None next to tool_calls; it is dropped as transformers does
        "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}}],
    },
    {"role": "tool", "content": '{"temperature": 21}'},
]


@pytest.fixture(scope="module")
def ours(shared_dir):
    return {name: Tokenizer.from_dir(shared_dir / "tokenizers" / name) for name in FAMILIES}


@pytest.fixture(scope="module")
def hf(shared_dir):
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return {
            name: transformers.AutoTokenizer.from_pretrained(str(shared_dir / "tokenizers" / name))
            for name in FAMILIES
        }


@pytest.fixture(scope="module")
def stories(shared_dir):
    return Tokenizer.from_dir(shared_dir / "models" / "stories260k")


def hf_render(hf_tok, messages, **kwargs):
    return hf_tok.apply_chat_template(messages, tokenize=False, **kwargs)


@pytest.mark.parametrize("name", FAMILIES)
def test_reference_rendering(ours, shared_dir, name):
    chat = json.loads((shared_dir / "tokenizers" / "conformance_cases.json").read_text())[name]["chat"]
    tok = ours[name]
    args = dict(add_generation_prompt=chat["add_generation_prompt"], **chat["template_kwargs"])
    assert tok.apply_chat_template(chat["messages"], **args) == chat["text"]
    assert tok.apply_chat_template(chat["messages"], tokenize=True, **args) == chat["ids"]


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_matches_transformers(ours, hf, name, conversation, add_generation_prompt):
    messages = CONVERSATIONS[conversation]
    kwargs = dict(add_generation_prompt=add_generation_prompt, **KWARGS.get(name, {}))
    expected = hf_render(hf[name], messages, **kwargs)
    assert ours[name].apply_chat_template(messages, **kwargs) == expected


@pytest.mark.parametrize("name", ["llama-3.2-instruct", "qwen2.5-instruct"])
def test_tools_match_transformers(ours, hf, name):
    kwargs = dict(tools=[WEATHER_TOOL], add_generation_prompt=True, **KWARGS.get(name, {}))
    for messages in (TOOL_CHAT[:1], TOOL_CHAT):
        assert ours[name].apply_chat_template(messages, **kwargs) == hf_render(hf[name], messages, **kwargs)


def test_continue_final_message_matches_transformers(ours, hf):
    messages = [{"role": "user", "content": "Count to three."}, {"role": "assistant", "content": "One, two, "}]
    for name in ("qwen2.5-instruct", "phi-3-mini-instruct"):
        got = ours[name].apply_chat_template(messages, continue_final_message=True)
        assert got == hf_render(hf[name], messages, continue_final_message=True)
        assert got.endswith("One, two, ")
    with pytest.raises(ChatTemplateError, match="add_generation_prompt"):
        ours["qwen2.5-instruct"].apply_chat_template(messages, continue_final_message=True, add_generation_prompt=True)


def test_llama3_date_defaults_to_today(ours):
    before = datetime.now().strftime("%d %b %Y")
    text = ours["llama-3.2-instruct"].apply_chat_template(CONVERSATIONS["user"])
    after = datetime.now().strftime("%d %b %Y")  # rendering may cross midnight: either day is today
    assert f"Today Date: {before}\n" in text or f"Today Date: {after}\n" in text


# Templates exercising the environment: whitespace control, tojson options, loop controls, namespace,
# special-token variables, the {% generation %} tag, dict(), and raise_exception guarded by a condition.
CUSTOM_TEMPLATES = [
    "{% for m in messages %}\n  {% if m.role == 'user' %}\n    U: {{ m.content }}\n  {% else %}\n"
    "    A: {{ m.content }}\n  {% endif %}\n{% endfor %}\n{% if add_generation_prompt %}A:{% endif %}",
    "{{ messages | tojson }}|{{ messages[0] | tojson(indent=2, sort_keys=True) }}|"
    "{{ {'b': 1, 'a': '<é>'} | tojson(separators=(',', ':')) }}",
    "{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}{% if m.role == 'system' %}{% continue %}"
    "{% endif %}[{{ m.role }}]{% endfor %}",
    "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + m.content | length %}{% endfor %}"
    "{{ bos_token }}{{ ns.n }}{{ eos_token }}{{ unk_token }}{{ pad_token is defined }}",
    "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}{{ m.content }}{% endgeneration %}"
    "{% else %}{{ m.content }}{% endif %}{% endfor %}",
    "{{ dict(a=1, b=[1, 2]) | tojson }}{{ messages | length }}{{ extra_var | default('none') }}",
    "{%- for m in messages -%}\n  {{- m.content | trim }}\n{%- endfor -%}",
]


@pytest.mark.parametrize("template", CUSTOM_TEMPLATES)
def test_custom_templates_match_transformers(ours, hf, template):
    messages = CONVERSATIONS["multi-turn"]
    for name in ("llama-2-chat", "qwen2.5-instruct"):  # different special tokens (Qwen has no bos/unk)
        for gen in (True, False):
            expected = hf_render(hf[name], messages, chat_template=template, add_generation_prompt=gen)
            assert ours[name].apply_chat_template(messages, chat_template=template, add_generation_prompt=gen) == (
                expected
            )


def test_extra_kwargs_reach_the_template(ours, hf):
    template = "{{ extra_var }}/{{ bos_token }}/{{ flag }}"
    kwargs = dict(chat_template=template, extra_var="X", bos_token="<B>", flag=[1, {"k": None}])
    got = ours["llama-2-chat"].apply_chat_template(CONVERSATIONS["user"], **kwargs)
    assert got == hf_render(hf["llama-2-chat"], CONVERSATIONS["user"], **kwargs) == "X/<B>/[1, {'k': None}]"


def test_raise_exception(ours):
    with pytest.raises(ChatTemplateError, match="Conversation roles must alternate"):
        ours["llama-2-chat"].apply_chat_template([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    with pytest.raises(ChatTemplateError, match="custom failure"):
        render_chat_template("{{ raise_exception('custom failure') }}", CONVERSATIONS["user"])


@pytest.mark.parametrize(
    "template",
    [
        "{{ ''.__class__.__mro__ }}",
        "{{ messages.__class__.__base__.__subclasses__() }}",
        "{{ messages.append({'role': 'x'}) }}",
        "{% set ns = namespace() %}{% set ns._x = 1 %}",
        "{{ namespace(__init__=1) }}",
        "{{ dict.__class__ }}{{ cycler.__init__.__globals__ }}",
    ],
)
def test_sandbox_blocks_escapes(template):
    with pytest.raises(ChatTemplateError) as info:
        render_chat_template(template, CONVERSATIONS["user"])
    assert "unsafe" in str(info.value).lower() or "security" in str(info.value).lower() or "underscore" in str(
        info.value
    )


def test_broken_templates(ours):
    with pytest.raises(ChatTemplateError, match="does not compile"):
        render_chat_template("{% for m in messages %}", CONVERSATIONS["user"])
    with pytest.raises(ChatTemplateError, match="TypeError"):
        render_chat_template("{{ 1 + messages }}", CONVERSATIONS["user"])
    with pytest.raises(ChatTemplateError, match="empty conversation"):
        ours["qwen2.5-instruct"].apply_chat_template([])


def test_no_template(stories):
    with pytest.raises(ChatTemplateError, match=r"chat_template=\.\.\."):
        stories.apply_chat_template(CONVERSATIONS["user"])
    assert stories.apply_chat_template(CONVERSATIONS["user"], chat_template="{{ bos_token }}x") == "<s>x"


def test_template_files_and_named_templates(shared_dir, tmp_path):
    """chat_template.jinja beats the config; a list of named templates picks "default", or "tool_use" with tools."""
    src = shared_dir / "models" / "stories260k"
    shutil.copy(src / "tokenizer.json", tmp_path / "tokenizer.json")
    config = json.loads((src / "tokenizer_config.json").read_text())
    config["chat_template"] = [
        {"name": "default", "template": "D{{ messages | length }}"},
        {"name": "tool_use", "template": "T{{ tools | length }}"},
        {"name": "terse", "template": "S"},
    ]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.apply_chat_template(CONVERSATIONS["user"]) == "D1"
    assert tok.apply_chat_template(CONVERSATIONS["user"], tools=[WEATHER_TOOL]) == "T1"
    assert tok.apply_chat_template(CONVERSATIONS["user"], chat_template="terse") == "S"
    assert set(tok.chat_templates) == {"default", "tool_use", "terse"}

    (tmp_path / "chat_template.jinja").write_text("J{{ bos_token }}")
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.chat_template == "J{{ bos_token }}" and tok.apply_chat_template(CONVERSATIONS["user"]) == "J<s>"
    transformers = pytest.importorskip("transformers")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf_tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    assert hf_render(hf_tok, CONVERSATIONS["user"]) == "J<s>"


def test_bad_inputs(ours):
    tok = ours["qwen2.5-instruct"]
    with pytest.raises(ChatTemplateError, match="tools must be"):
        tok.apply_chat_template(CONVERSATIONS["user"], tools=[print])
    with pytest.raises(ChatTemplateError, match="each message"):
        tok.apply_chat_template(["hello"])


def test_messages_are_not_modified(ours):
    messages = json.loads(json.dumps(TOOL_CHAT))
    before = json.dumps(messages)
    ours["qwen2.5-instruct"].apply_chat_template(messages, tools=[WEATHER_TOOL])
    chat = [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
    text = ours["qwen2.5-instruct"].apply_chat_template(
        chat, continue_final_message=True, chat_template="{{ messages[-1].content[0].text }}!"
    )
    assert text == "Hi" and chat == [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
    assert json.dumps(messages) == before
