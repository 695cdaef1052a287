"""Tool calls in the library: templates render tools, past calls and results byte-identical to transformers; each
format's parser reads hand-written outputs the same whole and streamed at every split; each grammar accepts the
format's calls and refuses what breaks a schema (llguidance on the real tokenizers); `LLM.chat(tools=...)` on
random-weight models with the Llama 3.2 and Qwen2.5 tokenizers returns calls whose arguments validate under
`jsonschema`, and a full loop (call -> tool result -> answer) runs."""

from __future__ import annotations

import json
import random
import warnings

import jsonschema
import pytest
import torch
from conftest import requires_shared
from support.tiny_models import build_chat_model

import nexttoken
from nexttoken.errors import GenerationConfigError
from nexttoken.generation.processors.structured import GRAMMARS, Constraint, allowed_tokens
from nexttoken.text.tokenizer import Tokenizer
from nexttoken.chat import FORMATS, ToolCallDelta, ToolsError, ToolUse, template_messages
from support.tools import QUESTION, SCHEMAS, TOOLS, WEATHER

pytestmark = requires_shared



def openai_turns(arguments: list[tuple[str, dict]], results: list[str]) -> list[dict]:
    """An assistant turn with these calls (OpenAI's layout: arguments as JSON text), then one tool result each."""
    calls = [{"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}
             for i, (name, args) in enumerate(arguments)]
    return [{"role": "assistant", "content": None, "tool_calls": calls},
            *({"role": "tool", "tool_call_id": f"call_{i}", "content": r} for i, r in enumerate(results))]


# ---- templates -------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def toks(shared_dir):
    return {name: Tokenizer.from_dir(shared_dir / "tokenizers" / name)
            for name in ("llama-3.2-instruct", "qwen2.5-instruct")}


@pytest.fixture(scope="module")
def hf_toks(shared_dir):
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return {name: transformers.AutoTokenizer.from_pretrained(str(shared_dir / "tokenizers" / name))
                for name in ("llama-3.2-instruct", "qwen2.5-instruct")}


CHATS = {
    # (tokenizer, conversation after QUESTION): Llama 3.2's template takes one call per turn, Qwen's several.
    "llama-one-call": ("llama-3.2-instruct", [("get_weather", {"city": "Zürich", "unit": "celsius"})], ["21 °C"]),
    "qwen-one-call": ("qwen2.5-instruct", [("get_weather", {"city": "Zürich", "unit": "celsius"})], ["21 °C"]),
    "qwen-parallel": ("qwen2.5-instruct", [("get_weather", {"city": "Zürich", "unit": "celsius"}),
                                           ("get_time", {"tz": "CET", "hours24": True})],
                      ['{"temp": 21}', "14:05"]),
}


@pytest.mark.parametrize("case", CHATS)
@pytest.mark.parametrize("stage", ["question", "after-results", "answered"])
def test_templates_render_tools_calls_and_results_as_transformers(toks, hf_toks, case, stage):
    """OpenAI-layout messages (arguments as JSON text) become what transformers renders for the same
    conversation with the arguments as objects, the form its templates document."""
    name, calls, results = CHATS[case]
    turns = openai_turns(calls, results)
    messages = {"question": QUESTION, "after-results": QUESTION + turns,
                "answered": QUESTION + turns + [{"role": "assistant", "content": "It is 21 °C at 14:05."}]}[stage]
    reference = [dict(m) for m in messages]
    for m in reference:
        if m.get("tool_calls"):
            m["tool_calls"] = [{**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
                               for c in m["tool_calls"]]
    extra = {"date_string": "26 Jul 2024"} if name.startswith("llama") else {}
    kwargs = dict(tools=TOOLS, add_generation_prompt=stage != "answered", **extra)
    expected = hf_toks[name].apply_chat_template(reference, tokenize=False, **kwargs)
    assert toks[name].apply_chat_template(template_messages(messages), **kwargs) == expected
    assert "get_time" in expected and ("Zürich" in expected or stage == "question")


def test_formats_are_read_off_the_templates(toks, shared_dir):
    assert ToolUse.of(TOOLS, template=toks["qwen2.5-instruct"].chat_template_for(TOOLS)).format.name == "hermes"
    assert ToolUse.of(TOOLS, template=toks["llama-3.2-instruct"].chat_template_for(TOOLS)).format.name == "llama3_json"
    phi = Tokenizer.from_dir(shared_dir / "tokenizers" / "phi-3-mini-instruct").chat_template_for(TOOLS)
    with pytest.raises(ToolsError, match="--tool-call-parser"):
        ToolUse.of(TOOLS, template=phi)
    assert ToolUse.of(TOOLS, "none", template=phi).format is None  # tools shown, nothing parsed
    assert ToolUse.of(TOOLS, format="mistral", template=phi).format.name == "mistral"


def test_the_renderer_gives_a_template_without_tools_hermes_preamble(toks, shared_dir):
    """Without --tool-call-parser: a template that renders no tools (Phi-3's) gets Hermes' preamble by default, as
    llama.cpp's server writes tools into such a prompt; one that shows its format keeps it; one that renders tools
    in no known format is refused by name; a format set wins over all three."""
    from nexttoken.chat.render import ChatRenderer

    phi_tok = Tokenizer.from_dir(shared_dir / "tokenizers" / "phi-3-mini-instruct")
    phi = ChatRenderer(phi_tok)
    use = phi.tool_use(TOOLS)
    assert (phi.call_format, phi.preamble_format, use.format.name, use.choice) == ("hermes", "hermes", "hermes", "auto")
    prompt = phi.render(QUESTION, use)
    assert prompt.preamble == "hermes" and FORMATS["hermes"].preamble(TOOLS) in prompt.text
    assert prompt.text.startswith("<|system|>")  # the preamble went in as a system message Phi-3's template renders
    qwen = ChatRenderer(toks["qwen2.5-instruct"])
    assert (qwen.call_format, qwen.preamble_format, qwen.tool_use(TOOLS).format.name) == ("hermes", None, "hermes")
    assert qwen.render(QUESTION, qwen.tool_use(TOOLS)).preamble is None  # the template's own tools section
    assert ChatRenderer(phi_tok, tool_call_parser="mistral").tool_use(TOOLS).format.name == "mistral"
    # tools rendered, but as bare JSON: the model was told of no call syntax this server reads
    json_only = Tokenizer.from_dir(shared_dir / "tokenizers" / "phi-3-mini-instruct")
    json_only.use_chat_template("{% if tools %}Tools: {{ tools | tojson }}\n{% endif %}"
                               "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")
    refused = ChatRenderer(json_only)
    assert refused.call_format is None and refused.preamble_format is None
    with pytest.raises(ToolsError, match="--tool-call-parser"):
        refused.tool_use(TOOLS)
    assert refused.tool_use(TOOLS, "none").format is None


# ---- parsers ---------------------------------------------------------------------------------------------------

W = '{"city": "Zürich", "unit": "celsius"}'
T = '{"tz": "CET", "hours24": true}'
TRICKY = r'{"q": "a } b { \" ] [TOOL_CALLS] <tool_call> ;", "n": [1, {"x": -2.5e3}], "e": null}'
PARSER_CASES = {
    "hermes": [
        (f'<tool_call>\n{{"name": "get_weather", "arguments": {W}}}\n</tool_call>', None, [("get_weather", W)]),
        (f'Let me look.\n<tool_call>\n{{"name": "get_weather", "arguments": {W}}}\n</tool_call>\n<tool_call>\n'
         f'{{"name": "get_time", "arguments": {T}}}\n</tool_call>', "Let me look.",
         [("get_weather", W), ("get_time", T)]),
        (f'<tool_call>\n{{"arguments": {TRICKY}, "name": "odd"}}\n</tool_call>', None, [("odd", TRICKY)]),
        ('<tool_call>\n{"name": "noargs"}\n</tool_call>', None, [("noargs", "{}")]),
        ("Just text, with a <tool_ lookalike and </tool_call>.", "Just text, with a <tool_ lookalike and "
         "</tool_call>.", []),
        ("Trailing <tool_c", "Trailing <tool_c", []),
    ],
    "llama3_json": [
        (f'{{"name": "get_weather", "parameters": {W}}}', None, [("get_weather", W)]),
        (f'<|python_tag|>{{"name": "get_weather", "parameters": {W}}}; {{"name": "get_time", "parameters": {T}}}',
         None, [("get_weather", W), ("get_time", T)]),
        (f'{{"name": "odd", "arguments": {TRICKY}}}', None, [("odd", TRICKY)]),
        ("The answer is {not a call}.", "The answer is {not a call}.", []),
        (f'Checking.<|python_tag|>{{"name": "get_time", "parameters": {T}}}', "Checking.", [("get_time", T)]),
    ],
    "mistral": [
        (f'[TOOL_CALLS] [{{"name": "get_weather", "arguments": {W}}}, {{"name": "get_time", "arguments": {T}}}]',
         None, [("get_weather", W), ("get_time", T)]),
        (f'Sure. [TOOL_CALLS] [{{"name": "odd", "arguments": {json.dumps(TRICKY)}}}]', "Sure.", [("odd", TRICKY)]),
        (f"[TOOL_CALLS]get_weather[ARGS]{W}[TOOL_CALLS]get_time[CALL_ID]a1b2c3d4e[ARGS]{T}", None,
         [("get_weather", W), ("get_time", T)]),
        ("No calls [TOOL", "No calls [TOOL", []),
    ],
}
FLAT = [(fmt, i) for fmt, cases in PARSER_CASES.items() for i in range(len(cases))]


def _streamed(fmt: str, chunks: list[str]) -> tuple[str | None, list[tuple[str, str]], list]:
    """Feed chunks; rebuild content and calls from the emitted pieces alone (as a client does)."""
    parser = FORMATS[fmt].parser()
    pieces = [p for chunk in chunks for p in parser.feed(chunk)] + parser.finish()
    content = "".join(p for p in pieces if isinstance(p, str))
    calls: dict[int, list[str]] = {}
    for p in pieces:
        if isinstance(p, ToolCallDelta):
            if p.id is not None:
                assert p.index not in calls and p.index == len(calls), "a call's id and name come first, once"
                calls[p.index] = [p.name, ""]
            calls[p.index][1] += p.arguments
    assert (content, [tuple(c) for c in calls.values()]) == (
        parser.content, [(c.name, c.arguments) for c in parser.calls])
    return (content or None) if calls else content, [tuple(c) for c in calls.values()], pieces


@pytest.mark.parametrize("fmt,i", FLAT)
def test_parsers_read_hand_written_outputs_the_same_in_every_chunking(fmt, i):
    text, content, calls = PARSER_CASES[fmt][i]
    assert FORMATS[fmt].parser().parse(text)[0] == content
    assert [(c.name, c.arguments) for c in FORMATS[fmt].parser().parse(text)[1]] == calls
    for name, arguments in calls:
        json.loads(arguments)
    assert _streamed(fmt, [text])[:2] == (content, calls)
    assert _streamed(fmt, list(text))[:2] == (content, calls)  # a character at a time
    for cut in range(1, len(text)):  # every split point
        assert _streamed(fmt, [text[:cut], text[cut:]])[:2] == (content, calls), cut
    rng = random.Random(i)
    for _ in range(20):  # random chunkings, as token boundaries fall
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(2, 12))))
        chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        assert _streamed(fmt, chunks)[:2] == (content, calls)


@pytest.mark.parametrize("fmt", list(PARSER_CASES))
def test_a_text_cut_anywhere_gives_whole_calls_and_no_markup_in_content(fmt):
    """An answer cut by max_tokens (`cut=True`): only calls that ended are returned (their arguments parse), and
    no piece of markup (a marker's start, `{"name":`, `</tool`) reaches the content, whole or streamed."""
    markup = ("<tool", "</tool", "{\"name", "<|python_tag|>", "[TOOL_CALLS]", "[ARGS]")
    for text, content, calls in PARSER_CASES[fmt]:
        for cut in range(len(text) + 1):
            got_content, got_calls = FORMATS[fmt].parser().parse(text[:cut], cut=True)
            got = [(c.name, c.arguments) for c in got_calls]
            assert got == calls[:len(got)], (text[:cut], got)
            for _, arguments in got:
                json.loads(arguments)
            assert (content or "").startswith((got_content or "").rstrip()), (text[:cut], got_content)
            if calls:
                assert not any(m in (got_content or "") for m in markup), (text[:cut], got_content)
            parser = FORMATS[fmt].parser()
            pieces = parser.feed(text[:cut]) + parser.finish(cut=True)
            assert "".join(p for p in pieces if isinstance(p, str)) == parser.content == (got_content or "")


def test_streamed_arguments_arrive_before_the_call_ends():
    text = f'<tool_call>\n{{"name": "get_weather", "arguments": {W}}}\n</tool_call>'
    parser = FORMATS["hermes"].parser()
    half = text.index("Zürich") + 3
    pieces = parser.feed(text[:half])
    assert pieces[0].name == "get_weather" and pieces[0].id.startswith("call_")
    assert "".join(p.arguments for p in pieces) == '{"city": "Zür'


def test_mistral_ids_are_nine_alphanumerics():
    _, calls = FORMATS["mistral"].parser().parse(f'[TOOL_CALLS] [{{"name": "f", "arguments": {W}}}]')
    assert len(calls[0].id) == 9 and calls[0].id.isalnum()


# ---- grammars --------------------------------------------------------------------------------------------------

def _tokenizer_with_tool_calls_token(shared_dir, tmp_path) -> Tokenizer:
    """Llama 2's tokenizer with Mistral's [TOOL_CALLS] added as a special token (id 32000), as Mistral's has it."""
    data = json.loads((shared_dir / "tokenizers" / "llama-2-chat" / "tokenizer.json").read_text())
    data["added_tokens"].append({"id": 32000, "content": "[TOOL_CALLS]", "single_word": False, "lstrip": False,
                                 "rstrip": False, "normalized": False, "special": True})
    (tmp_path / "tokenizer.json").write_text(json.dumps(data))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "bos_token": "<s>"}))
    return Tokenizer.from_dir(tmp_path)


class _Matcher:
    """llguidance fed token by token; `allows(text)` says whether the text then EOS is a complete output."""

    def __init__(self, tokenizer: Tokenizer, grammar: str, eos: int) -> None:
        self.tokenizer, self.eos, self.vocab = tokenizer, eos, len(tokenizer)
        self.lltok = GRAMMARS.tokenizer(tokenizer, self.vocab, (eos,))
        self.compiled = GRAMMARS.compile(Constraint("grammar", grammar), self.lltok)

    def ids(self, text: str) -> list[int]:
        """Tokens as a model would write them mid-answer: no SentencePiece dummy space, markers that are special
        tokens as those tokens."""
        return self.lltok.tokenize_str(text, parse_special=True)

    def allows(self, text: str) -> bool:
        matcher = self.compiled.template.deep_copy()
        for token in [*self.ids(text), self.eos]:
            if not matcher.consume_token(token):
                return False
        return matcher.is_stopped() or matcher.is_accepting()

    def next_allowed(self, text: str) -> set[str]:
        import llguidance.torch

        matcher = self.compiled.template.deep_copy()
        for token in self.ids(text):
            assert matcher.consume_token(token), text
        mask = llguidance.torch.allocate_token_bitmask(1, self.vocab)
        llguidance.torch.fill_next_token_bitmask(matcher, mask, 0)
        ids = allowed_tokens(mask, self.vocab)[0].nonzero().flatten().tolist()
        return {self.tokenizer.decode([i]) for i in ids}


def _grammar_cases(fmt: str) -> dict[str, str]:
    """Outputs in `fmt`'s layout (compact JSON, as the grammar writes it)."""
    w, t = '{"city": "Zürich", "unit": "celsius"}', '{"tz": "CET", "hours24": true}'
    bad = '{"city": "Zürich", "unit": "kelvin"}'
    if fmt == "hermes":
        call = lambda name, args: f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'  # noqa: E731
        return {"one": call("get_weather", w), "two": call("get_weather", w) + "\n" + call("get_time", t),
                "text+one": "Let me check.\n" + call("get_time", t), "text": "No tool needed.",
                "bad-args": call("get_weather", bad), "unknown": call("get_news", t)}
    if fmt == "llama3_json":
        call = lambda name, args: f'{{"name": "{name}", "parameters": {args}}}'  # noqa: E731
        return {"one": call("get_weather", w), "two": call("get_weather", w) + "; " + call("get_time", t),
                "text+one": "Let me check." + call("get_time", t), "text": "No tool needed.",
                "bad-args": call("get_weather", bad), "unknown": call("get_news", t)}
    call = lambda name, args: f'{{"name": "{name}", "arguments": {args}}}'  # noqa: E731
    return {"one": f"[TOOL_CALLS] [{call('get_weather', w)}]",
            "two": f"[TOOL_CALLS] [{call('get_weather', w)}, {call('get_time', t)}]",
            "text+one": f"Let me check.[TOOL_CALLS] [{call('get_time', t)}]", "text": "No tool needed.",
            "bad-args": f"[TOOL_CALLS] [{call('get_weather', bad)}]", "unknown": f"[TOOL_CALLS] [{call('x', t)}]"}


EXPECTED = {  # choice, parallel -> the cases the grammar accepts
    ("auto", True): {"one", "two", "text+one", "text"},
    ("auto", False): {"one", "text+one", "text"},
    ("required", True): {"one", "two"},
    ("required", False): {"one"},
}
GRAMMAR_SETUPS = {  # name -> (format, tokenizer): markers as special tokens, and as plain text (lazy triggers)
    "hermes/qwen": ("hermes", "qwen2.5-instruct"),
    "hermes/plain-markers": ("hermes", "llama-2-chat"),
    "llama3_json/llama3": ("llama3_json", "llama-3.2-instruct"),
    "mistral/special-token": ("mistral", "mistral-like"),
    "mistral/plain-marker": ("mistral", "qwen2.5-instruct"),
}


@pytest.mark.parametrize("setup", GRAMMAR_SETUPS)
def test_grammars_accept_the_format_and_refuse_broken_calls(setup, shared_dir, tmp_path):
    fmt, tok_name = GRAMMAR_SETUPS[setup]
    tok = (_tokenizer_with_tool_calls_token(shared_dir, tmp_path) if tok_name == "mistral-like"
           else Tokenizer.from_dir(shared_dir / "tokenizers" / tok_name))
    eos = tok.encode("</s>" if tok_name in ("llama-2-chat", "mistral-like") else "<|im_end|>" if "qwen" in tok_name
                     else "<|eot_id|>", add_special_tokens=False)[-1]
    cases = _grammar_cases(fmt)
    for (choice, parallel), accepted in EXPECTED.items():
        use = ToolUse.of(TOOLS, choice, parallel, format=fmt)
        matcher = _Matcher(tok, use.grammar(tok), eos)
        # (Llama 3's "text+one" is plain text: its calls open with "{" at the very start only.)
        got = {name for name, text in cases.items() if matcher.allows(text)}
        assert got == accepted, (choice, parallel)
    named = ToolUse.of(TOOLS, {"type": "function", "function": {"name": "get_time"}}, format=fmt)
    matcher = _Matcher(tok, named.grammar(tok), eos)
    assert {name for name, text in cases.items() if matcher.allows(text)} == set()  # get_weather first: refused
    one_time = cases["text+one"].split("check.")[1].lstrip("\n")
    assert matcher.allows(one_time) and not named.parallel


def test_grammar_steers_inside_a_call_and_leaves_text_free(toks):
    tok = toks["qwen2.5-instruct"]
    use = ToolUse.of(TOOLS, "auto", template=tok.chat_template_for(TOOLS))
    matcher = _Matcher(tok, use.grammar(tok), tok.encode("<|im_end|>", add_special_tokens=False)[0])
    free = matcher.next_allowed("I think")
    assert len(free) > 100_000  # text: anything (but the markers' own special tokens out of place)
    assert matcher.next_allowed('<tool_call>\n{"name": "get_time", "arguments": {"tz": "') <= {"U", "UT", "UTC",
                                                                                              "C", "CE", "CET", "P",
                                                                                              "PS", "PST"}


def test_bad_tools_and_choices_are_refused_by_name():
    with pytest.raises(ToolsError, match="not among the tools"):
        ToolUse.of(TOOLS, {"type": "function", "function": {"name": "nope"}}, format="hermes")
    with pytest.raises(ToolsError, match="needs tools"):
        ToolUse.of([], "required", format="hermes")
    with pytest.raises(ToolsError, match="tool_choice must be one of"):
        ToolUse.of(TOOLS, "sometimes", format="hermes")
    with pytest.raises(ToolsError, match="unique"):
        ToolUse.of([WEATHER, WEATHER], format="hermes")
    with pytest.raises(ToolsError, match="only function tools"):
        ToolUse.of([{"type": "web_search"}], format="hermes")
    with pytest.raises(ToolsError, match="name must be"):
        ToolUse.of([{"type": "function", "function": {"name": "has space"}}], format="hermes")
    with pytest.raises(ToolsError, match="JSON Schema of an object"):
        ToolUse.of([{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}],
                   format="hermes")
    with pytest.raises(ToolsError, match="unknown tool-call parser"):
        ToolUse.of(TOOLS, format="pythonic")


# ---- LLM.chat end to end ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module", params=[("qwen2", "qwen2.5-instruct"), ("llama", "llama-3.2-instruct")],
                ids=["qwen2.5", "llama3.2"])
def chat_llm(request, shared_dir, tmp_path_factory):
    arch, name = request.param
    folder = build_chat_model(tmp_path_factory.mktemp(name), shared_dir / "tokenizers" / name, arch)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield nexttoken.load(folder)
    torch.set_num_threads(before)


def _check_calls(completion, allowed: set[str]) -> None:
    assert completion.finish_reason == "tool_calls", completion
    assert completion.tool_calls and {c.name for c in completion.tool_calls} <= allowed
    for call in completion.tool_calls:
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])


def _ending(llm) -> dict:
    """A bias towards the end tokens: a random model would otherwise add call after call until max_new_tokens
    (the grammar lets it end after each complete call, and only there)."""
    return {(t,): 8.0 for t in llm.generation_config.eos_ids}


@pytest.mark.parametrize("seed", range(3))
def test_required_and_named_calls_validate(chat_llm, seed):
    for choice, allowed in (("required", {"get_weather", "get_time"}),
                            ({"type": "function", "function": {"name": "get_time"}}, {"get_time"})):
        c = chat_llm.chat(QUESTION, tools=TOOLS, tool_choice=choice, max_new_tokens=120, do_sample=True, seed=seed,
                          sequence_bias=_ending(chat_llm))
        _check_calls(c, allowed)
        if choice != "required":
            assert len(c.tool_calls) == 1
    greedy = chat_llm.chat(QUESTION, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                           max_new_tokens=120, do_sample=False)
    _check_calls(greedy, {"get_weather", "get_time"})
    assert len(greedy.tool_calls) == 1 and greedy.text == ""


def test_auto_constrains_a_call_once_the_model_opens_one(chat_llm):
    """"auto": free text unless the model opens a call, then the call's grammar. A logit bias on the opening
    token makes the random model open one; the rest of the call is the grammar's doing."""
    tok = chat_llm.tokenizer
    opening = "<tool_call>" if "<tool_call>" in tok.chat_template_for(TOOLS) else "{"
    bias = {tok.encode(opening, add_special_tokens=False)[0]: 100.0}
    c = chat_llm.chat(QUESTION, tools=TOOLS, parallel_tool_calls=False, max_new_tokens=120, do_sample=True, seed=0,
                      sequence_bias={(t,): b for t, b in bias.items()})
    _check_calls(c, {"get_weather", "get_time"})
    free = chat_llm.chat(QUESTION, tools=TOOLS, max_new_tokens=12, do_sample=True, seed=0)
    assert free.tool_calls is None and free.finish_reason == "length" and free.text
    none = chat_llm.chat(QUESTION, tools=TOOLS, tool_choice="none", max_new_tokens=12, do_sample=True, seed=0,
                         sequence_bias={(t,): b for t, b in bias.items()})
    assert none.tool_calls is None and none.text  # "none": not constrained, not parsed


def test_a_full_tool_loop_runs(chat_llm):
    """call -> the tool's result as a `tool` message -> the model answers (in text: tool_choice "none")."""
    c = chat_llm.chat(QUESTION, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                      max_new_tokens=120, do_sample=False)
    call = c.tool_calls[0]
    history = QUESTION + [{"role": "assistant", "content": None, "tool_calls": [call.to_openai()]},
                          {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"result": 21})}]
    prompt = chat_llm.tokenizer.decode(chat_llm.chat_prompt(template_messages(history), tools=TOOLS))
    assert call.name in prompt and '{"result": 21}' in prompt.replace('\\"', '"')
    answer = chat_llm.chat(history, tools=TOOLS, tool_choice="none", max_new_tokens=8, do_sample=False)
    assert answer.tool_calls is None and answer.text and answer.finish_reason == "length"
    again = chat_llm.chat(history, tools=TOOLS, tool_choice="required", max_new_tokens=120, do_sample=True, seed=5,
                          sequence_bias=_ending(chat_llm))
    _check_calls(again, {"get_weather", "get_time"})


def test_chat_refuses_tools_it_cannot_use(chat_llm):
    with pytest.raises(ToolsError, match="cannot be combined with json_schema"):
        chat_llm.chat(QUESTION, tools=TOOLS, tool_choice="required", json_schema={"type": "object"})
    with pytest.raises(GenerationConfigError, match="stream_chat"):
        next(chat_llm.stream_chat(QUESTION, tools=TOOLS))


def test_a_tool_grammar_is_lark_even_when_a_schema_mentions_gbnf(toks):
    """A grammar text containing "::=" is read as GBNF, unless it is llguidance's Lark (as tool grammars are):
    a description quoting a BNF rule must not turn the tools' grammar into GBNF."""
    odd = {"type": "function", "function": {"name": "parse", "description": "expr ::= term '+' term",
                                            "parameters": {"type": "object", "properties": {
                                                "rule": {"type": "string", "description": "a ::= b"}}}}}
    tok = toks["qwen2.5-instruct"]
    use = ToolUse.of([odd], "required", template=tok.chat_template_for([odd]))
    matcher = _Matcher(tok, use.grammar(tok), tok.encode("<|im_end|>", add_special_tokens=False)[0])
    assert matcher.allows('<tool_call>\n{"name": "parse", "arguments": {"rule": "x ::= y"}}\n</tool_call>')
