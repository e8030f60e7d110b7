"""The `k3jax generate` command and the single-request decode loop behind it.

One real subprocess runs the CLI while the in-process tests run; every in-process generation uses
one shape set (prompt <= 64 tokens, 4 pages of 4 tokens), so the tiny model compiles once per step kind.
"""

import subprocess
import sys

import numpy as np
import pytest

from k3jax.api import load_model
from k3jax.cli import main
from k3jax.engine.simple import generate_stream
from k3jax.sampling import SamplingParams
from k3jax.tokenizer import IncrementalDecoder
from tests import one_device_env

PROMPT = "Hello"
N_NEW = 8
PAGE = 4  # 5 prompt + 8 new tokens span 4 pages: decode crosses page boundaries


def _cli(*args):
    # a user's environment: one device, XLA:CPU's default thread pools (not this suite's 8 host devices
    # and PJRT_NPROC, tests/conftest.py); unoptimised XLA code compiles ~2x faster, the tokens are the same
    env = one_device_env(JAX_PLATFORMS="cpu", PYTHONIOENCODING="utf-8")
    env["XLA_FLAGS"] += " --xla_backend_optimization_level=0"
    return subprocess.Popen([sys.executable, "-m", "k3jax.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env)


@pytest.fixture(scope="module")
def cli_run():
    """The real CLI, started first so it compiles while the in-process tests run."""
    proc = _cli("generate", "--model", "k3-tiny", "--prompt", PROMPT, "--max-new-tokens", str(N_NEW))
    yield proc
    if proc.poll() is None:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def model(cli_run):
    return load_model("k3-tiny")


def _gen(model, sampling, prompt=None, **kw):
    ids = model.tokenizer.encode(PROMPT) if prompt is None else prompt
    stats = {}
    toks = list(generate_stream(model, ids, sampling, page_size=PAGE, stats=stats, **kw))
    return toks, stats


@pytest.fixture(scope="module")
def greedy(model):
    return _gen(model, SamplingParams(max_new_tokens=N_NEW))


def test_decode_loop_matches_full_forward(model, greedy):
    """Reference: argmax of the last row of a plain forward over the growing sequence."""
    toks, stats = greedy
    seq = model.tokenizer.encode(PROMPT)
    ref = []
    for _ in range(N_NEW):
        logits = model.logits(seq)[-1]
        top2 = np.sort(logits)[-2:]
        assert top2[1] - top2[0] > 1e-3  # a well-separated argmax (DESIGN.md section 4)
        ref.append(int(logits.argmax()))
        seq.append(ref[-1])
    assert toks == ref
    assert stats == dict(prompt_tokens=5, generated_tokens=N_NEW, warmup_s=0.0, finish_reason="length")


def test_chunked_prefill_and_warmup_do_not_change_tokens(model, greedy):
    toks, _ = _gen(model, SamplingParams(max_new_tokens=N_NEW), prefill_chunk=2, warmup=True)
    assert toks == greedy[0]


def test_stop_string_ends_after_completing_token(model, greedy):
    toks = greedy[0]
    dec = IncrementalDecoder(model.tokenizer)
    texts = [dec.push(t) for t in toks]
    k = next((i for i, s in enumerate(texts) if i > 0 and s), None)
    if k is None:
        pytest.skip("the random model's greedy output has no visible text")
    stop = texts[k][-1]
    first = next(i for i in range(N_NEW) if stop in "".join(texts[: i + 1]))
    out, stats = _gen(model, SamplingParams(max_new_tokens=N_NEW, stop=["never seen", stop]))
    assert out == toks[: first + 1] and stats["finish_reason"] == "stop"


def test_logit_bias(model, greedy):
    """The single-request loop adds the bias after the penalties: +100 forces a token, -100 bans the greedy one
    (the rest is the full forward's argmax with the bias added); `--logit-bias ID=BIAS` parses to it."""
    from k3jax.cli import _build_parser, _sampling

    assert _gen(model, SamplingParams(max_new_tokens=N_NEW, logit_bias={65: 100.0}))[0] == [65] * N_NEW
    first = greedy[0][0]
    toks, _ = _gen(model, SamplingParams(max_new_tokens=3, logit_bias={first: -100.0}))
    seq = model.tokenizer.encode(PROMPT)
    for t in toks:
        row = model.logits(seq)[-1]
        row[first] -= 100.0
        assert t == int(row.argmax()) and t != first
        seq.append(t)
    args = _build_parser().parse_args(["generate", "--prompt", "x", "--logit-bias", "65=100", "--logit-bias", "3=-1.5"])
    assert _sampling(args).logit_bias == {65: 100.0, 3: -1.5}


def test_seeded_sampling_is_reproducible(model):
    sp = SamplingParams(max_new_tokens=N_NEW, temperature=1.0, top_k=50, seed=7)
    assert _gen(model, sp)[0] == _gen(model, sp)[0]


def test_generate_stream_errors(model):
    with pytest.raises(ValueError, match="empty"):
        next(generate_stream(model, [], SamplingParams()))
    with pytest.raises(ValueError, match="context"):
        next(generate_stream(model, [1] * model.config.max_position_embeddings, SamplingParams()))
    with pytest.raises(ValueError, match="temperature"):
        next(generate_stream(model, [1], SamplingParams(temperature=-1)))


def test_cli_generate_subprocess(cli_run, model, greedy):
    out, err = cli_run.communicate(timeout=120)
    err = err.decode()
    assert cli_run.returncode == 0, err
    assert "Traceback" not in err
    # same greedy tokens as in-process (different page size: greedy tokens must not depend on it)
    expected = model.tokenizer.decode(greedy[0])
    assert out.decode("utf-8") == expected + "\n"
    assert "generated 8" in err and "time to first token" in err and "tokens/s" in err


@pytest.mark.parametrize("argv, message", [
    (["--model", "no-such-preset", "--prompt", "hi"], "no-such-preset"),
    (["--model", "./missing_dir", "--prompt", "hi"], "missing_dir"),
    (["--prompt", ""], "--prompt is empty"),
    (["--prompt", "hi", "--temperature", "-1"], "temperature"),
    (["--prompt", "hi", "--top-p", "2"], "top_p"),
    (["--prompt", "hi", "--min-p", "-0.5"], "min_p"),
    (["--prompt", "hi", "--repetition-penalty", "0"], "repetition_penalty"),
    (["--prompt", "hi", "--frequency-penalty", "3"], "frequency_penalty"),
    (["--prompt", "hi", "--max-new-tokens", "0"], "max_new_tokens"),
    (["--prompt", "hi", "--stop-token-id", "-1"], "stop_token_ids"),
    (["--prompt", "hi", "--batch-invariant", "--mesh", "tp=2"], "--batch-invariant runs on one device"),
    (["--prompt", "hi", "--image", "no_such_image.png"], "no_such_image.png"),
])
def test_cli_user_errors(argv, message, capsys):
    assert main(["generate", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("k3jax generate: error:")


def test_cli_image(model, tmp_path, capsys):
    """--image (a PNG; Pillow decodes it) runs the engine on the image prompt and prints the text of
    `LLM.generate`'s greedy tokens; with no <|media_pad|> in the prompt the image goes first. A .npy image loads
    as the same array."""
    from PIL import Image

    from k3jax import LLM
    from k3jax.media import load_image, prepare

    img = np.random.default_rng(5).integers(0, 256, (56, 70, 3), dtype=np.uint8)
    np.save(tmp_path / "img.npy", img)
    Image.fromarray(img).save(tmp_path / "img.png")
    np.testing.assert_array_equal(load_image(str(tmp_path / "img.npy")), img)
    np.testing.assert_array_equal(load_image(str(tmp_path / "img.png")), img)
    ids = [259] + model.tokenizer.encode("Look: ")
    n_prompt = len(prepare(model, ids, [img]).keyed)  # the CLI's engine shapes: its compiles are these
    llm = LLM(model, max_running=1, single_bucket=True, prefill_chunk=64, max_seq_len=n_prompt + 4)
    want = llm.generate(ids, SamplingParams(max_new_tokens=4), images=[img])[0].text
    assert main(["generate", "--prompt", "Look: ", "--image", str(tmp_path / "img.png"), "--max-new-tokens", "4",
                 "--prefill-chunk", "64", "-q"]) == 0
    assert capsys.readouterr().out == want + "\n"


def test_cli_chat(model, monkeypatch, capsys):
    """`k3jax chat`: each --message (or stdin line) is a user turn; the replies are `LLM.chat`'s greedy ones on
    the conversation so far (text up to any tool-call section, then the parsed calls as JSON lines)."""
    import io
    import json

    from k3jax import LLM
    from k3jax.xtml import TOOLS_BEGIN

    shape = ["--prefill-chunk", "64", "--max-seq-len", "128", "--max-new-tokens", "4", "-q"]
    llm = LLM(model, max_running=1, single_bucket=True, prefill_chunk=64, max_seq_len=128)  # the CLI's shapes
    tb = model.tokenizer.special_tokens[TOOLS_BEGIN]
    conv, want = [{"role": "system", "content": "Be brief."}], ""
    for text in ("Hi", "And then?"):
        conv.append({"role": "user", "content": text})
        out = llm.chat(conv, SamplingParams(max_new_tokens=4))[0]
        shown = out.token_ids[: out.token_ids.index(tb)] if tb in out.token_ids else out.token_ids
        want += model.tokenizer.decode(shown) + "\n"
        want += "".join(json.dumps({"tool_call": c.to_dict()}, ensure_ascii=False) + "\n" for c in out.message.tool_calls)
        conv.append(out.message.to_message())
    assert main(["chat", "--system", "Be brief.", "--message", "Hi", "--message", "And then?", *shape]) == 0
    assert capsys.readouterr().out == want
    monkeypatch.setattr("sys.stdin", io.StringIO("Hi\nAnd then?\n\nnever read\n"))  # an empty line ends the chat
    assert main(["chat", "--system", "Be brief.", *shape]) == 0
    assert capsys.readouterr().out == want
    assert main(["chat", "--message", " ", *shape]) == 2
    assert "--message is empty" in capsys.readouterr().err


def test_cli_logit_bias_errors(capsys):
    with pytest.raises(SystemExit) as e:  # argparse: a malformed pair
        main(["generate", "--prompt", "x", "--logit-bias", "65"])
    assert e.value.code == 2 and "--logit-bias: expected ID=BIAS" in capsys.readouterr().err
    assert main(["generate", "--prompt", "x", "--logit-bias", "65=101"]) == 2
    assert "logit_bias[65] must be in [-100, 100]" in capsys.readouterr().err
    assert main(["generate", "--prompt", "x", "--logit-bias", "9999=1", "-q"]) == 2  # checked against the vocabulary
    assert "logit_bias: unknown token ids [9999]" in capsys.readouterr().err


def test_cli_error_subprocess_has_no_traceback():
    proc = _cli("generate", "--prompt", "hi", "--temperature", "-1")
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 2
    assert err.decode().strip() == "k3jax generate: error: temperature must be a finite number >= 0, got -1.0"


def test_cli_help_explains_every_flag(capsys):
    with pytest.raises(SystemExit) as e:
        main(["generate", "--help"])
    assert e.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # undo line wrapping
    for flag in ("--model", "--prompt", "--max-new-tokens", "--temperature", "--top-p", "--top-k", "--seed",
                 "--stop", "--page-size", "--prefill-chunk", "--add-bos", "--show-special", "--quiet",
                 "--batch-invariant", "--stop-token-id", "--ignore-eos", "--repetition-penalty", "--presence-penalty",
                 "--frequency-penalty", "--image"):
        assert flag in text
    assert "(default: k3-tiny)" in text and "(default: 16)" in text and "greedy" in text
    with pytest.raises(SystemExit):
        main(["chat", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for flag in ("--model", "--system", "--message", "--image", "--max-seq-len", "--max-new-tokens", "--temperature",
                 "--mesh", "--show-special", "--quiet"):
        assert flag in text
    assert "(default: 256)" in text and "(default: 4096)" in text
