"""benchmarks/shapes.py: a model-shaped file written through the streamed F16 and llama.cpp's
Q4_K_M quantizer loads in toymlx with its shape, its vocabulary and the quantizer's mixture."""

from __future__ import annotations

import sys
from collections import Counter
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import shapes
from llamacpp_source import llamacpp_source  # noqa: F401  (session fixture)

from toymlx.data.tokenizer import Tokenizer
from toymlx.gguf.llama import args_from_gguf, check_shapes
from toymlx.gguf.reader import GGUFFile


@pytest.mark.interop  # the quantizer is llama.cpp's (llama-cpp-python)
def test_tiny_gemma3_shape_written_quantized_and_reused(tmp_path):
    args = replace(shapes.SHAPES["gemma-3-270m"].args, vocab_size=1000, d_model=256,
                   n_layers=6, ffn_dim=512, key_length=128,
                   sliding_layers=(True,) * 5 + (False,))
    shape = shapes.Shape("tiny-gemma3", args, "synthetic")
    killed = tmp_path / ".tiny-gemma3.q4_k_m.gguf.f16.tmp-999999999"  # a writer long gone
    killed.write_bytes(b"half an F16")
    said: list[str] = []
    path, took = shapes.shape_file(shape, tmp_path, progress=said.append)
    assert path == tmp_path / "tiny-gemma3.q4_k_m.gguf" and took["f16_bytes"] > path.stat().st_size
    # the quantizer's wait is said (it was silent: 64 s for the 1B shape), and its peak RSS,
    # a child's, is reported beside this process's (which never holds its tensors)
    assert said[-1] == ("tiny-gemma3.q4_k_m.gguf: quantizing the F16 to Q4_K_M (llama.cpp's "
                        "quantizer)")
    assert took["quantizer_peak_rss_mb"] > 0
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]  # the F16 is gone
    with GGUFFile(path) as g:
        # the file says the epsilon in float32, and the query scale is llama.cpp's gemma3 one
        assert args_from_gguf(g) == replace(args, attn_scale=128 ** -0.5,
                                            norm_eps=float(np.float32(1e-6)))
        check_shapes(g, args)
        types = Counter(t.type_name for t in g.tensors.values())
        # Q4_K_M: Q4_K matrices, Q6_K for half of attn_v / ffn_down and the tied token table
        assert types["Q4_K"] > 0 and types["Q6_K"] > 0 and g.tensors["blk.0.attn_norm.weight"
                                                                   ].type_name == "F32"
        assert g.get("general.file_type", int) == 15  # MOSTLY_Q4_K_M
    tok = Tokenizer.from_gguf(path)
    assert tok.decode(tok.encode("abc zz", add_bos=False)) == "abc zz"
    again, took = shapes.shape_file(shape, tmp_path)
    assert again == path and took == {}


@pytest.mark.interop  # llama.cpp's quantizer, tokenizer and source tree
def test_tiny_qwen3_shape_carries_qwen3s_vocabulary_and_template(tmp_path, monkeypatch,
                                                                 llamacpp_source):  # noqa: F811
    """The qwen3 shape: Qwen2's BPE with Qwen3's added tokens, ids and real chat template; a
    two-turn chat rendered by the file's template tokenizes to llama.cpp's ids (`<think>` one
    token, 151667, as in Qwen3's tokenizer.json)."""
    import llama_cpp

    monkeypatch.setenv(shapes.LLAMACPP_TREE_ENV, str(llamacpp_source))
    args = replace(shapes.SHAPES["qwen3-1.7b"].args, d_model=256, n_layers=2, ffn_dim=512,
                   n_heads=4, n_kv_heads=2)  # heads 128 wide: key_length set
    path, _ = shapes.shape_file(shapes.Shape("tiny-qwen3", args, "qwen3"), tmp_path)
    with GGUFFile(path) as g:
        assert args_from_gguf(g) == replace(args, norm_eps=float(np.float32(1e-6)))
        assert g.get("tokenizer.ggml.eos_token_id", int) == 151645
        assert g.get("tokenizer.chat_template", str) == (
            llamacpp_source / "models" / "templates" / "Qwen-Qwen3-0.6B.jinja").read_text()
    tok = Tokenizer.from_gguf(path)
    text = ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi é 日本<|im_end|>\n"
            "<|im_start|>assistant\n<think>\n\n</think>\n\nHello!<|im_end|>\n")
    ids = tok.encode(text, add_bos=False)
    llm = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    assert ids == llm.tokenize(text.encode(), add_bos=False, special=True)
    assert ids[:2] == [151644, 8948] and 151667 in ids and 151668 in ids


@pytest.mark.interop  # llama.cpp's quantizer, tokenizer, source tree and qwen35 graph
def test_tiny_qwen35_shape_loads_and_runs_in_llamacpp(tmp_path, monkeypatch,
                                                      llamacpp_source):  # noqa: F811
    """The qwen3.5 shape at two blocks: its list keys (recurrent_layers, dimension_sections) are
    arrays (they were written as one uint32 and the writer failed), its convolution F32 as the
    converter writes it (an F16 one crashed llama.cpp's ssm_conv) and its decay rates negative
    (ones made the state grow e-fold a token); toymlx reads the shape back, the vocabulary is
    padded to 248,320 and tokenizes a Qwen3.5 chat as llama.cpp does, and toymlx's last-token
    logits are llama.cpp's within its 8-bit activation rounding."""
    import llama_cpp

    from toymlx.gguf.llama import load_llama

    monkeypatch.setenv(shapes.LLAMACPP_TREE_ENV, str(llamacpp_source))
    args = replace(shapes.SHAPES["qwen3.5-0.8b"].args, d_model=256, n_layers=2, ffn_dim=512,
                   linear_layers=(True, False))
    path, _ = shapes.shape_file(shapes.Shape("tiny-qwen35", args, "qwen35"), tmp_path)
    with GGUFFile(path) as g:
        assert args_from_gguf(g) == replace(args, norm_eps=float(np.float32(1e-6)))
        assert g.tensors["blk.0.ssm_conv1d.weight"].type_name == "F32"
        assert (g.load("blk.0.ssm_a") < 0).all()
        assert len(g.metadata["tokenizer.ggml.tokens"]) == 248320
        assert g.get("tokenizer.ggml.pre", str) == "qwen35"
        assert g.get("tokenizer.chat_template", str) == (
            llamacpp_source / "models" / "templates" / "Qwen3.5-4B.jinja").read_text()
    tok = Tokenizer.from_gguf(path)
    text = "<|im_start|>user\nHi é 日本 12345<|im_end|>\n<|im_start|>assistant\n<think>\n\n"
    ids = tok.encode(text, add_bos=False)
    llm = llama_cpp.Llama(str(path), n_ctx=64, verbose=False, logits_all=True)
    assert ids == llm.tokenize(text.encode(), add_bos=False, special=True)
    llm.eval(ids)
    import mlx.core as mx

    model, _ = load_llama(path)
    mine = np.array(model(mx.array([ids]))[0, -1])
    theirs = np.array(llm.scores[len(ids) - 1])
    # llama.cpp rounds activations to 8 bits inside its Q4_K / Q6_K dot products (the margin
    # test_qwen35.py's test_quantized_copies reports): 0.034 here, on logits up to 1.6
    assert np.abs(mine - theirs).max() < 0.05
    assert np.corrcoef(mine, theirs)[0, 1] > 0.99


@pytest.mark.interop  # llama.cpp's quantizer and source tree
def test_tiny_qwen3moe_shape_keeps_its_experts_in_k_quants(tmp_path, monkeypatch,
                                                            llamacpp_source):  # noqa: F811
    """The Qwen3-30B-A3B shape, small: its 3-D expert tensors are streamed (E * out rows of
    random values) and quantized by llama.cpp as K-quants; toymlx reads the shape back and holds
    them in their blocks."""
    from toymlx.gguf.llama import load_llama
    from toymlx.models.moe import BlockExperts

    monkeypatch.setenv(shapes.LLAMACPP_TREE_ENV, str(llamacpp_source))
    args = replace(shapes.SHAPES["qwen3-30b-a3b-2l"].args, d_model=256, n_heads=4,
                   n_kv_heads=2, n_experts=4, n_experts_used=2, expert_ffn_dim=256)
    path, _ = shapes.shape_file(shapes.Shape("tiny-qwen3moe", args, "qwen3"), tmp_path)
    with GGUFFile(path) as g:
        assert args_from_gguf(g) == replace(args, norm_eps=float(np.float32(1e-6)))
        assert g.tensors["blk.0.ffn_up_exps.weight"].shape == (4, 256, 256)
        assert g.tensors["blk.0.ffn_up_exps.weight"].type_name in ("Q4_K", "Q6_K")
        w = g.load("blk.1.ffn_down_exps.weight")
        assert 0.015 < float(w.std()) < 0.025  # N(0, 0.02) in every expert
        assert float(np.abs(w[0] - w[3]).max()) > 0
    model, _ = load_llama(path, weights="blocks")
    assert isinstance(model.layers[1].mlp.down_exps, BlockExperts)


def test_synthetic_vocabulary_has_the_size_asked_and_unique_tokens():
    v = shapes.synthetic_spm(262144)
    tokens = v["tokenizer.ggml.tokens"][0]
    assert len(tokens) == len(set(tokens)) == 262144
    assert len(v["tokenizer.ggml.scores"][0]) == len(v["tokenizer.ggml.token_type"][0]) == 262144


def test_a_vocabulary_file_stands_in_for_the_smollm2_gguf(monkeypatch, tmp_path, stories_path):
    """`write_vocab` writes a GGUF of the tokenizer.* keys alone, and with $TOYMLX_SHAPES_VOCAB
    naming it `smollm2_vocab` reads the same keys, values and types back (what a lent GPU
    machine, without the 94 MB SmolLM2 file, writes the Llama shapes' files with); the source
    here is the tiny stories260K GGUF, named the same way."""
    monkeypatch.setenv(shapes.VOCAB_ENV, str(stories_path))
    want = shapes.smollm2_vocab()
    out = tmp_path / "vocab.gguf"
    shapes.write_vocab(out)
    with GGUFFile(out) as g:
        assert not g.tensors
    monkeypatch.setenv(shapes.VOCAB_ENV, str(out))
    got = shapes.smollm2_vocab()
    assert "tokenizer.ggml.tokens" in got and got.keys() == want.keys()
    for k, (v, vt, et) in want.items():
        assert got[k][1:] == (vt, et), k
        assert (list(got[k][0]) == list(v)) if isinstance(v, (list, tuple)) else got[k][0] == v


def test_nothing_asked_is_an_error(capsys):
    """`names` became optional with --write-vocab: `shapes.py` alone wrote nothing and exited 0."""
    with pytest.raises(SystemExit) as e:
        shapes.main([])
    assert e.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(
        "error: names: expected some of " + ", ".join(shapes.SHAPES) + " (or --write-vocab), "
        "found none")
