"""Tokenizers for Kimi checkpoints.

Two on-disk forms are read:

* Kimi's own form: ``tiktoken.model`` (BPE ranks, one ``base64(token) rank`` per line) plus
  ``tokenizer_config.json`` (special tokens in ``added_tokens_decoder``, bos/eos/pad names, chat template).
  Encoding runs through ``tiktoken`` with Kimi's split pattern (``KIMI_PAT_STR``).
* The Hugging Face form: ``tokenizer.json`` read by the ``tokenizers`` library, with
  ``tokenizer_config.json`` for special-token names and the chat template when present.

Both give the same ``Tokenizer`` interface. ``IncrementalDetokenizer`` turns a stream of generated ids
into text deltas, and ``write_demo_tokenizer`` writes a small Kimi-form tokenizer for tests and demo
checkpoints (no network: its BPE merges are learned from a built-in text).
"""

from __future__ import annotations

import base64
import codecs
import heapq
import json
import re
from abc import ABC, abstractmethod
from collections import Counter, defaultdict
from datetime import datetime
from pathlib import Path
from typing import Any, Iterable, Sequence

from kestrel.errors import CheckpointError, RequestError

# Kimi's pre-tokenization pattern. Han runs are their own pieces; other letters follow a cased-word rule
# (the `&&[^\p{Han}]` class intersections keep Han out of them); digits group by at most three.
# tiktoken compiles this with fancy-regex (classes delegated to the Rust regex crate), which accepts the
# `&&` intersection syntax as is and treats it as intersection, not as literal '&' characters:
# tests/test_tokenizer.py checks that "a中" splits into "a" | "中" and that "&&" stays punctuation.
KIMI_PAT_STR = "|".join(
    [
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)

# Kimi keeps a block of 256 ids after the BPE ranks for special tokens; ids in it that the config does
# not name are still valid ids (the embedding has rows for them), named like Kimi names them.
NUM_RESERVED_SPECIAL_TOKENS = 256

TIKTOKEN_FILE = "tiktoken.model"
HF_TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"
GENERATION_CONFIG_FILE = "generation_config.json"

# Names the renderer passes to every chat template itself; a caller's template arguments may not replace them.
TEMPLATE_OWN_ARGUMENTS = frozenset(
    {"messages", "add_generation_prompt", "bos_token", "eos_token", "raise_exception", "strftime_now"}
)


def _reserved_name(token_id: int) -> str:
    return f"<|reserved_token_{token_id}|>"


# ---------------------------------------------------------------------------------------------------
# Chat templates


def _raise_exception(message: str) -> None:
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False, sort_keys: bool = False) -> str:
    # Jinja's built-in tojson HTML-escapes '<', '>', '&' and "'", which would change what the model sees
    # in tool schemas; chat templates are written against a plain json.dumps.
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _compile_chat_template(source: str, origin: str):
    from jinja2 import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    # A chat template comes with a downloaded checkpoint, so it runs sandboxed. trim_blocks/lstrip_blocks
    # are what template authors test against (the transformers convention).
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.filters["tojson"] = _tojson
    try:
        return env.from_string(source)
    except TemplateError as e:
        raise CheckpointError(f"chat template in {origin} does not compile ({e}); fix or remove it") from None


# ---------------------------------------------------------------------------------------------------
# Tokenizer


class Tokenizer(ABC):
    """Text <-> token ids, special tokens and the chat template of one checkpoint.

    Use ``load_tokenizer``; the subclasses differ only in the encoding backend.
    """

    def __init__(
        self,
        *,
        model_dir: Path,
        vocab_size: int,
        special_tokens: dict[str, int],
        bos_token: str | None,
        eos_token: str | None,
        pad_token: str | None,
        chat_template: str | None,
        template_origin: str,
        extra_eos_ids: Iterable[int] = (),
    ) -> None:
        self.model_dir = model_dir
        self._vocab_size = vocab_size
        self._special_tokens = dict(special_tokens)
        self._special_ids = frozenset(special_tokens.values())
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.pad_token = pad_token
        self.bos_token_id = self._named_special(bos_token, "bos_token")
        self.eos_token_id = self._named_special(eos_token, "eos_token")
        self.pad_token_id = self._named_special(pad_token, "pad_token")
        self.chat_template = chat_template
        self._markup: tuple | None = None  # _MarkupGuard's tables, built on first use
        self._template = _compile_chat_template(chat_template, template_origin) if chat_template else None

        eos = set(extra_eos_ids)
        if self.eos_token_id is not None:
            eos.add(self.eos_token_id)
        eos.update(self._turn_end_ids())
        self.eos_token_ids: frozenset[int] = frozenset(eos)

    # -- backend hooks ------------------------------------------------------------------------------

    @abstractmethod
    def _encode(self, text: str, allow_special: bool) -> list[int]:
        ...

    @abstractmethod
    def _decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        ...

    @abstractmethod
    def _token_to_id(self, token: str) -> int | None:
        ...

    @abstractmethod
    def id_to_piece(self, token_id: int) -> bytes:
        """The raw bytes of one token (a special token's text for special ids); may be part of a character."""

    #: True when ``decode(ids) == b"".join(id_to_piece(i) ...).decode("utf-8", "replace")`` (skipping
    #: special ids when asked), which lets ``IncrementalDetokenizer`` work on bytes alone.
    pieces_are_exact: bool = True

    # -- public API ---------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Number of ids, special and reserved ids included (the embedding table's minimum row count)."""
        return self._vocab_size

    @property
    def special_ids(self) -> frozenset[int]:
        return self._special_ids

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids

    def token_to_id(self, token: str) -> int | None:
        """Id of a special token or of a whole vocabulary entry, else None."""
        if token in self._special_tokens:
            return self._special_tokens[token]
        return self._token_to_id(token)

    def encode(self, text: str, add_bos: bool = False, allow_special: bool = False) -> list[int]:
        """Token ids of ``text``.

        Special-token text (``<|im_end|>``) inside ``text`` is encoded as ordinary text unless
        ``allow_special``: user input must not be able to forge turn boundaries. Set it only for text the
        engine itself produced, such as a rendered chat template.
        """
        ids = self._encode(text, allow_special)
        if add_bos and self.bos_token_id is not None:
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._decode(list(ids), skip_special_tokens)

    def apply_chat_template(
        self, messages: list[dict], /, add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render ``messages`` with the checkpoint's chat template; extra keyword arguments (``tools``, ...)
        are passed to the template. The text is for display: to get token ids use ``encode_chat``, which keeps
        the caller's strings from becoming special tokens (``encode(text, allow_special=True)`` would not)."""
        if self._template is None:
            raise CheckpointError(
                f"{self.model_dir} has no chat template (looked for {TEMPLATE_FILE} and 'chat_template' in "
                f"{CONFIG_FILE}); add one or send a plain completion prompt"
            )
        clash = sorted(set(kwargs) & TEMPLATE_OWN_ARGUMENTS)
        if clash:
            raise RequestError(
                f"chat template argument `{clash[0]}` is set by Kestrel itself and cannot be passed in; "
                f"drop it (arguments the template may not override: {', '.join(sorted(TEMPLATE_OWN_ARGUMENTS))})"
            )
        from jinja2.exceptions import TemplateError

        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                **kwargs,
            )
        except TemplateError as e:
            raise RequestError(f"the chat template rejected the messages: {e}") from None
        except RecursionError:
            raise RequestError("the chat template recursed too deeply on these messages; nest them less") from None
        except Exception as e:  # template code failing on the request's data (a wrong type, a missing key)
            raise RequestError(f"the chat template failed on these messages ({type(e).__name__}: {e}); "
                               "check the messages' fields") from None

    def encode_chat(
        self, messages: list[dict], /, add_generation_prompt: bool = True, **kwargs: Any
    ) -> list[int]:
        """Token ids of ``messages`` rendered by the chat template, where only the template's own markup becomes
        special tokens: every string the caller passes (message contents, names, tool arguments, template
        arguments) is encoded as plain text, also where it spells a special token such as ``<|im_end|>``.

        Each run of special-token text inside a caller's string is swapped for an opaque marker before rendering
        (so the template cannot see it as markup), and swapped back as plain text afterwards. Strings with no
        such text reach the template unchanged, so its comparisons and filters behave as usual.
        """
        guard = _MarkupGuard(self)
        clean_messages = guard.sanitize(messages)
        clean_kwargs = guard.sanitize(kwargs)
        text = self.apply_chat_template(clean_messages, add_generation_prompt, **clean_kwargs)
        if not guard.markers:
            return self.encode(text, allow_special=True)
        return guard.encode(text)

    # -- helpers ------------------------------------------------------------------------------------

    def _known(self, ids: list[int]) -> list[int]:
        """``ids`` without those at or past the vocabulary size. Models pad their embedding past the tokenizer
        (a multiple of 64 or 128 rows), so a sampled id may have no piece: it decodes as no text."""
        if any(i >= self._vocab_size for i in ids):
            return [i for i in ids if i < self._vocab_size]
        return ids

    def _markup_tables(self) -> tuple:
        """(pattern of special-token text or a marker character, pattern of markers or special-token text,
        proper prefixes of special tokens, proper suffixes of special tokens), for ``_MarkupGuard``."""
        if self._markup is None:
            names = sorted(self._special_tokens, key=len, reverse=True)  # longest first, as the encoders match
            specials = "|".join(map(re.escape, names))
            self._markup = (
                re.compile(f"{specials}|{_MARK_OPEN}" if names else _MARK_OPEN),
                re.compile(f"{_MARKER.pattern}|{specials}" if names else _MARKER.pattern),
                frozenset(n[:i] for n in names for i in range(1, len(n))),
                frozenset(n[i:] for n in names for i in range(1, len(n))),
            )
        return self._markup

    def _named_special(self, name: str | None, field: str) -> int | None:
        if name is None:
            return None
        token_id = self.token_to_id(name)
        if token_id is None:
            raise CheckpointError(
                f"{field} {name!r} in {self.model_dir / CONFIG_FILE} is not a token of the vocabulary; "
                f"fix {field} or add the token to added_tokens_decoder"
            )
        return token_id

    def _turn_end_ids(self) -> set[int]:
        # A chat model stops at the token that closes an assistant turn, which is often not the config's
        # eos (Kimi: eos is [EOS], turns end with <|im_end|>). Render a short conversation and take the
        # special token the text ends with; a template that refuses this probe just contributes nothing.
        if self._template is None:
            return set()
        probes = (
            [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
            [{"role": "user", "content": "hi"}],
        )
        for messages in probes:
            try:
                text = self.apply_chat_template(messages, add_generation_prompt=False).rstrip()
            except Exception:
                continue
            ends = [s for s in self._special_tokens if text.endswith(s)]
            if ends:
                return {self._special_tokens[max(ends, key=len)]}
            return set()
        return set()

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({str(self.model_dir)!r}, vocab_size={self.vocab_size}, "
            f"bos={self.bos_token_id}, eos={sorted(self.eos_token_ids)})"
        )


# Markers stand for special-token text from a caller while the chat template renders: private-use characters, which
# have no case, are not whitespace, and pass through json.dumps, so the template's filters leave them alone.
_MARK_OPEN, _MARK_CLOSE = "\ue000", "\ue001"
_MARKER = re.compile(f"{_MARK_OPEN}([0-9]+){_MARK_CLOSE}")


class _MarkupGuard:
    """One ``encode_chat`` call: swaps the special-token text in a caller's strings for markers, then encodes the
    rendered template with its own special tokens as ids and the markers' text as plain text.

    Marked in each string: every occurrence of a special token's text (and of the marker character), a head
    that is a proper suffix of a special token and a tail that is a proper prefix of one (so the template's
    neighbouring text cannot complete a special token across the string's edge). Plain text runs between the
    template's special tokens are encoded whole, so a caller's text gets the same ids as ``encode(text)``.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.find, self.parse, self.prefixes, self.suffixes = tokenizer._markup_tables()
        self.longest = max((len(t) for t in tokenizer._special_tokens), default=0)
        self.markers: list[str] = []  # the text marker i stands for

    def sanitize(self, value: Any) -> Any:
        if isinstance(value, str):
            return self._string(value)
        if isinstance(value, dict):
            return {self.sanitize(k): self.sanitize(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self.sanitize(v) for v in value]
        return value

    def _string(self, s: str) -> str:
        spans = [m.span() for m in self.find.finditer(s)]
        edge = min(len(s), self.longest - 1)
        head = next((n for n in range(edge, 0, -1) if s[:n] in self.suffixes), 0)
        tail = next((n for n in range(edge, 0, -1) if s[-n:] in self.prefixes), 0)
        if head:
            spans.append((0, head))
        if tail:
            spans.append((len(s) - tail, len(s)))
        if not spans:
            return s
        out, pos = [], 0
        for a, b in _merged(spans):
            out.append(s[pos:a])
            out.append(f"{_MARK_OPEN}{len(self.markers)}{_MARK_CLOSE}")
            self.markers.append(s[a:b])
            pos = b
        out.append(s[pos:])
        return "".join(out)

    def encode(self, rendered: str) -> list[int]:
        tok = self.tokenizer
        ids: list[int] = []
        plain: list[str] = []
        pos = 0

        def flush_plain(upto: int) -> None:
            text = rendered[pos:upto]
            if _MARK_OPEN in text or _MARK_CLOSE in text:
                raise RequestError(
                    "the chat template cut into message text that spells a special token, so it cannot be "
                    "encoded as plain text; remove the special-token text from the request"
                )
            plain.append(text)

        for m in self.parse.finditer(rendered):
            flush_plain(m.start())
            pos = m.end()
            if m.group(1) is not None:
                index = int(m.group(1))
                if index >= len(self.markers):
                    raise RequestError("the chat template produced text that was not in the request; "
                                       "remove the special-token text from the request")
                plain.append(self.markers[index])
                continue
            if plain:
                ids.extend(tok.encode("".join(plain)))
                plain.clear()
            ids.append(tok._special_tokens[m.group(0)])
        flush_plain(len(rendered))
        if plain:
            ids.extend(tok.encode("".join(plain)))
        return ids


def _merged(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[list[int]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


class TiktokenTokenizer(Tokenizer):
    """Kimi's form: tiktoken BPE ranks plus special tokens numbered after them."""

    def __init__(self, *, ranks: dict[bytes, int], special_tokens: dict[str, int], **kwargs: Any) -> None:
        import tiktoken

        self._enc = tiktoken.Encoding(
            name=f"kestrel:{kwargs['model_dir']}",
            pat_str=KIMI_PAT_STR,
            mergeable_ranks=ranks,
            special_tokens=special_tokens,
        )
        self._ranks = ranks
        super().__init__(special_tokens=special_tokens, **kwargs)

    # Kimi's tokenizer encodes long inputs in blocks of 400k characters, and cuts runs of more than 25k
    # whitespace or non-whitespace characters every 25k (tiktoken's BPE is slow on very long pieces).
    # Cutting at the same places keeps our ids identical to Kimi's on such inputs too.
    _BLOCK_CHARS = 400_000
    _MAX_RUN_CHARS = 25_000
    _RUN = re.compile(r"\s+|\S+")

    def _encode(self, text: str, allow_special: bool) -> list[int]:
        if allow_special:
            kwargs: dict[str, Any] = {"allowed_special": "all"}
        else:
            kwargs = {"allowed_special": set(), "disallowed_special": ()}
        if len(text) <= self._MAX_RUN_CHARS:
            return self._enc.encode(text, **kwargs)
        ids: list[int] = []
        for chunk in self._chunks(text):
            ids.extend(self._enc.encode(chunk, **kwargs))
        return ids

    def _chunks(self, text: str) -> Iterable[str]:
        for b in range(0, len(text), self._BLOCK_CHARS):
            block = text[b:b + self._BLOCK_CHARS]
            start = 0
            for run in self._RUN.finditer(block):
                for cut in range(run.start() + self._MAX_RUN_CHARS, run.end(), self._MAX_RUN_CHARS):
                    yield block[start:cut]
                    start = cut
            yield block[start:]

    def _decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        ids = self._known(ids)
        if skip_special_tokens:
            ids = [i for i in ids if i not in self._special_ids]
        try:
            data = self._enc.decode_bytes(ids)
        except (KeyError, OverflowError):
            bad = next(i for i in ids if not 0 <= i < self._vocab_size)
            raise ValueError(f"token id {bad} is not a token id (the vocabulary has {self._vocab_size})") from None
        return data.decode("utf-8", errors="replace")

    def _token_to_id(self, token: str) -> int | None:
        return self._ranks.get(token.encode("utf-8"))

    def id_to_piece(self, token_id: int) -> bytes:
        if token_id >= self._vocab_size:
            return b""  # a padded embedding row (see Tokenizer._known)
        try:
            return self._enc.decode_single_token_bytes(token_id)
        except (KeyError, OverflowError):
            raise ValueError(f"token id {token_id} is not a token id (the vocabulary has {self._vocab_size})") from None


# GPT-2's byte-level alphabet, used by byte-level tokenizer.json files: printable bytes stand for
# themselves, the rest are shifted to code points from 256 up, in byte order.
def _byte_level_alphabet() -> dict[str, int]:
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    char_to_byte = {chr(b): b for b in printable}
    shift = 0
    for b in range(256):
        if b not in printable:
            char_to_byte[chr(256 + shift)] = b
            shift += 1
    return char_to_byte


_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class HFTokenizer(Tokenizer):
    """The ``tokenizer.json`` form, through the ``tokenizers`` library."""

    def __init__(self, *, tokenizer_json: str, **kwargs: Any) -> None:
        from tokenizers import Tokenizer as _HF

        spec = json.loads(tokenizer_json)
        # Two instances rather than flipping encode_special_tokens per call, so encode stays reentrant.
        self._hf_special = _HF.from_str(tokenizer_json)
        self._hf_plain = _HF.from_str(tokenizer_json)
        self._hf_plain.encode_special_tokens = True

        added = self._hf_special.get_added_tokens_decoder()
        special_tokens = {t.content: i for i, t in added.items() if t.special}
        self._added_content = {i: t.content for i, t in added.items()}
        vocab_size = max([self._hf_special.get_vocab_size(with_added_tokens=True), *(i + 1 for i in added)])

        self._byte_level = _uses_byte_level(spec.get("decoder"))
        self.pieces_are_exact = self._byte_level
        self._char_to_byte = _byte_level_alphabet() if self._byte_level else {}
        self._pieces: dict[int, bytes] = {}
        super().__init__(vocab_size=vocab_size, special_tokens=special_tokens, **kwargs)

    def _encode(self, text: str, allow_special: bool) -> list[int]:
        hf = self._hf_special if allow_special else self._hf_plain
        # BOS is ours to add (encode's add_bos); the file's post-processor must not add it a second time.
        return hf.encode(text, add_special_tokens=False).ids

    def _decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        return self._hf_special.decode(self._known(ids), skip_special_tokens=skip_special_tokens)

    def _token_to_id(self, token: str) -> int | None:
        return self._hf_special.token_to_id(token)

    def id_to_piece(self, token_id: int) -> bytes:
        piece = self._pieces.get(token_id)
        if piece is not None:
            return piece
        if token_id >= self._vocab_size:
            return b""  # a padded embedding row (see Tokenizer._known)
        if token_id in self._added_content:
            piece = self._added_content[token_id].encode("utf-8")
        else:
            token = self._hf_special.id_to_token(token_id)
            if token is None:
                if token_id >= 0:
                    return b""  # a hole in the vocabulary: no text, like a padded row
                raise ValueError(f"token id {token_id} is not a token id (the vocabulary has {self._vocab_size})")
            if self._byte_level:
                piece = bytes(self._char_to_byte[c] for c in token)
            elif m := _BYTE_FALLBACK.fullmatch(token):
                piece = bytes([int(m.group(1), 16)])
            else:
                piece = token.replace("\u2581", " ").encode("utf-8")  # sentencepiece's word marker
        self._pieces[token_id] = piece
        return piece


def _uses_byte_level(decoder: dict | None) -> bool:
    if not decoder:
        return False
    if decoder.get("type") == "ByteLevel":
        return True
    if decoder.get("type") == "Sequence":
        return any(_uses_byte_level(d) for d in decoder.get("decoders", []))
    return False


# ---------------------------------------------------------------------------------------------------
# Loading


def load_tokenizer(model_dir: str) -> Tokenizer:
    """The tokenizer of the checkpoint in ``model_dir`` (Kimi's tiktoken form first, then tokenizer.json)."""
    d = Path(model_dir)
    if not d.is_dir():
        raise CheckpointError(f"tokenizer directory {d} does not exist; pass the checkpoint directory")
    if (d / TIKTOKEN_FILE).is_file():
        return _load_tiktoken(d)
    if (d / HF_TOKENIZER_FILE).is_file():
        return _load_hf(d)
    raise CheckpointError(
        f"no tokenizer in {d}: looked for {TIKTOKEN_FILE} (with {CONFIG_FILE}) and {HF_TOKENIZER_FILE}; "
        f"copy the checkpoint's tokenizer files there"
    )


def _read_json(path: Path) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read {path} ({e}); restore it from the original checkpoint") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} is not a JSON object; restore it from the original checkpoint")
    return data


def _token_name(value: Any) -> str | None:
    # transformers writes these either as plain strings or as serialized AddedToken objects.
    if isinstance(value, dict):
        return value.get("content")
    return value


def _read_chat_template(d: Path, config: dict) -> tuple[str | None, str]:
    # A separate chat_template.jinja is what newer checkpoints write and wins over the config field.
    if (d / TEMPLATE_FILE).is_file():
        return (d / TEMPLATE_FILE).read_text(encoding="utf-8"), str(d / TEMPLATE_FILE)
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return template, str(d / CONFIG_FILE)


def _generation_eos_ids(d: Path) -> list[int]:
    path = d / GENERATION_CONFIG_FILE
    if not path.is_file():
        return []
    eos = _read_json(path).get("eos_token_id")
    if eos is None:
        return []
    return [eos] if isinstance(eos, int) else [int(i) for i in eos]


def _read_ranks(path: Path) -> dict[bytes, int]:
    ranks: dict[bytes, int] = {}
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                token, rank = line.split()
                ranks[base64.b64decode(token, validate=True)] = int(rank)
            except ValueError:
                raise CheckpointError(
                    f"{path} line {lineno} is not 'base64token rank'; restore the file from the checkpoint"
                ) from None
    if not ranks:
        raise CheckpointError(f"{path} is empty; restore the file from the checkpoint")
    return ranks


def _load_tiktoken(d: Path) -> Tokenizer:
    if not (d / CONFIG_FILE).is_file():
        raise CheckpointError(
            f"{d} has {TIKTOKEN_FILE} but no {CONFIG_FILE} (special tokens, eos); copy it from the checkpoint"
        )
    ranks = _read_ranks(d / TIKTOKEN_FILE)
    config = _read_json(d / CONFIG_FILE)
    # Ranks are normally 0..n-1; numbering the specials after the largest rank also covers gaps.
    num_base = max(ranks.values()) + 1

    # Every added token lives in the special block (Kimi treats them all as control tokens).
    named: dict[int, str] = {}
    for key, entry in (config.get("added_tokens_decoder") or {}).items():
        content = _token_name(entry)
        if content is None or not key.lstrip("-").isdigit() or int(key) < num_base:
            raise CheckpointError(
                f"added_tokens_decoder entry {key!r} in {d / CONFIG_FILE} is not a special token numbered "
                f"after the {num_base} BPE ranks; fix the entry"
            )
        named[int(key)] = content
    top = max(named, default=num_base - 1)
    num_slots = max(NUM_RESERVED_SPECIAL_TOKENS, top - num_base + 1)
    special_tokens = {named.get(i, _reserved_name(i)): i for i in range(num_base, num_base + num_slots)}

    template, origin = _read_chat_template(d, config)
    return TiktokenTokenizer(
        model_dir=d,
        ranks=ranks,
        vocab_size=num_base + num_slots,
        special_tokens=special_tokens,
        bos_token=_token_name(config.get("bos_token")),
        eos_token=_token_name(config.get("eos_token")),
        pad_token=_token_name(config.get("pad_token")),
        chat_template=template,
        template_origin=origin,
        extra_eos_ids=_generation_eos_ids(d),
    )


def _load_hf(d: Path) -> Tokenizer:
    config = _read_json(d / CONFIG_FILE) if (d / CONFIG_FILE).is_file() else {}
    try:
        tokenizer_json = (d / HF_TOKENIZER_FILE).read_text(encoding="utf-8")
        template, origin = _read_chat_template(d, config)
        return HFTokenizer(
            model_dir=d,
            tokenizer_json=tokenizer_json,
            bos_token=_token_name(config.get("bos_token")),
            eos_token=_token_name(config.get("eos_token")),
            pad_token=_token_name(config.get("pad_token")),
            chat_template=template,
            template_origin=origin,
            extra_eos_ids=_generation_eos_ids(d),
        )
    except CheckpointError:
        raise
    except Exception as e:  # the tokenizers library reports a malformed file as a plain Exception
        raise CheckpointError(
            f"cannot read {d / HF_TOKENIZER_FILE} ({e}); restore it from the original checkpoint"
        ) from None


# ---------------------------------------------------------------------------------------------------
# Incremental detokenization


class IncrementalDetokenizer:
    """Turns generated ids into text deltas as they arrive.

    A token can end in the middle of a UTF-8 character (Chinese, emoji); those bytes are held back until
    the character is complete, so no delta ever contains half a character, and the concatenation of all
    deltas plus ``flush()`` equals ``tokenizer.decode(all_generated_ids, skip_special_tokens)``.

    Byte-level tokenizers (Kimi's tiktoken form, byte-level tokenizer.json) are decoded through Python's
    incremental UTF-8 decoder: each call costs O(new tokens). Other tokenizer.json files (sentencepiece
    style, whose decode strips or rewrites text) are decoded over a short window of recent tokens, with
    the prompt's last tokens as left context; their deltas match a full decode for ordinary text.
    """

    # Window mode: tokens of left context re-decoded with each call, and the most tokens it waits for a
    # character to complete before giving up and emitting replacement characters.
    _CONTEXT = 6
    _MAX_PENDING = 8

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] | None = None,
                 skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._bytes_mode = tokenizer.pieces_are_exact
        if self._bytes_mode:
            # Prompt ids do not matter here: a byte-level decode of the output does not depend on them.
            self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        else:
            # The ids list holds a few already-emitted tokens as left context, then the pending ones.
            self._ids: list[int] = list(prompt_ids or ())[-self._CONTEXT:]
            self._read = len(self._ids)  # ids before this index have been emitted (or are prompt)

    def add(self, token_ids: Sequence[int]) -> str:
        """Text finalized by these new ids (possibly empty)."""
        if self._bytes_mode:
            tok = self.tokenizer
            if self.skip_special_tokens:
                data = b"".join(tok.id_to_piece(i) for i in token_ids if not tok.is_special(i))
            else:
                data = b"".join(tok.id_to_piece(i) for i in token_ids)
            return self._utf8.decode(data)
        self._ids.extend(token_ids)
        return self._window_delta(final=False)

    def flush(self) -> str:
        """Whatever is still held back, completed with replacement characters; call once at the end."""
        if self._bytes_mode:
            return self._utf8.decode(b"", final=True)
        return self._window_delta(final=True)

    def _window_delta(self, final: bool) -> str:
        decode = self.tokenizer.decode
        done = decode(self._ids[:self._read], self.skip_special_tokens)
        text = decode(self._ids, self.skip_special_tokens)
        pending = len(self._ids) - self._read
        if not final and (pending == 0 or (text.endswith("\ufffd") and pending < self._MAX_PENDING)):
            return ""  # the last token may be the first part of a character
        delta = text[len(done):]
        del self._ids[:max(len(self._ids) - self._CONTEXT, 0)]
        self._read = len(self._ids)
        return delta


# ---------------------------------------------------------------------------------------------------
# Demo tokenizer

# Kimi's special tokens at their offsets after the BPE ranks, as in Kimi's tokenizer_config.json; the
# other slots of the 256 become <|reserved_token_{id}|>.
_DEMO_SPECIALS = {
    0: "[BOS]",
    1: "[EOS]",
    2: "<|im_end|>",
    3: "<|im_user|>",
    4: "<|im_assistant|>",
    6: "<|start_header_id|>",
    7: "<|end_header_id|>",
    9: "[EOT]",
    10: "<|im_system|>",
    # Kimi K2's tool-call and thinking control tokens, at the slots the K2 / Kimi Linear tokenizers give them
    11: "<|tool_calls_section_begin|>",
    12: "<|tool_calls_section_end|>",
    13: "<|tool_call_begin|>",
    14: "<|tool_call_argument_begin|>",
    15: "<|tool_call_end|>",
    17: "<|im_middle|>",
    22: "<think>",
    23: "</think>",
    254: "[UNK]",
    255: "[PAD]",
}
# The K3 variant (`write_demo_tokenizer(..., chat_format="kimi_k3")`): K3's four XTML control tokens where K3 has
# them; K3's chat encoding is code (no Jinja template) and its turns end with <|end_of_msg|>.
_DEMO_K3_SPECIALS = {**_DEMO_SPECIALS, 2: "<|end_of_msg|>", 3: "<|open|>", 4: "<|close|>", 5: "<|sep|>"}

# Kimi-style turns: <|im_{role}|>{role}<|im_middle|>{content}<|im_end|>. Roles other than system, user
# and assistant (tool results) are carried in a system-tagged turn under their own name, as Kimi does.
DEMO_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- set role = message['role'] -%}"
    "{%- set tag = role if role in ['system', 'user', 'assistant'] else 'system' -%}"
    "<|im_{{ tag }}|>{{ role }}<|im_middle|>"
    "{%- if message['content'] is string -%}{{ message['content'] }}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{{ part['text'] }}"
    "{%- else -%}{{ raise_exception('unsupported content part type: ' ~ part['type']) }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
)

# Training text for the demo BPE: a few kilobytes of plain English, so that merges look like real
# subwords (" the", "ing", " kestrel") and test prompts tokenize to plausible lengths.
_DEMO_TEXT = """\
The common kestrel is a small falcon of open country. It is best known for the way it hunts: it hangs
in the air facing into the wind, tail fanned and wings beating fast, while its head stays perfectly
still. From that fixed point it watches the grass below for voles, mice, beetles and grasshoppers.
When it sees movement it drops in short stages, pausing again and again, and finally falls onto the
prey with its feet. Country people once called it the windhover, a name that describes the habit well.

Kestrels are found across Europe, Asia and Africa, and a close relative, the American kestrel, lives
throughout the Americas. They like farmland, heath, moorland, coastal dunes and the wide verges of
roads, where the grass is long enough to hold small mammals but short enough to see into. Motorway
embankments are a favourite, and drivers often notice a kestrel hovering beside the traffic.

The male has a grey head and a grey tail with a black band near the tip, and a warm chestnut back
spotted with black. The female is larger and browner, barred all over, with a brown head. Both have
a dark stripe below the eye, like a tear, and long pointed wings. In flight the wings look narrow and
the tail looks long, which helps to tell a kestrel from a sparrowhawk, whose wings are broad and round.

A kestrel does not build a nest. It lays its eggs on a bare ledge, in a hole in a tree, in the old nest
of a crow, or in a box that people put up for it. Four to six eggs are laid in spring, and the female
sits on them for about a month while the male brings her food. The chicks are covered in white down at
first. They grow quickly and leave the nest after four or five weeks, but they stay close to their
parents for some time, learning to hunt by watching and by trying again and again.

Voles follow a cycle of good and bad years, and kestrels follow them. In a good vole year many pairs
raise large broods; in a poor year few chicks survive. Birds that hunt over farmland depend on rough
grass at the edges of fields, and where that grass has been ploughed or mown short the birds become
scarce. Careful management of field margins, hedges and road verges helps them, as do nest boxes.

Kestrels can see ultraviolet light. The urine trails that voles leave along their runways reflect
ultraviolet, so a hunting kestrel may be able to see where voles have been busy and search those
patches first. This may explain why they spend so much time hovering over some fields and so little
over others. Scientists have tested the idea with trained birds, and the results suggest it is true.

Other birds of prey share the same countryside. Buzzards soar in wide circles on broad wings and often
sit on fence posts. Barn owls hunt the same voles at dusk, gliding low and silent over the grass.
Peregrines are larger falcons that take pigeons and ducks in fast dives from great heights. Hobbies
chase dragonflies and swallows in summer. Merlins are the smallest falcons and hunt small birds over
open moor in winter. Each has its own shape, its own hunting method and its own place.

Watching a kestrel is easy and rewarding. Find a patch of rough grass, stand still, and look for a
small bird holding its place in the wind. Notice how the body moves with every gust while the head does
not move at all. Count how long it hovers before it drops, and whether it catches anything. Write down
the time, the weather and the place. Over a season such notes show where the birds hunt, when they
breed, and how they are doing from year to year. Records like these, gathered by many observers, are
how we know that kestrel numbers have fallen in some regions and recovered in others.

Questions people often ask: Why does the kestrel hover? Because it lets it search open ground without a
perch. How fast can it fly? In a dive it can pass sixty kilometres an hour. How long does it live?
Most die young, but a kestrel that survives its first winter may live five years or more, and the oldest
known wild bird was over fifteen. What does it eat in winter? Mostly voles and mice, with some small
birds, earthworms and insects when the ground is soft and the weather is mild.
"""


def _learn_byte_bpe(text: str, num_ranks: int) -> list[bytes]:
    """Tokens in rank order: the 256 single bytes, then merges learned from ``text`` until ``num_ranks``.

    Classic BPE over a table of distinct pre-tokenized words with their counts. Pair counts and the words
    each pair occurs in are kept up to date incrementally, and the most frequent pair comes from a heap
    with stale entries skipped, so one merge costs time proportional to the words it touches.
    """
    import regex  # tiktoken's own dependency; V1 mode understands the `&&` class intersections

    vocab = [bytes([b]) for b in range(256)]
    index = {tok: i for i, tok in enumerate(vocab)}

    word_counts = Counter(p.encode("utf-8") for p in regex.findall(KIMI_PAT_STR, text, flags=regex.V1))
    words = [list(w) for w in word_counts]
    freqs = list(word_counts.values())

    pair_count: dict[tuple[int, int], int] = defaultdict(int)
    pair_words: dict[tuple[int, int], set[int]] = defaultdict(set)
    for wi, w in enumerate(words):
        for pair in zip(w, w[1:]):
            pair_count[pair] += freqs[wi]
            pair_words[pair].add(wi)
    # Ties go to the smallest pair of ids, which keeps the result deterministic.
    heap = [(-c, pair) for pair, c in pair_count.items()]
    heapq.heapify(heap)

    while len(vocab) < num_ranks and heap:
        neg, pair = heapq.heappop(heap)
        if pair_count.get(pair, 0) != -neg:
            continue  # stale entry: the count changed after it was pushed
        a, b = pair
        merged = vocab[a] + vocab[b]
        new_id = index.get(merged)
        if new_id is None:  # different pairs can spell the same bytes; tiktoken wants each once
            new_id = len(vocab)
            vocab.append(merged)
            index[merged] = new_id
        touched: set[tuple[int, int]] = set()
        for wi in pair_words.pop(pair):
            w, f = words[wi], freqs[wi]
            out: list[int] = []
            i = 0
            while i < len(w):
                if i + 1 < len(w) and w[i] == a and w[i + 1] == b:
                    out.append(new_id)
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            if len(out) == len(w):
                continue  # a stale member of pair_words: merged away by an earlier merge
            for p in zip(w, w[1:]):
                pair_count[p] -= f
                touched.add(p)
            for p in zip(out, out[1:]):
                pair_count[p] += f
                pair_words[p].add(wi)
                touched.add(p)
            words[wi] = out
        for p in touched:
            c = pair_count[p]
            if c > 0:
                heapq.heappush(heap, (-c, p))
            else:
                del pair_count[p]
                pair_words.pop(p, None)

    # The text has run out of pairs: extend learned tokens by one common byte each, in rank order. Each
    # new token is the concatenation of two existing ones, so tiktoken can still reach it.
    suffixes = b"etaoinshrdlucmfwygpbvkxqjz .,"
    i = 256 if len(vocab) > 256 else 0
    while len(vocab) < num_ranks:
        base = vocab[i]
        for s in suffixes:
            tok = base + bytes([s])
            if tok not in index and len(vocab) < num_ranks:
                index[tok] = len(vocab)
                vocab.append(tok)
        i += 1
    return vocab


def write_demo_tokenizer(out_dir: str, vocab_size: int, chat_format: str = "kimi_k2") -> None:
    """Write a Kimi-form tokenizer (tiktoken.model + tokenizer_config.json) of exactly ``vocab_size`` ids:
    ``vocab_size - 256`` BPE ranks learned from a built-in English text, then 256 special-token slots.
    ``chat_format`` "kimi_k2": K2's turn, tool-call and think tokens and a Kimi chat template; "kimi_k3": K3's
    XTML tokens, no template, ``<|end_of_msg|>`` as the end of a turn."""
    if chat_format not in ("kimi_k2", "kimi_k3"):
        raise ValueError(f"demo tokenizer chat_format must be kimi_k2 or kimi_k3, got {chat_format!r}")
    specials = _DEMO_SPECIALS if chat_format == "kimi_k2" else _DEMO_K3_SPECIALS
    if vocab_size < 512:
        raise ValueError(f"demo tokenizer vocab_size must be >= 512 (256 bytes + 256 specials), got {vocab_size}")
    num_ranks = vocab_size - NUM_RESERVED_SPECIAL_TOKENS
    vocab = _learn_byte_bpe(_DEMO_TEXT, num_ranks)

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / TIKTOKEN_FILE, "w", encoding="ascii") as f:
        f.writelines(f"{base64.b64encode(tok).decode('ascii')} {rank}\n" for rank, tok in enumerate(vocab))

    added = {
        str(num_ranks + slot): {
            "content": specials.get(slot, _reserved_name(num_ranks + slot)),
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for slot in range(NUM_RESERVED_SPECIAL_TOKENS)
    }
    config = {
        "added_tokens_decoder": added,
        "additional_special_tokens": [
            t for t in specials.values() if t not in ("[BOS]", "[EOS]", "[UNK]", "[PAD]")
        ],
        "bos_token": "[BOS]",
        "eos_token": "[EOS]" if chat_format == "kimi_k2" else "<|end_of_msg|>",
        "pad_token": "[PAD]",
        "unk_token": "[UNK]",
        **({"chat_template": DEMO_CHAT_TEMPLATE} if chat_format == "kimi_k2" else {}),
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1048576,
        "tokenizer_class": "TikTokenTokenizer",
    }
    with open(out / CONFIG_FILE, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, ensure_ascii=False)
        f.write("\n")
