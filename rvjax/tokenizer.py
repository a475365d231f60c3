"""Tokenizers built from a GGUF file's metadata, id for id equal to HF's `AutoTokenizer(..., gguf_file=...)`.

A GGUF carries no tokenizer.json, only llama.cpp's `tokenizer.ggml.*` keys. We rebuild the same
`tokenizers.Tokenizer` that transformers' GGUF conversion builds from them, for two kinds:

* `gpt2` (Qwen2.5): byte-level BPE with the file's merges and a split regex picked by `tokenizer.ggml.pre`.
* `llama` on Gemma 2/3: SentencePiece-style BPE with byte fallback. The file has no merges, so they
  are rebuilt from the vocabulary, ranked by token position like HF does (the scores do not follow
  Gemma's merge order).

Control tokens (type 3) become special added tokens and user-defined ones (type 4) plain added tokens,
so `<|im_start|>` or `<start_of_turn>` in a text encode as one id, like in HF.
"""

from __future__ import annotations

import codecs
import json
import mmap
import os
import string
import struct
from collections.abc import Iterable
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
import jinja2.sandbox
import numpy as np
import tokenizers
from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers

from rvjax.errors import CheckpointError, InvalidRequestError

# llama.cpp token types (gguf.TokenType)
_CONTROL, _USER_DEFINED = 3, 4

# Split regexes by `tokenizer.ggml.pre`, the ones HF's GGUF conversion uses for these vocabularies.
# They differ only in digits: Qwen2 splits every digit alone, Llama 3 groups up to three.
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_SPLIT = _QWEN2_SPLIT.replace(r"|\p{N}|", r"|\p{N}{1,3}|")
_SPLITS = {
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"), _QWEN2_SPLIT),
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "smaug-bpe", "dbrx"), _LLAMA3_SPLIT),
}
_SENTENCEPIECE_ARCHS = ("gemma", "gemma2", "gemma3")
# End-of-turn markers that stop generation by default, besides the file's eos.
_END_OF_TURN = ("<|endoftext|>", "<|im_end|>", "<end_of_turn>", "<|eot_id|>", "<|eom_id|>", "<|end|>")

# GGUF metadata value types: fixed-size scalars (8 = string and 9 = array are handled apart).
_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


def read_gguf_tokenizer_metadata(path: str | os.PathLike) -> dict:
    """The `general.*` and `tokenizer.*` key/values of a GGUF file.

    gguf.GGUFReader parses every field and tensor record into numpy views (~10 s for a 262K vocab);
    this reads only the key/value section, straight from a memory map (~0.15 s).
    """
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != b"GGUF":
            raise CheckpointError(f"{path} is not a GGUF file (magic {bytes(buf[:4])!r})")
        version, _n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
        if version not in (2, 3):
            raise CheckpointError(f"{path}: unsupported GGUF version {version}")
        pos = 24
        u64 = struct.Struct("<Q").unpack_from

        def text(pos: int) -> tuple[str, int]:
            (n,) = u64(buf, pos)
            return buf[pos + 8 : pos + 8 + n].decode("utf-8", errors="replace"), pos + 8 + n

        meta: dict = {}
        for _ in range(n_kv):
            key, pos = text(pos)
            (vtype,) = struct.unpack_from("<I", buf, pos)
            pos += 4
            if vtype == 8:
                value, pos = text(pos)
            elif vtype == 9:
                etype, n = struct.unpack_from("<IQ", buf, pos)
                pos += 12
                if etype == 8:
                    value = []
                    for _ in range(n):
                        s, pos = text(pos)
                        value.append(s)
                elif etype in _GGUF_SCALARS:
                    dtype = np.dtype(_GGUF_SCALARS[etype])
                    value = np.frombuffer(buf, dtype, n, pos).copy()
                    pos += n * dtype.itemsize
                else:
                    raise CheckpointError(f"{path}: key {key!r} is an array of unsupported type {etype}")
            elif vtype in _GGUF_SCALARS:
                (value,) = struct.unpack_from(_GGUF_SCALARS[vtype], buf, pos)
                pos += struct.calcsize(_GGUF_SCALARS[vtype])
            else:
                raise CheckpointError(f"{path}: key {key!r} has unsupported value type {vtype}")
            if key.startswith(("general.", "tokenizer.")):
                meta[key] = value
        return meta


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map: printable Latin-1 bytes stand for themselves, the rest
    are shifted up past U+0100, so every byte string is spelled as a string without spaces/controls."""
    keep = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    table, shifted = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + shifted)
            shifted += 1
    return table


def _byte_level_backend(tokens: list[str], merges: list[str], pre: str | None) -> tuple[tokenizers.Tokenizer, dict]:
    alphabet = _byte_alphabet()
    chars = set(alphabet.values())
    # Tokens are stored in the byte alphabet already; a few files spell one in plain UTF-8 instead.
    spelled = [t if set(t) <= chars else "".join(alphabet[b] for b in t.encode("utf-8")) for t in tokens]
    vocab = {t: i for i, t in enumerate(spelled)}
    pairs = [tuple(m.split(" ")) for m in merges]
    backend = tokenizers.Tokenizer(
        tokenizers.models.BPE(vocab, pairs, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False)
    )
    split = _SPLITS.get(pre)
    if split is None:  # HF keeps GPT-2's own byte-level split then
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    backend.decoder = decoders.ByteLevel()
    return backend, vocab


def _sentencepiece_backend(tokens: list[str], unk: str) -> tuple[tokenizers.Tokenizer, dict[str, int]]:
    # Gemma files store the multi-space tokens with real spaces; the normalizer turns spaces into U+2581.
    spelled = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {t: i for i, t in enumerate(spelled)}
    # No merges in the file: every split of a token into two vocabulary tokens is a merge, ranked by the
    # token's position, then by longer left part first (the order HF's generate_merges sorts them in).
    # A token listed twice keeps its last position (as in a dict), so rank by that position.
    ordered = spelled if len(vocab) == len(spelled) else sorted(vocab, key=vocab.__getitem__)
    known = frozenset(vocab)  # set lookups; one comprehension keeps this ~0.8 s for Gemma's 1.5M characters
    merges = [(t[:k], t[k:]) for t in ordered for k in range(len(t) - 1, 0, -1) if t[:k] in known and t[k:] in known]
    backend = tokenizers.Tokenizer(
        tokenizers.models.BPE(vocab, merges, unk_token=unk, fuse_unk=True, byte_fallback=True)
    )
    backend.normalizer = normalizers.Replace(" ", "\u2581")
    # A no-op after the normalizer (no spaces are left), but it is what HF's GemmaTokenizer sets.
    backend.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    return backend, vocab


def _byte_fallback_value(piece: str) -> int | None:
    """The byte a `<0xNN>` piece stands for (the test HF's ByteFallback decoder applies), else None."""
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        if all(c in string.hexdigits for c in piece[3:5]):
            return int(piece[3:5], 16)
    return None


class _Namespace(jinja2.utils.Namespace):
    """jinja2's `namespace()` minus underscore attributes, so a template cannot reach Python internals."""

    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for key in attrs:
            _Namespace._check(key)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, key, value):
        _Namespace._check(key)
        jinja2.utils.Namespace.__setitem__(self, key, value)

    @staticmethod
    def _check(key):
        if isinstance(key, str) and key.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat template may not set namespace attribute {key!r}")


def _compile_chat_template(source: str) -> jinja2.Template:
    """The template compiled the way HF's apply_chat_template does, with the same helpers."""

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # jinja2's own tojson escapes HTML characters, which would change the prompt.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals.update(
        raise_exception=raise_exception,
        strftime_now=lambda fmt: datetime.now().strftime(fmt),
        namespace=_Namespace,
    )
    return env.from_string(source)


class Tokenizer:
    """Text <-> token ids for one model, over a `tokenizers.Tokenizer` built from the GGUF metadata."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        name: str,
        byte_level: bool,
        bos_id: int | None,
        eos_id: int | None,
        pad_id: int | None,
        add_bos: bool,
        add_eos: bool = False,
        chat_template: str | None = None,
        stop_ids: Iterable[int] = (),
    ):
        self._backend = backend
        self.name = name
        self._byte_level = byte_level  # else SentencePiece-style pieces with byte fallback
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self.bos_id, self.eos_id, self.pad_id = bos_id, eos_id, pad_id
        self.add_bos, self.add_eos = add_bos, add_eos
        self.chat_template = chat_template
        self.stop_ids = frozenset(stop_ids) | ({eos_id} if eos_id is not None else frozenset())
        self._special_ids = frozenset(i for i, t in backend.get_added_tokens_decoder().items() if t.special)
        # byte-level piece character -> byte, to stream raw bytes (see IncrementalDetokenizer)
        self._char_bytes = {c: b for b, c in _byte_alphabet().items()} if byte_level else {}
        self._template: jinja2.Template | None = None

    def __repr__(self) -> str:
        return f"Tokenizer({self.name!r}, vocab_size={self.vocab_size})"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; special-token strings in it (e.g. `<|im_start|>`) become their single id."""
        if not isinstance(text, str):
            raise InvalidRequestError(f"text to encode must be a str, got {type(text).__name__}: {text!r:.80}")
        ids = self._backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens:
            if self.add_bos and self.bos_id is not None:
                ids = [self.bos_id, *ids]
            if self.add_eos and self.eos_id is not None:
                ids = [*ids, self.eos_id]
        return ids

    def _bad_id(self, i) -> InvalidRequestError:
        return InvalidRequestError(f"token id {i!r} is out of range for {self.name!r} (vocab_size {self.vocab_size})")

    def _check_ids(self, ids: Iterable[int]) -> list[int]:
        ids = [int(i) for i in ids]  # also takes numpy arrays / numpy ints
        for i in ids:
            if not 0 <= i < self.vocab_size:
                raise self._bad_id(i)
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(self._check_ids(ids), skip_special_tokens=skip_special_tokens)

    def id_to_piece(self, i: int) -> str:
        """Token `i` as the vocabulary spells it (byte-level or with U+2581 for spaces, like HF's
        convert_ids_to_tokens)."""
        if not isinstance(i, (int, np.integer)) or not 0 <= i < self.vocab_size:
            raise self._bad_id(i)
        return self._backend.id_to_token(int(i))

    def _stream_unit(self, i: int, skip_special_tokens: bool) -> tuple[bool, bytes] | None:
        """What token `i` adds to the decoded text: (is it a byte-fallback byte, its bytes), None if skipped."""
        if skip_special_tokens and i in self._special_ids:
            return None
        piece = self.id_to_piece(i)
        if self._byte_level:
            try:
                return False, bytes(self._char_bytes[c] for c in piece)
            except KeyError:  # a piece not in the byte alphabet: ByteLevel decodes its UTF-8 as is
                return False, piece.encode("utf-8")
        byte = _byte_fallback_value(piece)
        if byte is not None:
            return True, bytes((byte,))
        return False, piece.replace("\u2581", " ").encode("utf-8")

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        """The prompt text for a conversation, rendered like HF's `apply_chat_template(tokenize=False)`."""
        if self.chat_template is None:
            raise InvalidRequestError(
                f"model {self.name!r} has no chat template (its GGUF has no tokenizer.chat_template); "
                "send a plain prompt instead of chat messages"
            )
        if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
            raise InvalidRequestError(f"messages must be a list of dicts with a 'role', got {messages!r:.200}")
        if self._template is None:
            self._template = _compile_chat_template(self.chat_template)
        names = {"bos_token": self.bos_id, "eos_token": self.eos_id, "pad_token": self.pad_id}
        context = {key: self.id_to_piece(i) for key, i in names.items() if i is not None}
        context.update(tools=None, documents=None)
        context.update(kwargs)
        try:
            # A JSON round trip hands the template plain copies, never the caller's own objects.
            messages = json.loads(json.dumps(messages))
        except (TypeError, ValueError) as e:
            raise InvalidRequestError(f"messages must be JSON-like data: {e}") from e
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt, **context)
        except jinja2.exceptions.TemplateError as e:
            raise InvalidRequestError(f"chat template of model {self.name!r} rejected the messages: {e}") from e


def load_gguf_tokenizer(path: str | os.PathLike, name: str | None = None) -> Tokenizer:
    """The tokenizer a GGUF file describes (`name` is only used in messages; defaults to the file name)."""
    path = Path(path)
    name = name or path.name
    if not path.is_file():
        raise CheckpointError(f"GGUF file {str(path)!r} for model {name!r} does not exist")
    meta = read_gguf_tokenizer_metadata(path)
    kind = meta.get("tokenizer.ggml.model")
    arch = meta.get("general.architecture")
    tokens = meta.get("tokenizer.ggml.tokens")
    if tokens is None:
        raise CheckpointError(f"GGUF {str(path)!r} has no tokenizer.ggml.tokens; cannot build a tokenizer")
    types = meta["tokenizer.ggml.token_type"].tolist() if "tokenizer.ggml.token_type" in meta else [0] * len(tokens)

    def token_id(key: str) -> int | None:
        value = meta.get(f"tokenizer.ggml.{key}")
        return int(value) if value is not None and 0 <= int(value) < len(tokens) else None

    if kind == "gpt2":
        if "tokenizer.ggml.merges" not in meta:
            raise CheckpointError(f"GGUF {str(path)!r} is a byte-level BPE tokenizer without tokenizer.ggml.merges")
        backend, vocab = _byte_level_backend(tokens, meta["tokenizer.ggml.merges"], meta.get("tokenizer.ggml.pre"))
        # A control token spelled outside the byte alphabet is a llama.cpp mislabel; HF leaves it out.
        alphabet = set(_byte_alphabet().values())
        control = [t for t, ty in zip(tokens, types) if ty == _CONTROL and set(t) <= alphabet]
        add_bos_default = False
    elif kind == "llama" and arch in _SENTENCEPIECE_ARCHS:
        unk = token_id("unknown_token_id")
        backend, vocab = _sentencepiece_backend(tokens, tokens[unk] if unk is not None else "<unk>")
        control = [t for t, ty in zip(tokens, types) if ty == _CONTROL]
        add_bos_default = True  # llama.cpp's default for SentencePiece vocabularies without the flag
    else:
        raise CheckpointError(
            f"GGUF {str(path)!r}: tokenizer model {kind!r} for architecture {arch!r} is not supported; "
            f"supported: 'gpt2', and 'llama' for {list(_SENTENCEPIECE_ARCHS)}"
        )

    backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in control])
    # User-defined tokens (e.g. Qwen's <tool_call>, Gemma's "\n\n") always match whole, as in llama.cpp.
    user = [t for t, ty in zip(tokens, types) if ty == _USER_DEFINED and t in vocab]
    backend.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])

    eos = token_id("eos_token_id")
    stop = {i for i, t in enumerate(tokens) if types[i] == _CONTROL and t in _END_OF_TURN}
    stop |= {i for i in (token_id("eot_token_id"), token_id("eom_token_id")) if i is not None}
    return Tokenizer(
        backend,
        name=name,
        byte_level=kind == "gpt2",
        bos_id=token_id("bos_token_id"),
        eos_id=eos,
        pad_id=token_id("padding_token_id"),
        add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", add_bos_default)),
        add_eos=bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        chat_template=meta.get("tokenizer.chat_template"),
        stop_ids=stop,
    )


class IncrementalDetokenizer:
    """Turns generated ids into text as they arrive; the pieces joined equal `tokenizer.decode(ids)`.

    Works on the bytes each token stands for, so a character split over several tokens is only
    emitted once complete:
    * byte-level BPE: HF decodes the joined bytes as lossy UTF-8, so an incremental UTF-8 decoder
      with errors="replace" gives the same text piece by piece.
    * byte fallback: HF decodes each run of `<0xNN>` tokens as a whole (valid UTF-8, else one U+FFFD
      per byte), so a run is held back until a normal token ends it. Pieces need no context: the
      Gemma decoder only maps U+2581 to a space, with no leading-space stripping.
    Neither depends on the prompt, so `prompt_ids` is only checked; it is taken so callers can pass it.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int] | None = None, skip_special_tokens: bool = True):
        if prompt_ids is not None:
            tokenizer._check_ids(prompt_ids)
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._run = bytearray()  # pending byte-fallback bytes
        self._parts: list[str] = []
        self.ids: list[int] = []

    def _end_run(self) -> str:
        run, self._run = bytes(self._run), bytearray()
        try:
            return run.decode("utf-8")
        except UnicodeDecodeError:
            return "\ufffd" * len(run)

    def push(self, token_id: int) -> str:
        """The text completed by `token_id` (may be empty while a character is incomplete)."""
        unit = self._tok._stream_unit(int(token_id), self._skip)
        self.ids.append(int(token_id))
        if unit is None:
            return ""
        is_byte, data = unit
        if self._tok._byte_level:
            out = self._utf8.decode(data)
        elif is_byte:
            self._run += data
            return ""
        else:
            out = (self._end_run() if self._run else "") + data.decode("utf-8")
        self._parts.append(out)
        return out

    def flush(self) -> str:
        """Whatever is held back, at the end of generation (incomplete bytes become U+FFFD)."""
        out = self._utf8.decode(b"", final=True) + (self._end_run() if self._run else "")
        self._parts.append(out)
        return out

    @property
    def text(self) -> str:
        return "".join(self._parts)
