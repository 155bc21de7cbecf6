"""The model's tokenizer for the checks before the model loads, without transformers.

Loading a tokenizer through transformers imports it and torch: 2.4 s of CPU, 10 s on a busy
machine, far over the 2 s the pre-load checks may take. Reading tokenizer.json with the
`tokenizers` library alone is not the same tokenizer: transformers may rebuild parts of it
(the tools demo's loads as a Qwen2 tokenizer, with another pre-tokenizer and an NFC
normaliser: "cafe" + a combining accent is 3 tokens, not 6). So the trainer's set-up, which loads the real
tokenizer anyway, records what it became (`remember`), as does the first `leangrpo check`
of a model: its backend serialised by `tokenizers`, the chat template, the special tokens;
`recall` reads that record before the model loads (the environment's checks, and all of
`leangrpo check`: preflight.py `check_tokenizer`), as a `TokenizerRecord` with the calls
the checks make (`__call__`, `decode`, `apply_chat_template(tokenize=False)`, the special
and added tokens).

- Exact or absent: a record is written only after it rendered and encoded probe
  conversations (with and without tools), and encoded and decoded plain texts with and
  without the special tokens (raw prompts), exactly as the real tokenizer did, and it is
  keyed by the tokenizer files' names, sizes and modification times, the model directory
  and the transformers and tokenizers versions; any change is a miss. On a miss the
  pre-load checks that need the tokenizer are left to the set-up, which makes them with
  the real one right after loading it (still before the model loads).
- The chat template is rendered as transformers renders it (`compiled_template`: a
  sandboxed, immutable Jinja environment with trim_blocks and lstrip_blocks, loop
  controls, `{% generation %}` blocks, its `tojson`, `raise_exception`, `strftime_now`,
  `dict` and `namespace`; the special tokens as variables; message keys holding None left
  out). Only plain string templates: a tokenizer with several named templates is not
  recorded.
- Records live in `$LEANGRPO_CACHE/tokenizers` (default ~/.cache/leangrpo), one JSON file
  and one backend file per key, written atomically.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from leangrpo.model.smollm2 import cache_dir

TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "chat_template.jinja", "chat_template.json", "tokenizer.model", "vocab.json", "merges.txt",
    "vocab.txt", "config.json",
)  # fmt: skip
RECORD_VERSION = 2  # 2: probed on plain text too, with and without special tokens


@dataclass(frozen=True)
class AddedToken:
    content: str
    special: bool


class TokenizerRecord:
    """A tokenizer as the set-up's real one behaves, for rendering and counting tokens."""

    def __init__(self, meta: dict[str, Any], backend: Any):
        self.backend = backend
        self.chat_template: str | None = meta["chat_template"]
        self.special_tokens_map: dict[str, str] = meta["special_tokens_map"]
        self.all_special_tokens: list[str] = meta["all_special_tokens"]
        self.added_tokens_decoder = {int(i): AddedToken(c, s) for i, c, s in meta["added_tokens"]}
        self.added_tokens_encoder = {t.content: i for i, t in self.added_tokens_decoder.items()}
        self.eos_token_id: int | None = meta["eos_token_id"]
        self.name_or_path: str = meta["name_or_path"]

    def __call__(self, text: str | list[str], add_special_tokens: bool = False) -> dict[str, Any]:
        if isinstance(text, str):
            return {"input_ids": self.backend.encode(text, add_special_tokens=add_special_tokens).ids}
        encoded = self.backend.encode_batch(list(text), add_special_tokens=add_special_tokens)
        return {"input_ids": [e.ids for e in encoded]}

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_tokens_to_ids(self, tokens: str | list[str]) -> int | list[int]:
        if isinstance(tokens, str):
            return self.backend.token_to_id(tokens)
        return [self.backend.token_to_id(t) for t in tokens]

    def apply_chat_template(
        self,
        messages: list[dict],
        tools: list[dict] | None = None,
        add_generation_prompt: bool = False,
        tokenize: bool = False,
        chat_template: str | None = None,
    ) -> str:
        if tokenize:
            raise ValueError("a TokenizerRecord renders text only (tokenize=False)")
        template = chat_template if chat_template is not None else self.chat_template
        if template is None:
            raise ValueError("the tokenizer has no chat template")
        return render_chat(template, messages, tools, add_generation_prompt, self.special_tokens_map)


# -- the chat template, rendered as transformers renders it ----------------------------------


@functools.lru_cache(maxsize=16)
def compiled_template(source: str) -> Any:
    """The template compiled as transformers compiles it (raises jinja2's TemplateError,
    TemplateSyntaxError included, on a template that does not parse)."""
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        """{% generation %}...{% endgeneration %}: rendered as it is."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False) -> str:  # fmt: skip
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    class TemplateDict:
        def __call__(self, *args: Any, **kwargs: Any) -> dict:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
            return dict.fromkeys(*args, **kwargs)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals.update(
        raise_exception=raise_exception,
        strftime_now=lambda fmt: datetime.now().strftime(fmt),
        dict=TemplateDict(),
        namespace=jinja2.utils.Namespace,
    )
    return env.from_string(source)


def render_chat(
    template: str, messages: list[dict], tools: list[dict] | None, generation_prompt: bool, specials: dict
) -> str:
    chat = [{k: v for k, v in dict(m).items() if v is not None} for m in messages]
    return compiled_template(template).render(
        messages=chat, tools=tools, documents=None, add_generation_prompt=generation_prompt, **specials
    )


# -- records -------------------------------------------------------------------------------


def record_key(directory: Path) -> str | None:
    """What the record depends on; None when the directory cannot be read."""
    import importlib.metadata

    try:
        files = sorted(
            (name, st.st_size, st.st_mtime_ns)
            for name in TOKENIZER_FILES
            if (st := _stat(directory / name)) is not None
        )
        versions = [importlib.metadata.version(p) for p in ("transformers", "tokenizers")]
    except (OSError, importlib.metadata.PackageNotFoundError):
        return None
    text = json.dumps([RECORD_VERSION, str(directory.resolve()), files, versions])
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _stat(path: Path) -> os.stat_result | None:
    try:
        return path.stat()
    except FileNotFoundError:
        return None


def records_dir() -> Path:
    return cache_dir() / "tokenizers"


def recall(directory: Path | None) -> TokenizerRecord | None:
    """The record the set-up left for this model's tokenizer files, or None."""
    key = record_key(directory) if directory is not None else None
    if key is None:
        return None
    meta_path = records_dir() / f"{key}.json"
    try:
        meta = json.loads(meta_path.read_text())
        from tokenizers import Tokenizer

        backend = Tokenizer.from_file(str(records_dir() / f"{key}.tokenizer.json"))
    except Exception:  # noqa: BLE001  no record, or a damaged one: the set-up checks instead
        return None
    return TokenizerRecord(meta, backend)


def remember(directory: Path | None, tokenizer: Any) -> bool:
    """Record `tokenizer` (the real one, as loaded) for `recall`, when it is not recorded
    yet and the record behaves exactly like it on the probes; True when one exists now."""
    key = record_key(directory) if directory is not None else None
    if key is None or not isinstance(getattr(tokenizer, "chat_template", None), (str, type(None))):
        return False
    if (records_dir() / f"{key}.json").is_file():
        return True
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return False
    meta = {
        "chat_template": tokenizer.chat_template,
        "special_tokens_map": dict(tokenizer.special_tokens_map),
        "all_special_tokens": list(tokenizer.all_special_tokens),
        "added_tokens": [[i, t.content, bool(t.special)] for i, t in tokenizer.added_tokens_decoder.items()],
        "eos_token_id": tokenizer.eos_token_id,
        "name_or_path": str(getattr(tokenizer, "name_or_path", "") or "the tokenizer"),
    }
    from tokenizers import Tokenizer

    serialised = backend.to_str()
    record = TokenizerRecord(meta, Tokenizer.from_str(serialised))
    if not behaves_alike(record, tokenizer):
        return False
    try:
        records_dir().mkdir(parents=True, exist_ok=True)
        _write(records_dir() / f"{key}.tokenizer.json", serialised)
        _write(records_dir() / f"{key}.json", json.dumps(meta))  # last: the record is complete
    except OSError:
        return False
    return True


def _write(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


PROBE_TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two integers.",
               "parameters": {"type": "object", "properties": {"a": {"type": "integer", "description": "A."}},
                              "required": ["a"]}}}]  # fmt: skip
PROBE_CHATS = [
    [{"role": "user", "content": "What is 12 + 30? Ünïcödé, tabs\tand  spaces.\n"}],
    [{"role": "system", "content": "You add numbers."}, {"role": "user", "content": "395+136="},
     {"role": "assistant", "content": " It is 531.\n"}, {"role": "user", "content": "And <b>1 + 1</b>?"}],
]  # fmt: skip


PROBE_TEXTS = ["37+45=", "What is 12 + 30? Ünïcödé, tabs\tand  spaces.\n", "  <b>1 + 1</b>  "]


def behaves_alike(record: TokenizerRecord, tokenizer: Any) -> bool:
    """The record renders, encodes and decodes the probes as `tokenizer` does (a probe the
    template refuses must be refused by both); plain texts (raw prompts) too, encoded with
    and without the special tokens the tokenizer adds, decoded with and without them."""
    if not all(_encodes_alike(record, tokenizer, text) for text in PROBE_TEXTS):
        return False
    for chat in PROBE_CHATS:
        for tools in (None, PROBE_TOOLS):
            for generation_prompt in (False, True):
                got, want = _rendered(record, chat, tools, generation_prompt), _rendered(tokenizer, chat, tools, generation_prompt)  # fmt: skip
                if got != want:
                    return False
                if want is None:
                    continue
                ids = tokenizer(want, add_special_tokens=False)["input_ids"]
                if record(want, add_special_tokens=False)["input_ids"] != ids:
                    return False
                if record.decode(ids) != tokenizer.decode(ids, skip_special_tokens=False):
                    return False
    return True


def _encodes_alike(record: TokenizerRecord, tokenizer: Any, text: str) -> bool:
    for special in (False, True):
        ids = tokenizer(text, add_special_tokens=special)["input_ids"]
        if record(text, add_special_tokens=special)["input_ids"] != ids:
            return False
        if record([text], add_special_tokens=special)["input_ids"] != [ids]:
            return False
        if record.decode(ids, skip_special_tokens=special) != tokenizer.decode(ids, skip_special_tokens=special):
            return False
    return True


def _rendered(tokenizer: Any, chat: list[dict], tools: list | None, generation_prompt: bool) -> str | None:
    if getattr(tokenizer, "chat_template", None) is None:
        return None
    try:
        return tokenizer.apply_chat_template(chat, tools=tools, add_generation_prompt=generation_prompt, tokenize=False)
    except Exception:  # noqa: BLE001  a template that refuses a role: both must refuse it
        return None
