"""`python -m rvjax.generate` error handling, and the model-name errors of `rvjax.LLM`.

Bad input must end the CLI with exit code 2 and one `error: ...` line on stderr naming the bad
value, never a traceback. Errors that need no model (sampling parameters, malformed --prompt-ids)
must be reported before any model is resolved or loaded: the tests pass `--model no-such-model`
alongside them and expect the parameter's error, not the model's.

Loaded-model cases use a tiny Qwen2 HF directory written with NumPy + safetensors (no torch)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import rvjax
from rvjax import generate
from rvjax.errors import ModelNotFoundError
from rvjax.weights import demo

REPO = Path(__file__).resolve().parents[1]
D, F, V, L, N, K = 32, 64, 64, 2, 4, 2


def write_tiny_qwen2(d: Path, **config_overrides) -> Path:
    from safetensors.numpy import save_file

    d.mkdir(parents=True, exist_ok=True)
    h = D // N
    shapes = {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,), "lm_head.weight": (V, D)}
    for i in range(L):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (D,), p + "post_attention_layernorm.weight": (D,),
            p + "self_attn.q_proj.weight": (N * h, D), p + "self_attn.k_proj.weight": (K * h, D),
            p + "self_attn.v_proj.weight": (K * h, D), p + "self_attn.o_proj.weight": (D, N * h),
            p + "self_attn.q_proj.bias": (N * h,), p + "self_attn.k_proj.bias": (K * h,),
            p + "self_attn.v_proj.bias": (K * h,), p + "mlp.gate_proj.weight": (F, D),
            p + "mlp.up_proj.weight": (F, D), p + "mlp.down_proj.weight": (D, F)})
    rng = np.random.default_rng(0)
    save_file({k: (rng.standard_normal(s) * 0.1).astype(np.float32) for k, s in shapes.items()},
              str(d / "model.safetensors"))
    cfg = dict(model_type="qwen2", vocab_size=V, hidden_size=D, num_hidden_layers=L, num_attention_heads=N,
               num_key_value_heads=K, intermediate_size=F, max_position_embeddings=128, rms_norm_eps=1e-6,
               rope_theta=10_000.0, tie_word_embeddings=False)
    cfg.update(config_overrides)
    (d / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if v is not None}))
    return d


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_tiny_qwen2(tmp_path_factory.mktemp("tiny_qwen2"))


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("rvjax_cache")


def cli(*args, cache: Path | None = None, timeout: int = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="3")
    if cache is not None:
        env["RVJAX_CACHE"] = str(cache)
    return subprocess.run([sys.executable, "-m", "rvjax.generate", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


def error_line(proc: subprocess.CompletedProcess, *needles: str, only_line: bool = True) -> str:
    """Assert a clean user error (exit 2, one `error:` line, no traceback) and return that line."""
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("error:")]
    assert len(errors) == 1, proc.stderr
    if only_line:  # nothing loaded, nothing logged: the error is all there is
        assert lines == errors, proc.stderr
    else:
        assert lines[-1] == errors[0], proc.stderr
    assert proc.stdout == "", proc.stdout
    for n in needles:
        assert n in errors[0], (n, errors[0])
    return errors[0]


@pytest.fixture
def restore_rvjax_logger():
    """LLM() installs a stderr handler on the "rvjax" logger; undo that after in-process tests."""
    log = logging.getLogger("rvjax")
    saved = (list(log.handlers), log.level, log.propagate)
    yield
    log.handlers[:] = saved[0]
    log.setLevel(saved[1])
    log.propagate = saved[2]


# ---- errors found before any model is touched ------------------------------------------------------


def test_unknown_model_name(cache_dir):
    line = error_line(cli("--model", "no-such-model", "--prompt", "hi", cache=cache_dir), "'no-such-model'")
    assert "qwen2.5-coder-0.5b-instruct" in line  # the message lists the known demo names


def test_missing_model_path(tmp_path):
    path = str(tmp_path / "nowhere" / "model.gguf")
    error_line(cli("--model", path, "--prompt-ids", "1,2"), path)


@pytest.mark.parametrize("ids", ["1,x,3", "1.5,2", "abc"])
def test_garbage_prompt_ids(ids):
    error_line(cli("--model", "no-such-model", "--prompt-ids", ids), "--prompt-ids", repr(ids))


@pytest.mark.parametrize("flag,value,needle", [
    ("--max-tokens", "0", "max_tokens"),
    ("--top-p", "0", "top_p"),
    ("--top-p", "1.5", "top_p"),
])
def test_bad_sampling_flags_fail_before_loading(flag, value, needle):
    line = error_line(cli("--model", "no-such-model", "--prompt", "hi", flag, value), needle, value)
    assert "no-such-model" not in line


def test_empty_prompt():
    error_line(cli("--model", "no-such-model", "--prompt", ""), "--prompt")


def test_argparse_usage_error_is_not_a_traceback():
    proc = cli("--model", "no-such-model")  # neither --prompt nor --prompt-ids
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "--prompt" in proc.stderr and "error:" in proc.stderr


# The same checks in-process, through generate.main (cheaper than a subprocess each).


@pytest.mark.parametrize("argv,needles", [
    (["--temperature", "-1"], ["temperature", "-1.0"]),
    (["--top-k", "-3"], ["top_k", "-3"]),
    (["--min-p", "2"], ["min_p", "2.0"]),
    (["--max-tokens", "-5"], ["max_tokens", "-5"]),
    (["--chat", "--prompt-ids", "1,2"], ["--chat"]),
])
def test_main_rejects_bad_flags_in_process(capsys, restore_rvjax_logger, argv, needles):
    if "--prompt-ids" not in argv:
        argv = argv + ["--prompt", "hi"]
    rc = generate.main(["--model", "no-such-model", *argv])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.startswith("error:") and err.count("\n") == 1, err
    assert "no-such-model" not in err
    for n in needles:
        assert n in err, (n, err)


# ---- errors from the model itself ------------------------------------------------------------------


def test_llm_unknown_model_raises_model_not_found(restore_rvjax_logger):
    with pytest.raises(ModelNotFoundError, match="no-such-model"):
        rvjax.LLM("no-such-model")


def test_llm_directory_without_config(tmp_path, restore_rvjax_logger):
    with pytest.raises(ModelNotFoundError, match=str(tmp_path)):
        rvjax.LLM(str(tmp_path))


FAKE_PKG = "rvjax_test_no_such_package_xyz"


@pytest.fixture
def fake_demo(monkeypatch):
    fake = demo.DemoModel(name="fake-demo-1b", packages=(FAKE_PKG,), part_globs=("data/part01.bin",),
                          filename="fake-demo-1b.gguf", pip_install="pip install rvjax-test-no-such-package-xyz")
    # setitem, not setattr: rvjax.engine.loading holds a reference to the same dict.
    monkeypatch.setitem(demo.DEMO_MODELS, fake.name, fake)
    return fake


def test_demo_with_missing_package_says_pip_install(fake_demo, restore_rvjax_logger):
    with pytest.raises(ModelNotFoundError) as e:
        rvjax.LLM(fake_demo.name)
    msg = str(e.value)
    assert "pip install rvjax-test-no-such-package-xyz" in msg and FAKE_PKG in msg and fake_demo.name in msg, msg


def test_demo_with_missing_package_via_cli_main(fake_demo, capsys, restore_rvjax_logger):
    rc = generate.main(["--model", fake_demo.name, "--prompt", "hi"])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error:") and "pip install" in err and "Traceback" not in err, err


def test_demo_with_missing_part_file_says_reinstall(monkeypatch, restore_rvjax_logger):
    # An importable package ("json", stdlib) that lacks the part file.
    fake = demo.DemoModel(name="fake-demo-parts", packages=("json",), part_globs=("data/part01.bin",),
                          filename="x.gguf", pip_install="pip install fake-demo-parts")
    monkeypatch.setitem(demo.DEMO_MODELS, fake.name, fake)
    with pytest.raises(ModelNotFoundError, match="pip install fake-demo-parts") as e:
        rvjax.LLM(fake.name)
    assert "part01.bin" in str(e.value)


def test_generate_on_tiny_model_works(tiny, cache_dir):
    """The happy path, so the error cases below fail for their own reason, not a broken model."""
    proc = cli("--model", str(tiny), "--prompt-ids", "1,2,3", "--max-tokens", "3", "--ignore-eos", "--json",
               cache=cache_dir)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["prompt_ids"] == [1, 2, 3] and len(out["token_ids"]) == 3
    assert all(0 <= t < V for t in out["token_ids"]) and out["text"] is None


@pytest.mark.parametrize("args,needles", [
    (["--prompt-ids", "1,999"], ["999"]),
    (["--prompt-ids", ",,"], ["empty"]),
    (["--prompt", "hello"], ["tokenizer"]),
])
def test_request_errors_after_loading(tiny, cache_dir, args, needles):
    error_line(cli("--model", str(tiny), *args, cache=cache_dir), *needles, only_line=False)



def test_bad_max_model_len_is_a_clean_error(tiny, cache_dir):
    error_line(cli("--model", str(tiny), "--prompt-ids", "1,2", "--max-model-len", "100000", cache=cache_dir),
               "max_model_len", "100000", only_line=False)



def test_negative_seed_is_a_clean_error_or_works(tiny, cache_dir):
    proc = cli("--model", str(tiny), "--prompt-ids", "1,2", "--max-tokens", "2", "--temperature", "1", "--seed", "-1",
               cache=cache_dir)
    if proc.returncode != 0:
        error_line(proc, "seed", "-1", only_line=False)



def test_config_json_missing_key_is_a_clean_error(tmp_path, cache_dir):
    d = write_tiny_qwen2(tmp_path / "nohidden", hidden_size=None)
    error_line(cli("--model", str(d), "--prompt-ids", "1,2", cache=cache_dir), "hidden_size", only_line=False)



def test_max_model_len_zero_is_rejected(tiny, restore_rvjax_logger):
    with pytest.raises(ValueError, match="max_model_len"):
        rvjax.LLM(str(tiny), max_model_len=0)
