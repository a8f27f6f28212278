"""Text <-> token ids, and the chat template, for one model.

Built with `tokenizers` from GGUF metadata (byte-level BPE: tokens, merges, token types), from a
Hugging Face tokenizer.json, or as a plain byte tokenizer for models with random weights. The chat
template is rendered with jinja2 the way Hugging Face transformers renders it (its `render_jinja_template`): sandboxed,
trim/lstrip blocks, loop controls, the `{% generation %}` block, `raise_exception`, `strftime_now`, its `tojson`, and
the variables it passes (messages, tools and documents None, add_generation_prompt, the special tokens the model has).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import structlog
from jinja2 import nodes
from jinja2.parser import Parser
from jinja2.runtime import Macro
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

log = structlog.get_logger(__name__)

# GGUF token types (llama.cpp's llama_token_type): control and user-defined tokens are special.
TOKEN_CONTROL = 3
TOKEN_USER_DEFINED = 4

GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# A text longer than this is encoded with the tokenizers library's batch call, which releases the GIL while it works
# (its single-text call holds it: 4.2M characters held it for ~6 s, and no other thread of the process ran).
RELEASE_GIL_CHARS = 4096

# The chat template's variables the server sets (transformers' own): a request's template arguments cannot name them,
# nor the environment's globals (Tokenizer._own_names).
TEMPLATE_OWN = frozenset({"messages", "add_generation_prompt", "tools", "documents", "bos_token", "eos_token"})

# The window `Tokenizer.boundary_tail` takes: more bytes than any word, number or run of punctuation a tokenizer's
# pre-tokenizer keeps in one piece in ordinary text.
BOUNDARY_BYTES = 128
BOUNDARY_TOKENS = 64

CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class UnrepresentableText(ValueError):
    """The text holds bytes the model's byte-level vocabulary has no token for."""


class ChatTemplateError(ValueError):
    """The model's chat template could not be rendered for these messages."""


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    """The pre-tokenizer llama.cpp uses for `tokenizer.ggml.pre` (llama-vocab.cpp's regex table)."""
    if pre in ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"):
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        )
    if pre in ("llama-bpe", "llama3", "dbrx", "smaug-bpe"):
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    if pre not in ("gpt2", "default", "mpt", "olmo", "jais"):
        log.warning("tokenizer_pre_unknown", pre=pre, using="gpt2")
    return pre_tokenizers.ByteLevel(add_prefix_space=False)


class Tokenizer:
    def __init__(
        self,
        tok: HFTokenizer,
        *,
        bos_id: int | None,
        eos_id: int,
        chat_template: str | None,
        add_bos: bool = False,
        extra_stop_ids: Sequence[int] = (),
    ) -> None:
        self._tok = tok
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.add_bos = add_bos
        self.chat_template = chat_template or CHATML_TEMPLATE
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        self.special_ids: frozenset[int] = frozenset(
            i for i, t in tok.get_added_tokens_decoder().items() if t.special
        )
        # Byte-level BPE drops bytes that have no token of their own; some vocabularies lack a few
        # (SmolLM2 has none for 0x04, 0xF1, ...). Text holding them is refused instead of mangled.
        self._missing_bytes = b""
        # For byte-level vocabularies, the bytes each id decodes to (b"" for special tokens): lets
        # streaming detokenize a token in O(1) instead of re-decoding a window of ids.
        self.token_bytes: list[bytes] | None = None
        if isinstance(tok.decoder, decoders.ByteLevel):
            self._missing_bytes = bytes(
                sorted(_byte_of(c) for c in pre_tokenizers.ByteLevel.alphabet() if tok.token_to_id(c) is None)
            )
            self.token_bytes = _byte_level_table(tok)
        # With byte-level tokens and no normalizer, every token covers at most this many bytes of the text (specials
        # their content): a text of n characters is at least n / max_token_bytes tokens (`min_tokens`). 0: unknown.
        self.max_token_bytes = 0
        if self.token_bytes is not None and tok.normalizer is None:
            specials = [len(t.content.encode()) for t in tok.get_added_tokens_decoder().values()]
            self.max_token_bytes = max([1, *map(len, self.token_bytes), *specials])
        # Ids that end a generation: EOS plus e.g. Llama 3's <|eot_id|>.
        self.stop_ids: frozenset[int] = frozenset({eos_id, *extra_stop_ids})
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
        env.globals["raise_exception"] = _raise_template_error
        env.globals["strftime_now"] = _strftime_now
        env.filters["tojson"] = _tojson
        # Names a request's template arguments cannot take: the variables the server sets, and jinja's globals
        # (range, dict, namespace, ...), which a template calls.
        self._own_names = TEMPLATE_OWN | frozenset(env.globals)
        try:
            self._template = env.from_string(self.chat_template)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"the model's chat template does not parse: {e}") from e

    # -- constructors ---------------------------------------------------------------------------

    @classmethod
    def from_gguf_fields(cls, fields: dict[str, Any]) -> Tokenizer:
        kind = fields.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ValueError(f"unsupported GGUF tokenizer model {kind!r}: only byte-level BPE ('gpt2') is supported")
        tokens: list[str] = fields["tokenizer.ggml.tokens"]
        types: list[int] = fields.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        merges = [tuple(m.split(" ", 1)) for m in fields["tokenizer.ggml.merges"]]
        vocab = {t: i for i, t in enumerate(tokens)}
        tok = HFTokenizer(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False))
        tok.pre_tokenizer = _pre_tokenizer(str(fields.get("tokenizer.ggml.pre", "gpt2")))
        tok.decoder = decoders.ByteLevel()
        specials = [tokens[i] for i, ty in enumerate(types) if ty in (TOKEN_CONTROL, TOKEN_USER_DEFINED)]
        tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
        bos = fields.get("tokenizer.ggml.bos_token_id")
        eos = int(fields["tokenizer.ggml.eos_token_id"])
        extra = [i for name in ("<|eot_id|>", "<|eom_id|>") if (i := vocab.get(name)) is not None]
        return cls(
            tok,
            bos_id=None if bos is None else int(bos),
            eos_id=eos,
            chat_template=fields.get("tokenizer.chat_template"),
            add_bos=bool(fields.get("tokenizer.ggml.add_bos_token", False)),
            extra_stop_ids=extra,
        )

    @classmethod
    def from_hf_folder(cls, folder: Path) -> Tokenizer:
        tok = HFTokenizer.from_file(str(folder / "tokenizer.json"))
        cfg: dict[str, Any] = {}
        if (folder / "tokenizer_config.json").exists():
            cfg = json.loads((folder / "tokenizer_config.json").read_text())
        gen: dict[str, Any] = {}
        if (folder / "generation_config.json").exists():
            gen = json.loads((folder / "generation_config.json").read_text())

        def token_id(value: Any) -> int | None:
            if isinstance(value, dict):
                value = value.get("content")
            return None if value is None else tok.token_to_id(str(value))

        eos_ids = gen.get("eos_token_id")
        eos_list = eos_ids if isinstance(eos_ids, list) else [eos_ids] if eos_ids is not None else []
        eos = token_id(cfg.get("eos_token"))
        if eos is None:
            if not eos_list:
                raise ValueError(f"{folder}: no eos token in tokenizer_config.json or generation_config.json")
            eos = int(eos_list[0])
        template = cfg.get("chat_template")
        if isinstance(template, list):  # a list of named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if (folder / "chat_template.jinja").exists():  # where transformers saves it (not in the config): it comes first
            template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
        bos = token_id(cfg.get("bos_token"))
        add_bos = bool(cfg.get("add_bos_token", False))
        if tok.post_processor is not None:
            bos, add_bos = _post_processor_bos(tok, bos, folder)
        return cls(
            tok,
            bos_id=bos,
            eos_id=eos,
            chat_template=template,
            add_bos=add_bos,
            extra_stop_ids=[int(i) for i in eos_list if int(i) != eos],
        )

    @classmethod
    def bytes_only(cls) -> Tokenizer:
        """256 byte tokens plus ChatML specials (ids 256..258): for models with random weights."""
        alphabet = pre_tokenizers.ByteLevel.alphabet()
        byte_chars = sorted(alphabet, key=lambda c: _byte_of(c))
        vocab = {c: i for i, c in enumerate(byte_chars)}
        tok = HFTokenizer(models.BPE(vocab, [], fuse_unk=False))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens(
            [AddedToken(s, special=True, normalized=False) for s in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")]
        )
        return cls(tok, bos_id=None, eos_id=258, chat_template=CHATML_TEMPLATE)

    # -- use ------------------------------------------------------------------------------------

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Token ids of `text`. Special-token strings in the text (e.g. "<|im_start|>") map to their ids."""
        if self._missing_bytes and not self.representable(text):
            bad = sorted({f"{b:#04x}" for b in text.encode("utf-8", "surrogatepass") if b in self._missing_bytes})
            raise UnrepresentableText(f"text contains bytes this model's vocabulary cannot encode: {', '.join(bad)}")
        if len(text) > RELEASE_GIL_CHARS:  # the same encoding; the GIL released while it runs (see RELEASE_GIL_CHARS)
            ids: list[int] = self._tok.encode_batch([text], add_special_tokens=False)[0].ids
        else:
            ids = self._tok.encode(text, add_special_tokens=False).ids
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            ids = [self.bos_id, *ids]
        return ids

    def boundary_tail(self, tokens: Sequence[int]) -> list[int]:
        """The last tokens of a sequence that a text appended to it is tokenized with (`encode_after`): back to
        BOUNDARY_BYTES bytes or BOUNDARY_TOKENS tokens, then on to a token that starts a piece of the pre-tokenizer's
        (a space before a character that is not one: a word, or punctuation, with its space, in GPT-2's, Llama 3's and
        Qwen's patterns) within BOUNDARY_TOKENS more, else to one that does not start inside a UTF-8 character; never
        past a special token (tokenizers split special tokens out first: nothing merges across one)."""
        table = self.token_bytes
        if table is None:
            return list(tokens[max(0, len(tokens) - BOUNDARY_TOKENS):])

        def starts_piece(token: int) -> bool:
            data = table[token] if 0 <= token < len(table) else b""
            return len(data) > 1 and data[0] == 0x20 and data[1] not in b" \t\r\n\v\f"

        def inside_character(token: int) -> bool:
            data = table[token] if 0 <= token < len(table) else b""
            return bool(data) and data[0] & 0xC0 == 0x80

        start, size = len(tokens), 0
        furthest = len(tokens) - 2 * BOUNDARY_TOKENS
        while start > 0 and tokens[start - 1] not in self.special_ids:
            if size >= BOUNDARY_BYTES or len(tokens) - start >= BOUNDARY_TOKENS:
                if starts_piece(tokens[start]) or (start <= furthest and not inside_character(tokens[start])):
                    break
            start -= 1
            size += len(table[tokens[start]]) if 0 <= tokens[start] < len(table) else 1
        return list(tokens[start:])

    def encode_after(self, tail: Sequence[int], text: str) -> list[int] | None:
        """The ids `text` adds after a sequence ending in `tail` (its `boundary_tail`), as a tokenization of the two
        together makes them, or None where that tokenization does not keep the tail's own tokens: the tokenizer merges
        across the boundary ("Par" then "is": one token "Paris"), and no ids appended after the tail's give the whole
        text's tokens. Tokenization is local (the pre-tokenizer splits text into pieces, words, numbers, punctuation,
        spaces, and no token crosses two), so a tail that starts a piece stands for the whole sequence. No BOS."""
        if not tail:
            return self.encode(text, add_bos=False)
        if self.token_bytes is not None:
            try:
                before = b"".join(self.token_bytes[t] for t in tail).decode("utf-8")
            except (IndexError, UnicodeDecodeError):  # it ends inside a character: the text would complete it
                return None
        else:
            before = self.decode(tail)
        both = self.encode(before + text, add_bos=False)
        return both[len(tail):] if both[:len(tail)] == list(tail) else None

    def min_tokens(self, text: str) -> int:
        """A lower bound on the tokens `encode(text)` makes, found without encoding it (0 where none is known): each
        token covers at most `max_token_bytes` bytes, and a character is at least one byte."""
        if not self.max_token_bytes:
            return 0
        return -(-len(text) // self.max_token_bytes)

    def representable(self, text: str) -> bool:
        """Whether every byte of the text's UTF-8 has a token (always true for complete byte vocabularies)."""
        raw = text.encode("utf-8", "surrogatepass")
        return not self._missing_bytes or len(raw.translate(None, self._missing_bytes)) == len(raw)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def token_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def apply_chat_template(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        variables: Mapping[str, Any] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> Any:
        """Render the model's chat template; with tokenize=True return the token ids instead. `variables`: more for
        the template (as transformers' apply_chat_template keyword arguments: Qwen3's enable_thinking), never one of
        those it sets itself (TEMPLATE_OWN) nor jinja's globals. `tools`: the functions the model may call (OpenAI's
        tools list), as transformers passes them; a message may carry `tool_calls` (OpenAI's, each function's
        arguments a map) and `tool_call_id`, as transformers takes them."""
        taken = sorted(self._own_names.intersection(variables or ()))
        if taken:
            raise ChatTemplateError(f"{', '.join(taken)}: the template's own (set by the server or jinja), not a template "
                                    "argument")
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ChatTemplateError("each message must be a dict with string 'role' and 'content'")
        # As transformers passes them: a special token the model lacks is left undefined, not "".
        specials = {name: token for name, i in (("bos_token", self.bos_id), ("eos_token", self.eos_id))
                    if i is not None and (token := self.token(i)) is not None}
        try:
            text = self._template.render(**(variables or {}), messages=list(messages),
                                         tools=None if tools is None else list(tools), documents=None,
                                         add_generation_prompt=add_generation_prompt, **specials)
        except ChatTemplateError:
            raise  # the template's raise_exception
        except Exception as e:  # any other failure of the template on these inputs (a TypeError, ...): the request's
            raise ChatTemplateError(f"chat template failed: {type(e).__name__}: {e}") from e
        return self.encode(text, add_bos=False) if tokenize else text

    def chat_continuation(self, tokens: Sequence[int], turns: Sequence[dict[str, str]],
                          variables: Mapping[str, Any] | None = None) -> str | None:
        """The text that these turns and the next assistant prompt add to a conversation whose tokens are `tokens`,
        which end with an answer generated after the template's assistant prompt (and its stop token, or none where it
        was cut short: then the EOS goes first). So that the tokens stay those of the whole conversation, the template
        must render that answer as the tokens hold it, right after its assistant prompt and before the same stop
        token, once these turns follow it. None where it does not: it rewrites earlier answers (Llama 3 trims their
        spaces; Qwen3 drops the reasoning of those before the last user turn; Qwen3.5's assistant prompt opens a
        <think> that no earlier answer shows), and only rendering the whole conversation gives its text. Turns before
        the answer are stood for by one user turn, with and without a system message before it (Mistral's template
        moves the system message to the last user turn: the continuation must not depend on them); tokens holding no
        assistant prompt (a text appended by hand) go on as after a plain answer."""
        found: set[str] = set()
        for asked in ([{"role": "user", "content": "u"}],
                      [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]):
            try:
                text = self._continuation_after(asked, tokens, turns, variables)
            except ChatTemplateError:
                if asked[0]["role"] == "system":  # a template without system messages
                    continue
                raise
            if text is None:
                return None
            found.add(text)
        return found.pop() if len(found) == 1 else None

    def _continuation_after(self, asked: list[dict[str, str]], tokens: Sequence[int], turns: Sequence[dict[str, str]],
                            variables: Mapping[str, Any] | None) -> str | None:
        """chat_continuation with the turns before the answer stood for by `asked`."""
        prompt = self.apply_chat_template(asked, add_generation_prompt=True, variables=variables)
        before = self.apply_chat_template(asked, add_generation_prompt=False, variables=variables)
        header = self.encode(prompt[len(before):], add_bos=False) if prompt.startswith(before) else []
        start = _last_index(tokens, header)
        closed = bool(tokens) and tokens[-1] in self.stop_ids
        stop = self.decode([tokens[-1] if closed else self.eos_id])
        answer = "." if start is None else self.decode(tokens[start + len(header):len(tokens) - closed])
        held = prompt + answer + stop
        whole = self.apply_chat_template([*asked, {"role": "assistant", "content": answer}, *turns], variables=variables)
        if not whole.startswith(held):
            return None
        return ("" if closed else stop) + whole[len(held):]

    def answer_prompt_tail(self, variables: Mapping[str, Any] | None = None) -> str:
        """The end of the assistant prompt that the template leaves out where it renders that turn's answer as an
        earlier one (Qwen3.5's and Qwen3-Thinking's "<think>\n", which no earlier answer shows); "" where an earlier
        answer follows the assistant prompt as the prompt ends."""
        asked = [{"role": "user", "content": "u"}]
        prompt = self.apply_chat_template(asked, add_generation_prompt=True, variables=variables)
        later = self.apply_chat_template([*asked, {"role": "assistant", "content": "\x00"},
                                          {"role": "user", "content": "v"}], variables=variables)
        same = 0
        for a, b in zip(prompt, later, strict=False):
            if a != b:
                break
            same += 1
        return prompt[same:]

    def chat_after_answer(self, tokens: Sequence[int], turns: Sequence[dict[str, str]],
                          variables: Mapping[str, Any] | None = None) -> str:
        """The text that these turns and the next assistant prompt add after a conversation's last answer, the answer
        kept as the tokens hold it: `chat_continuation` where the template keeps it so, else what the template puts
        after an answer's stop token (the stop first where the answer was cut short). Where the template renders earlier
        answers otherwise (Qwen3's reasoning), the session then holds other tokens than the whole conversation: its
        answers as the model gave them."""
        exact = self.chat_continuation(tokens, turns, variables)
        if exact is not None:
            return exact
        asked = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "\x00"}]
        whole = self.apply_chat_template([*asked, *turns], variables=variables)
        if whole.count("\x00") != 1:
            raise ChatTemplateError("the model's chat template does not render an earlier answer as it is: turns "
                                    "cannot follow a session's answer")
        after = whole[whole.index("\x00") + 1:].lstrip(" \t\r\n")  # (the spaces a trimming template kept)
        closed = bool(tokens) and tokens[-1] in self.stop_ids
        ends = sorted((text for i in self.stop_ids if (text := self.token(i))), key=len, reverse=True)
        end = next((text for text in ends if after.startswith(text)), None)
        if end is None:
            raise ChatTemplateError("the model's chat template does not end an answer with a stop token: turns cannot "
                                    "follow a session's answer")
        return after[len(end):] if closed else after


def _post_processor_bos(tok: HFTokenizer, bos: int | None, folder: Path) -> tuple[int | None, bool]:
    """(the BOS id, whether a text prompt starts with it) as tokenizer.json's post-processor says: it is what
    transformers follows when it tokenizes a text (Llama 3 adds <|begin_of_text|> there, and its tokenizer_config.json
    has no add_bos_token; a folder transformers writes keeps the choice only there). A post-processor that adds
    anything else (a token after the text, several before it) is refused: those prompts would be other tokens."""
    probe = "a"
    plain = tok.encode(probe, add_special_tokens=False).ids
    full = tok.encode(probe, add_special_tokens=True).ids
    start = next((i for i in range(len(full) - len(plain) + 1) if full[i:i + len(plain)] == plain), None)
    if start is None or full[start + len(plain):] or start > 1:
        raise ValueError(f"{folder}: tokenizer.json's post-processor turns {plain} into {full}; only a BOS token "
                         "before a text is supported")
    if start == 0:
        return bos, False
    if bos is not None and full[0] != bos:
        raise ValueError(f"{folder}: tokenizer.json's post-processor starts a text with token {full[0]}, "
                         f"tokenizer_config.json's bos_token is {bos}")
    return full[0], True


def _raise_template_error(message: str) -> None:
    raise ChatTemplateError(message)


def _last_index(tokens: Sequence[int], part: Sequence[int]) -> int | None:
    """Where the last occurrence of `part` (not empty) starts in `tokens`, or None."""
    n = len(part)
    for i in range(len(tokens) - n, -1, -1) if n else ():
        if tokens[i] == part[0] and list(tokens[i:i + n]) == list(part):
            return i
    return None


def _strftime_now(fmt: str) -> str:
    """The local date and time in `fmt`, as transformers gives templates (Llama 3.2's "Today Date")."""
    return datetime.now().strftime(fmt)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """transformers' `tojson` filter: json.dumps with its arguments, no HTML escaping (jinja's own escapes <, >, &)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: transformers' mark of the assistant's tokens (for training masks),
    which templates saved for fine-tuning carry. Rendered as its body, as transformers renders it."""

    tags = {"generation"}

    def parse(self, parser: Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Macro) -> str:
        return str(caller())


def _byte_level_table(tok: HFTokenizer) -> list[bytes]:
    """bytes of every id of a byte-level BPE vocabulary; special tokens map to b"" (they are skipped)."""
    size = tok.get_vocab_size(with_added_tokens=True)
    table = [b""] * size
    added = tok.get_added_tokens_decoder()
    byte_of = {c: _byte_of(c) for c in pre_tokenizers.ByteLevel.alphabet()}
    for token, i in tok.get_vocab(with_added_tokens=True).items():
        if i in added:
            table[i] = b"" if added[i].special else token.encode("utf-8")
        else:
            table[i] = bytes(byte_of[c] for c in token if c in byte_of)
    return table


def _byte_of(char: str) -> int:
    """The byte a ByteLevel alphabet character stands for (GPT-2's bytes_to_unicode, inverted)."""
    code = ord(char)
    if 33 <= code <= 126 or 161 <= code <= 172 or 174 <= code <= 255:
        return code
    # The other 68 bytes are shifted to 256.. in increasing order of byte value.
    others = [b for b in range(256) if not (33 <= b <= 126 or 161 <= b <= 172 or 174 <= b <= 255)]
    return others[code - 256]

