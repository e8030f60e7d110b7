import base64
import json

import pytest

from k3jax.config import preset
from k3jax.tokenizer import (
    ByteTokenizer, IncrementalDecoder, TiktokenTokenizer, load_tokenizer,
)

CFG = preset("k3-tiny")  # vocab 512, bos 256, eos 257, pad 258
TEXTS = ["", "hello world", "héllo wörld", "日本語のテキスト", "emoji 🚀🎉 and 👩‍👩‍👧 family", "mixed ∑ x² ≠ ∞\n\ttabs"]


@pytest.fixture(scope="module")
def byte_tok():
    return ByteTokenizer(CFG)


@pytest.mark.parametrize("text", TEXTS)
def test_byte_round_trip(byte_tok, text):
    ids = byte_tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert all(0 <= i < 256 for i in ids)
    assert byte_tok.decode(ids) == text


def test_byte_specials(byte_tok):
    t = byte_tok
    assert (t.vocab_size, t.bos_token_id, t.eos_token_id, t.pad_token_id) == (512, 256, 257, 258)
    assert t.encode("hi", add_bos=True) == [256, 104, 105]
    assert t.encode("a<|eos|>") == [97, 257]
    assert t.encode("a<|eos|>", allow_special=False) == list(b"a<|eos|>")
    ids = [256, 104, 105, 257, 300]
    assert t.decode(ids) == "hi"
    assert t.decode(ids, skip_special=False) == "<|bos|>hi<|eos|><|reserved_300|>"
    assert t.is_special(257) and t.is_special(300) and not t.is_special(65)
    assert t.id_is_valid(511) and not t.id_is_valid(512) and not t.id_is_valid(-1)
    with pytest.raises(ValueError, match="512"):
        t.decode([512])


def test_byte_invalid_utf8_is_replaced(byte_tok):
    assert byte_tok.decode([0xFF, 104, 0xE2, 0x82]) == "\ufffdh\ufffd"


def test_byte_tokenizer_needs_room_for_bytes():
    with pytest.raises(ValueError, match="at least 256"):
        ByteTokenizer(CFG.replace(vocab_size=200, bos_token_id=None, eos_token_id=None, pad_token_id=None, vision=None))


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_decoder_never_emits_partial_characters(byte_tok, text):
    ids = byte_tok.encode(text) + [257] + byte_tok.encode(text[::-1])
    dec = IncrementalDecoder(byte_tok)
    pieces = [dec.push(i) for i in ids] + [dec.flush()]
    assert "\ufffd" not in "".join(pieces)
    assert "".join(pieces) == byte_tok.decode(ids)
    for p in pieces:  # each piece is whole characters: it survives a UTF-8 round trip on its own
        assert p.encode("utf-8").decode("utf-8") == p
    # a 4-byte emoji arrives over 4 pushes: nothing until the last byte
    dec = IncrementalDecoder(byte_tok)
    assert [dec.push(i) for i in "🚀".encode()] == ["", "", "", "🚀"]


def test_incremental_decoder_matches_decode_on_invalid_bytes(byte_tok):
    ids = [0xE2, 0x82, 65, 0xF0, 0x9F, 0x9A, 0x80, 0xF0, 0x9F]
    dec = IncrementalDecoder(byte_tok, skip_special=False)
    out = "".join(dec.push(i) for i in ids) + dec.flush()
    assert out == byte_tok.decode(ids, skip_special=False) == "\ufffdA🚀\ufffd"


MERGES = [b"he", b"ll", b"hell", b"hello", b" w", b"or"]


def _write_tiktoken_dir(path, specials):
    ranks = [bytes([i]) for i in range(256)] + MERGES
    (path / "tiktoken.model").write_text(
        "".join(f"{base64.b64encode(tok).decode()} {rank}\n" for rank, tok in enumerate(ranks)))
    added = {str(i): {"content": c, "special": True} for i, c in specials.items()}
    (path / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": added, "bos_token": "[BOS]"}))
    return len(ranks)


@pytest.fixture(scope="module")
def tik_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    n_base = _write_tiktoken_dir(d, {262: "[BOS]", 263: "<|im_end|>"})
    assert n_base == 262
    return d


def test_tiktoken_encode_uses_merges(tik_dir):
    tok = load_tokenizer(tik_dir, CFG.replace(bos_token_id=None, eos_token_id=263, pad_token_id=None))
    assert isinstance(tok, TiktokenTokenizer)
    assert tok.encode("hello") == [259]
    assert tok.encode("hell") == [258]
    assert tok.encode("hello world") == [259, 260, 261, ord("l"), ord("d")]
    assert tok.bos_token_id == 262  # from tokenizer_config.json's bos_token
    assert tok.eos_token_id == 263  # from the model config
    assert tok.vocab_size == CFG.vocab_size  # reserved specials fill the model's vocabulary


@pytest.mark.parametrize("text", TEXTS + ["hello hello, wörld 42 1234567 你好世界"])
def test_tiktoken_round_trip(tik_dir, text):
    tok = TiktokenTokenizer(tik_dir, CFG)
    assert tok.decode(tok.encode(text)) == text
    ids = tok.encode(text)
    dec = IncrementalDecoder(tok)
    assert "".join(dec.push(i) for i in ids) + dec.flush() == text


def test_tiktoken_specials(tik_dir):
    tok = TiktokenTokenizer(tik_dir, CFG)
    ids = tok.encode("[BOS]hello<|im_end|>")
    assert ids == [262, 259, 263]
    assert tok.decode(ids) == "hello"
    assert tok.decode(ids, skip_special=False) == "[BOS]hello<|im_end|>"
    assert tok.decode([300], skip_special=False) == "<|reserved_token_300|>"
    assert tok.is_special(263) and not tok.is_special(259)
    assert tok.encode("<|im_end|>", allow_special=False) != [263]
    assert tok.encode("x", add_bos=True) == [tok.bos_token_id, ord("x")]


def test_tiktoken_without_model_config(tik_dir):
    tok = TiktokenTokenizer(tik_dir)
    assert tok.vocab_size == 262 + 256
    assert tok.bos_token_id == 262


def test_load_tokenizer_fallbacks(tmp_path):
    assert isinstance(load_tokenizer(None, CFG), ByteTokenizer)
    assert isinstance(load_tokenizer(tmp_path, CFG), ByteTokenizer)  # no vocabulary, 512 ids fit bytes
    small = CFG.replace(vocab_size=100, bos_token_id=None, eos_token_id=None, pad_token_id=None, vision=None)
    with pytest.raises(FileNotFoundError, match="tiktoken.model"):
        load_tokenizer(tmp_path, small)
    with pytest.raises(FileNotFoundError):
        load_tokenizer(tmp_path / "missing", CFG)
    (tmp_path / "tiktoken.model").write_text("not base64!! x\n")
    with pytest.raises(ValueError, match="tiktoken.model:1"):
        load_tokenizer(tmp_path, CFG)
