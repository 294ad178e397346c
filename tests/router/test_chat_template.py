"""router/chat_template.py against transformers' apply_chat_template(tokenize=False):
real-world templates (inline), where templates and special tokens are found, message
validation, template errors, the built-in model's template, no torch on import or render."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.router.chat_template import MAX_CONTENT_BYTES, MAX_MESSAGES, ChatTemplate

# ---- templates (as published with the models, trimmed to their tools-free paths where noted)

LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}"
)

# Llama 3.1: a system header with a date (strftime_now), namespace-free
LLAMA31_DATE = """{{- bos_token }}
{%- if not date_string is defined %}
    {%- if strftime_now is defined %}
        {%- set date_string = strftime_now("%Y") %}
    {%- else %}
        {%- set date_string = "2024" %}
    {%- endif %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

QWEN25 = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

MISTRAL = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}"
    "{% endif %}{% endfor %}"
)

# tojson with transformers' options, not jinja's (no HTML escaping), plus loop controls,
# namespace, dict() and the {% generation %} tag
TOJSON = """{%- set ns = namespace(n=0) %}
{%- for message in messages %}
    {%- if message.role == 'skip' %}{% continue %}{% endif %}
    {%- if message.role == 'stop' %}{% break %}{% endif %}
    {%- set ns.n = ns.n + 1 %}
{{ message | tojson }}
{{ message | tojson(indent=2) }}
{{ message | tojson(separators=(',', ':'), sort_keys=true) }}
{{ message | tojson(ensure_ascii=true) }}
{{ dict(role=message.role, n=ns.n) | tojson }}
    {%- if message.role == 'assistant' %}{% generation %}{{ message.content }}{% endgeneration %}{% endif %}
{% endfor %}
{%- if add_generation_prompt %}<|assistant|>{{ ns.n }}{% endif %}"""

# content as a string or as a list of parts (e.g. Gemma 3); we always pass a string
PARTS = """{{ bos_token }}
{%- for message in messages %}
<start_of_turn>{{ message['role'] }}
{% if message['content'] is string %}{{ message['content'] | trim }}
{%- else %}{% for item in message['content'] %}{% if item['type'] == 'text' %}{{ item['text'] | trim }}{% endif %}{% endfor %}
{%- endif %}<end_of_turn>
{% endfor %}
{%- if add_generation_prompt %}<start_of_turn>model
{% endif %}"""

# every special token the template can see, the reasoning aliases, extra variables
SPECIALS = ("{{ bos_token }}|{{ eos_token }}|{{ unk_token }}|{{ pad_token }}|"
            "{{ sep_token }}|{{ image_token }}|{{ extra }}\n"
            "{% for m in messages %}{{ m.role }}:{{ m.content }}:{{ m.thinking }}:"
            "{{ m.reasoning_content }}:{{ m.name }}\n{% endfor %}")

CHAT = [
    {"role": "system", "content": "  You are terse. "},
    {"role": "user", "content": "Hello, <who> & \"what\"? déjà 東京 🙂"},
    {"role": "assistant", "content": "Hi!"},
    {"role": "user", "content": "Again\nwith a newline"},
]
USER_ASSISTANT = [m for m in CHAT if m["role"] != "system"]


# ---- helpers --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def transformers():
    return pytest.importorskip("transformers")


def make_folder(base: str, dest: Path, template=None, tok_cfg: dict | None = None,
                files: dict[str, str] | None = None, special_map: dict | None = None) -> Path:
    """A copy of the tiny model's tokenizer files with `template` as tokenizer_config's
    chat_template (None: no template), `tok_cfg` merged in and `files` written."""
    shutil.copytree(base, dest, ignore=shutil.ignore_patterns("model.safetensors"))
    cfg = json.loads((dest / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    if template is not None:
        cfg["chat_template"] = template
    cfg.update(tok_cfg or {})
    (dest / "tokenizer_config.json").write_text(json.dumps(cfg))
    if special_map is not None:
        (dest / "special_tokens_map.json").write_text(json.dumps(special_map))
    for name, text in (files or {}).items():
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        (dest / name).write_text(text)
    return dest


def hf_render(transformers, folder: Path, messages, **kwargs) -> str:
    tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    return tok.apply_chat_template(messages, tokenize=False, **kwargs)


def assert_same(transformers, folder: Path, messages, hf_messages=None, **kwargs):
    ours = ChatTemplate.from_model_dir(folder)
    assert ours is not None
    tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    for agp in (True, False):
        got = ours.render(messages, add_generation_prompt=agp, **kwargs)
        want = tok.apply_chat_template(hf_messages or messages, tokenize=False,
                                       add_generation_prompt=agp, **kwargs)
        assert got == want, (agp, got, want)
    return got


# ---- same strings as transformers -----------------------------------------------------------

@pytest.mark.parametrize("name,template,messages", [
    ("llama3", LLAMA3, CHAT),
    ("llama31", LLAMA31_DATE, CHAT),
    ("qwen25", QWEN25, CHAT),
    ("qwen25-no-system", QWEN25, USER_ASSISTANT),
    ("mistral", MISTRAL, USER_ASSISTANT),
    ("tojson", TOJSON, [*CHAT, {"role": "skip", "content": "x"}, {"role": "user", "content": "y"},
                        {"role": "stop", "content": "z"}, {"role": "user", "content": "never"}]),
    ("parts", PARTS, CHAT),
])
def test_renders_like_transformers(transformers, tiny_model_dir, tmp_path, name, template,
                                   messages):
    folder = make_folder(tiny_model_dir, tmp_path / name, template)
    out = assert_same(transformers, folder, messages)
    assert out  # rendered something
    if name == "tojson":
        assert "<who> & \\\"what\\\"? déjà 東京 🙂" in out  # no HTML escaping, no \\u
        assert "never" not in out and "\"skip\"" not in out


def test_list_of_text_parts_joined_like_vllm(transformers, tiny_model_dir, tmp_path):
    folder = make_folder(tiny_model_dir, tmp_path / "m", PARTS)
    parts = [{"role": "user", "content": [{"type": "text", "text": " first "},
                                          {"type": "text", "text": "second"}]},
             {"role": "assistant", "content": [{"type": "text", "text": "ok"}]},
             {"role": "user", "content": "plain"}]
    joined = [{"role": "user", "content": " first \nsecond"},
              {"role": "assistant", "content": "ok"}, {"role": "user", "content": "plain"}]
    out = assert_same(transformers, folder, parts, hf_messages=joined)
    assert "first \nsecond" in out
    folder = make_folder(tiny_model_dir, tmp_path / "q", QWEN25)
    assert_same(transformers, folder, parts, hf_messages=joined)


def test_tools_and_extra_variables(transformers, tiny_model_dir, tmp_path):
    folder = make_folder(tiny_model_dir, tmp_path / "q", QWEN25)
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "Weather in <city> & \"region\"",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
    out = assert_same(transformers, folder, CHAT, tools=tools)
    assert '"name": "get_weather"' in out and "<city> &" in out
    folder = make_folder(tiny_model_dir, tmp_path / "d", LLAMA31_DATE)
    out = assert_same(transformers, folder, CHAT, date_string="26 Jul 2024")
    assert "Today Date: 26 Jul 2024" in out
    ours = ChatTemplate.from_model_dir(folder)
    assert ours.render(CHAT, chat_template_kwargs={"date_string": "x"}) == \
        ours.render(CHAT, date_string="x")


def test_special_tokens_and_reasoning_aliases(transformers, tiny_model_dir, tmp_path):
    messages = [{"role": "user", "content": "q", "name": "ann", "tool_calls": None},
                {"role": "assistant", "content": "a", "reasoning": "because"},
                {"role": "assistant", "content": "b", "reasoning_content": "rc"}]
    # AddedToken dicts in tokenizer_config.json, a model-specific *_token, and a
    # special_tokens_map.json (read: no added_tokens_decoder) that wins for named tokens
    added = {"__type": "AddedToken", "content": "<s>", "lstrip": False, "normalized": False,
             "rstrip": False, "single_word": False, "special": True}
    folder = make_folder(
        tiny_model_dir, tmp_path / "a", SPECIALS,
        tok_cfg={"bos_token": added, "pad_token": "</s>", "image_token": "<unk>"},
        special_map={"bos_token": "<s>", "unk_token": {"content": "<unk>", "lstrip": False},
                     "eos_token": "</s>", "sep_token": {"content": "</s>"}})
    out = assert_same(transformers, folder, messages, extra="E")
    assert out.startswith("<s>|</s>|<unk>|</s>|</s>|<unk>|E\n")
    assert "assistant:a:because:because:" in out and "user:q:::ann" in out
    # with added_tokens_decoder, special_tokens_map.json is not read (sep_token unset)
    folder = make_folder(tiny_model_dir, tmp_path / "b", SPECIALS,
                         tok_cfg={"added_tokens_decoder": {}},
                         special_map={"sep_token": "<unk>", "bos_token": "</s>"})
    out = assert_same(transformers, folder, messages)
    assert out.startswith("<s>|</s>|<unk>||||\n")
    # extra variables override special tokens, as in transformers
    assert_same(transformers, folder, messages, bos_token="<BOS>")


def test_continue_final_message(transformers, tiny_model_dir, tmp_path):
    folder = make_folder(tiny_model_dir, tmp_path / "m", LLAMA3)
    ours = ChatTemplate.from_model_dir(folder)
    messages = [*USER_ASSISTANT[:2], {"role": "assistant", "content": "The answer is "}]
    got = ours.render(messages, False, continue_final_message=True)
    assert got == hf_render(transformers, folder, messages, continue_final_message=True)
    assert got.endswith("The answer is")
    with pytest.raises(ValueError, match="add_generation_prompt"):
        ours.render(messages, continue_final_message=True)


# ---- where the template comes from ---------------------------------------------------------

def test_template_precedence(transformers, tiny_model_dir, tmp_path):
    simple = "{% for m in messages %}{{ NAME }}{{ m.content }}{% endfor %}"

    def t(name):
        return simple.replace("NAME", repr(name + ":"))

    # chat_template.jinja beats tokenizer_config.json's chat_template
    folder = make_folder(tiny_model_dir, tmp_path / "a", t("config"),
                         files={"chat_template.jinja": t("file")})
    assert assert_same(transformers, folder, CHAT[:1]) == "file:  You are terse. "
    # a list of named templates in the config: "default" is used
    folder = make_folder(tiny_model_dir, tmp_path / "b",
                         [{"name": "rag", "template": t("rag")},
                          {"name": "default", "template": t("default")}])
    assert assert_same(transformers, folder, CHAT[:1]).startswith("default:")
    # template files replace the config's list entirely; tool_use is chosen with tools
    folder = make_folder(tiny_model_dir, tmp_path / "c",
                         [{"name": "default", "template": t("config")}],
                         files={"chat_template.jinja": t("file"),
                                "additional_chat_templates/tool_use.jinja": t("tools")})
    assert assert_same(transformers, folder, CHAT[:1]).startswith("file:")
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert assert_same(transformers, folder, CHAT[:1], tools=tools).startswith("tools:")
    # only additional templates, none named default: no template to use, as in transformers
    folder = make_folder(tiny_model_dir, tmp_path / "d", t("config"),
                         files={"additional_chat_templates/rag.jinja": t("rag")})
    ours = ChatTemplate.from_model_dir(folder)
    with pytest.raises(ValueError, match="none named 'default'.*rag"):
        ours.render(CHAT[:1])
    with pytest.raises(ValueError):
        hf_render(transformers, folder, CHAT[:1])


def test_no_template_is_none(tiny_model_dir, tmp_path):
    folder = make_folder(tiny_model_dir, tmp_path / "m", None)
    assert ChatTemplate.from_model_dir(folder) is None
    (folder / "tokenizer_config.json").unlink()
    assert ChatTemplate.from_model_dir(folder) is None


# ---- errors ---------------------------------------------------------------------------------

def test_raise_exception_becomes_value_error(transformers, tiny_model_dir, tmp_path):
    folder = make_folder(tiny_model_dir, tmp_path / "m", MISTRAL)
    ours = ChatTemplate.from_model_dir(folder)
    bad = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(ValueError, match=r"Conversation roles must alternate user/assistant"):
        ours.render(bad)
    with pytest.raises(ValueError, match="Only user and assistant roles are supported"):
        ours.render([{"role": "user", "content": "u"}, {"role": "system", "content": "s"}])
    with pytest.raises(Exception, match="Conversation roles must alternate"):
        hf_render(transformers, folder, bad)


@pytest.mark.parametrize("template,match", [
    ("{% for m in messages %}{{ m.content }", "does not compile"),
    ("{{ messages[0].content + 1 }}", "chat template error"),
    ("{% set ns = namespace(_secret=1) %}", "underscore-prefixed"),
    ("{{ messages[5].content.upper() }}", "chat template error"),
])
def test_template_errors_become_value_errors(tiny_model_dir, tmp_path, template, match):
    folder = make_folder(tiny_model_dir, tmp_path / "m", template)
    ours = ChatTemplate.from_model_dir(folder)
    with pytest.raises(ValueError, match=match):
        ours.render([{"role": "user", "content": "x"}])


@pytest.mark.parametrize("messages,field", [
    ({"role": "user", "content": "x"}, "messages"),
    ([], "messages"),
    ([{"role": "user", "content": "x"}] * (MAX_MESSAGES + 1), "messages"),
    ([{"role": "user", "content": "x"}, "hi"], r"messages\[1\]"),
    ([{"content": "x"}], r"messages\[0\]\.role"),
    ([{"role": 3, "content": "x"}], r"messages\[0\]\.role"),
    ([{"role": "user", "content": "x"}, {"role": "user"}], r"messages\[1\]\.content"),
    ([{"role": "user", "content": None}], r"messages\[0\]\.content"),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
      {"role": "user", "content": 7}], r"messages\[2\]\.content"),
    ([{"role": "user", "content": {"text": "x"}}], r"messages\[0\]\.content"),
    ([{"role": "user", "content": ["x"]}], r"messages\[0\]\.content\[0\]"),
    ([{"role": "user", "content": [{"type": "text", "text": "a"},
                                   {"type": "image_url", "image_url": {"url": "u"}}]}],
     r"messages\[0\]\.content\[1\]\.type"),
    ([{"role": "user", "content": [{"type": "text", "text": 1}]}],
     r"messages\[0\]\.content\[0\]\.text"),
    ([{"role": "user", "content": "x", "name": object()}], r"messages\[0\]\.name"),
    ([{"role": "user", "content": "a" * (MAX_CONTENT_BYTES // 2)},
      {"role": "user", "content": "é" * (MAX_CONTENT_BYTES // 4 + 1)}],
     r"messages\[1\]\.content.*too large"),
])
def test_bad_messages_name_the_field(tiny_model_dir, tmp_path, messages, field):
    ours = ChatTemplate.from_model_dir(make_folder(tiny_model_dir, tmp_path / "m", LLAMA3))
    with pytest.raises(ValueError, match=field):
        ours.render(messages)


def test_bad_template_kwargs(tiny_model_dir, tmp_path):
    ours = ChatTemplate.from_model_dir(make_folder(tiny_model_dir, tmp_path / "m", QWEN25))
    msgs = [{"role": "user", "content": "x"}]
    for kwargs, field in (({"messages": []}, "chat_template_kwargs.messages"),
                          ({"add_generation_prompt": False},
                           "chat_template_kwargs.add_generation_prompt"),
                          ({"x": {1, 2}}, "chat_template_kwargs.x"),
                          ({"tools": "f"}, "tools")):
        with pytest.raises(ValueError, match=field):
            ours.render(msgs, chat_template_kwargs=kwargs)
    with pytest.raises(ValueError, match="chat_template_kwargs"):
        ours.render(msgs, chat_template_kwargs=["x"])


# ---- the built-in model -------------------------------------------------------------------

def test_builtin_model_has_a_template(transformers, tiny_model_dir):
    from pdserve.engine.model.tokenizer import Tokenizer

    ours = ChatTemplate.from_model_dir(tiny_model_dir)
    assert ours is not None
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"},
            {"role": "assistant", "content": "Hi"}, {"role": "user", "content": "Bye"}]
    prompt = assert_same(transformers, Path(tiny_model_dir), msgs)  # without generation prompt
    assert prompt == "<s>### system\nBe brief.\n### user\nHello\n### assistant\nHi</s>\n" \
                     "### user\nBye\n"
    prompt = ours.render(msgs)
    assert prompt.endswith("### user\nBye\n### assistant\n")
    assert ours.starts_with_bos(prompt) and ours.count_leading_bos(prompt) == 1
    tok = Tokenizer.from_model(tiny_model_dir)
    ids = ours.encode(tok, prompt)
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
    assert ids.count(tok.eos_token_id) == 1  # the assistant turn's EOS, as a token
    hf = transformers.AutoTokenizer.from_pretrained(tiny_model_dir)
    assert ids == list(hf.apply_chat_template(msgs, add_generation_prompt=True,
                                              return_dict=False))
    assert ours.encode(tok, prompt, add_special_tokens=True) == ids  # never a second BOS
    assert tok.encode(prompt)[:2] == [tok.bos_token_id] * 2  # what encode() alone would do


def _digests(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}


def test_cached_builtin_model_gets_the_template(tiny_model_dir, tmp_path, monkeypatch):
    from pdserve.engine.model.catalog import ensure_tiny_model

    fresh = _digests(Path(tiny_model_dir))
    cached = tmp_path / "cache" / "tiny-llama"
    shutil.copytree(tiny_model_dir, cached)
    cfg = json.loads((cached / "tokenizer_config.json").read_text())
    del cfg["chat_template"]  # as an older pdserve wrote it
    (cached / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    assert ChatTemplate.from_model_dir(cached) is None
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path / "cache"))
    assert ensure_tiny_model() == cached
    assert _digests(cached) == fresh  # only tokenizer_config.json changed, back to current
    assert ChatTemplate.from_model_dir(cached).render([{"role": "user", "content": "x"}]) \
        == "<s>### user\nx\n### assistant\n"
    assert ensure_tiny_model() == cached and _digests(cached) == fresh


def test_template_without_a_folder_renders_like_the_folder(tiny_model_dir):
    """The GGUF path: a template string and special tokens, no tokenizer files."""
    from pdserve.engine.model.tiny import CHAT_TEMPLATE

    msgs = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
    ours = ChatTemplate(CHAT_TEMPLATE, {"bos_token": "<s>", "eos_token": "</s>"}, "gguf")
    assert ours.render(msgs) == ChatTemplate.from_model_dir(tiny_model_dir).render(msgs)
    assert (ours.bos_token, ours.eos_token) == ("<s>", "</s>")
    named = ChatTemplate({"default": "d{{ bos_token }}", "tool_use": "t"}, {"bos_token": "<s>"})
    assert named.render(msgs) == "d<s>" and named.render(msgs, tools=[{"a": 1}]) == "t"
    for bad in (({"default": 1},), ("x", {"bos_token": 1}), ("x", {"model_max_length": "9"})):
        with pytest.raises(ValueError):
            ChatTemplate(*bad)


def test_apply_chat_template_options_are_not_template_variables(tiny_model_dir):
    ours = ChatTemplate.from_model_dir(tiny_model_dir)
    for name in ("tokenize", "return_dict", "return_assistant_tokens_mask", "chat_template"):
        with pytest.raises(ValueError, match=f"chat_template_kwargs.{name}: reserved"):
            ours.render([{"role": "user", "content": "x"}], chat_template_kwargs={name: True})


def test_folder_without_a_tokenizer_is_a_clear_error(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "x"}))
    with pytest.raises(ValueError, match="cannot load the tokenizer"):
        ChatTemplate.from_model_dir(tmp_path)


def _python(code: str) -> list[str]:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def test_imports_no_torch():
    assert _python("import sys; import pdserve.router.chat_template, pdserve.engine.model.tiny; "
                   "print('torch' in sys.modules)") == ["False"]


def test_renders_with_transformers_but_no_torch(tiny_model_dir):
    """transformers' PreTrainedTokenizerFast renders; torch stays out of the process."""
    code = ("import sys\n"
            "from pdserve.router.chat_template import ChatTemplate\n"
            f"t = ChatTemplate.from_model_dir({str(tiny_model_dir)!r})\n"
            "g = ChatTemplate(t.template_source(), t.special_tokens)\n"
            "msgs = [{'role': 'user', 'content': 'x'}]\n"
            "assert t.render(msgs) == g.render(msgs) == '<s>### user\\nx\\n### assistant\\n'\n"
            "try:\n    t.render([{'role': 'user'}])\nexcept ValueError:\n    pass\n"
            "print('transformers' in sys.modules, 'torch' in sys.modules)")
    assert _python(code) == ["True", "False"]
