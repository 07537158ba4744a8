"""Generation: KV cache against full forward, greedy stories260K, sampling, the CLI."""

from __future__ import annotations

import dataclasses
import importlib.util
import io
import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from chat_templates import GEMMA2, GEMMA_CONVERSATION, GEMMA_LLAMACPP, GEMMA_SYSTEM
from toymlx_cli import generate as cli

from toymlx.bundle.checkpoint import update_latest
from toymlx.generation.generate import generate, load_for_generation
from toymlx.gguf.llama import SUPPORTED, load_llama
from toymlx.gguf.writer import write_gguf

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def stories(stories_path):
    return load_for_generation(stories_path)


def full_forward_greedy(model, ids: list[int], n: int) -> list[int]:
    """Reference: no cache, the whole sequence through the model for every new token."""
    ids, out = list(ids), []
    for _ in range(n):
        logits = model(mx.array([ids]))[0, -1]  # (V,)
        tok = int(mx.argmax(logits).item())
        out.append(tok)
        ids.append(tok)
    return out


def test_greedy_stories_is_fluent_and_matches_full_forward(stories):
    model, tok = stories
    prompt = tok.encode(PROMPT)
    assert prompt[0] == tok.bos_id
    got = list(generate(model, tok, prompt, max_tokens=12, temperature=0.0))
    ref = full_forward_greedy(model, prompt, 12)
    assert got == ref
    text = tok.decode(got)
    print(f"stories260K greedy ids {got} -> {text!r}")
    assert "there was a little girl" in text
    # The same ids llama.cpp's greedy decoding of this model gives (pinned so a change in
    # the forward pass or the tokenizer shows up here, in the fast tier).
    assert got[:10] == EXPECTED_GREEDY[:10]


# Greedy tokens after "Once upon a time" for stories260K, from llama.cpp's logits:
# ',', '▁there', '▁was', '▁a', '▁little', '▁g', 'ir', 'l', '▁named', '▁Lily', '.', '▁She'.
EXPECTED_GREEDY = [432, 383, 286, 261, 376, 298, 315, 421, 395, 317, 426, 338]


def cached_vs_full(model, ids: list[int]) -> tuple[float, float]:
    """(max abs diff, max abs logit) of cached chunked decoding against one full forward."""
    full = np.array(model(mx.array([ids]))[0])  # (T, V)
    cache = model.make_cache()
    parts, pos = [], 0
    for size in (17, 1, 1, 5, 1) + (1,) * (len(ids) - 25):  # prefill, single steps, a chunk
        chunk = ids[pos:pos + size]
        parts.append(np.array(model(mx.array([chunk]), cache=cache)[0]))
        pos += size
    assert pos == len(ids) and cache[0].offset == len(ids)
    return float(np.abs(np.concatenate(parts) - full).max()), float(np.abs(full).max())


def test_kv_cache_logits_equal_full_forward(stories, stories_path):
    model, tok = stories
    ids = tok.encode("Once upon a time, there was a little girl named Lily. She loved to play "
                     "outside in the park with her friends.")
    assert len(ids) >= 32
    diff, scale = cached_vs_full(model, ids)
    # fp32: BLAS blocks an M=1 product differently from an M=36 one, so logits of size ~22
    # move by a few ulp (a plain forward of a prefix differs from the full one by ~1e-5 too).
    print(f"KV-cache vs full forward, fp32: max abs logit diff {diff:.3g} (max |logit| "
          f"{scale:.1f}) over {len(ids)} positions")
    assert diff <= 1e-6 * scale
    # fp64 on the CPU takes the rounding away: the cache itself must be exact.
    m64, _ = load_llama(stories_path)
    m64.set_dtype(mx.float64)
    with mx.stream(mx.cpu):
        diff64, _ = cached_vs_full(m64, ids)
    print(f"KV-cache vs full forward, fp64: max abs logit diff {diff64:.3g}")
    assert diff64 <= 1e-10


def test_generate_stops_at_eos_and_context(stories):
    model, tok = stories
    prompt = tok.encode(PROMPT)

    class EosIsNext:
        eos_id = EXPECTED_GREEDY[0]

    assert list(generate(model, EosIsNext(), prompt, max_tokens=5)) == []
    assert list(generate(model, tok, prompt, max_tokens=0)) == []
    room = model.args.context - len(prompt)
    short = load_llama_with_context(model, len(prompt) + 3)
    assert len(list(generate(short, tok, prompt, max_tokens=10))) == 3 and room > 3


@pytest.fixture(scope="module")
def eot_path(stories_path, tmp_path_factory) -> Path:
    """stories260K whose `tokenizer.ggml.eot_token_id` is its second greedy token ('▁there')."""
    from toymlx.gguf.reader import GGUFFile

    with GGUFFile(stories_path) as g:
        meta = {**g.metadata, "tokenizer.ggml.eot_token_id": EXPECTED_GREEDY[1]}
        types = {k: t for k, t in g.metadata_types.items() if k in meta}
        tensors = {n: g.load(n, np.float32) for n in g.tensors}
    return write_gguf(tmp_path_factory.mktemp("eot") / "eot.gguf", meta, tensors, types=types)


def test_generate_stops_at_an_end_of_turn_token_not_only_eos(eot_path, capsys):
    """llama.cpp (and Ollama) end a generation at any end-of-generation token, not eos alone:
    at the end-of-turn token, after one token (',')."""
    model, tok = load_for_generation(eot_path)
    assert tok.eos_id == 2 and tok.eog_ids == {2, EXPECTED_GREEDY[1]}
    assert list(generate(model, tok, tok.encode(PROMPT), max_tokens=12)) == EXPECTED_GREEDY[:1]
    out, err = cli_tokens(["--model", str(eot_path), "--prompt", PROMPT, "--temperature", "0",
                           "--max-tokens", "12", "--engine", "mlx"], capsys)
    assert out == ",\n" and "5 prompt + 1 new tokens" in err


@pytest.mark.interop
def test_llamacpp_stops_where_llamacpps_own_completion_stops(eot_path, capsys):
    import llama_cpp

    llm = llama_cpp.Llama(str(eot_path), n_ctx=64, verbose=False)
    done = llm.create_completion(PROMPT, max_tokens=12, temperature=0.0)
    del llm
    assert (done["choices"][0]["text"], done["choices"][0]["finish_reason"],
            done["usage"]["completion_tokens"]) == (",", "stop", 1)
    out, err = cli_tokens(["--model", str(eot_path), "--prompt", PROMPT, "--temperature", "0",
                           "--max-tokens", "12", "--engine", "llama.cpp"], capsys)
    assert out == ",\n" and "5 prompt + 1 new tokens" in err and "llama.cpp)" in err


def load_llama_with_context(model, context: int):
    """The same weights with a smaller declared context (to test the context stop cheaply)."""
    from dataclasses import replace

    from mlx.utils import tree_flatten

    from toymlx.models.llama import Llama

    m = Llama(replace(model.args, context=context))
    m.load_weights(tree_flatten(model.parameters()))
    return m


def test_sampling_is_seeded_and_top_p_narrows(stories):
    model, tok = stories
    prompt = tok.encode(PROMPT)
    a = list(generate(model, tok, prompt, 20, temperature=1.0, top_p=0.95, seed=3))
    b = list(generate(model, tok, prompt, 20, temperature=1.0, top_p=0.95, seed=3))
    c = list(generate(model, tok, prompt, 20, temperature=1.5, top_p=1.0, seed=4))
    assert a == b and a != c
    # A nucleus smaller than the top token's probability is greedy decoding.
    assert list(generate(model, tok, prompt, 8, temperature=1.0, top_p=1e-6)) == \
        EXPECTED_GREEDY[:8]
    with pytest.raises(ValueError, match="top-p"):
        next(generate(model, tok, prompt, 1, temperature=1.0, top_p=0.0))


class FixedDistribution:
    """A 'model' whose next-token probabilities are always [0.5, 0.3, 0.15, 0.05]."""

    args = type("Args", (), {"context": 10_000, "vocab_size": 4})()

    def make_cache(self):
        from mlx_lm.models.cache import KVCache

        return [KVCache()]

    def __call__(self, tokens, cache=None):
        p = mx.array([0.5, 0.3, 0.15, 0.05])
        return mx.broadcast_to(mx.log(p), (*tokens.shape, 4))


@pytest.mark.parametrize("kw, allowed", [({"top_p": 0.7}, {0, 1}),  # 0.5 + 0.3 reach 0.7
                                         ({"top_k": 3}, {0, 1, 2}),
                                         ({"min_p": 0.5}, {0, 1}),  # 0.15 < 0.5 * 0.5
                                         ({"temperature": 0.0}, {0})])
def test_samplers_cut_the_distribution_where_they_say(kw, allowed):
    kw = {"temperature": 1.0, **kw}
    draws = list(generate(FixedDistribution(), None, [0], max_tokens=400, seed=1, **kw))
    assert set(draws) == allowed and len(draws) == 400
    if kw["temperature"] and kw.get("top_p"):  # the kept mass renormalised: 0.5 / 0.8 = 0.625
        assert abs(draws.count(0) / 400 - 0.625) < 0.08


def _nucleus_fp64(logprobs: np.ndarray, top_p: float, rounding: float) -> range:
    """How many tokens top-p may keep: in float64, the tokens whose strictly more likely tokens
    hold less than top_p of the mass, give or take cuts within `rounding` (relative) of top_p,
    where float32 sums over the vocabulary may land either side."""
    probs = np.sort(np.exp(logprobs.astype(np.float64)))[::-1]
    above = np.cumsum(probs) - probs
    wanted = top_p * probs.sum()
    return range(int((above < wanted * (1 - rounding)).sum()),
                 int((above < wanted * (1 + rounding)).sum()) + 1)


@pytest.mark.parametrize("scale", [0.5, 2.0, 4.0, 8.0])
def test_cpu_top_p_keeps_the_nucleus_mlx_lm_keeps_and_draws_the_same_token(scale):
    """toymlx's CPU top-p (the most likely 256 tokens first, the whole vocabulary sorted only
    where they hold less than top_p: scales 0.5 and 2 here) against a float64 nucleus and
    mlx-lm's apply_top_p, on SmolLM2-sized vocabularies: both keep the float64 nucleus up to
    float32 rounding of the mass (3e-4), nearly always exactly the same tokens, and then draw the
    same token for a seed."""
    from mlx_lm.sample_utils import apply_top_p
    from mlx_lm.sample_utils import make_sampler as mlx_lm_sampler

    from toymlx.generation.sampling import make_sampler, top_p_cut

    rng = np.random.default_rng(int(scale * 10))
    same = cases = 0
    for case in range(12):
        x = mx.array((rng.standard_normal((1, 49152)) * scale).astype(np.float32))
        logprobs = x - mx.logsumexp(x, axis=-1, keepdims=True)
        for top_p in (0.5, 0.9, 0.95):
            band = _nucleus_fp64(np.array(logprobs)[0], top_p, rounding=3e-4)
            ours, theirs = top_p_cut(logprobs, top_p), apply_top_p(logprobs, top_p)
            assert int(mx.isfinite(ours).sum()) in band and int(mx.isfinite(theirs).sum()) in band
            cases += 1
            if not mx.array_equal(ours, theirs):
                continue
            same += 1
            mx.random.seed(case)
            want = mlx_lm_sampler(temp=0.7, top_p=top_p)(logprobs).item()
            mx.random.seed(case)
            assert make_sampler(0.7, top_p, 0.0, 0, checked_on_host=True)(logprobs).item() == want
    assert same >= 0.9 * cases


@pytest.mark.parametrize("kw", [{}, {"top_p": 0.9}, {"min_p": 0.05}, {"top_k": 40},
                                {"top_p": 0.95, "min_p": 0.02, "top_k": 100}])
def test_the_sampler_chain_draws_mlx_lms_tokens(kw):
    """toymlx.generation.sampling against mlx_lm.sample_utils, same log-probabilities and seed: the same
    token, for every filter and their chain (top-p sorted as mlx-lm sorts, host-checked where
    the cut is clear of float32 rounding: these distributions are peaked)."""
    from mlx_lm.sample_utils import make_sampler as mlx_lm_sampler

    from toymlx.generation.sampling import make_sampler

    rng = np.random.default_rng(7)
    theirs = mlx_lm_sampler(temp=0.8, top_p=kw.get("top_p", 0.0), min_p=kw.get("min_p", 0.0),
                            top_k=kw.get("top_k", 0))
    for checked in (False, True):
        ours = make_sampler(0.8, kw.get("top_p", 1.0), kw.get("min_p", 0.0), kw.get("top_k", 0),
                            checked_on_host=checked)
        for case in range(20):
            x = mx.array((rng.standard_normal((1, 4096)) * 6).astype(np.float32))
            logprobs = x - mx.logsumexp(x, axis=-1, keepdims=True)
            mx.random.seed(case)
            want = theirs(logprobs).item()
            mx.random.seed(case)
            assert ours(logprobs).item() == want, (kw, checked, case)


def test_repetition_penalty_is_mlx_lms():
    from mlx_lm.sample_utils import make_repetition_penalty

    from toymlx.generation.sampling import repetition_penalty

    rng = np.random.default_rng(3)
    logits = mx.array(rng.standard_normal((1, 300)).astype(np.float32))
    tokens = mx.array(rng.integers(0, 300, 45), dtype=mx.int32)
    want = make_repetition_penalty(1.3, 20)(tokens, mx.array(logits))
    got = repetition_penalty(1.3)(tokens, mx.array(logits))
    assert mx.array_equal(got, want) and not mx.array_equal(got, logits)


def test_kv_cache_returns_what_mlx_lms_returns():
    """Prompt chunks and single tokens, across the 256-position growth steps."""
    from mlx_lm.models.cache import KVCache as MlxLmCache

    from toymlx.models.kv_cache import KVCache

    rng = np.random.default_rng(0)
    ours, theirs = KVCache(), MlxLmCache()
    for T in (5, 300, 1, 1, 207, 1, 40):
        k, v = (mx.array(rng.standard_normal((1, 2, T, 8)).astype(np.float32)) for _ in "kv")
        got, want = ours.update_and_fetch(k, v), theirs.update_and_fetch(k, v)
        assert ours.offset == theirs.offset
        assert all(mx.array_equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("sampling", [{"temperature": 0.0},
                                      {"temperature": 0.9, "top_p": 0.95,
                                       "repetition_penalty": 1.2}])
def test_decoding_gives_mlx_lms_generate_step_tokens(stories, sampling):
    """toymlx's decoding loop (prefill in chunks, one token at a time, the penalty's recent
    tokens) against mlx_lm.generate.generate_step with mlx-lm's sampler and processors, on
    stories260K with a prompt longer than the prefill chunk: the same tokens."""
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_logits_processors
    from mlx_lm.sample_utils import make_sampler as mlx_lm_sampler

    import toymlx.generation.generate as G

    model, tok = stories
    prompt = tok.encode(PROMPT + " there was a little girl named Lily. She liked to play.") * 3
    temp, top_p = sampling["temperature"], sampling.get("top_p", 1.0)
    penalty = sampling.get("repetition_penalty")
    mx.random.seed(11)
    want = [int(t) for t, _ in generate_step(
        mx.array(prompt, dtype=mx.int32), model, max_tokens=40, prefill_step_size=16,
        sampler=mlx_lm_sampler(temp=temp, top_p=top_p if top_p < 1 else 0.0),
        logits_processors=make_logits_processors(repetition_penalty=penalty))]
    chunk, G.PREFILL_CHUNK = G.PREFILL_CHUNK, 16
    try:
        got = list(G.generate(model, None, prompt, 40, seed=11, **sampling))
    finally:
        G.PREFILL_CHUNK = chunk
    assert got == want


def test_a_kept_prompt_cache_gives_the_fresh_tokens(stories):
    """PromptCache between calls: a prompt that continues the last one (its reply included)
    and one that departs from it mid-way reuse exactly the shared start, and decode the tokens
    a fresh cache decodes (greedy and sampled, same seed)."""
    from toymlx.generation.generate import PromptCache

    model, tok = stories
    first = tok.encode(PROMPT + " there was a little girl")
    for kw in ({"temperature": 0.0}, {"temperature": 0.9, "top_p": 0.95, "seed": 4}):
        kept = PromptCache()
        reply = list(generate(model, tok, first, 16, kept=kept, **kw))
        assert len(reply) == 16  # the budget, not eos: the last token was never fed back
        assert kept.reused == 0 and kept.ids == first + reply[:-1]
        follow = first + reply + tok.encode(" and her dog")
        departs = first[:5] + tok.encode(" in a big city")
        for prompt, shared in ((follow, len(first) + 15), (departs, 5)):
            got = list(generate(model, tok, prompt, 16, kept=kept, **kw))
            assert kept.reused == shared
            assert got == list(generate(model, tok, prompt, 16, **kw))


def test_generation_does_not_import_mlx_lm_or_transformers():
    """What makes toymlx-generate start in about a second: nothing of mlx-lm's package."""
    code = ("import sys, toymlx.generation.generate, toymlx_cli.generate; "
            "print(sorted(m for m in ('mlx_lm', 'transformers', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120)
    assert out.stdout.strip() == "[]"


def make_run_dir(root: Path, gguf: Path, step: int = 5) -> Path:
    run = root / "runs" / "demo"
    weights = run / "weights"
    weights.mkdir(parents=True)
    target = weights / f"step_{step}.gguf"
    shutil.copyfile(gguf, target)
    update_latest(weights, target)
    return run


def test_run_directory_as_model(tmp_path, stories_path, capsys):
    run = make_run_dir(tmp_path, stories_path)
    model, tok = load_for_generation(run)
    assert model.args.n_layers == 5 and tok.vocab_size == 512
    rc = cli.main(["--model", str(run), "--prompt", PROMPT, "--max-tokens", "12",
                   "--temperature", "0"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert out.startswith(", there was a little girl"), out
    assert "12 new tokens" in err



def test_a_large_model_is_announced_before_it_loads(stories_path, capsys, monkeypatch):
    """toymlx-generate --model of a 1B Q4_K_M (4.3 GB as float32) read and decoded it for ~16 s
    with nothing said; a model held in `memory.LOADING_NOTE_BYTES` or more now says first what
    it loads and how it is held, the line toymlx-train's lora recipe says of its base; a
    smaller one says nothing. stories260K: 292,800 F32 values, 1,171,200 bytes as float32."""
    from toymlx.training import memory

    def err(threshold: int) -> list[str]:
        monkeypatch.setattr(memory, "LOADING_NOTE_BYTES", threshold)
        assert cli.main(["--model", str(stories_path), "--prompt", PROMPT, "--max-tokens", "2",
                         "--temperature", "0", "--engine", "mlx"]) == 0
        return capsys.readouterr().err.splitlines()

    assert not any(x.startswith("toymlx: loading") for x in err(1_171_201))
    said = err(1_171_200)
    assert said[:2] == [
        "toymlx: loading stories260K.gguf (0.0 GB, F32) held as float32: about 0.0 GB",
        f"toymlx-generate: model {stories_path}"]


def test_temp_is_mlx_lm_s_spelling_of_temperature(stories_path, capsys):
    """--temp (mlx_lm.generate's and llama.cpp's flag) was refused, "did you mean
    --temperature?": it is the same option; --temp 0 is greedy (mlx_lm.generate's default), a
    sampled --temp the same tokens as --temperature with that value and seed."""
    def text(*flags: str) -> str:
        assert cli.main(["--model", str(stories_path), "--prompt", PROMPT, "--max-tokens", "12",
                         *flags]) == 0
        return capsys.readouterr().out

    greedy = text("--temp", "0")
    assert greedy.startswith(", there was a little girl") and greedy == text("--temperature", "0")
    hot = text("--temp", "1.5", "--top-p", "1", "--seed", "3")
    assert hot == text("--temperature", "1.5", "--top-p", "1", "--seed", "3") and hot != greedy


def test_llama_cli_s_and_mlx_lm_s_short_flags_are_toymlx_s_options(stories_path, capsys):
    """-p (mlx_lm.generate's and llama-cli's --prompt), -n (llama-cli's --predict) and -s (its
    --seed) were refused ("did you mean --prompt?"): they are the same options here, as is -sys
    (llama-cli's --system-prompt) of --system. -m stays refused: llama-cli's --model,
    mlx_lm.generate's --max-tokens."""
    from toymlx_cli.usage import parse_options

    def text(*flags: str) -> str:
        assert cli.main(["--model", str(stories_path), "--temp", "1.5", "--top-p", "1",
                         *flags]) == 0
        return capsys.readouterr().out

    short = text("-p", PROMPT, "-n", "9", "-s", "3")
    assert short == text("--prompt", PROMPT, "--max-tokens", "9", "--seed", "3")
    assert short != text("--prompt", PROMPT, "--max-tokens", "9", "--seed", "4")
    assert short != text("--prompt", PROMPT, "--max-tokens", "10", "--seed", "3")
    args = parse_options(cli.Args, ["--model", "m", "-sys", "Be brief.", "-p", "Hi"], cli.PROG)
    assert (args.system, args.prompt) == ("Be brief.", "Hi")


def test_a_file_s_value_refused_is_named_by_its_key_unless_a_flag_gave_it(tmp_path, capsys):
    """A later check on a -c file's value names the file and its key (it named the flag, not
    typed); a value the command line gives over the file, by any spelling (--temp, the alias),
    is named as a flag, not blamed on the file."""
    f = tmp_path / "g.yaml"
    f.write_text("model: nowhere.gguf\nprompt: hi\ntemperature: -1\n")
    assert cli.main(["-c", str(f)]) == 2
    assert capsys.readouterr().err == (f"toymlx-generate: error: {f}: key 'temperature': "
                                       "expected a finite number >= 0, found -1.0\n")
    f.write_text("model: nowhere.gguf\nprompt: hi\ntemperature: 0.5\n")
    for flags in (["--temp", "-1"], ["--temperature=-1"]):
        assert cli.main(["-c", str(f), *flags]) == 2
        typed = flags[0].partition("=")[0]
        assert capsys.readouterr().err.startswith(f"toymlx-generate: error: {typed}: ")


@pytest.mark.parametrize("flags, said", [
    (["--temp", "-1"], "--temp: expected a finite number >= 0, found -1.0"),
    (["--temp=nan"], "--temp: expected a finite number >= 0, found nan"),
    (["--temp", "0", "--num-samples", "2"], ("--temp: expected > 0 with --num-samples 2, "
     "found 0 (greedy: every sample would be the same text; drop --num-samples)")),
    (["-n", "-1"], ("-n: expected a count >= 0, found -1; for llama.cpp's -n -1 (on to the "
     "end) give a large count, e.g. --max-tokens 100000: generation stops at an "
     "end-of-generation token (or at the model's window, with --no-context-shift)")),
    (["--max_tokens=-1", "--seed", "1"], ("--max_tokens: expected a count >= 0, found -1; for "
     "llama.cpp's -n -1 (on to the end) give a large count, e.g. --max-tokens 100000: "
     "generation stops at an end-of-generation token (or at the model's window, with "
     "--no-context-shift)")),
    (["--seed", "1", "-s", "-1"], "-s: expected 0..18446744073709551615, found -1"),
    (["-s", "1", "--seed", "-1"], "--seed: expected 0..18446744073709551615, found -1"),
    (["-sys", "\udcff"], "-sys: expected UTF-8 text, found the byte 0xff at character 0"),
    (["--system-prompt=\udcff"], ("--system-prompt: expected UTF-8 text, found the byte 0xff "
     "at character 0")),
    (["--system", "\udcff"], "--system: expected UTF-8 text, found the byte 0xff at character 0"),
    # a second flag of the line, typed short (-p) or with underscores (--num_samples)
    (["--chat", "-p", "", "--num_samples", "2"], ("--num_samples 2: expected a -p (a --chat "
     "conversation answers each turn once), found none")),
    (["--temp", "0", "--num_samples", "2"], ("--temp: expected > 0 with --num_samples 2, found 0 "
     "(greedy: every sample would be the same text; drop --num-samples)")),
])
def test_refused_flag_is_named_as_typed(flags, said, capsys):
    """A refused value was named by its option's own flag (--temperature, --max-tokens, --seed,
    --system), one the user may never have typed (--temp, -n, -s, -sys, --system-prompt:
    mlx_lm.generate's and llama-cli's spellings); now as typed, at its last use (tyro's), in
    the one place every forward command's refusals pass (`line_as_typed`)."""
    assert cli.main(["--model", "nowhere.gguf", "-p", "hi", *flags]) == 2
    assert capsys.readouterr().err == f"toymlx-generate: error: {said}\n"


def test_prompt_from_empty_stdin_is_named_as_typed(monkeypatch, capsys):
    """-p - over an empty stdin named --prompt -, not typed."""
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"")))
    assert cli.main(["--model", "nowhere.gguf", "-p", "-"]) == 2
    assert capsys.readouterr().err == ("toymlx-generate: error: -p -: expected the prompt's text "
                                       "on stdin, found it empty (ended at once)\n")


def test_a_latin1_prompt_on_stdin_gets_the_iconv_hint_a_training_file_gets(monkeypatch,
                                                                           capsys):
    """A Latin-1 prompt piped to -p - was refused without the hint a training file gets (which
    byte it is in Windows-1252, and the iconv that converts it): now the same helper gives it."""
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO("café au lait".encode("latin-1"))))
    assert cli.main(["--model", "nowhere.gguf", "-p", "-"]) == 2
    assert capsys.readouterr().err == (
        "toymlx-generate: error: stdin: expected UTF-8 text, found the byte 0xe9 at byte 3 (0xe9 "
        "is 'é' in Windows-1252, Latin-1's superset: pipe it through iconv -f CP1252 -t "
        "UTF-8)\n")


def test_samples_refused_for_a_file_s_value_name_its_key(tmp_path, capsys):
    """A -c file's `temp: 0` (or a `seed:` too high) with --num-samples 2 named --temperature
    (--seed) in the middle of a line on --num-samples; the line now leads with that option, so
    it names the file's key (and a flag that gives it over the file, as typed)."""
    f = tmp_path / "g.yaml"
    f.write_text("model: nowhere.gguf\nprompt: hi\ntemp: 0\n")
    why = ("expected > 0 with --num-samples 2, found 0 (greedy: every sample would be the same "
           "text; drop --num-samples)")
    assert cli.main(["-c", str(f), "--num-samples", "2"]) == 2
    assert capsys.readouterr().err == f"toymlx-generate: error: {f}: key 'temp': {why}\n"
    assert cli.main(["-c", str(f), "--num-samples", "2", "--temperature", "0"]) == 2
    assert capsys.readouterr().err == f"toymlx-generate: error: --temperature: {why}\n"
    f.write_text(f"model: nowhere.gguf\nprompt: hi\nseed: {2**64 - 1}\n")
    assert cli.main(["-c", str(f), "--num-samples", "2"]) == 2
    assert capsys.readouterr().err == (f"toymlx-generate: error: {f}: key 'seed': expected <= "
                                       f"{2**64 - 2} with --num-samples 2 (the samples' seeds "
                                       f"run from it up to {2**64 - 1}), found {2**64 - 1}\n")


def test_system_prompt_is_system(stories_path, tmp_path, capsys):
    """--system-prompt (mlx_lm.generate's and llama-cli's long flag) was refused with a hint
    ("mlx-lm's --system-prompt is toymlx-generate's --system"); it is --system's alias, as -sys
    is, on the command line and as a -c file's key."""
    from toymlx_cli.usage import parse_options

    for flags in (["--system-prompt", "Be brief."], ["--system-prompt=Be brief."]):
        args = parse_options(cli.Args, ["--model", "m", *flags, "-p", "Hi"], cli.PROG)
        assert (args.system, args.prompt) == ("Be brief.", "Hi")
    f = tmp_path / "g.yaml"  # a later check names the key as the file spells it
    f.write_text(f"model: {stories_path}\nsystem_prompt: Be brief.\nprompt: Hi\n"
                 "ignore_chat_template: true\n")
    assert cli.main(["-c", str(f)]) == 2
    assert capsys.readouterr().err == (
        f"toymlx-generate: error: {f}: key 'system_prompt': expected a prompt rendered through "
        "a chat template, found --ignore-chat-template\n")

def test_stream_prints_multibyte_characters_whole(monkeypatch):
    from toymlx.data.tokenizer import byte_tokenizer
    from toymlx.generation import generate as gen

    tok = byte_tokenizer()
    text = "héllo ✓ 日本 🙂!\n"
    new = tok.encode(text, add_bos=False)
    assert len(new) == len(text.encode())  # one token per byte

    monkeypatch.setattr(gen, "generate", lambda *a, **k: iter(new))
    writes = []

    class Out(io.StringIO):
        def write(self, s):
            writes.append(s)
            return super().write(s)

    out = Out()
    args = cli.Args(model="x", prompt="a", max_tokens=len(new))
    shown, n = cli.stream(None, tok, tok.encode("a"), args, out=out)
    assert shown == text and out.getvalue() == text and n == len(new)
    assert not any("\ufffd" in w for w in writes)
    assert len(writes) == len(text)  # one write per complete character


def test_chat_needs_a_template(stories_path, capsys):
    rc = cli.main(["--model", str(stories_path), "--prompt", "hi", "--chat"])
    err = capsys.readouterr().err
    assert rc == 2 and "chat_template" in err and len(err.strip().splitlines()) == 1


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def with_template(stories_path, path: Path, template: str) -> Path:
    """stories260K written to `path` with `template` as its tokenizer.chat_template (its
    vocabulary has none of the template's special tokens: their text is tokenized as text)."""
    from toymlx.gguf.reader import GGUFFile

    with GGUFFile(stories_path) as g:
        write_gguf(path, {**g.metadata, "tokenizer.chat_template": template},
                   {n: g.load(n) for n in g.tensors}, types=dict(g.metadata_types))
    return path


@pytest.fixture(scope="module")
def chat_path(tmp_path_factory, stories_path):
    """stories260K with a ChatML template in its metadata."""
    return with_template(stories_path, tmp_path_factory.mktemp("chat") / "stories-chat.gguf",
                         CHATML)


@pytest.fixture(scope="module")
def gemma_chat_path(tmp_path_factory, stories_path):
    """stories260K with Gemma 2's chat template (no system role)."""
    return with_template(stories_path,
                         tmp_path_factory.mktemp("gemma-chat") / "stories-gemma.gguf", GEMMA2)


def test_system_on_a_template_without_the_role_goes_where_llamacpp_puts_it(gemma_chat_path,
                                                                         capsys):
    """Gemma's template raises "System role not supported" on a system message: --system was a
    jinja2 traceback. Now its text starts the first user message, as llama.cpp's own Gemma
    template renders it (GEMMA_LLAMACPP, from llama_chat_apply_template), and a line says so;
    a template that takes a system role still gets one."""
    from toymlx.generation.generate import load_for_generation

    _, tok = load_for_generation(gemma_chat_path)
    args = cli.Args(model=str(gemma_chat_path), prompt=GEMMA_CONVERSATION[-1]["content"],
                    system=GEMMA_SYSTEM)
    ids = cli.prompt_ids(tok, args, GEMMA_CONVERSATION[:-1])
    assert ids[0] == tok.bos_id and tok.bos_id not in ids[1:]  # the template's BOS, once
    assert tok.decode(ids) == GEMMA_LLAMACPP
    rc = cli.main(["--model", str(gemma_chat_path), "--prompt", "Hi", "--system", "Be brief.",
                   "--max-tokens", "3", "--temperature", "0"])
    err = capsys.readouterr().err.splitlines()
    assert rc == 0
    assert err[1] == (f"toymlx-generate: {gemma_chat_path}: its chat template has no system role "
                      "(it raises 'System role not supported'): --system starts the first user "
                      "message instead, a blank line after it, as llama.cpp's Gemma template "
                      "puts it")
    assert cli.system_note(tok, cli.Args(model="m", prompt="Hi"), "m") is None  # no --system


def test_system_on_a_template_with_the_role_is_a_system_message(chat_path, capsys):
    from toymlx.generation.generate import load_for_generation

    _, tok = load_for_generation(chat_path)
    args = cli.Args(model=str(chat_path), prompt="Hi", system="Be brief.")
    assert tok.decode(cli.prompt_ids(tok, args)) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n")
    assert cli.system_note(tok, args, "m") is None


def test_an_error_the_template_raises_is_one_line(tmp_path, stories_path, capsys):
    """A template's own raise_exception on the prompt (here: any conversation) was a jinja2
    traceback; now one line naming the file, the roles and the template's message."""
    path = with_template(stories_path, tmp_path / "raising.gguf",
                         "{{ raise_exception('Only tool turns are supported') }}")
    rc = cli.main(["--model", str(path), "--prompt", "Hi", "--system", "Be brief."])
    err = capsys.readouterr().err
    assert rc == 2 and err.splitlines() == [
        (f"toymlx-generate: error: {path}: tokenizer.chat_template: expected to render a "
         "conversation of roles system, user, found the template's error: Only tool turns are "
         "supported")]


def test_chat_without_a_prompt_is_a_conversation(chat_path, capsys, monkeypatch):
    """--chat with no --prompt reads turns from stdin: the first answer is the one-shot
    --chat answer, the second is generated from the template over the whole conversation
    (first answer included), /reset starts over (the one-shot answer again), Ctrl-D ends."""
    from toymlx.generation.generate import generate, load_for_generation

    flags = ["--model", str(chat_path), "--chat", "--temperature", "0", "--max-tokens", "12"]
    assert cli.main([*flags, "--prompt", "Tell me a story"]) == 0
    one_shot = capsys.readouterr().out.strip()

    model, tok = load_for_generation(chat_path)
    args = cli.Args(model=str(chat_path), chat=True, prompt="About a cat")
    history = [{"role": "user", "content": "Tell me a story"},
               {"role": "assistant", "content": one_shot}]
    second = tok.decode(list(generate(model, tok, cli.prompt_ids(tok, args, history), 12)))

    stdin = io.StringIO("Tell me a story\nAbout a cat\n\n/reset\nTell me a story\n")
    turns = cli.chat(model, tok, cli.Args(model=str(chat_path), chat=True, temperature=0.0,
                                           max_tokens=12), model.args.context, stdin,
                     out := io.StringIO())
    replies = out.getvalue().splitlines()
    assert turns == 3 and one_shot and second.strip() != one_shot
    assert replies == [one_shot, second.strip(), one_shot]

    # the command itself, reading its standard input
    monkeypatch.setattr(sys, "stdin", io.StringIO("Tell me a story\nAbout a cat\n/quit\nnot read\n"))
    assert cli.main(flags) == 0
    assert capsys.readouterr().out.splitlines() == [one_shot, second.strip()]


def test_a_conversation_traces_its_decoder_once_and_keeps_its_kv_cache(chat_path, monkeypatch):
    """--chat made generate's CPU decoder (`CompiledDecode`) anew for every turn, so every turn
    traced each block's one-token step again (a function given to `mx.compile` runs only when
    it is traced): 10 traces a turn here, 60 for SmolLM2. Now the blocks are traced at the first
    turn alone, the turn after /reset included; each turn's prefill computes only what the
    conversation added (the last turn's prompt and reply come from the kept KV cache); and each
    reply is, token for token, the one a fresh decoder and cache give that turn's prompt with
    the same seed (sampled), as every turn was answered before."""
    from toymlx.backend.device import on_gpu
    from toymlx.generation import generate as gen

    model, tok = gen.load_for_generation(chat_path)
    args = cli.Args(model=str(chat_path), chat=True, temperature=0.8, seed=7, max_tokens=12)
    lines = ["Tell me a story", "About a cat", "/reset", "And a dog"]
    want, prompts, replies, history = [], [], [], []
    for text in lines:  # each turn from its own decoder and an empty cache
        if text == "/reset":
            history = []
            continue
        turn = cli.Args(**{**vars(args), "prompt": text})
        ids = cli.prompt_ids(tok, turn, history)
        reply, _ = cli.stream(model, tok, ids, turn, out=io.StringIO())
        prompts.append(ids)
        replies.append(list(generate(model, tok, ids, 12, 0.8, args.top_p, 7)))
        want.append(reply)
        history += [{"role": "user", "content": text},
                    {"role": "assistant", "content": reply.strip()}]
    assert len(set(want)) == 3 and all(len(r) == 12 for r in replies)  # each ran to its budget

    traced = []  # at each trace, the turn it is in (from 1: the turns that took a cache)
    took = []  # (prompt tokens, tokens taken from the kept cache) of each turn
    real_compile, real_take = mx.compile, gen.PromptCache.take

    def counted_compile(fun, **kw):
        def traced_fun(*a, **k):
            traced.append(len(took))
            return fun(*a, **k)
        return real_compile(traced_fun, **kw)

    def counted_take(self, m, ids):
        layers = real_take(self, m, ids)
        took.append((len(ids), self.reused))
        return layers

    monkeypatch.setattr(mx, "compile", counted_compile)
    monkeypatch.setattr(gen.PromptCache, "take", counted_take)
    turns = cli.chat(model, tok, args, model.args.context,
                     io.StringIO("".join(x + "\n" for x in lines)), out := io.StringIO())
    assert turns == 3 and out.getvalue().splitlines() == want
    assert traced == ([] if on_gpu() else [1] * 2 * len(model.layers))
    # turn 2: all that turn 1 computed, its prompt and its reply but the last token (never fed
    # back: the budget ended there); after /reset, nothing
    shared = len(prompts[0]) + 11
    assert prompts[1][:shared] == prompts[0] + replies[0][:11]
    assert took == [(len(prompts[0]), 0), (len(prompts[1]), shared), (len(prompts[2]), 0)]


@pytest.mark.parametrize("prompt,flag,found", [
    ("ab\udcffc", "--prompt", "the byte 0xff at character 2"),  # argv's undecodable byte
    ("ab\ud800", "--prompt", "a lone surrogate U+D800 at character 2"),
    ("\udcc3", "--system", "the byte 0xc3 at character 0"),
])
def test_text_that_is_not_utf8_is_one_line(stories_path, capsys, prompt, flag, found):
    """Invalid UTF-8 in --prompt crashed the tokenizer (`TypeError: TextInputSequence must be
    str`)."""
    other = ["--prompt", "hi", "--chat", "--system", prompt] if flag == "--system" else \
        ["--prompt", prompt]
    assert cli.main(["--model", str(stories_path), *other, "--max-tokens", "2"]) == 2
    out, err = capsys.readouterr()
    assert err == f"toymlx-generate: error: {flag}: expected UTF-8 text, found {found}\n"
    assert out == ""


@pytest.mark.parametrize("flags,want", [
    (["--temperature", "nan"], "--temperature: expected a finite number >= 0, found nan"),
    (["--temperature", "inf"], "--temperature: expected a finite number >= 0, found inf"),
    (["--top-k", "-1"], "--top-k: expected >= 0 (0: off), found -1"),
    (["--max-tokens", "-1"], ("--max-tokens: expected a count >= 0, found -1; for llama.cpp's "
     "-n -1 (on to the end) give a large count, e.g. --max-tokens 100000: generation stops at an "
     "end-of-generation token (or at the model's window, with --no-context-shift)")),
    (["--min-p", "1.5"], "--min-p: expected in [0, 1) (0: off), found 1.5"),
    (["--repetition-penalty", "0"], ("--repetition-penalty: expected a finite number > 0, "
     "found 0.0")),
])
def test_sampler_options_out_of_range_are_one_line(stories_path, capsys,
                                                                     flags, want):
    """A nan temperature sampled from nan logits."""
    assert cli.main(["--model", str(stories_path), "--prompt", "hi", *flags]) == 2
    out, err = capsys.readouterr()
    assert (out, err) == ("", f"toymlx-generate: error: {want}\n")


@pytest.mark.parametrize("engine", ["mlx", "llama.cpp"])
@pytest.mark.parametrize("temperature", ["0", "0.7"])
@pytest.mark.parametrize("k", ["512", "100000"])
def test_a_top_k_past_the_vocabulary_is_refused_before_the_weights_load(
        stories_path, capsys, monkeypatch, engine, temperature, k):
    """--top-k at or past stories260K's 512 tokens was refused only by the sampler, after the
    weights loaded and the prompt's prefill, with the "model" line already printed; greedy
    (--temperature 0) and the llama.cpp engine took it silently. Now it is one line from the
    header alone: loading the weights or starting llama.cpp here fails the test."""
    import toymlx.generation.generate as gen

    def no_load(*a, **k):
        raise AssertionError("the weights were loaded before --top-k was checked")

    monkeypatch.setattr(gen, "load_llama", no_load)
    monkeypatch.setattr(gen, "LlamaCppDecoder", no_load)
    monkeypatch.setattr(gen, "choose_engine", lambda name, gpu: name)
    assert cli.main(["--model", str(stories_path), "--prompt", "Once", "--top-k", k,
                     "--temperature", temperature, "--engine", engine]) == 2
    want = (f"toymlx-generate: error: {stories_path}: --top-k: expected 0 (off) or below 512 "
            f"(the model's vocabulary), found {k}\n")
    assert capsys.readouterr() == ("", want)


def test_generate_refuses_a_top_k_past_the_vocabulary_even_greedy(stories):
    """The library's `generate` checks --top-k against the model before the prompt's prefill,
    at temperature 0 too (where no sampler ever looked at it)."""
    model, tok = stories
    for temperature in (0.0, 0.8):
        with pytest.raises(ValueError) as e:
            next(generate(model, tok, tok.encode(PROMPT), 4, temperature, top_k=512))
        assert str(e.value) == ("--top-k: expected 0 (off) or below 512 (the model's "
                                "vocabulary), found 512")
    assert len(list(generate(model, tok, tok.encode(PROMPT), 4, 0.8, top_k=511))) == 4


def test_generate_checks_the_prompt_ids_a_script_gives(stories):
    """From Python, `generate(model, tok, [10**9])` read past the token table (a segmentation
    fault), a str prompt and numpy's ids (`np.array(tok.encode(...))`) failed in MLX
    ("Invalid type int64 received in array initialization")."""
    import numpy as np

    model, tok = stories
    ids = tok.encode(PROMPT)
    assert list(generate(model, tok, np.array(ids), 4)) == list(generate(model, tok, ids, 4))
    for bad, kind, want in [
            (PROMPT, TypeError, ("prompt_ids: expected a list of token ids "
                                 "(tokenizer.encode(text)), found a str")),
            ([ids[0], 512], ValueError, ("prompt_ids[1]: expected a token id in 0..511 (the "
                                         "model's vocabulary), found 512")),
            ([-1], ValueError, ("prompt_ids[0]: expected a token id in 0..511 (the model's "
                                "vocabulary), found -1")),
            ([1.0], TypeError, "prompt_ids[0]: expected an int token id, found 1.0")]:
        with pytest.raises(kind) as e:
            next(generate(model, tok, bad, 4))
        assert str(e.value) == want
    # max_tokens -1 yielded nothing without a word, "3" failed in Python's comparison
    for bad in (-1, "3", 2.0, True):
        with pytest.raises(ValueError) as e:
            next(generate(model, tok, ids, bad))
        assert str(e.value) == f"max_tokens: expected an integer >= 0, found {bad!r}"
    assert list(generate(model, tok, ids, 0)) == []
    assert list(generate(model, tok, ids, np.int64(4))) == list(generate(model, tok, ids, 4))


def test_a_chat_turn_that_is_not_utf8_is_refused_and_the_conversation_goes_on(chat_path,
                                                                             capsys):
    """A bad turn read from stdin crashed --chat and lost the conversation: now it is one line,
    and the next turns answer as if it had not been typed."""
    from toymlx.generation.generate import load_for_generation

    model, tok = load_for_generation(chat_path)
    args = cli.Args(model=str(chat_path), chat=True, temperature=0.0, max_tokens=12)
    replies = {}
    for case, raw in [("clean", b"Tell me a story\nAbout a cat\n"),
                      ("bad byte", b"Tell me a story\nA \xff dog\nAbout a cat\n"),
                      ("cut sequence", b"Tell me a story\n\xe2\x82\nAbout a cat\n")]:
        stdin = io.TextIOWrapper(io.BytesIO(raw), encoding="utf-8")
        turns = cli.chat(model, tok, args, model.args.context, stdin, out := io.StringIO())
        replies[case] = (turns, out.getvalue(), capsys.readouterr().err)
    assert replies["clean"][0] == 2 and replies["clean"][2] == ""
    latin1 = "in Windows-1252, Latin-1's superset: pipe it through iconv -f CP1252 -t UTF-8)"
    for case, at in (("bad byte", f"the byte 0xff at byte 2 (0xff is 'ÿ' {latin1}"),
                     ("cut sequence", f"the byte 0xe2 at byte 0 (0xe2 is 'â' {latin1}")):
        assert replies[case][:2] == replies["clean"][:2]
        assert replies[case][2] == (f"toymlx-generate: error: stdin line 2: expected UTF-8 text, "
                                    f"found {at}; the turn is skipped, the conversation goes on\n")
    # a text stream (no bytes underneath) holding a lone surrogate
    turns = cli.chat(model, tok, args, model.args.context,
                     io.StringIO("Tell me a story\n\ud800\nAbout a cat\n"), out := io.StringIO())
    assert (turns, out.getvalue()) == replies["clean"][:2]
    assert "stdin line 2: expected UTF-8 text, found a lone surrogate U+D800 at character 0" \
        in capsys.readouterr().err


@pytest.mark.interop
def test_llamacpp_chat_answers_every_turn(chat_path, capsys, monkeypatch):
    """--engine llama.cpp --chat with the turns on stdin: one llama.cpp child answers each turn
    (and the turn after /reset) with the words MLX's engine gives, greedy on the F32 model."""
    flags = ["--model", str(chat_path), "--chat", "--temperature", "0", "--max-tokens", "12"]
    turns = "Tell me a story\nAbout a cat\nAnd a dog\n/reset\nAbout a cat\n"
    replies = {}
    for engine in ("mlx", "llama.cpp"):
        monkeypatch.setattr(sys, "stdin", io.StringIO(turns))
        assert cli.main([*flags, "--engine", engine]) == 0
        replies[engine] = capsys.readouterr().out.splitlines()
    assert len(replies["mlx"]) == 4 and all(replies["mlx"])
    assert len(set(replies["mlx"][:3])) == 3  # each turn its own answer
    assert replies["llama.cpp"] == replies["mlx"]


def bad_inputs(tmp_path: Path, stories_path: Path) -> dict[str, tuple[Path, str]]:
    not_gguf = tmp_path / "notes.gguf"
    not_gguf.write_text("hello, not a model\n")
    gpt2 = tmp_path / "gpt2.gguf"
    write_gguf(gpt2, {"general.architecture": "gpt2", "gpt2.block_count": 1},
               {"token_embd.weight": np.zeros((4, 8), np.float32)})
    adapter = tmp_path / "adapter.gguf"
    write_gguf(adapter, {"general.architecture": "llama", "general.type": "adapter",
                         "adapter.type": "lora"},
               {"blk.0.attn_q.weight.lora_a": np.zeros((2, 64), np.float32)})
    empty_run = tmp_path / "runs" / "empty"
    (empty_run / "weights").mkdir(parents=True)
    # llama-quantize writes zeros where the header goes and the header last: a file it is
    # still writing (measured on SmolLM2's Q4_1 -> Q8_0: zeros at offset 0 until it returned)
    writing = tmp_path / "model-q8_0.gguf"
    writing.write_bytes(bytes(4096) + stories_path.read_bytes()[4096:])
    half = tmp_path / "half.gguf"
    half.write_bytes(stories_path.read_bytes()[:592688])
    return {
        "being written": (writing, (f"{writing}: magic: expected b'GGUF', found zero bytes (a "
                          "GGUF still being written: llama-quantize writes its header last; "
                          "or an incomplete copy): wait for its writer to finish")),
        "truncated": (half, (f"{half}: tensor 'blk.1.ffn_down.weight' data: expected 44032 "
                      "bytes at offset 551776, found file end at 592688 (file truncated, or "
                      "still being written?)")),
        "missing": (tmp_path / "nope.gguf", "found nothing at that path"),
        "not a GGUF": (not_gguf, "not a GGUF file"),
        "wrong architecture": (gpt2, f"expected one of {SUPPORTED}, found 'gpt2'"),
        "adapter as model": (adapter, "--adapter"),
        "run without checkpoints": (empty_run, "found no checkpoint"),
    }


def test_cli_bad_inputs_exit_2_with_one_line(tmp_path, stories_path, capsys):
    for case, (path, needle) in bad_inputs(tmp_path, stories_path).items():
        rc = cli.main(["--model", str(path), "--prompt", "hi"])
        out, err = capsys.readouterr()
        lines = err.strip().splitlines()
        assert rc == 2, case
        assert len(lines) == 1 and lines[0].startswith("toymlx-generate: error: "), (case, err)
        assert needle in lines[0], (case, lines[0])
        assert out == ""
    for flags, needle in ((["--top-p", "0"], "--top-p"), (["--temperature", "-1"],
                                                             "--temperature")):
        rc = cli.main(["--model", str(stories_path), "--prompt", "hi", *flags])
        assert rc == 2 and needle in capsys.readouterr().err


@pytest.fixture(scope="module")
def stories_adapter(stories_path, tmp_path_factory) -> Path:
    """A LoRA adapter for stories260K on q and v with random B (so it changes the output)."""
    from toymlx.models.lora import apply_lora, lora_layers
    from toymlx.training.adapter import write_adapter

    model = apply_lora(load_llama(stories_path)[0], "q,v", rank=4, alpha=8.0)
    mx.random.seed(3)
    for m in lora_layers(model).values():
        m.lora_b = 0.2 * mx.random.normal(m.lora_b.shape)
    return write_adapter(tmp_path_factory.mktemp("ad") / "ad.gguf", model,
                         {"general.architecture": "llama"})


def cli_tokens(args: list[str], capsys) -> tuple[str, str]:
    rc = cli.main(args)
    out, err = capsys.readouterr()
    assert rc == 0, err
    return out, err


def test_cli_adapter_changes_the_continuation_as_apply_adapter_does(stories_path,
                                                                   stories_adapter, capsys):
    from toymlx.training.adapter import apply_adapter

    model, tok = load_for_generation(stories_path)
    plain = tok.decode(list(generate(model, tok, tok.encode(PROMPT), 24)))
    adapted = apply_adapter(load_for_generation(stories_path)[0], stories_adapter)
    want = tok.decode(list(generate(adapted, tok, tok.encode(PROMPT), 24)))
    assert want != plain  # the adapter is real
    out, err = cli_tokens(["--model", str(stories_path), "--adapter", str(stories_adapter),
                           "--prompt", PROMPT, "--max-tokens", "24", "--temperature", "0",
                           "--engine", "mlx"], capsys)
    assert out.rstrip("\n") == want and "mlx)" in err


def test_engine_llamacpp_without_llama_cpp_python_is_one_line(monkeypatch):
    import importlib.util

    from toymlx.generation.generate import choose_engine

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llama_cpp" else real(name, *a))
    assert choose_engine("auto", on_gpu=False) == "mlx"
    with pytest.raises(ValueError, match=r"pip install 'toymlx\[interop\]'"):
        choose_engine("llama.cpp", on_gpu=False)
    assert choose_engine("auto", on_gpu=True) == "mlx"


@pytest.mark.interop
@pytest.mark.parametrize("adapter", [False, True])
def test_llamacpp_engine_decodes_what_mlx_decodes(stories_path, stories_adapter, adapter,
                                                  capsys):
    """Greedy: the same 48 tokens from both engines (stories260K in F32, with and without a LoRA
    adapter); sampled: the llama.cpp engine repeats itself for one seed."""
    flags = ["--model", str(stories_path), "--prompt", PROMPT, "--max-tokens", "48"]
    flags += ["--adapter", str(stories_adapter)] if adapter else []
    mlx_out, _ = cli_tokens([*flags, "--temperature", "0", "--engine", "mlx"], capsys)
    cpp_out, err = cli_tokens([*flags, "--temperature", "0", "--engine", "llama.cpp"], capsys)
    assert "llama.cpp)" in err
    assert cpp_out == mlx_out
    sampled = [cli_tokens([*flags, "--temperature", "1.0", "--seed", "5", "--engine",
                           "llama.cpp"], capsys)[0] for _ in range(2)]
    assert sampled[0] == sampled[1] != cpp_out


def test_console_script_error_has_no_traceback(tmp_path):
    r = subprocess.run([sys.executable, "-m", "toymlx_cli.generate", "--model",
                        str(tmp_path / "missing.gguf"), "--prompt", "hi"],
                       check=False, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_a_llamacpp_that_crashes_falls_back_to_mlx(stories_path, tmp_path):
    """A llama.cpp build that segfaults (as one did decoding Q4_1 on an AVX-512 host): --engine
    auto says so in one line and decodes with MLX; --engine llama.cpp is a one-line error."""
    shim = tmp_path / "shim" / "llama_cpp"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text("import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)\n")
    env = {**os.environ, "PYTHONPATH": str(shim.parent)}
    flags = ["--model", str(stories_path), "--prompt", PROMPT, "--max-tokens", "12",
             "--temperature", "0"]
    exe = [sys.executable, "-m", "toymlx_cli.generate"]
    auto = subprocess.run([*exe, *flags, "--engine", "auto"], capture_output=True, text=True,
                          env=env, check=False)
    assert auto.returncode == 0, auto.stderr
    assert "(killed by signal 11); decoding with MLX instead" in auto.stderr
    assert auto.stdout.startswith(", there was a little girl") and "mlx)" in auto.stderr
    forced = subprocess.run([*exe, *flags, "--engine", "llama.cpp"], capture_output=True,
                            text=True, env=env, check=False)
    assert forced.returncode == 2 and forced.stdout == ""
    want = ("toymlx-generate: error: --engine llama.cpp: llama.cpp stopped loading "
            f"{stories_path} (killed by signal 11)")
    assert forced.stderr.strip().splitlines() == [want]


def test_a_dora_adapter_decodes_in_mlx(stories_path, tmp_path, capsys):
    """llama.cpp has no DoRA adapters: --engine auto decodes a DoRA adapter with MLX (one line
    says why) and gives what apply_adapter gives, as the default engine (MLX) does; --engine
    llama.cpp refuses in one line."""
    from toymlx.models.lora import apply_lora, lora_layers
    from toymlx.training.adapter import apply_adapter, write_adapter

    model = apply_lora(load_llama(stories_path)[0], "q,v", rank=4, alpha=8.0, kind="dora")
    mx.random.seed(4)
    for m in lora_layers(model).values():
        m.lora_b = 0.05 * mx.random.normal(m.lora_b.shape)
    path = write_adapter(tmp_path / "dora.gguf", model, {"general.architecture": "llama"})
    adapted, tok = load_for_generation(stories_path)
    want = tok.decode(list(generate(apply_adapter(adapted, path), tok, tok.encode(PROMPT), 16)))
    flags = ["--model", str(stories_path), "--adapter", str(path), "--prompt", PROMPT,
             "--max-tokens", "16", "--temperature", "0"]
    assert cli_tokens(flags, capsys)[0].rstrip("\n") == want
    out, err = cli_tokens([*flags, "--engine", "auto"], capsys)
    assert out.rstrip("\n") == want and "mlx)" in err
    assert cli.main([*flags, "--engine", "llama.cpp"]) == 2
    forced = capsys.readouterr().err
    if importlib.util.find_spec("llama_cpp") is not None:  # else: the engine is not installed
        assert "llama.cpp reads only lora adapters, found 'dora'" in err
        assert "found 'dora'" in forced


def test_prompt_dash_reads_stdin_as_mlx_lm_does(stories_path, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(PROMPT.encode())))
    rc = cli.main(["--model", str(stories_path), "--prompt", "-", "--max-tokens", "12",
                   "--temperature", "0"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert out.startswith(", there was a little girl"), out  # as with --prompt PROMPT


def test_a_utf8_bom_on_stdin_is_not_part_of_the_prompt(stories_path, capsys, monkeypatch):
    """A prompt.txt saved by Windows Notepad starts with a UTF-8 BOM: `--prompt - < prompt.txt`
    fed it to the model as 3 more prompt tokens (a training text's BOM is dropped); the prompt
    and the sample are those of the file without it, and a BOM alone is an empty stdin."""
    runs = []
    for raw in (PROMPT.encode(), b"\xef\xbb\xbf" + PROMPT.encode()):
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(raw)))
        assert cli.main(["--model", str(stories_path), "--prompt", "-", "--max-tokens", "12",
                         "--temperature", "0"]) == 0
        out, err = capsys.readouterr()
        runs.append((out, [x.split(" new tokens")[0] for x in err.splitlines()
                           if " prompt + " in x]))
    assert runs[1] == runs[0] and runs[0][1] and runs[0][0].startswith(", there was")
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"\xef\xbb\xbf")))
    assert cli.main(["--model", str(stories_path), "--prompt", "-"]) == 2
    assert capsys.readouterr().err == ("toymlx-generate: error: --prompt -: expected the prompt's "
                                       "text on stdin, found it empty (ended at once)\n")


def test_an_empty_stdin_for_prompt_dash_is_refused_not_generated_from_bos(stories_path, capsys,
                                                                        monkeypatch):
    """`producer | toymlx-generate --prompt -` where the producer wrote nothing: a BOS-only
    story was printed with exit 0."""
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"")))
    assert cli.main(["--model", str(stories_path), "--prompt", "-", "--max-tokens", "3"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == ("toymlx-generate: error: --prompt -: expected the prompt's "
                                 "text on stdin, found it empty (ended at once)\n")


def test_no_prompt_on_a_tokenizer_without_bos_names_the_ways_to_give_one_before_loading(
        stories_path, chat_path, tmp_path, capsys, monkeypatch):
    """README's `toymlx-generate --model runs/chat` typed without `--prompt` (SmolLM2 adds no
    BOS): the weights loaded, then "--prompt: expected text (this tokenizer adds no BOS token),
    found an empty prompt", naming neither stdin nor --chat; now refused before they load."""
    from toymlx.generation import generate as gen
    from toymlx.gguf.reader import GGUFFile

    def no_bos(src: Path, name: str) -> Path:
        with GGUFFile(src) as g:
            path = tmp_path / name
            write_gguf(path, {**g.metadata, "tokenizer.ggml.add_bos_token": False},
                       {n: g.load(n) for n in g.tensors}, types=dict(g.metadata_types))
        return path

    def load_model(*a, **k):
        raise AssertionError("the weights loaded before the refusal")

    monkeypatch.setattr(gen, "load_model", load_model)
    start = ("toymlx-generate: error: --prompt: expected the text to answer or continue (this "
             "model's tokenizer adds no BOS token to start from), found none; give --prompt TEXT")
    for model, ways in ((no_bos(chat_path, "chat.gguf"),
                         ", --prompt - to read it from stdin, or --chat for a conversation"),
                        (no_bos(stories_path, "raw.gguf"), ", or --prompt - to read it from stdin")):
        for extra in ([], ["--prompt", ""], ["--ignore-chat-template"]):
            assert cli.main(["--model", str(model), *extra]) == 2
            out, err = capsys.readouterr()
            assert out == "" and err == start + ways + "\n", (extra, err)


def test_nanogpts_file_prompt_is_refused_not_taken_as_the_text(stories_path, capsys, tmp_path,
                                                                monkeypatch):
    """sample.py's `--start=FILE:prompt.txt` habit as `--prompt FILE:prompt.txt`: the story went
    on from the 15 characters `FILE:prompt.txt`, exit 0. A name that is not there (a typo) is
    refused too, saying so (it was generated from as the text, exit 0); a text that cannot be a
    file's name (a space after FILE:, too long: it was refused, "[Errno 36] File name too long")
    is text."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my prompt.txt").write_text(PROMPT)
    assert cli.main(["--model", str(stories_path), "--prompt", "FILE:my prompt.txt"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == (
        "toymlx-generate: error: --prompt: expected the prompt's text, found nanoGPT's "
        "'FILE:my prompt.txt' (sample.py's --start=FILE:...); to read my prompt.txt: "
        "--prompt - < 'my prompt.txt'\n")
    assert cli.main(["--model", str(stories_path), "--prompt", "FILE:promt.txt"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == (
        "toymlx-generate: error: --prompt: expected the prompt's text, found nanoGPT's "
        "'FILE:promt.txt' (sample.py's --start=FILE:...), and no file promt.txt is there; to "
        "read a file: --prompt - < FILE\n")
    for text in ("FILE: notes", "FILE:" + "a_long_name" * 30, "FILE:two\nlines"):
        assert cli.main(["--model", str(stories_path), "--prompt", text, "--max-tokens", "2",
                         "--temperature", "0"]) == 0


def test_device_gpu_with_the_llamacpp_engine_is_refused(stories_path, capsys):
    """The llama.cpp engine's child decodes on the CPU: --device gpu was accepted and unused
    (where MLX has a GPU) or refused for a reason that is not the one (where it has none)."""
    assert cli.main(["--model", str(stories_path), "--prompt", "hi", "--device", "gpu",
                     "--engine", "llama.cpp"]) == 2
    assert capsys.readouterr().err == (
        "toymlx-generate: error: --device gpu: expected --engine mlx or auto (--engine llama.cpp "
        "decodes on the CPU), found --engine llama.cpp\n")


def test_an_endless_stdin_is_refused_at_the_limit_not_read_until_memory_ends(
        stories_path, chat_path, capsys, monkeypatch):
    """`--prompt - < /dev/zero` or `yes | toymlx-generate --prompt -` read stdin to its end,
    which never came (3.2 GB after 20 s); a --chat line without a line end the same. Now
    at most STDIN_LIMIT + 1 bytes are read (here the limit is lowered to 1000), then one
    line, exit status 2."""
    from toymlx.generation.generate import load_for_generation

    monkeypatch.setattr(cli, "STDIN_LIMIT", 1000)
    want = ("expected at most 1,000 bytes (16 MiB, more than any model's context holds), "
            "found more; is stdin an endless stream?")
    raw = io.BytesIO(b"y\n" * 50_000)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(raw))
    assert cli.main(["--model", str(stories_path), "--prompt", "-", "--max-tokens", "2"]) == 2
    assert capsys.readouterr() == ("", f"toymlx-generate: error: --prompt -: stdin: {want}\n")
    assert raw.tell() == 1001
    model, tok = load_for_generation(chat_path)
    args = cli.Args(model=str(chat_path), chat=True, temperature=0.0, max_tokens=4)
    raw = io.BytesIO(b"Tell me a story\n" + b"\0" * 50_000)
    with pytest.raises(cli.UsageError) as e:
        cli.chat(model, tok, args, model.args.context, io.TextIOWrapper(raw), io.StringIO())
    assert str(e.value) == f"stdin line 2: {want}"
    assert raw.tell() == 16 + 1001


def test_a_generation_cut_by_the_context_says_so(stories_path, tmp_path, capsys):
    """--no-context-shift stops at the model's context, and says so; by default the context
    shift goes on to --max-tokens, from the same first tokens, on both engines."""
    from toymlx.gguf.fuse import write_with_tensors
    from toymlx.gguf.reader import GGUFFile

    short = tmp_path / "short.gguf"
    with GGUFFile(stories_path) as g:
        write_with_tensors(short, g, {}, {"llama.context_length": 24})
    flags = ["--model", str(short), "--prompt", PROMPT, "--max-tokens", "100", "--temperature",
             "0"]
    for engine in ("mlx", *(("llama.cpp",) if importlib.util.find_spec("llama_cpp") else ())):
        rc = cli.main([*flags, "--engine", engine, "--no-context-shift"])
        stopped, err = capsys.readouterr()
        assert rc == 0, err
        line = next(ln for ln in err.splitlines() if "stopped at" in ln)
        prompt = int(err.split(" prompt + ")[0].rsplit(" ", 1)[-1])
        assert line == (f"toymlx-generate: stopped at the model's context (24 tokens): {prompt} "
                        f"prompt + {24 - prompt} new tokens fill it (--max-tokens 100, "
                        "--no-context-shift)"), err
        shifted, err = cli_tokens([*flags, "--engine", engine], capsys)
        assert f"{prompt} prompt + 100 new tokens" in err and "stopped at" not in err
        assert shifted.startswith(stopped.rstrip("\n")) and len(shifted) > 3 * len(stopped)


def test_llamacpp_threads_follow_the_idle_cores(monkeypatch):
    """The llama.cpp engine decodes on one thread per idle core: its threads wait for each other
    after every matmul, so a thread on a core other work holds stalls the rest."""
    from toymlx.generation import llamacpp_decode as d

    assert [d.decode_threads(2, idle) for idle in (0.0, 0.4, 0.6, 1.0, 1.49, 1.5, 2.0, 3.0)] == \
        [1, 1, 1, 1, 1, 2, 2, 2]
    assert d.decode_threads(16, 11.7) == 12
    # two /proc/stat snapshots 0.1 s apart: 150 of 200 jiffies idle (+ iowait) on 2 cores
    snaps = iter([(1000, 5000), (1150, 5200)])
    monkeypatch.setattr(d, "_cpu_times", lambda: next(snaps))
    monkeypatch.setattr(d.os, "cpu_count", lambda: 2)
    assert d.idle_cores(window=0.0) == pytest.approx(1.5)
    # without /proc/stat (macOS): the cores less the 1-minute load average
    monkeypatch.setattr(d, "_cpu_times", lambda: None)
    monkeypatch.setattr(d.os, "getloadavg", lambda: (1.25, 0.0, 0.0))
    assert d.idle_cores() == pytest.approx(0.75)


def test_cpu_times_reads_this_machine():
    from toymlx.generation import llamacpp_decode as d

    got = d._cpu_times()
    if got is None:
        pytest.skip("no /proc/stat on this system")
    idle, total = got
    assert 0 <= idle <= total and total > 0


def test_mlx_decoding_on_the_cpu_runs_the_blas_on_the_idle_cores(stories, monkeypatch):
    """Where MLX computes on the CPU, `generate` runs OpenBLAS on one thread per idle core while
    it decodes (as the llama.cpp engine picks its threads) and gives its thread count back after
    the last token; the tokens are those decoded on every thread."""
    from toymlx.backend.device import blas_threads, on_gpu
    from toymlx.generation import generate as g

    have = blas_threads()
    if on_gpu() or have is None or have < 2:
        pytest.skip("needs MLX on the CPU with a toymlx-controlled BLAS on 2+ threads")
    model, tok = stories
    ids = tok.encode(PROMPT)

    def decode_seeing_threads(idle: float) -> tuple[list[int], set[int | None]]:
        monkeypatch.setattr(g, "DECODING_IDLE", lambda: idle)
        out, seen = [], set()
        for t in generate(model, tok, ids, 12):
            seen.add(blas_threads())  # between tokens, while the next one is computed
            out.append(t)
        assert blas_threads() == have  # given back
        return out, seen

    every, seen_idle = decode_seeing_threads(float(have))
    assert seen_idle == {have}
    busy, seen_busy = decode_seeing_threads(1.0)  # other work holds all cores but one
    assert seen_busy == {1}
    assert busy == every and len(every) == 12
    none_idle, seen_none = decode_seeing_threads(0.0)
    assert seen_none == {1} and none_idle == every
    early = generate(model, tok, ids, 12)  # a caller that stops reading early
    next(early)
    assert blas_threads() == 1  # idle_cores still says 0.0
    early.close()
    assert blas_threads() == have


def test_idle_cores_are_sampled_once_not_at_every_decoding_call(monkeypatch):
    """Each decoding call slept 0.1 s to sample the idle cores: every turn of a --chat and
    every prompt of a batch paid it. `IdleCores` sleeps at the first call only; later calls
    measure over the time since the call before (its decoding, this process's own CPU time
    counted idle), a window under 0.1 s takes the last figure, one over a minute samples anew;
    without /proc/stat every call reads the load average (no sleep)."""
    from toymlx.generation import llamacpp_decode as d

    sampled = []

    def idle_cores():
        sampled.append(1)
        return 1.25

    monkeypatch.setattr(d, "idle_cores", idle_cores)
    monkeypatch.setattr(d.os, "cpu_count", lambda: 2)
    # (idle, total, own jiffies, seconds): 2 cores, 100 jiffies a second each
    marks = iter([d.CpuMark(0, 0, 0, 0.0),  # the first call: sampled
                  d.CpuMark(10, 20, 0, 0.1),  # read after the sample (the window's start)
                  d.CpuMark(110, 420, 150, 2.1),  # 100 idle + 150 own of 400: 1.25 cores
                  d.CpuMark(112, 430, 150, 2.15),  # 0.05 s later: the last figure
                  d.CpuMark(420, 830, 150, 4.1),  # 310 idle of 410 since 2.1 s (not 2.15)
                  d.CpuMark(0, 0, 0, 70.0),  # over a minute since: sampled anew
                  d.CpuMark(0, 0, 0, 70.1)])
    monkeypatch.setattr(d, "cpu_mark", lambda: next(marks))
    idle = d.IdleCores()
    got = [idle() for _ in range(5)]
    assert got == [1.25, 1.25, 1.25, pytest.approx(2 * 310 / 410), 1.25]
    assert len(sampled) == 2
    monkeypatch.setattr(d, "cpu_mark", lambda: None)  # macOS: the load average each call
    assert [idle(), idle()] == [1.25, 1.25] and len(sampled) == 4


def test_a_chat_samples_the_idle_cores_at_its_first_turn_only(chat_path, monkeypatch):
    """Where MLX decodes on 2+ BLAS threads, a --chat conversation's turns slept 0.1 s each to
    sample the idle cores (`decoding_blas_threads`); now its first turn only does."""
    from toymlx.backend.device import blas_threads, on_gpu
    from toymlx.generation import generate as g
    from toymlx.generation import llamacpp_decode as d

    have = blas_threads()
    if on_gpu() or have is None or have < 2:
        pytest.skip("needs MLX on the CPU with a toymlx-controlled BLAS on 2+ threads")
    sampled = []
    real = d.idle_cores
    monkeypatch.setattr(d, "idle_cores", lambda: sampled.append(1) or real(0.0))
    monkeypatch.setattr(g, "DECODING_IDLE", d.IdleCores())  # as a fresh process's
    model, tok = g.load_for_generation(chat_path)
    stdin = io.StringIO("Tell me a story\nAbout a cat\nAnd a dog\nThe end\n")
    turns = cli.chat(model, tok, cli.Args(model=str(chat_path), chat=True, temperature=0.0,
                                           max_tokens=4), model.args.context, stdin,
                     io.StringIO())
    assert turns == 4 and len(sampled) == 1


def test_a_model_of_the_other_kind_names_the_command_that_uses_it(tmp_path, stories_path,
                                                                  shared_file, capsys):
    """toymlx-generate given a vit-tiny checkpoint (or run) said only "expected one of llama,
    qwen2, ... found 'vit'", and toymlx-classify given a language model "expected 'vit', found
    'llama'". Each now names the command that uses the file."""
    from cli_errors import error_line
    from test_timm_export import ARGS as VIT_ARGS
    from test_timm_export import NAMES, NORM
    from toymlx_cli.classify import main as classify_main

    from toymlx.gguf.vit import write_vit
    from toymlx.models.vit import ViT

    vit = tmp_path / "vit.gguf"
    write_vit(vit, ViT(VIT_ARGS), NORM, class_names=NAMES)
    capsys.readouterr()
    assert cli.main(["--model", str(vit), "--prompt", "hi"]) == 2
    assert error_line(capsys, "toymlx-generate") == (
        f"toymlx-generate: error: {vit}: metadata key 'general.architecture': expected a "
        f"language model ({SUPPORTED}), found 'vit', an image "
        f"classifier: toymlx-classify --model {vit} IMAGE uses it")
    # a vit-tiny run: named as typed, its checkpoint beside it (before: the checkpoint alone)
    vit_run = make_run_dir(tmp_path / "v", vit)
    assert cli.main(["--model", str(vit_run), "--prompt", "hi"]) == 2
    assert error_line(capsys, "toymlx-generate") == (
        f"toymlx-generate: error: {vit_run} ({vit_run / 'weights' / 'step_5.gguf'}): metadata "
        f"key 'general.architecture': expected a language model ({SUPPORTED}), found 'vit', an "
        f"image classifier: toymlx-classify --model {vit_run} IMAGE uses it")
    image = tmp_path / "x.png"
    from PIL import Image
    Image.new("RGB", (8, 8)).save(image)
    assert classify_main(["--model", str(stories_path), str(image)]) == 2
    assert error_line(capsys, "toymlx-classify") == (
        f"toymlx-classify: error: {stories_path}: metadata key 'general.architecture': "
        "expected 'vit' (an image classifier), found 'llama', a language model: "
        f"toymlx-generate --model {stories_path} uses it")
    # a run: named as typed (before: its checkpoint file alone, sent to toymlx-generate)
    run = make_run_dir(tmp_path, stories_path)
    assert classify_main(["--model", str(run), str(image)]) == 2
    assert error_line(capsys, "toymlx-classify") == (
        f"toymlx-classify: error: {run} ({run / 'weights' / 'step_5.gguf'}): metadata key "
        "'general.architecture': expected 'vit' (an image classifier), found 'llama', a language "
        f"model: toymlx-generate --model {run} uses it")
    # a vocabulary without weights: named as that, whatever its architecture (before: the
    # llama ones sent to toymlx-generate, which refuses them: "holds no tensors")
    for vocab, arch in (("smollm2", "llama"), ("gpt-2", "gpt2")):
        path = shared_file(f"tokenizers/ggml-vocab-{vocab}.gguf")
        assert classify_main(["--model", str(path), str(image)]) == 2
        assert error_line(capsys, "toymlx-classify") == (
            f"toymlx-classify: error: {path}: expected a ViT checkpoint (an image classifier), "
            f"found a '{arch}' vocabulary only: the file holds no tensors, a tokenizer-only GGUF "
            "(as llama.cpp's ggml-vocab-*.gguf), not a model")


SAMPLED = ["--prompt", PROMPT, "--max-tokens", "20", "--temperature", "0.8", "--seed", "7"]


def separate_samples(model: Path, flags: list[str], seeds: range, capsys) -> list[str]:
    """What one toymlx-generate call per seed prints (`flags` hold --seed 7, replaced)."""
    at = flags.index("--seed") + 1
    return [cli_tokens(["--model", str(model), *flags[:at], str(s), *flags[at + 1:]],
                       capsys)[0] for s in seeds]


@pytest.mark.parametrize("engine", ["mlx", pytest.param("llama.cpp", marks=pytest.mark.interop)])
@pytest.mark.parametrize("template", [False, True])
def test_num_samples_prints_the_samples_of_consecutive_seeds(stories_path, chat_path, engine,
                                                             template, capsys, monkeypatch):
    """--num-samples 3 --seed 7: the texts that --seed 7, 8 and 9 print alone, token for token
    (each from an empty KV cache), each followed by nanoGPT's line of 15 dashes; a line for
    each on stderr; the MLX model traced once (where MLX computes on the CPU)."""
    from toymlx.backend.device import on_gpu
    from toymlx.generation import generate as gen

    model = chat_path if template else stories_path
    flags = [*SAMPLED, "--engine", engine]
    want = separate_samples(model, flags, range(7, 10), capsys)
    assert len(set(want)) == 3 and all(w.endswith("\n") for w in want)  # three different texts
    traced = []
    real = gen.CompiledDecode.__init__
    monkeypatch.setattr(gen.CompiledDecode, "__init__",
                        lambda self, m: (traced.append(1), real(self, m))[1])
    out, err = cli_tokens(["--model", str(model), *flags, "--num-samples", "3"], capsys)
    assert out == "".join(w + "---------------\n" for w in want)
    assert out.split(cli.SEPARATOR + "\n") == [*want, ""]  # what a script splits on
    lines = [x for x in err.splitlines() if " prompt + " in x]
    assert [x.split(": ")[1] for x in lines] == [
        "sample 1 of 3 (--seed 7)", "sample 2 of 3 (--seed 8)", "sample 3 of 3 (--seed 9)"]
    assert len(traced) == (1 if engine == "mlx" and not on_gpu() else 0)


def test_one_sample_prints_no_separator(stories_path, capsys):
    """--num-samples 1 (the default) prints as before: the text, no line of dashes."""
    one, err = cli_tokens(["--model", str(stories_path), *SAMPLED, "--num-samples", "1"], capsys)
    assert one == separate_samples(stories_path, SAMPLED, range(7, 8), capsys)[0]
    assert "---" not in one and "sample 1" not in err


@pytest.mark.parametrize("flags, want", [
    (["--num-samples", "0"], ("--num-samples: expected a count in 1..1000, found 0 (more "
     "samples: another call with --seed 1000 higher)")),
    (["--num-samples", str(2**63)], (f"--num-samples: expected a count in 1..1000, found "
     f"{2**63} (more samples: another call with --seed 1000 higher)")),
    (["--num-samples", "3", "--temperature", "0"],
     ("--temperature: expected > 0 with --num-samples 3, found 0 (greedy: every sample would "
     "be the same text; drop --num-samples)")),
    (["--num-samples", "2", "--chat", "--prompt", ""],
     ("--num-samples 2: expected a --prompt (a --chat conversation answers each turn once), "
     "found none")),
    (["--num-samples", "3", "--seed", str(2**64 - 2)],
     (f"--seed: expected <= {2**64 - 3} with --num-samples 3 (the samples' seeds run from it "
     f"up to {2**64 - 1}), found {2**64 - 2}")),
    (["--num-samples", "3", "-s", str(2**64 - 2)],
     (f"-s: expected <= {2**64 - 3} with --num-samples 3 (the samples' seeds run from it "
     f"up to {2**64 - 1}), found {2**64 - 2}")),
])
def test_num_samples_that_cannot_be_drawn_are_one_line(stories_path, capsys, monkeypatch,
                                                       flags, want):
    """Refused before the weights load, in one line."""
    from toymlx.generation import generate as gen

    monkeypatch.setattr(gen, "load_llama", lambda *a, **k: pytest.fail("weights loaded"))
    rc = cli.main(["--model", str(stories_path), "--prompt", PROMPT, *flags])
    out, err = capsys.readouterr()
    assert (rc, out, err) == (2, "", f"toymlx-generate: error: {want}\n")


def test_ctrl_c_between_samples_leaves_the_samples_so_far_whole(stories_path, capsys,
                                                                monkeypatch):
    """Ctrl-C as the second of three samples starts: the first, its line of dashes, exit 130,
    and stderr says which were printed whole."""
    want = separate_samples(stories_path, SAMPLED, range(7, 8), capsys)[0]
    real, calls = cli.stream, []

    def stopped_at_the_second(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(cli, "stream", stopped_at_the_second)
    rc = cli.main(["--model", str(stories_path), *SAMPLED, "--num-samples", "3"])
    out, err = capsys.readouterr()
    assert (rc, out) == (130, want + "---------------\n")
    assert err.splitlines()[-2:] == [
        "toymlx-generate: 1 of 3 samples printed whole; sample 2 (--seed 8) was cut",
        "toymlx-generate: interrupted"]


def test_num_samples_into_head_ends_quietly(stories_path):
    """`--num-samples 3 | head -1`: the first line, exit status 0, no traceback."""
    cmd = [sys.executable, "-m", "toymlx_cli.generate", "--model", str(stories_path), *SAMPLED,
           "--num-samples", "3"]
    r = subprocess.run(f"{shlex.join(cmd)} | head -1; echo \"${{PIPESTATUS[0]}}\" >&2",
                       shell=True, executable="/bin/bash", capture_output=True, text=True,
                       timeout=300, check=False)
    assert r.stdout.count("\n") == 1 and r.stdout.startswith(", there was"), r.stdout
    assert r.stderr.splitlines()[-1] == "0" and "Traceback" not in r.stderr, r.stderr


def shift_reference(model, ids: list[int], n: int, window: int) -> list[int]:
    """Reference for the context shift: no cache, the text in view (`in_window`: whole while it
    leaves room, else its newer half) through the model for every new token, greedy."""
    from toymlx.generation.window import in_window

    text, out = list(ids), []
    view = in_window(text, window)
    for _ in range(n):
        logits = model(mx.array([view]))[0, -1]  # (V,)
        tok = int(mx.argmax(logits).item())
        out.append(tok)
        view = in_window(view + [tok], window)
    return out


class Recorded:
    """A decoder that records each call: (cache offset before it, tokens put through, logits)."""

    def __init__(self, inner):
        self.inner, self.calls = inner, []

    def make_cache(self):
        return self.inner.make_cache()

    def __call__(self, tokens, cache=None):
        offset = cache[0].offset
        logits = self.inner(tokens, cache)
        self.calls.append((offset, tokens.shape[-1], logits[0, -1]))
        return logits


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "eager"])
def test_greedy_tokens_after_a_context_shift_are_a_fresh_decode_of_the_kept_tokens(
        stories, compiled):
    """A 16-token window, a 5-token prompt, 30 new tokens: the text fills the window after 11,
    the model goes on from its last 8 (computed again from position 0), and again after 8 more
    (3 shifts, `window.shifts`). Greedy tokens equal the cache-free reference that reads the
    last 8 tokens each time the view fills; after the first shift they equal a fresh decode of
    the kept 8 tokens; the first post-shift logits equal a full forward over them. Both
    decoders: the traced one-token steps (MLX on a CPU) and the eager model (a GPU's)."""
    from toymlx.generation.generate import CompiledDecode
    from toymlx.generation.window import shifts

    model, tok = stories
    prompt = tok.encode(PROMPT)
    assert len(prompt) == 5
    decoder = Recorded(CompiledDecode(model) if compiled else model)
    got = list(generate(model, tok, prompt, 30, window=16, shift=True, decoder=decoder))
    assert got == shift_reference(model, prompt, 30, 16)
    assert got[:11] == list(generate(model, tok, prompt, 11))  # no shift before the view fills
    kept = (prompt + got)[8:16]  # the text's tokens 8..15: the newer half of the full window
    assert got[11:19] == list(generate(model, tok, kept, 8))
    assert got[11:19] != list(generate(model, tok, prompt + got[:11], 8))  # the shift matters
    refills = [i for i, (offset, n, _) in enumerate(decoder.calls) if offset == 0 and n > 1]
    assert len(refills) - 1 == shifts(5, 30, 16) == 3  # the prompt's prefill, then one a shift
    assert [decoder.calls[i][1] for i in refills] == [4, 7, 7, 7]
    assert max(offset + n for offset, n, _ in decoder.calls) == 15  # never a 16th position
    after = np.array(decoder.calls[refills[1] + 1][2])  # the first step after the shift
    assert decoder.calls[refills[1] + 1][:2] == (7, 1)
    full = np.array(model(mx.array([kept]))[0, -1])
    diff, scale = float(np.abs(after - full).max()), float(np.abs(full).max())
    print(f"first step after the shift vs a full forward over the kept 8 tokens: max abs logit "
          f"diff {diff:.3g} (max |logit| {scale:.1f})")
    assert diff <= 1e-6 * scale


def test_without_the_shift_generation_stops_where_the_first_shift_would_come(stories):
    """--no-context-shift's path: the window stops the text at 16 tokens, the 11 tokens the
    shifted decode makes before its first shift."""
    model, tok = stories
    prompt = tok.encode(PROMPT)
    stopped = list(generate(model, tok, prompt, 30, window=16))
    assert stopped == list(generate(model, tok, prompt, 30, window=16, shift=True))[:11]
    with pytest.raises(ValueError, match=r"window: expected 1\.\.2048 tokens \(the model's "
                       r"context\), found 4096"):
        next(generate(model, tok, prompt, 3, window=4096))
    with pytest.raises(ValueError, match="expected a window of at least 2 tokens"):
        next(generate(model, tok, prompt, 3, window=1, shift=True))


def test_a_prompt_that_fills_the_window_is_cut_to_its_newer_half(stories):
    """A 20-token prompt, a 16-token window: the model reads the prompt's last 8 tokens, and
    what it writes is a fresh decode of those 8, up to the next shift."""
    model, tok = stories
    prompt = tok.encode("Once upon a time, there was a little girl named Lily. She loved to")
    assert len(prompt) == 20
    got = list(generate(model, tok, prompt, 12, window=16, shift=True))
    assert got[:8] == list(generate(model, tok, prompt[-8:], 8))
    assert got == shift_reference(model, prompt, 12, 16)
    assert got[:8] != list(generate(model, tok, prompt, 8))


def test_sampling_through_context_shifts_repeats_for_a_seed(stories):
    model, tok = stories
    prompt = tok.encode(PROMPT)
    a, b, c = (list(generate(model, tok, prompt, 40, temperature=1.0, seed=s, window=12,
                             shift=True)) for s in (3, 3, 4))
    assert a == b != c and len(a) == 40


def seq_len_run(tmp_path: Path, stories_path: Path, recipe: str = "from-scratch") -> Path:
    """A run folder holding stories260K whose run_start records --seq-len 16."""
    run = make_run_dir(tmp_path, stories_path)
    start = {"kind": "run_start", "recipe": recipe, "config": {"seq_len": 16}}
    (run / "events.jsonl").write_text(json.dumps(start) + "\n")
    return run


@pytest.mark.parametrize("engine", ["mlx", pytest.param("llama.cpp", marks=pytest.mark.interop)])
def test_a_sample_past_the_runs_training_window_goes_on_by_context_shifts(tmp_path, stories_path,
                                                                         capsys, engine):
    """nanoGPT's Shakespeare on a CPU: --seq-len 64 with a 1024-token preset context, then 500
    new tokens fell apart past 64 (sample.py, which crops, stays readable). Here --seq-len 16:
    the text goes on by shifts within the 16-token window (the tokens of `generate`'s shift,
    on both engines; sampled, the same text again for a seed), and one line says where the
    first came; --no-context-shift stops there."""
    run = seq_len_run(tmp_path, stories_path)
    model, tok = load_for_generation(run)
    flags = ["--model", str(run), "--prompt", PROMPT, "--temperature", "0", "--engine", engine]
    out, err = cli_tokens([*flags, "--max-tokens", "30"], capsys)
    want = list(generate(model, tok, tok.encode(PROMPT), 30, window=16, shift=True))
    assert out == tok.decode(want) + "\n"
    note = ("toymlx-generate: context shift after new token 11: the text filled the 16-token "
            "window the run trained on (--seq-len 16), so the model went on from its last 8 "
            "tokens, computed again, and reads no further back (3 shifts in 30 new tokens, each "
            "dropping the older 8); --max-tokens 11 stays within it, --no-context-shift stops "
            "there; a run trained on a longer --seq-len reads further")
    assert [x for x in err.splitlines() if "context shift" in x] == [note], err
    sampled = [cli_tokens([*flags, "--max-tokens", "40", "--temperature", "0.8", "--seed", "5"],
                          capsys) for _ in range(2)]
    assert sampled[0][0] == sampled[1][0] and "context shift after new token 11" in sampled[0][1]
    out, err = cli_tokens([*flags, "--max-tokens", "11"], capsys)  # within the window: no line
    assert out == tok.decode(want[:11]) + "\n" and "context shift" not in err
    out, err = cli_tokens([*flags, "--max-tokens", "30", "--no-context-shift"], capsys)
    assert out == tok.decode(want[:11]) + "\n"
    assert err.splitlines()[-1] == (
        "toymlx-generate: stopped at the 16-token window the run trained on (--seq-len 16): 5 "
        "prompt + 11 new tokens fill it (--max-tokens 30, --no-context-shift)")


def test_a_lora_runs_window_is_the_models_context(tmp_path, stories_path, capsys):
    """A lora run's base read longer texts than its --seq-len: no shift at 16 tokens."""
    run = seq_len_run(tmp_path, stories_path, recipe="lora")
    assert cli.reading_window(str(run), 2048) == cli.Window(2048)
    assert cli.reading_window(str(seq_len_run(tmp_path / "b", stories_path)), 2048) == \
        cli.Window(16, trained=True)
    assert cli.reading_window(str(seq_len_run(tmp_path / "c", stories_path)), 12) == \
        cli.Window(12)  # a context under the trained window: the context
    _, err = cli_tokens(["--model", str(run), "--prompt", PROMPT, "--max-tokens", "20",
                         "--temperature", "0"], capsys)
    assert "context shift" not in err and "20 new tokens" in err


def test_a_checkpoint_out_of_its_run_keeps_its_training_window(tmp_path, stories_path, capsys):
    """A from-scratch checkpoint copied out of its run, or exported (`toymlx-export --base RUN`),
    as llama.cpp users keep one, read up to its 1,024-token preset context in toymlx-generate:
    a sample past the --seq-len it trained on fell apart, where the run's own did not. The
    checkpoint now carries its --seq-len (toy.seq_len), and a lone copy keeps that window."""
    from toymlx_cli.export import main as export_main
    from toymlx_cli.train import main as train_main

    from toymlx.gguf.reader import GGUFFile

    text = tmp_path / "t.txt"
    text.write_text("Once upon a time there was a cat who sat on a mat.\n" * 40)
    assert train_main(["--recipe", "from-scratch", "--data.path", str(text), "--model.d-model",
                       "32", "--model.n-layers", "1", "--model.n-heads", "4", "--seq-len", "16",
                       "--batch-size", "2", "--steps", "1", "--warmup", "0", "--no-compile",
                       "--runs-root", str(tmp_path), "--run-id", "r", "--no-progress"]) == 0
    lone = tmp_path / "lone.gguf"
    shutil.copyfile(tmp_path / "r" / "weights" / "step_1.gguf", lone)
    assert GGUFFile(lone).metadata["toy.seq_len"] == 16
    assert export_main(["--base", str(tmp_path / "r"), "--out", str(tmp_path / "x.gguf"),
                        "--dtype", "f16"]) == 0
    for model in (lone, tmp_path / "x.gguf"):
        assert cli.reading_window(str(model), 1024) == cli.Window(16, trained=True)
        # llama.cpp's n_ctx_train, Ollama's and LM Studio's context: the window trained, not
        # the tiny preset's 1,024 (no RoPE position past 16 was ever trained)
        assert GGUFFile(model).metadata["llama.context_length"] == 16
    assert cli.reading_window(str(stories_path), 2048) == cli.Window(2048)  # no such key
    capsys.readouterr()
    _, err = cli_tokens(["--model", str(lone), "--prompt", "Once", "--max-tokens", "20",
                         "--temperature", "0"], capsys)
    assert "context shift after new token 11: the text filled the 16-token window" in err, err


@pytest.mark.parametrize("engine", ["mlx", pytest.param("llama.cpp", marks=pytest.mark.interop)])
def test_a_prompt_filling_the_runs_window_is_cut_with_one_line(tmp_path, stories_path, capsys,
                                                               engine):
    """A 20-token prompt on a run of --seq-len 16: the model reads its last 8 tokens, and a
    line says so; --no-context-shift makes no token and says the prompt fills the window."""
    run = seq_len_run(tmp_path, stories_path, recipe="warm-start")
    model, tok = load_for_generation(run)
    text = "Once upon a time, there was a little girl named Lily. She loved to"
    flags = ["--model", str(run), "--prompt", text, "--temperature", "0", "--max-tokens", "6",
             "--engine", engine]
    ids = tok.encode(text)
    new = list(generate(model, tok, ids[-8:], 6))
    out, err = cli_tokens(flags, capsys)
    assert out == tok.decode(ids + new)[len(tok.decode(ids)):] + "\n"  # after the whole prompt
    assert err.splitlines()[1] == (
        "toymlx-generate: the prompt (20 tokens) fills the 16-token window the run trained on "
        "(--seq-len 16): the model reads its last 8 tokens (the context shift; a prompt under 16 "
        "tokens is read whole)")
    assert "20 prompt + 6 new tokens" in err and "context shift after" not in err
    out, err = cli_tokens([*flags, "--no-context-shift"], capsys)
    assert out == "" and err.splitlines()[-1] == (
        "toymlx-generate: 0 new tokens: the prompt (20 tokens) fills the 16-token window the run "
        "trained on (--seq-len 16)")


def test_the_shift_notes_count_as_the_decoder_shifts():
    """`shifts` against the rule written out: after a prompt of p tokens (cut to 8 where it
    fills the 16-token window) the view grows a token a step and falls to 8 where it is full."""
    from toymlx.generation.window import in_window, shifts

    for p in (1, 5, 15, 16, 40):
        view, total = len(in_window(range(p), 16)), 0
        for n in range(1, 61):
            if view >= 16:
                view, total = 8, total + 1
            view += 1
            assert shifts(p, n, 16) == total, (p, n)
    assert cli.shift_note(5, 11, cli.Window(24)) is None
    assert cli.shift_note(5, 20, cli.Window(24)) == (
        "toymlx-generate: context shift after new token 19: the text filled the model's context "
        "(24 tokens), so the model went on from its last 12 tokens, computed again, and reads no "
        "further back (1 shift in 20 new tokens, each dropping the older 12); --max-tokens 19 "
        "stays within it, --no-context-shift stops there")


@pytest.fixture(scope="module")
def short_chat_path(tmp_path_factory, stories_path):
    """stories260K with the ChatML template and a 256-token context: a few turns of 12-token
    replies fill it."""
    from toymlx.gguf.fuse import write_with_tensors
    from toymlx.gguf.reader import GGUFFile

    path = tmp_path_factory.mktemp("short-chat") / "short-chat.gguf"
    with GGUFFile(stories_path) as g:
        write_with_tensors(path, g, {}, {"llama.context_length": 256,
                                         "tokenizer.chat_template": CHATML})
    return path


TURNS = ["Tell me a story", "About a cat", "And a dog", "Then what", "The end", "/reset",
         "Tell me a story"]


def chatml_ids(tok, system: str, pairs: list[tuple[str, str]], user: str) -> list[int]:
    """Reference prompt: the template rendered over exactly these messages (the system message,
    the (user, reply) pairs, the new user message), then encoded (ChatML writes no BOS)."""
    messages = [{"role": "system", "content": system}]
    for asked, answered in pairs:
        messages += [{"role": "user", "content": asked}, {"role": "assistant", "content": answered}]
    messages.append({"role": "user", "content": user})
    return tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True))


def recorded_chat(monkeypatch, model, tok, args: cli.Args, lines: list[str],
                  decoder: bool = False):
    """Run `cli.chat` over `lines` in the 256-token context, recording each turn's prompt ids,
    reply and (with `decoder`) its decoder's calls. Returns (turns, stderr lines, prompts,
    replies, calls per turn)."""
    from toymlx.generation import generate as gen

    prompts, replies, calls = [], [], []
    real_stream, real_decoder_for = cli.stream, gen.decoder_for
    decoders: list[Recorded] = []

    def stream(m, t, ids, a, *rest, **kw):
        start = len(decoders[0].calls) if decoders else 0
        reply = real_stream(m, t, ids, a, *rest, **kw)
        prompts.append(list(ids))
        replies.append(reply[0].strip())
        calls.append(decoders[0].calls[start:] if decoders else [])
        return reply

    def decoder_for(m):
        decoders.append(Recorded(real_decoder_for(m)))
        return decoders[-1]

    monkeypatch.setattr(cli, "stream", stream)
    if decoder:
        monkeypatch.setattr(gen, "decoder_for", decoder_for)
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    turns = cli.chat(model, tok, args, 256, io.StringIO("".join(x + "\n" for x in lines)),
                     io.StringIO())
    monkeypatch.undo()
    return turns, err.getvalue().splitlines(), prompts, replies, calls


def test_a_chat_past_the_context_drops_its_earliest_turns(short_chat_path, monkeypatch):
    """A --chat conversation stopped at the model's context ('/reset to start again'). Now, where
    the next prompt and a --max-tokens reply would not fit, the earliest whole turns are dropped
    (the system message and the new message kept) and one line says how many: the prompt is the
    template rendered over exactly the kept messages, the fewest dropped that leave the room;
    the reply is, token for token, a fresh conversation's from those messages, and its first
    logits a full forward over that prompt (the KV cache kept only for the shared start, the
    system message's); /reset starts again."""
    model, tok = load_for_generation(short_chat_path)
    args = cli.Args(model=str(short_chat_path), chat=True, temperature=0.0, max_tokens=12,
                    system="Be kind")
    turns, err, prompts, replies, calls = recorded_chat(monkeypatch, model, tok, args, TURNS,
                                                        decoder=True)
    assert turns == 6 and all(replies)
    asked = [t for t in TURNS if t != "/reset"]
    pairs = list(zip(asked, replies))
    kept_from = [0, 0, 0, 1, 2, 5]  # the first pair each turn's prompt holds (5: after /reset)
    for k, first in enumerate(kept_from):
        want = chatml_ids(tok, "Be kind", pairs[first:k], asked[k])
        assert prompts[k] == want, k
        assert len(want) + 12 <= 256  # room for the reply ...
        if first > 0 and k < 5:  # ... and one turn more would not have left it
            assert len(chatml_ids(tok, "Be kind", pairs[first - 1:k], asked[k])) + 12 > 256
    assert [len(p) for p in prompts] == [77, 141, 204, 201, 199, 77]
    assert err == [
        f"toymlx-generate: dropped the conversation's earliest 1 turn (a message and its reply "
        f"each) to fit the model's context (256 tokens) with room for a 12-token reply; the model "
        f"reads the system message, 2 earlier turns and your message ({n} tokens)"
        for n in (201, 199)]
    assert replies[5] == replies[0]  # /reset: the first turn again

    for k in (3, 4):  # after each drop: a fresh decoder and cache over the kept messages
        fresh = list(generate(model, tok, prompts[k], 12))
        assert replies[k] == tok.decode(prompts[k] + fresh)[len(tok.decode(prompts[k])):].strip()
        prefill, first_step = calls[k][0], calls[k][1]
        shared = next(i for i, (a, b) in enumerate(zip(prompts[k], prompts[k - 1])) if a != b)
        assert prefill[:2] == (shared, len(prompts[k]) - 1 - shared)  # from the shared start on
        assert shared < len(chatml_ids(tok, "Be kind", [], ""))  # the system message's and less
        assert first_step[:2] == (len(prompts[k]) - 1, 1)
        full = np.array(model(mx.array([prompts[k]]))[0, -1])
        diff = float(np.abs(np.array(first_step[2]) - full).max())
        print(f"turn {k + 1}: first logits after the drop vs a full forward over the kept "
              f"{len(prompts[k])} tokens: max abs diff {diff:.3g} (max |logit| "
              f"{float(np.abs(full).max()):.1f})")
        assert diff <= 1e-5 * float(np.abs(full).max())


def test_a_sampled_chat_after_a_drop_answers_as_a_fresh_one(short_chat_path, monkeypatch):
    """Sampled (--temperature 0.8 --seed 7): each turn's reply, those after a drop included, is
    the one a fresh decoder and KV cache give that turn's prompt with the same seed."""
    model, tok = load_for_generation(short_chat_path)
    args = cli.Args(model=str(short_chat_path), chat=True, temperature=0.8, seed=7,
                    max_tokens=12, system="Be kind")
    _, err, prompts, replies, _ = recorded_chat(monkeypatch, model, tok, args, TURNS[:5])
    assert any("dropped the conversation's earliest" in line for line in err), err
    for ids, reply in zip(prompts, replies):
        assert cli.stream(model, tok, ids, args, out=io.StringIO())[0].strip() == reply


def test_without_the_context_shift_a_chat_stops_at_the_context(short_chat_path, monkeypatch):
    """--no-context-shift: the conversation that fills the context is not answered, as before
    (the whole conversation rendered, one line each turn), until /reset; a reply that reaches
    the context stops there with one line."""
    model, tok = load_for_generation(short_chat_path)
    args = cli.Args(model=str(short_chat_path), chat=True, temperature=0.0, max_tokens=12,
                    system="Be kind", context_shift=False)
    turns, err, prompts, replies, _ = recorded_chat(monkeypatch, model, tok, args, TURNS)
    asked = [t for t in TURNS if t != "/reset"]
    pairs = list(zip(asked, replies[:3]))
    full = [len(chatml_ids(tok, "Be kind", pairs, asked[k])) for k in (3, 4)]
    assert turns == 4 and [len(p) for p in prompts] == [77, 141, 204, 77] and full[0] >= 256
    assert err == [f"toymlx-generate: the conversation ({n} tokens) fills the model's context "
                   "(256); /reset to start again" for n in full]
    long = dataclasses.replace(args, max_tokens=400)  # a reply cut at the context: one line
    turns, err, _, replies, _ = recorded_chat(monkeypatch, model, tok, long, TURNS[:2])
    both = len(chatml_ids(tok, "Be kind", [(TURNS[0], replies[0])], TURNS[1]))
    assert turns == 1 and err == [
        ("toymlx-generate: the reply stopped at the model's context (256 tokens: 77 of the "
         "conversation, 179 of the reply; --max-tokens 400); /reset to start again "
         "(--no-context-shift)"),
        (f"toymlx-generate: the conversation ({both} tokens) fills the model's context (256); "
         "/reset to start again")]


def test_a_chat_message_too_long_alone_is_skipped_and_a_reply_stops_at_the_context(
        short_chat_path, monkeypatch):
    """A message that fills the context by itself is one line, the conversation kept for the
    next; a reply that reaches the context (--max-tokens 400: room is kept for at most half the
    context, 128 tokens) stops there with one line, and the next turn drops it."""
    model, tok = load_for_generation(short_chat_path)
    args = cli.Args(model=str(short_chat_path), chat=True, temperature=0.0, max_tokens=12,
                    system="Be kind")
    lines = ["Tell me a story", "x" * 300, "About a cat"]
    turns, err, prompts, replies, _ = recorded_chat(monkeypatch, model, tok, args, lines)
    alone = len(chatml_ids(tok, "Be kind", [], "x" * 300))
    assert turns == 2 and err == [(
        f"toymlx-generate: your message ({alone} tokens through the chat template with the "
        "system message) fills the model's context (256) alone; the turn is skipped, the "
        "conversation goes on")]
    assert prompts[1] == chatml_ids(tok, "Be kind", [(lines[0], replies[0])], lines[2])

    long = dataclasses.replace(args, max_tokens=400)
    turns, err, prompts, replies, _ = recorded_chat(monkeypatch, model, tok, long,
                                                    ["Tell me a story", "About a cat"])
    assert turns == 2 and len(prompts[0]) == 77 and len(tok.encode(replies[0])) > 100
    assert prompts[1] == chatml_ids(tok, "Be kind", [], "About a cat")
    cut = [(f"toymlx-generate: the reply stopped at the model's context (256 tokens: {len(ids)} "
            f"of the conversation, {256 - len(ids)} of the reply; --max-tokens 400); the next "
            "turn drops the earliest turns to make room") for ids in prompts]
    assert err == [cut[0], (
        "toymlx-generate: dropped the conversation's earliest 1 turn (a message and its reply "
        "each) to fit the model's context (256 tokens) with room for a 128-token reply; the "
        f"model reads the system message and your message ({len(prompts[1])} tokens)"), cut[1]]


@pytest.mark.interop
def test_llamacpp_chat_drops_the_same_turns(short_chat_path, capsys, monkeypatch):
    """--engine llama.cpp --chat in the 256-token context: the same turns dropped, the same
    lines, and the words MLX's engine gives (greedy on the F32 model), its child computing
    the kept conversation again where the prompt departs from what it holds."""
    flags = ["--model", str(short_chat_path), "--chat", "--temperature", "0", "--system",
             "Be kind"]
    seen = {}
    for engine in ("mlx", "llama.cpp"):
        for budget, lines in (("12", TURNS), ("400", TURNS[:2])):  # 400: replies cut
            monkeypatch.setattr(sys, "stdin", io.StringIO("".join(x + "\n" for x in lines)))
            assert cli.main([*flags, "--max-tokens", budget, "--engine", engine]) == 0
            out, err = capsys.readouterr()
            seen[engine, budget] = (out.splitlines(), err.splitlines()[1:])  # after "model"
    assert len(seen["mlx", "12"][0]) == 6
    assert [line.split("; the model reads")[1] for line in seen["mlx", "12"][1]] == [
        " the system message, 2 earlier turns and your message (201 tokens)",
        " the system message, 2 earlier turns and your message (199 tokens)"]
    assert [line.split(" (")[0] for line in seen["mlx", "400"][1]] == [
        "toymlx-generate: the reply stopped at the model's context",
        "toymlx-generate: dropped the conversation's earliest 1 turn",
        "toymlx-generate: the reply stopped at the model's context"]
    for budget in ("12", "400"):
        assert seen["llama.cpp", budget] == seen["mlx", budget]
