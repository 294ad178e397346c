"""A model's chat template, rendered by transformers' ``apply_chat_template``.

``ChatTemplate.from_model_dir(model_dir)`` loads the folder's tokenizer as a
``PreTrainedTokenizerFast`` (local files only): transformers finds the template
(``chat_template.jinja``, ``additional_chat_templates/``, tokenizer_config.json) and the
special tokens the template sees; None when the model has none. A GGUF file's template
and special tokens (``engine.model.gguf_file.GGUFModel``) go to ``ChatTemplate(templates,
special_tokens, source)``, which puts them on a tokenizer with an empty vocabulary.
Neither imports torch (tested); transformers is imported on first use.

``render(messages)`` is ``apply_chat_template(messages, tokenize=False, ...)`` after
pdserve's checks: a non-empty list (at most ``MAX_MESSAGES``) of objects with a string
``role`` and a ``content`` that is a string or a list (at most ``MAX_CONTENT_PARTS``) of
``{"type": "text", "text": str}`` parts, joined with "\\n" as vLLM does for text-only
models. Other fields pass through when they are plain JSON values; all strings together
are bounded by ``MAX_CONTENT_BYTES`` (UTF-8 bytes; every other value counts one). Every
problem, template errors included, is a ``ValueError`` naming the field, e.g.
``messages[2].content``. The template writes the special tokens (BOS among them), so the
prompt is tokenized with ``add_special_tokens=False`` (``encode``), as transformers and
vLLM do.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, models

MAX_MESSAGES = 1024
MAX_CONTENT_BYTES = 1 << 20
MAX_CONTENT_PARTS = 1024  # per message
MAX_DEPTH = 32  # nesting of the plain JSON values a template is given
# render's own arguments and apply_chat_template's options: never template variables
RESERVED_KWARGS = ("messages", "add_generation_prompt", "chat_template", "conversation",
                   "tokenize", "sanitize_control_tokens", "padding", "truncation",
                   "max_length", "return_tensors", "return_dict",
                   "return_assistant_tokens_mask", "tokenizer_kwargs")


class ChatTemplate:
    """One model's chat template(s) and special tokens, on a transformers tokenizer."""

    def __init__(self, templates: str | dict[str, str], special_tokens: dict[str, str] | None = None,
                 source: str = "") -> None:
        if isinstance(templates, dict):
            if not templates or not all(isinstance(k, str) and isinstance(v, str)
                                        for k, v in templates.items()):
                raise ValueError("chat templates must be a non-empty {name: template} mapping")
        elif not isinstance(templates, str):
            raise ValueError("a chat template must be a string")
        tokens = dict(special_tokens or {})
        if not all(k.endswith("_token") and isinstance(v, str) for k, v in tokens.items()):
            raise ValueError("special tokens must be a {name_token: string} mapping")
        # lazy: transformers is heavy; only a template in use needs it
        from transformers import PreTrainedTokenizerFast

        empty = Tokenizer(models.WordLevel({}, unk_token=None))
        self._tok = PreTrainedTokenizerFast(tokenizer_object=empty, chat_template=templates,
                                            **tokens)
        self.source = source

    @classmethod
    def _wrap(cls, tokenizer: Any, source: str) -> ChatTemplate:
        self = cls.__new__(cls)
        self._tok, self.source = tokenizer, source
        return self

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> ChatTemplate | None:
        """The chat template of a model folder or GGUF file, or None when it has none."""
        # lazy: gguf_file loads numpy and gguf, only with a model (the router's modules import this)
        from pdserve.engine.model.gguf_file import GGUFModel, find_gguf

        gguf_path = find_gguf(model_dir)
        if gguf_path is not None:
            gguf = GGUFModel.open(gguf_path)
            template = gguf.chat_template
            return cls(template, gguf.special_tokens, f"{gguf_path.name}: tokenizer.chat_template"
                       ) if template else None
        d = Path(model_dir)
        if not d.is_dir():
            raise FileNotFoundError(f"model folder {d} not found")
        from transformers import PreTrainedTokenizerFast  # lazy: heavy; only with a model

        try:
            tok = PreTrainedTokenizerFast.from_pretrained(str(d), local_files_only=True)
        except Exception as exc:  # no tokenizer.json, unreadable JSON, ...
            raise ValueError(f"{d}: cannot load the tokenizer (and its chat template): "
                             f"{type(exc).__name__}: {exc}") from None
        return cls._wrap(tok, str(d)) if tok.chat_template else None

    # -- what the template sees ------------------------------------------------------------

    @property
    def templates(self) -> str | dict[str, str]:
        return self._tok.chat_template

    @property
    def special_tokens(self) -> dict[str, str]:
        return {k: str(v) for k, v in self._tok.special_tokens_map.items() if isinstance(v, str)}

    @property
    def bos_token(self) -> str | None:
        return self._tok.bos_token

    @property
    def eos_token(self) -> str | None:
        return self._tok.eos_token

    def template_source(self, tools: Any = None) -> str:
        """The template text ``render`` uses (named templates: "tool_use" with tools, else
        "default")."""
        named = self._tok.chat_template
        if isinstance(named, dict) and "default" not in named and not (
                tools is not None and "tool_use" in named):
            raise ValueError("this model has several chat templates and none named 'default' "
                             f"(available: {', '.join(sorted(named))})")
        return self._tok.get_chat_template(None, tools)

    # -- rendering --------------------------------------------------------------------------

    def render(self, messages: Any, add_generation_prompt: bool = True, *,
               chat_template_kwargs: dict | None = None, **extra: Any) -> str:
        """``apply_chat_template(messages, tokenize=False, add_generation_prompt=...,
        **kwargs)``, kwargs being ``chat_template_kwargs`` (a request's) and ``extra`` (the
        caller's; it wins), both checked: template variables, or ``tools``, ``documents``
        and ``continue_final_message`` (with ``add_generation_prompt=False``)."""
        kwargs = _template_kwargs(chat_template_kwargs, extra)
        chat = validate_messages(messages)
        self.template_source(kwargs.get("tools"))
        try:
            return self._tok.apply_chat_template(
                chat, tokenize=False, add_generation_prompt=bool(add_generation_prompt),
                **kwargs)
        except Exception as exc:  # jinja2's errors, transformers' ValueErrors, a bad template
            raise ValueError(_describe(exc)) from None

    # -- tokenizing ------------------------------------------------------------------------

    def count_leading_bos(self, prompt: str) -> int:
        """How many BOS tokens (as text) the rendered prompt starts with."""
        bos, n = self.bos_token, 0
        while bos and prompt.startswith(bos, n * len(bos)):
            n += 1
        return n

    def starts_with_bos(self, prompt: str) -> bool:
        """Whether the template already wrote the BOS token at the start."""
        return self.count_leading_bos(prompt) > 0

    def encode(self, tokenizer, prompt: str, add_special_tokens: bool = False) -> list[int]:
        """The prompt's ids with ``tokenizer`` (anything with ``encode(text,
        add_special_tokens=...)``): none added by default (the template wrote them); with
        ``add_special_tokens=True`` only when the prompt does not start with BOS already."""
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
    return [_message(message, f"messages[{i}]", budget) for i, message in enumerate(messages)]


def _message(message: Any, where: str, budget: list[int]) -> dict[str, Any]:
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
    return plain


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
    _spend(n, where, budget)


def _spend(n: int, where: str, budget: list[int]) -> None:
    budget[0] -= n
    if budget[0] < 0:
        raise ValueError(f"{where}: the messages are too large (at most "
                         f"{MAX_CONTENT_BYTES} bytes of text in all)")


def _plain(value: Any, where: str, budget: list[int], depth: int) -> Any:
    """A plain-JSON copy of ``value`` (what a template may see), charged to ``budget``."""
    if isinstance(value, str):
        _charge(value, where, budget)
        return str.__str__(value)
    _spend(1, where, budget)  # a value that is not text counts one
    if value is None or isinstance(value, (bool, int, float)):
        return _plain_scalar(value)
    if depth >= MAX_DEPTH:
        raise ValueError(f"{where}: nested more than {MAX_DEPTH} levels deep")
    if isinstance(value, (list, tuple)):
        return [_plain(v, f"{where}[{i}]", budget, depth + 1) for i, v in enumerate(value)]
    if isinstance(value, dict):
        return _plain_object(value, where, budget, depth)
    raise ValueError(f"{where}: must be a JSON value, got {type(value).__name__}")


def _plain_scalar(value: None | bool | int | float) -> None | bool | int | float:
    # Subclasses (an IntEnum, numpy-like floats) become the plain type a template expects.
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int):
        return int.__int__(value)
    return float.__float__(value)


def _plain_object(value: dict, where: str, budget: list[int], depth: int) -> dict[str, Any]:
    out = {}
    for k, v in value.items():
        if not isinstance(k, str):
            raise ValueError(f"{where}: object keys must be strings")
        _charge(k, where, budget)
        out[str.__str__(k)] = _plain(v, f"{where}.{k}", budget, depth + 1)
    return out


# ---- template variables ----------------------------------------------------------------------

def _template_kwargs(chat_template_kwargs: dict | None, extra: dict) -> dict[str, Any]:
    """``render``'s template variables: a request's ``chat_template_kwargs`` and the
    caller's ``extra`` (it wins), as plain JSON, reserved names refused."""
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
    _check_known_kwargs(kwargs)
    return kwargs


def _check_known_kwargs(kwargs: dict[str, Any]) -> None:
    """The variables transformers itself reads must have the shape it expects."""
    for name in ("tools", "documents"):
        value = kwargs.get(name)
        if value is not None and not (isinstance(value, list)
                                      and all(isinstance(v, dict) for v in value)):
            raise ValueError(f"{name}: must be a list of objects")
    continue_final = kwargs.get("continue_final_message", False)
    if continue_final is not False and not isinstance(continue_final, (bool, str)):
        raise ValueError("continue_final_message: must be a boolean or a field name")


def _describe(exc: BaseException) -> str:
    """A one-line message for an error raised while compiling or rendering a template."""
    import jinja2.exceptions  # lazy: jinja2 (serve extra), only when a template fails

    if isinstance(exc, jinja2.exceptions.TemplateSyntaxError):
        return f"the model's chat template does not compile: {exc.message} (line {exc.lineno})"
    text = "" if isinstance(exc, (MemoryError, RecursionError)) else str(exc)
    if text and isinstance(exc, (jinja2.exceptions.TemplateError, ValueError)):
        return f"chat template error: {text}"  # raise_exception(...)'s, transformers' own
    return f"chat template error: {type(exc).__name__}" + (f": {text}" if text else "")
