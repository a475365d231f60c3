"""rvjax.tokenizer against HF's GGUF tokenizers for the two demo models.

HF (transformers) is a test-only dependency; the tests that need it skip without it. Loading HF's
tokenizers takes ~15-20 s each, so they are built once per module and those tests are marked slow.
"""

import json
import random
import time
from pathlib import Path

import pytest

from rvjax.errors import InvalidRequestError, ModelNotFoundError
from rvjax.tokenizer import IncrementalDetokenizer, Tokenizer, load_gguf_tokenizer
from rvjax.weights.demo import resolve_demo

MODELS = ["qwen2.5-coder-0.5b-instruct", "gemma-3-270m"]
PROMPTS = json.loads((Path(__file__).parent / "fixtures" / "prompts.json").read_text(encoding="utf-8"))["prompts"]

CHATS = [
    [{"role": "user", "content": "Write hello world in Python."}],
    [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Say hi in Japanese 🇯🇵"},
        {"role": "assistant", "content": "こんにちは"},
        {"role": "user", "content": "And in French?"},
    ],
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city <b>now</b>",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]


def _path(name: str) -> Path:
    try:
        return resolve_demo(name)
    except ModelNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def rv() -> dict[str, Tokenizer]:
    out = {}
    for name in MODELS:
        start = time.perf_counter()
        out[name] = load_gguf_tokenizer(_path(name), name)
        print(f"rvjax load {name}: {time.perf_counter() - start:.2f} s")
    return out


@pytest.fixture(scope="module")
def hf() -> dict:
    transformers = pytest.importorskip("transformers")
    out = {}
    for name in MODELS:
        path = _path(name)
        out[name] = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return out


def test_prompt_fixture_is_short_and_varied(rv):
    assert 10 <= len(PROMPTS) <= 16
    for tok in rv.values():
        assert all(len(tok.encode(p)) < 60 for p in PROMPTS)


def test_metadata(rv):
    qwen, gemma = rv["qwen2.5-coder-0.5b-instruct"], rv["gemma-3-270m"]
    assert (qwen.vocab_size, qwen.bos_id, qwen.eos_id, qwen.pad_id) == (151936, 151643, 151645, 151643)
    assert not qwen.add_bos
    assert qwen.stop_ids == {151643, 151645}  # <|endoftext|>, <|im_end|>
    assert qwen.chat_template and "<|im_start|>" in qwen.chat_template
    assert (gemma.vocab_size, gemma.bos_id, gemma.eos_id, gemma.pad_id, gemma.add_bos) == (262144, 2, 1, 0, True)
    assert gemma.stop_ids == {1, gemma.encode("<end_of_turn>", add_special_tokens=False)[0]}
    assert gemma.chat_template is None
    assert gemma.id_to_piece(2) == "<bos>" and qwen.id_to_piece(151644) == "<|im_start|>"


@pytest.mark.slow
@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_matches_hf(rv, hf, name, add_special_tokens):
    for prompt in PROMPTS:
        ours = rv[name].encode(prompt, add_special_tokens)
        assert ours == hf[name].encode(prompt, add_special_tokens=add_special_tokens), prompt


@pytest.mark.slow
@pytest.mark.parametrize("name", MODELS)
def test_decode_matches_hf(rv, hf, name):
    for prompt in PROMPTS:
        ids = rv[name].encode(prompt)
        for skip in (True, False):
            assert rv[name].decode(ids, skip) == hf[name].decode(ids, skip_special_tokens=skip), prompt
        # No normalizer changes these prompts, so decoding gives the text back.
        assert rv[name].decode(ids, skip_special_tokens=False).removeprefix("<bos>") == prompt


@pytest.mark.parametrize("name", MODELS)
def test_special_token_strings_encode_whole(rv, name):
    tok = rv[name]
    marker = "<|im_start|>" if name.startswith("qwen") else "<start_of_turn>"
    ids = tok.encode(f"a{marker}b", add_special_tokens=False)
    assert tok.id_to_piece(ids[1]) == marker and len(ids) == 3
    assert tok.decode(ids) == "ab"


def test_bad_ids_and_text_name_the_value(rv):
    tok = rv["gemma-3-270m"]
    with pytest.raises(InvalidRequestError, match="262144"):
        tok.decode([5, 262144])
    with pytest.raises(InvalidRequestError, match="-1"):
        tok.id_to_piece(-1)
    with pytest.raises(InvalidRequestError, match="bytes"):
        tok.encode(b"hi")


def _stream(tok, ids, skip=True):
    detok = IncrementalDetokenizer(tok, prompt_ids=[tok.bos_id or 0], skip_special_tokens=skip)
    pieces = [detok.push(i) for i in ids]
    pieces.append(detok.flush())
    assert "".join(pieces) == detok.text
    return pieces


@pytest.mark.parametrize("name", MODELS)
def test_streaming_equals_decode_without_broken_chars(rv, name):
    tok = rv[name]
    for prompt in PROMPTS:
        ids = tok.encode(prompt)
        for skip in (True, False):
            pieces = _stream(tok, ids, skip)
            assert "".join(pieces) == tok.decode(ids, skip), prompt
            assert not any("\ufffd" in p for p in pieces), (prompt, pieces)


@pytest.mark.parametrize("name", MODELS)
def test_streaming_holds_back_split_characters(rv, name):
    tok = rv[name]
    ids = tok.encode("🦩𠀋", add_special_tokens=False)
    assert len(ids) >= 4  # both are spelled in byte tokens by both vocabularies
    pieces = _stream(tok, ids)
    assert "".join(pieces) == "🦩𠀋"
    assert all(p in ("", "🦩", "𠀋", "🦩𠀋") for p in pieces), pieces


@pytest.mark.parametrize("name", MODELS)
def test_streaming_equals_decode_on_random_ids(rv, name):
    """Garbage too: lone UTF-8 lead/continuation bytes, specials between byte tokens."""
    tok = rv[name]
    rng = random.Random(0)
    byte_ids = tok.encode("é中😀𠀋 \n", add_special_tokens=False)
    # Gemma's <0xNN> tokens, Qwen's one-byte pieces (byte alphabet characters sit below U+0200)
    pieces = [tok.id_to_piece(i) for i in range(tok.vocab_size)]
    byte_ids += [i for i, p in enumerate(pieces) if p.startswith("<0x") or (len(p) == 1 and ord(p) < 0x200)]
    special = sorted(tok.stop_ids | {tok.bos_id})
    for _ in range(200):
        ids = [
            rng.choice(byte_ids) if r < 0.6 else rng.choice(special) if r < 0.7 else rng.randrange(tok.vocab_size)
            for r in (rng.random() for _ in range(rng.randrange(1, 12)))
        ]
        for skip in (True, False):
            assert "".join(_stream(tok, ids, skip)) == tok.decode(ids, skip), ids


@pytest.mark.slow
@pytest.mark.parametrize("chat", CHATS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_qwen_chat_template_matches_hf(rv, hf, chat, add_generation_prompt):
    name = "qwen2.5-coder-0.5b-instruct"
    ours = rv[name].apply_chat_template(chat, add_generation_prompt=add_generation_prompt)
    theirs = hf[name].apply_chat_template(chat, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours == theirs
    ours = rv[name].apply_chat_template(chat, tools=TOOLS)
    assert ours == hf[name].apply_chat_template(chat, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert "<b>now</b>" in ours  # our tojson, like HF's, does not HTML-escape


def test_gemma_has_no_chat_template(rv):
    with pytest.raises(InvalidRequestError, match="gemma-3-270m.*no chat template"):
        rv["gemma-3-270m"].apply_chat_template(CHATS[0])


def test_chat_template_bad_messages(rv):
    with pytest.raises(InvalidRequestError, match="role"):
        rv["qwen2.5-coder-0.5b-instruct"].apply_chat_template([{"content": "no role"}])
