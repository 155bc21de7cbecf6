"""The teacher's checks before anything loads (preflight), without torch: its files, its
quantization's needs, and that it reads the policy's token ids as the same tokens.

The teacher scores the ids the policy sampled, never text, so what must agree is the map
from id to token (the vocabulary and the added tokens): two tokenizers that agree on it
give the teacher exactly the sequence the policy wrote, whatever their normalisers or
pre-tokenizers do with text. Read from each directory's tokenizer.json (plain JSON: BPE
and WordPiece vocabularies are token -> id, Unigram's a list whose index is the id;
added tokens carry their ids), or through transformers' tokenizer where there is no
tokenizer.json (sentencepiece-only models). The first id on which they differ is named.
The teacher's embedding rows (config.json vocab_size) must also cover the policy's: a
policy may sample any id below its own vocab_size, padding rows included, and the
teacher must have a log-prob for it; rows past the policy's are cut off as the teacher
loads (distill/teacher.py `narrow_vocabulary`), so its log-softmax runs over the policy's. Its context (config.json max_position_embeddings)
must hold the run's longest sequence (the longest prompt plus rollout.max_new_tokens, or
environment.max_total_tokens). It must end, begin and pad with the policy's ids
(generation_config.json, config.json, the tokenizer's tokens), and when prompts are
rendered with the tokenizer's chat template, have the policy's template. Which added
tokens are flagged special is not compared: it changes how text is tokenized and
decoded, and the teacher reads ids.

Each side is a `TokenizerSide`. A served teacher (distill.teacher_urls) is compared the
same way from what each server says of the model it loaded (GET /teacher: the same
record read from its directory, `tokenizer_report`, and its max_model_len), with two
differences: its vocabulary rows must equal the policy's (vLLM normalises over all the
rows a model has; a local teacher is narrowed to the policy's), and its max_model_len,
not its config's context, must hold the run's longest sequence. A server that does not
answer or refuses is one `TeacherServerError`.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from leangrpo.config import ConfigError
from leangrpo.errors import RunError, UserError
from leangrpo.model.files import (
    ModelFiles,
    attention_heads,
    check_context_heads,
    check_model_files,
    embedding_rows,
)

MISSING = object()
log = logging.getLogger("leangrpo")


class TeacherMismatchError(UserError):
    """The teacher cannot score the policy's ids (one sentence)."""


class TeacherServerError(RunError):
    """A server of distill.teacher_urls does not answer, or refuses (one sentence), before
    the run or during it."""


URLS_KEY = "distill.teacher_urls"


def id_to_token(directory: Path) -> dict[int, str]:
    """id -> token of the tokenizer saved in `directory` (vocabulary and added tokens)."""
    file = directory / "tokenizer.json"
    if file.is_file():
        try:
            data = json.loads(file.read_text(encoding="utf-8"))
            return _from_tokenizer_json(data)
        except (UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError):
            pass  # transformers reads it, or says what is wrong with it
    from transformers import AutoTokenizer

    vocab = AutoTokenizer.from_pretrained(str(directory)).get_vocab()
    return {int(i): str(t) for t, i in vocab.items()}


def _from_tokenizer_json(data: dict[str, Any]) -> dict[int, str]:
    vocab = data["model"].get("vocab") or {}
    if isinstance(vocab, dict):
        out = {int(i): str(t) for t, i in vocab.items()}
    else:  # Unigram: [[token, score], ...], the index is the id
        out = {i: str(entry[0]) for i, entry in enumerate(vocab)}
    for added in data.get("added_tokens") or []:
        out[int(added["id"])] = str(added["content"])
    return out


def first_difference(policy: dict[int, str], teacher: dict[int, str]) -> str | None:
    """'id N is ... for the policy and ... for the teacher' at the lowest id where the
    two maps differ, or None when they are equal."""
    if policy == teacher:
        return None
    for i in sorted(set(policy) | set(teacher)):
        mine, theirs = policy.get(i, MISSING), teacher.get(i, MISSING)
        if mine != theirs:
            return f"id {i} is {_shown(mine)} for the policy and {_shown(theirs)} for the teacher"
    return None  # unreachable: unequal maps differ at some id


def _shown(token: object) -> str:
    return "absent" if token is MISSING else repr(token)


@dataclass(frozen=True)
class TokenizerSide:
    """One side of the comparison (the policy, or a local or served teacher): what it
    calls itself in a message, its id -> token map, its vocabulary rows (config.json
    vocab_size; None: not said), the ids it ends, begins and pads with, its chat
    template (None: none)."""

    name: str
    tokens: dict[int, str]
    rows: int | None
    specials: dict[str, tuple[int, ...] | None]
    template: Any


def local_side(name: str, directory: Path) -> TokenizerSide:
    """A model directory's side of the comparison."""
    return TokenizerSide(
        name, id_to_token(directory), _rows(directory), special_ids(directory),
        chat_template(directory),
    )  # fmt: skip


def tokenizer_report(directory: Path) -> dict[str, Any]:
    """A model directory's side as JSON (what `leangrpo serve` answers GET /teacher with:
    token ids as [id, token] pairs, special ids as lists)."""
    side = local_side(str(directory), directory)
    return {
        "tokens": sorted(side.tokens.items()),
        "vocab_size": side.rows,
        "specials": {k: None if v is None else list(v) for k, v in side.specials.items()},
        "chat_template": side.template,
    }


def served_side(name: str, report: dict[str, Any]) -> TokenizerSide:
    """A served teacher's side, from its GET /teacher reply (`tokenizer_report`)."""
    specials = {k: None if v is None else tuple(v) for k, v in report["specials"].items()}
    tokens = {int(i): str(token) for i, token in report["tokens"]}
    return TokenizerSide(name, tokens, report["vocab_size"], specials, report["chat_template"])


def check_teacher_vocabulary(policy: TokenizerSide, teacher: TokenizerSide) -> None:
    """Refuse a teacher whose tokenizer maps some id to another token than the policy's,
    or whose embedding rows do not cover the policy's (one sentence each)."""
    difference = first_difference(policy.tokens, teacher.tokens)
    if difference is not None:
        raise TeacherMismatchError(
            f"{teacher.name} has another tokenizer than the policy ({policy.name}): {difference}, so it would score other tokens than the policy sampled; use a teacher of the same tokenizer family (same vocabulary and added tokens)."
        )
    mine, theirs = policy.rows, teacher.rows
    if mine is not None and theirs is not None and theirs < mine:
        raise TeacherMismatchError(
            f"{teacher.name} has {theirs} vocabulary rows (config.json vocab_size) and the policy {mine}, so a token the policy samples from its last {mine - theirs} rows would have no teacher log-prob; use a teacher whose vocab_size covers the policy's."
        )


SPECIALS = ("eos", "bos", "pad")


def special_ids(directory: Path) -> dict[str, tuple[int, ...] | None]:
    """The ids the model ends, begins and pads with, as the hf engine picks them
    (rollout/hf/engine.py): generation_config.json's, else config.json's, else the
    tokenizer's (tokenizer_config.json's token, read through the id map); pad: the
    tokenizer's, else generation_config.json's, else the eos."""
    configs = [_json(directory / name) for name in ("generation_config.json", "config.json")]
    tokens = _json(directory / "tokenizer_config.json")
    ids = {token: i for i, token in id_to_token(directory).items()}
    out: dict[str, tuple[int, ...] | None] = {}
    for kind in ("eos", "bos"):
        found = [c.get(f"{kind}_token_id") for c in configs] + [ids.get(_content(tokens, kind))]
        out[kind] = next((_ids(v) for v in found if v is not None), None)
    pad = [ids.get(_content(tokens, "pad")), configs[0].get("pad_token_id")]
    out["pad"] = next((_ids(v) for v in pad if v is not None), out["eos"])
    return out


def chat_template(directory: Path) -> Any:
    """The tokenizer's chat template: chat_template.jinja, chat_template.json's, or
    tokenizer_config.json's (None: it has none)."""
    jinja = directory / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    for name in ("chat_template.json", "tokenizer_config.json"):
        template = _json(directory / name).get("chat_template")
        if template is not None:
            return template
    return None


def check_teacher_specials(
    policy: TokenizerSide, teacher: TokenizerSide, with_template: bool
) -> None:
    """Refuse a teacher that ends, begins or pads with other ids than the policy (its
    log-prob of the policy's end-of-sequence would be that of an ordinary token), or, when
    prompts are rendered with the tokenizer's chat template (`with_template`), whose
    template differs (it would score prompts laid out as it never saw them). One sentence
    naming what differs."""
    for kind in SPECIALS:
        mine, theirs = policy.specials[kind], teacher.specials[kind]
        if mine != theirs:
            raise TeacherMismatchError(
                f"{teacher.name} has another {kind} token id than the policy ({policy.name}): {_listed(mine)} for the policy and {_listed(theirs)} for the teacher (generation_config.json, config.json or tokenizer_config.json), so it would score the policy's {kind} token as another token; use a teacher of the same tokenizer and special tokens."
            )
    if with_template and policy.template != teacher.template:
        raise TeacherMismatchError(
            f"{teacher.name} has another chat template than the policy ({policy.name}), and data.chat_template: true renders the prompts with the policy's, so the teacher would score prompts laid out as it was never trained on; use a teacher with the same chat template, or name one template for both in data.chat_template."
        )


def _renders_with_tokenizer(cfg: Any) -> bool:
    """Prompts (or turns) rendered with the policy tokenizer's own chat template."""
    env = cfg.environment
    if env is not None and env.chat_template is not None:
        return False
    return cfg.data.chat_template is True


def _json(file: Path) -> dict[str, Any]:
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _content(tokens: dict[str, Any], kind: str) -> str | None:
    token = tokens.get(f"{kind}_token")
    return token.get("content") if isinstance(token, dict) else token


def _ids(value: Any) -> tuple[int, ...]:
    return tuple(sorted({int(v) for v in (value if isinstance(value, list) else [value])}))


def _listed(ids: tuple[int, ...] | None) -> str:
    if ids is None:
        return "none"
    return str(ids[0]) if len(ids) == 1 else ", ".join(map(str, ids))


def check_teacher(cfg: Any, policy: ModelFiles, world_size: int, limit: Any = None) -> None:
    """Everything about `cfg.distill` that can be known before torch is imported: the
    teacher's files (as model.name_or_path's), bitsandbytes and the CPU for a quantized
    teacher, torchrun's limits, its context against the run's longest sequence (`limit`:
    the prompt limit preflight found, a `data.prompts.PromptLimit`, or None), and the
    vocabulary check, which needs both tokenizers on disk: a hub model not in the local
    cache yet is not compared (a warning says so; download it first to have it checked)."""
    distill = cfg.distill
    if distill is None:
        return
    if distill.served:
        check_served_teacher(cfg, policy, limit)
        return
    settings = SimpleNamespace(name_or_path=distill.teacher, revision=distill.teacher_revision)
    try:
        teacher = check_model_files(settings)
    except UserError as error:  # its messages name model.name_or_path
        raise TeacherMismatchError(
            str(error).replace("model.name_or_path", "distill.teacher")
        ) from None
    check_teacher_quantization(cfg, world_size)
    check_teacher_context(cfg, policy, teacher, limit)
    if teacher.directory is not None:  # its rows are split over the context group too
        config = json.loads((teacher.directory / "config.json").read_text(encoding="utf-8"))
        heads = attention_heads(config)
        c = cfg.distributed.context_parallel_size
        check_context_heads(c, heads, distill.teacher, "distill.teacher")
    if policy.directory is None or teacher.directory is None:
        log.warning(
            "distill.teacher: the policy's and the teacher's tokenizers were not compared, because one of them is not downloaded yet; download both (huggingface-cli download) to have the check run before anything loads"
        )
        return
    mine = local_side(str(policy.directory), policy.directory)
    theirs = local_side(f"distill.teacher ({teacher.directory})", teacher.directory)
    check_teacher_vocabulary(mine, theirs)
    check_teacher_specials(mine, theirs, _renders_with_tokenizer(cfg))


def check_served_teacher(cfg: Any, policy: ModelFiles, limit: Any) -> None:
    """A served teacher's checks (distill.teacher_urls), the local teacher's asked of each
    server's model (GET /teacher): the same id -> token map, special ids and (prompts
    rendered with it) chat template as the policy's; exactly the policy's vocabulary rows
    (vLLM's log-softmax runs over all the rows the model has, where a local teacher is
    narrowed to the policy's); a max_model_len that holds the run's longest sequence.
    A server that does not answer, or refuses, is one error naming it."""
    if policy.directory is None:
        log.warning(
            "distill.teacher_urls: the policy's and the served teacher's tokenizers were not compared, because the policy is not downloaded yet; download it (huggingface-cli download) to have the check run before anything loads"
        )
        return
    mine = local_side(str(policy.directory), policy.directory)
    for url, report in served_reports(cfg.distill):
        theirs = served_side(f"distill.teacher_urls' {url} (serving {report['model']})", report)
        check_teacher_vocabulary(mine, theirs)
        if mine.rows is not None and theirs.rows is not None and theirs.rows > mine.rows:
            raise TeacherMismatchError(
                f"{theirs.name} has {theirs.rows} vocabulary rows (config.json vocab_size) and the policy {mine.rows}, and vLLM's log-probs are normalised over all of the teacher's rows, so its last {theirs.rows - mine.rows} would take probability from every token the student can sample; serve a teacher with the policy's vocab_size, or load it in the trainer (distill.teacher), which narrows it to the policy's rows."
            )
        check_teacher_specials(mine, theirs, _renders_with_tokenizer(cfg))
        check_served_context(cfg, policy, limit, theirs.name, int(report["max_model_len"]))


def served_reports(distill: Any) -> list[tuple[str, dict[str, Any]]]:
    """(url, GET /teacher reply) of every server in distill.teacher_urls; a server that
    does not answer, refuses the token or the route is one `TeacherServerError`."""
    from leangrpo.rollout.vllm.client import ServerPool, VLLMServerError, read_token

    try:
        token = read_token(distill.teacher_token_file, "distill.teacher_token_file")
        pool = ServerPool(distill.teacher_urls, timeout_s=distill.teacher_timeout_s,
                          token=token, key=URLS_KEY)  # fmt: skip
    except (ValueError, VLLMServerError) as error:
        raise TeacherServerError(f"{URLS_KEY}: {one_sentence(error)}.") from None
    try:
        return [(url, pool.request(url, "GET", "/teacher")) for url in pool.urls]
    except VLLMServerError as error:
        raise TeacherServerError(
            f"{URLS_KEY}: {one_sentence(error)}; a served teacher is a `leangrpo serve TEACHER` of this leangrpo version."
        ) from None
    finally:
        pool.close()


def one_sentence(error: BaseException) -> str:
    return " ".join(str(error).split()).rstrip(".")


def check_served_context(cfg: Any, policy: ModelFiles, limit: Any, name: str, served: int) -> None:
    """Refuse a server whose max_model_len is shorter than the run's longest sequence:
    vLLM would refuse the request that scores it, mid-run."""
    longest = longest_sequence(cfg, limit, policy)
    if longest is None or longest[0] <= served:
        return
    tokens, why = longest
    raise TeacherMismatchError(
        f"{name} takes sequences of up to {served} tokens (its max_model_len), but this run's sequences reach {tokens} tokens ({why}); start it with `leangrpo serve ... --max-model-len {tokens}` (where the model's context allows), or shorten the run's sequences."
    )


def longest_sequence(cfg: Any, limit: Any, policy: ModelFiles) -> tuple[int, str] | None:
    """The most tokens one of the run's sequences holds, and why (None: no bound is known):
    environment.max_total_tokens for multi-turn, else the longest prompt plus
    rollout.max_new_tokens (`limit`: the prompt limit; without one, the policy's context
    bounds the sequences)."""
    if cfg.environment is not None:
        total = cfg.environment.max_total_tokens
        return total, f"environment.max_total_tokens = {total}"
    if limit is None:
        if policy.context is None:
            return None
        return policy.context, f"the policy's context of {policy.context} positions"
    new = cfg.rollout.max_new_tokens
    return limit.tokens + new, (
        f"a prompt of up to {limit.tokens} tokens ({limit.reason}) plus rollout.max_new_tokens = {new}"
    )


def check_teacher_context(cfg: Any, policy: ModelFiles, teacher: ModelFiles, limit: Any) -> None:
    """Refuse a teacher whose context (config.json max_position_embeddings, rope scaling
    included) is shorter than the run's longest sequence: it would score positions it was
    never trained on (or index past its rotary table) without a word."""
    longest = longest_sequence(cfg, limit, policy)
    if teacher.context is None or longest is None or longest[0] <= teacher.context:
        return
    tokens, why = longest
    fix = (
        f"lower environment.max_total_tokens to {teacher.context}"
        if cfg.environment is not None
        else f"set data.max_prompt_tokens to at most {teacher.context - cfg.rollout.max_new_tokens}"
        if teacher.context > cfg.rollout.max_new_tokens
        else f"lower rollout.max_new_tokens below {teacher.context}"
    )
    raise TeacherMismatchError(
        f"distill.teacher ({cfg.distill.teacher}) attends to {teacher.context} positions ({teacher.context_source}), but this run's sequences reach {tokens} tokens ({why}); {fix}, or use a teacher with a longer context."
    )


def check_teacher_quantization(cfg: Any, world_size: int) -> None:
    """bitsandbytes installed and a CPU it runs on (model/quantization.py's checks), and
    no int8 teacher under torchrun (FSDP2 loses int8 layers' scales)."""
    quant = cfg.distill.teacher_quantization
    if quant == "none":
        return
    import platform

    from leangrpo.model.quantization import (
        QuantizationError,
        bitsandbytes_version,
        check_bitsandbytes,
        cpu_flags,
        cpu_problem,
    )

    key = "distill.teacher_quantization"
    check_bitsandbytes(quant, bitsandbytes_version(), key)
    if cfg.run.device == "cpu":
        problem = cpu_problem(platform.machine(), cpu_flags(), key)
        if problem:
            raise QuantizationError(f"{key}: {quant} {problem}")
    if quant == "int8" and world_size > 1:
        raise ConfigError(
            f"distill.teacher_quantization: int8 cannot be sharded by FSDP2 (bitsandbytes' int8 layers lose their scales when their weight becomes a DTensor), and this run has {world_size} torchrun processes; use distill.teacher_quantization: nf4, or one process."
        )


def _rows(directory: Path) -> int | None:
    """config.json's vocab_size in `directory` (check_model_files read it already)."""
    return embedding_rows(json.loads((directory / "config.json").read_text(encoding="utf-8")))
