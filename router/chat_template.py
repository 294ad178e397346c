"""A model's chat template, rendered exactly as transformers' ``apply_chat_template``.

``ChatTemplate.from_model_dir(model_dir)`` finds the template the way transformers 5
(``PreTrainedTokenizerBase.from_pretrained``) does, or returns None when the model has
none; ``render(messages)`` turns an OpenAI-style conversation into the prompt text, as
``tokenizer.apply_chat_template(messages, tokenize=False)`` would. Neither torch nor
transformers is imported (only jinja2 >= 3.1.6, the version transformers requires).

Where the template comes from (transformers' precedence):

1. ``chat_template.jinja`` and ``additional_chat_templates/*.jinja`` in the folder. If
   any exist they replace the config's templates entirely: ``chat_template.jinja`` alone
   is *the* template; otherwise the files are named templates (file stem = name,
   ``chat_template.jinja`` = "default").
2. Else tokenizer_config.json's ``chat_template``: a string, or a list of
   ``{"name", "template"}`` objects (named templates).
3. Else the model has no template: ``from_model_dir`` returns None.

With named templates, ``render`` uses "tool_use" when ``tools`` are passed and the model
has one, else "default" (no "default": ``ValueError``, as transformers raises).

The template sees: ``messages``, ``add_generation_prompt``, ``tools`` and ``documents``
(None unless passed), the tokenizer's special tokens as strings (``bos_token``,
``eos_token``, ``unk_token``, ``sep_token``, ``pad_token``, ``cls_token``, ``mask_token``
and any other ``*_token`` key of tokenizer_config.json / special_tokens_map.json,
AddedToken objects by their ``content``; special_tokens_map.json counts only when
tokenizer_config.json has no ``added_tokens_decoder``, and then wins for the standard
names; ``pad_token`` falls back to tokenizer.json's padding), then the extra keyword
arguments (which override special tokens). The environment is transformers':
``ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)`` with the
loop-controls extension, the ``{% generation %}`` tag, a ``tojson`` filter that does not
HTML-escape and takes ``ensure_ascii``/``indent``/``separators``/``sort_keys``, and the
globals ``raise_exception``, ``strftime_now``, ``dict`` and an underscore-refusing
``namespace``. As in transformers, keys whose value is None are dropped from messages,
and a message's ``reasoning_content``/``thinking``/``reasoning`` is also given under
``thinking`` and ``reasoning_content``.

Messages: a non-empty list (at most ``MAX_MESSAGES``) of objects with a string ``role``
and a ``content`` that is a string or a list (at most ``MAX_CONTENT_PARTS``) of
``{"type": "text", "text": str}`` parts.
Parts are joined with "\\n" into one string before rendering, as vLLM does for text-only
models (its "string" content format), so the template always sees string content.
Other fields of a message (``name``, ``reasoning_content``, ...) pass through when they
are plain JSON values. All strings in the messages together are bounded by
``MAX_CONTENT_BYTES`` (UTF-8 bytes; every non-string value counts one). Any problem is a
``ValueError`` naming the field, e.g. ``messages[2].content``; so is every template
error (syntax, ``raise_exception(...)`` with the template's own message, a failing
expression).

Tokenizing the prompt: the template writes the special tokens itself (BOS among them),
so the rendered text is tokenized with ``add_special_tokens=False``, as
``apply_chat_template(tokenize=True)`` and vLLM's chat endpoint do; ``encode`` does
that. ``starts_with_bos`` / ``count_leading_bos`` tell whether the template wrote BOS.
pdserve's ``Tokenizer.encode(text)`` (add_special_tokens=True) would put a second BOS in
front of a template's BOS: the tokenizer.json post-processor adds one regardless.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

MAX_MESSAGES = 1024
MAX_CONTENT_BYTES = 1 << 20
MAX_CONTENT_PARTS = 1024  # per message
MAX_DEPTH = 32  # nesting of the plain JSON values a template is given

TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_MAP_FILE = "special_tokens_map.json"
TOKENIZER_FILE = "tokenizer.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATE_DIR = "additional_chat_templates"
SPECIAL_TOKENS_ATTRIBUTES = ("bos_token", "eos_token", "unk_token", "sep_token",
                             "pad_token", "cls_token", "mask_token")
# Names the caller sets through render's own arguments, never through template kwargs.
RESERVED_KWARGS = ("messages", "add_generation_prompt", "chat_template")
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class ChatTemplate:
    """One model's chat template(s) and special tokens; see the module docstring."""

    def __init__(self, templates: str | dict[str, str], special_tokens: dict[str, str] | None = None,
                 source: str = "") -> None:
        if isinstance(templates, dict):
            if not templates or not all(isinstance(k, str) and isinstance(v, str)
                                        for k, v in templates.items()):
                raise ValueError("chat templates must be a non-empty {name: template} mapping")
            self.templates: str | dict[str, str] = dict(templates)
        elif isinstance(templates, str):
            self.templates = templates
        else:
            raise ValueError("a chat template must be a string")
        self.special_tokens: dict[str, str] = dict(special_tokens or {})
        self.source = source
        self._compiled: dict[str, Any] = {}

    # -- loading ------------------------------------------------------------------------

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> ChatTemplate | None:
        """The chat template of a model folder or GGUF file, or None when it has none."""
        from pdserve.engine.gguf_file import GGUFModel, find_gguf

        gguf_path = find_gguf(model_dir)
        if gguf_path is not None:
            gguf = GGUFModel.open(gguf_path)
            template = gguf.chat_template
            return cls(template, gguf.special_tokens, f"{gguf_path.name}: tokenizer.chat_template"
                       ) if template else None
        d = Path(model_dir)
        if not d.is_dir():
            raise FileNotFoundError(f"model folder {d} not found")
        tcfg = _read_json(d / TOKENIZER_CONFIG_FILE)
        templates, source = _find_templates(d, tcfg)
        if templates is None:
            return None
        return cls(templates, _special_tokens(d, tcfg), source)

    # -- what the template sees ------------------------------------------------------------

    @property
    def bos_token(self) -> str | None:
        return self.special_tokens.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens.get("eos_token")

    def template_source(self, tools: Any = None) -> str:
        """The template text ``render`` uses (named templates: "tool_use" with tools, else
        "default")."""
        return self.templates if isinstance(self.templates, str) else \
            self.templates[self._template_name(tools)]

    def _template_name(self, tools: Any) -> str:
        if isinstance(self.templates, str):
            return ""
        if tools is not None and "tool_use" in self.templates:
            return "tool_use"
        if "default" in self.templates:
            return "default"
        raise ValueError("this model has several chat templates and none named 'default' "
                         f"(available: {', '.join(sorted(self.templates))})")

    def _compile(self, name: str):
        got = self._compiled.get(name)
        if got is None:
            text = self.templates if isinstance(self.templates, str) else self.templates[name]
            env = _environment()
            try:
                got = env.from_string(text)
            except Exception as exc:  # jinja2.TemplateSyntaxError and friends
                got = ValueError(f"the model's chat template does not compile: {_describe(exc)}")
            self._compiled[name] = got
        if isinstance(got, ValueError):
            raise ValueError(str(got))
        return got

    # -- rendering --------------------------------------------------------------------------

    def render(self, messages: Any, add_generation_prompt: bool = True, *,
               chat_template_kwargs: dict | None = None, **extra: Any) -> str:
        """The prompt text for ``messages``, as ``apply_chat_template(messages,
        tokenize=False, add_generation_prompt=..., **kwargs)`` renders it.

        ``extra`` (the caller's) and ``chat_template_kwargs`` (e.g. a request's, checked
        the same way; ``extra`` wins) are template variables, except ``tools``,
        ``documents`` and ``continue_final_message``, which mean what they mean to
        ``apply_chat_template``. ``continue_final_message`` needs
        ``add_generation_prompt=False``. Raises ``ValueError`` naming the field."""
        kwargs: dict[str, Any] = {}
        budget = [MAX_CONTENT_BYTES]
        for where, given in (("chat_template_kwargs", chat_template_kwargs), ("", extra)):
            if given is None:
                continue
            if not isinstance(given, dict):
                raise ValueError(f"{where}: must be an object")
            for key, value in given.items():
                name = f"{where}.{key}" if where else str(key)
                if not isinstance(key, str):
                    raise ValueError(f"{where or 'template kwargs'}: names must be strings")
                if key in RESERVED_KWARGS:
                    raise ValueError(f"{name}: reserved, cannot be set as a template variable")
                kwargs[key] = _plain(value, name, budget, 0)
        tools = kwargs.pop("tools", None)
        documents = kwargs.pop("documents", None)
        continue_final = kwargs.pop("continue_final_message", False)
        for name, value in (("tools", tools), ("documents", documents)):
            if value is not None and not (isinstance(value, list)
                                          and all(isinstance(v, dict) for v in value)):
                raise ValueError(f"{name}: must be a list of objects")
        if continue_final is not False and not isinstance(continue_final, (bool, str)):
            raise ValueError("continue_final_message: must be a boolean or a field name")

        chat = _alias_reasoning_fields(validate_messages(messages))
        name = self._template_name(tools)
        template_text = self.template_source(tools)
        compiled = self._compile(name)
        final_message = None
        if continue_final:
            if add_generation_prompt:
                raise ValueError("continue_final_message and add_generation_prompt are not "
                                 "compatible: pass add_generation_prompt=False")
            final_message = _tag_final_message(chat, continue_final, template_text)

        variables = {**self.special_tokens, **kwargs}
        try:
            rendered = compiled.render(messages=chat, tools=tools, documents=documents,
                                       add_generation_prompt=bool(add_generation_prompt),
                                       **variables)
        except (MemoryError, RecursionError) as exc:
            raise ValueError(f"chat template error: {type(exc).__name__}") from None
        except Exception as exc:
            raise ValueError(f"chat template error: {_describe(exc)}") from None
        if continue_final:
            rendered = _cut_at_final_message(rendered, final_message)
        return rendered

    # -- tokenizing ------------------------------------------------------------------------

    def count_leading_bos(self, prompt: str) -> int:
        """How many BOS tokens (as text) the rendered prompt starts with."""
        bos = self.bos_token
        if not bos:
            return 0
        n = 0
        while prompt.startswith(bos, n * len(bos)):
            n += 1
        return n

    def starts_with_bos(self, prompt: str) -> bool:
        """Whether the template already wrote the BOS token at the start."""
        return self.count_leading_bos(prompt) > 0

    def encode(self, tokenizer, prompt: str, add_special_tokens: bool = False) -> list[int]:
        """The prompt's token ids with ``tokenizer`` (pdserve's ``engine.tokenizer.
        Tokenizer`` or anything with ``encode(text, add_special_tokens=...)``).

        By default no special tokens are added, as transformers and vLLM do for chat: the
        template wrote them. With ``add_special_tokens=True`` the tokenizer's own (BOS)
        are added only when the prompt does not already start with BOS, so there is
        never a second one."""
        add = add_special_tokens and not self.starts_with_bos(prompt)
        return list(tokenizer.encode(prompt, add_special_tokens=add))

    def __repr__(self) -> str:
        names = "single" if isinstance(self.templates, str) else ",".join(sorted(self.templates))
        return f"ChatTemplate({names} from {self.source or '?'})"


# ---- messages --------------------------------------------------------------------------------

def validate_messages(messages: Any) -> list[dict[str, Any]]:
    """Checked, plain copies of OpenAI-style chat messages, with list-of-parts content
    joined to one string ("\\n" between parts, as vLLM does for text-only models) and
    None-valued fields dropped. Raises ``ValueError`` naming the field."""
    if not isinstance(messages, list):
        raise ValueError("messages: must be a list of message objects")
    if not messages:
        raise ValueError("messages: must not be empty")
    if len(messages) > MAX_MESSAGES:
        raise ValueError(f"messages: at most {MAX_MESSAGES} messages are allowed, "
                         f"got {len(messages)}")
    budget = [MAX_CONTENT_BYTES]
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise ValueError(f"{where}: must be an object with 'role' and 'content'")
        if "role" not in message or message["role"] is None:
            raise ValueError(f"{where}.role: missing")
        if not isinstance(message["role"], str):
            raise ValueError(f"{where}.role: must be a string")
        if "content" not in message or message["content"] is None:
            raise ValueError(f"{where}.content: missing")
        plain: dict[str, Any] = {}
        for key, value in message.items():
            if not isinstance(key, str):
                raise ValueError(f"{where}: field names must be strings")
            if key == "content":
                plain[key] = _content_text(value, f"{where}.content", budget)
            elif value is not None:  # transformers drops None-valued keys
                plain[key] = _plain(value, f"{where}.{key}", budget, 0)
        out.append(plain)
    return out


def _content_text(content: Any, where: str, budget: list[int]) -> str:
    if isinstance(content, str):
        _charge(content, where, budget)
        return str.__str__(content)
    if not isinstance(content, list):
        raise ValueError(f"{where}: must be a string or a list of text parts")
    if len(content) > MAX_CONTENT_PARTS:
        raise ValueError(f"{where}: at most {MAX_CONTENT_PARTS} parts are allowed, "
                         f"got {len(content)}")
    texts = []
    for j, part in enumerate(content):
        at = f"{where}[{j}]"
        if not isinstance(part, dict):
            raise ValueError(f"{at}: must be an object {{\"type\": \"text\", \"text\": ...}}")
        kind = part.get("type")
        if kind != "text":
            raise ValueError(f"{at}.type: only 'text' parts are supported, got {kind!r}")
        text = part.get("text")
        if not isinstance(text, str):
            raise ValueError(f"{at}.text: must be a string")
        _charge(text, f"{at}.text", budget)
        texts.append(str.__str__(text))
    return "\n".join(texts)


def _charge(text: str, where: str, budget: list[int]) -> None:
    # UTF-8 is at least one byte a character: the length decides most cases unencoded.
    n = len(text) if len(text) > budget[0] else len(text.encode("utf-8", "surrogatepass"))
    budget[0] -= n
    if budget[0] < 0:
        raise ValueError(f"{where}: the messages are too large (at most "
                         f"{MAX_CONTENT_BYTES} bytes of text in all)")


def _plain(value: Any, where: str, budget: list[int], depth: int) -> Any:
    """A plain-JSON copy of ``value`` (what a template may see), charged to ``budget``."""
    if isinstance(value, str):
        _charge(value, where, budget)
        return str.__str__(value)
    budget[0] -= 1
    if budget[0] < 0:
        raise ValueError(f"{where}: the messages are too large (at most "
                         f"{MAX_CONTENT_BYTES} bytes of text in all)")
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if depth >= MAX_DEPTH:
        raise ValueError(f"{where}: nested more than {MAX_DEPTH} levels deep")
    if isinstance(value, (list, tuple)):
        return [_plain(v, f"{where}[{i}]", budget, depth + 1) for i, v in enumerate(value)]
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise ValueError(f"{where}: object keys must be strings")
            _charge(k, where, budget)
            out[str.__str__(k)] = _plain(v, f"{where}.{k}", budget, depth + 1)
        return out
    raise ValueError(f"{where}: must be a JSON value, got {type(value).__name__}")


def _alias_reasoning_fields(chat: list[dict]) -> list[dict]:
    # transformers: fill `reasoning_content` from older names, and `thinking` (gpt-oss)
    out = []
    for message in chat:
        reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None),
                         None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def _tag_final_message(chat: list[dict], continue_final: bool | str, template: str) -> Any:
    """transformers' continue_final_message: mark the end of the last message's field."""
    field = continue_final if isinstance(continue_final, str) else "content"
    final = chat[-1].get(field)
    if final is None:
        raise ValueError(f"continue_final_message: the final message has no {field!r} "
                         "to continue")
    fields = [field]
    if field in _REASONING_FIELDS:
        fields = [f for f in _REASONING_FIELDS if chat[-1].get(f) == final]
    if not any(f in template for f in fields):
        raise ValueError(f"continue_final_message: {field!r} is not a field the chat "
                         "template uses")
    if isinstance(final, list):
        for block in reversed(final):
            if isinstance(block, dict) and isinstance(block.get("text"), str):
                final = block["text"]
                block["text"] = block["text"] + _CONTINUE_TAG
                return final
        raise ValueError("continue_final_message: no text to continue in the final message")
    if not isinstance(final, str):
        raise ValueError(f"continue_final_message: the final message's {field!r} "
                         "is not text")
    for f in fields:
        chat[-1][f] = chat[-1][f] + _CONTINUE_TAG
    return final


def _cut_at_final_message(rendered: str, final: str) -> str:
    tag = _CONTINUE_TAG.strip()
    if final.strip() not in rendered or tag not in rendered:
        raise ValueError("continue_final_message: the final message does not appear in the "
                         "rendered chat (the chat template changes or drops it)")
    at = rendered.rindex(tag)
    if rendered[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return rendered[:at]
    return rendered[:at].rstrip()


# ---- the model folder ------------------------------------------------------------------------

def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: unreadable JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: must hold a JSON object")
    return data


def _find_templates(d: Path, tcfg: dict) -> tuple[str | dict[str, str] | None, str]:
    """transformers' precedence: template files replace the config's templates."""
    files: dict[str, str] = {}
    main = d / CHAT_TEMPLATE_FILE
    if main.is_file():
        files["default"] = main.read_text(encoding="utf-8")
    extra_dir = d / CHAT_TEMPLATE_DIR
    if extra_dir.is_dir():
        for path in sorted(extra_dir.glob("*.jinja")):
            if path.is_file():
                files[path.name.removesuffix(".jinja")] = path.read_text(encoding="utf-8")
    if len(files) == 1 and "default" in files:
        return files["default"], str(main)
    if files:
        return files, f"{d}/{{{CHAT_TEMPLATE_FILE},{CHAT_TEMPLATE_DIR}/}}"

    raw = tcfg.get("chat_template")
    source = f"{d / TOKENIZER_CONFIG_FILE} chat_template"
    if raw is None:
        return None, ""
    if isinstance(raw, str):
        return raw, source
    if isinstance(raw, dict):  # {name: template}, as transformers keeps it in memory
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in raw.items()):
            raise ValueError(f"{source}: template names and templates must be strings")
        return (dict(raw) or None), source
    if isinstance(raw, list):
        try:
            named = {t["name"]: t["template"] for t in raw}
        except (TypeError, KeyError):
            raise ValueError(f"{source}: a list of chat templates must hold "
                             "{\"name\": ..., \"template\": ...} objects") from None
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in named.items()):
            raise ValueError(f"{source}: template names and templates must be strings")
        return (named or None), source
    raise ValueError(f"{source}: must be a string or a list of named templates")


class _Token(str):
    """An AddedToken, as far as a template sees it: its content."""


def _as_token(value: Any, lenient: bool = False) -> Any:
    """transformers' convert_added_tokens on one value: {"__type": "AddedToken", ...}
    dicts become tokens. ``lenient`` also takes a plain {"content": ...} dict (which
    transformers itself refuses for a named special token)."""
    if isinstance(value, dict) and isinstance(value.get("content"), str) and (
            lenient or value.get("__type") == "AddedToken"):
        return _Token(value["content"])
    return value


def _special_tokens(d: Path, tcfg: dict) -> dict[str, str]:
    """The tokenizer's ``special_tokens_map`` as transformers 5 builds it (its
    ``_from_pretrained`` and ``__init__``), as {name: string}."""
    cfg = dict(tcfg)
    for key in ("tokenizer_class", "init_inputs", "chat_template"):
        cfg.pop(key, None)
    if "additional_special_tokens" in cfg and not cfg.get("extra_special_tokens"):
        cfg["extra_special_tokens"] = cfg.pop("additional_special_tokens")
    # model-specific tokens: other *_token keys holding a string, and a dict of extra ones
    explicit = {k: cfg.pop(k) for k in list(cfg)
                if k not in SPECIAL_TOKENS_ATTRIBUTES and k.endswith("_token")
                and isinstance(cfg[k], str)}
    if isinstance(cfg.get("extra_special_tokens"), dict):
        explicit.update(cfg.pop("extra_special_tokens"))
    # legacy special_tokens_map.json: read only without added_tokens_decoder; it wins
    if "added_tokens_decoder" not in cfg:
        for key, value in _read_json(d / SPECIAL_TOKENS_MAP_FILE).items():
            if isinstance(value, dict) and key != "extra_special_tokens":
                value = _as_token(value, lenient=True)
            cfg[key] = value
        if isinstance(cfg.get("extra_special_tokens"), dict):
            explicit.update(cfg.pop("extra_special_tokens"))
    cfg = {k: _as_token(v) for k, v in cfg.items()}
    explicit = {k: _as_token(v, lenient=True) for k, v in explicit.items()}
    if not explicit and isinstance(cfg.get("model_specific_special_tokens"), dict):
        explicit = {k: _as_token(v, lenient=True)
                    for k, v in cfg["model_specific_special_tokens"].items()}
    cfg.pop("model_specific_special_tokens", None)
    # TokenizersBackend: a padding setting in tokenizer.json names the pad token
    if "pad_token" not in cfg and (d / TOKENIZER_FILE).is_file():
        try:
            padding = json.loads((d / TOKENIZER_FILE).read_text(encoding="utf-8")).get("padding")
        except (OSError, ValueError, AttributeError):
            padding = None
        if isinstance(padding, dict) and isinstance(padding.get("pad_token"), str):
            cfg["pad_token"] = padding["pad_token"]

    tokens: dict[str, str] = {}
    auto: dict[str, str] = {}
    for key, value in cfg.items():
        if key in SPECIAL_TOKENS_ATTRIBUTES:
            value = _as_token(value, lenient=True)
            if isinstance(value, str):
                tokens[key] = str.__str__(value)
        elif key.endswith("_token") and isinstance(value, str):
            auto[key] = str.__str__(value)
    for key, value in {**auto, **explicit}.items():
        if isinstance(value, str):
            tokens[key] = str.__str__(value)
    return tokens


# ---- the jinja environment (transformers' utils/chat_template_utils.py) ---------------------

_ENV = None


def _environment():
    global _ENV
    if _ENV is None:
        _ENV = _make_environment()
    return _ENV


def _make_environment():
    try:
        import jinja2
        import jinja2.exceptions
        import jinja2.ext
        import jinja2.nodes
        import jinja2.utils
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise ImportError("chat templates need jinja2>=3.1.6 (pip install 'jinja2>=3.1.6')") \
            from None
    if tuple(int(p) for p in jinja2.__version__.split(".")[:3] if p.isdigit()) < (3, 1, 6):
        # older versions have known sandbox escapes (templates come from model folders)
        raise ImportError(f"chat templates need jinja2>=3.1.6, found {jinja2.__version__}")

    class GenerationTag(jinja2.ext.Extension):
        # {% generation %}...{% endgeneration %} marks assistant text for training masks;
        # rendering a prompt it is just its body.
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_generation_support"), [], [],
                                          body).set_lineno(lineno)

        def _generation_support(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # not jinja's own: no HTML escaping, and json.dumps's options
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(format):
        return datetime.now().strftime(format)

    class TemplateDict:
        # dict() and dict.fromkeys() without handing the dict type itself to the template
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        # namespaces refuse underscore-prefixed attributes (no reaching CPython internals)
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    "chat templates cannot store underscore-prefixed attributes on a "
                    f"namespace, got {name!r}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    return env


def _describe(exc: BaseException) -> str:
    try:
        import jinja2.exceptions

        if isinstance(exc, jinja2.exceptions.TemplateSyntaxError):
            return f"{exc.message} (line {exc.lineno})"
        if isinstance(exc, jinja2.exceptions.TemplateError) and exc.message:
            return exc.message
    except ImportError:  # pragma: no cover
        pass
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
