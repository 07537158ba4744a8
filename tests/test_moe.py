"""Mixtures of experts (qwen3moe; Mixtral's llama and qwen2moe where a test names them): toymlx
against llama.cpp and transformers on the tiny Qwen3MoeForCausalLM (MixtralForCausalLM,
Qwen2MoeForCausalLM) checkpoints of tests/hf_tiny.py (llama.cpp's converter; `-q`: 256 wide,
quantized by llama.cpp's quantizer).

test_hf_tiny.py checks the F32 files' logits (kinds qwen3moe, qwen3moe-q). Here: the routing
is not decided by ties (so 1e-6 logit agreement is not luck); the quantized experts held in
their blocks compute what float32 does, forward and backward; the quantized file against
llama.cpp; a LoRA step on the attention and router lowers the loss; adapters load in llama.cpp
with toymlx's logits, LoRA on the experts' 3-D tensors too (a pair per expert, as llama.cpp
applies them); `toymlx-export --fuse` writes a file llama.cpp computes the adapter with;
greedy decoding with the KV cache is llama.cpp's.
"""

from __future__ import annotations

import json
import time

import mlx.core as mx
import numpy as np
import pytest
from hf_tiny import (
    hf_logits,
    llamacpp_quantize,
    tiny_gguf,  # noqa: F401  (session fixtures)
    tiny_hf,  # noqa: F401
    token_ids,
)
from llamacpp_runner import llamacpp_greedy, llamacpp_logits
from llamacpp_source import llamacpp_source  # noqa: F401  (session fixture)
from mlx import nn
from mlx.utils import tree_flatten

from toymlx.data.tokenizer import Tokenizer
from toymlx.gguf.llama import load_llama
from toymlx.models.lora import apply_lora, lora_layers
from toymlx.models.moe import BlockExperts, ExpertLinear, MoE
from toymlx.training.adapter import write_adapter

N_TOKENS = 40
HF_TOL = 1e-4  # as test_hf_tiny's F32 kinds


def report(what: str, **figures) -> None:
    print(f"\n[moe] {what}: " + json.dumps(figures, default=str))


def logits(model, ids) -> np.ndarray:
    return np.array(model(mx.array([ids]))[0].astype(mx.float32))


def routing_margins(model, ids) -> list[float]:
    """Per MoE block, the smallest gap over the tokens between the k-th and (k+1)-th router
    probability: the distance from a different choice of experts."""
    gaps: list[float] = []
    for layer in model.layers:
        moe = layer.mlp
        route = moe.route

        def recording(h, moe=moe, route=route):
            p = mx.sort(mx.softmax(moe.router(h).astype(mx.float32), axis=-1), axis=-1)
            k = moe.n_used
            gaps.append(float((p[:, -k] - p[:, -k - 1]).min()))
            return route(h)

        moe.route = recording
    model(mx.array([ids]))
    for layer in model.layers:
        del layer.mlp.route
    return gaps


@pytest.mark.interop
@pytest.mark.parametrize("kind", ["qwen3moe", "qwen3moe-q", "mixtral", "mixtral-q", "qwen2moe",
                                  "qwen2moe-q"])
def test_routing_is_not_decided_by_ties(kind, tiny_hf, tiny_gguf):  # noqa: F811
    model, _ = load_llama(tiny_gguf(kind))
    assert all(isinstance(b.mlp, MoE) for b in model.layers)
    ids = token_ids(tiny_hf(kind), N_TOKENS)
    gaps = routing_margins(model, ids)
    report(f"{kind} routing", smallest_topk_gap_per_block=gaps)
    # the three implementations' logits agree to ~1e-6 (test_hf_tiny), their router
    # probabilities closer still: a gap above 1e-6 is not crossed, so no token's experts differ
    # (qwen2moe's block 1 comes closest: 2.0e-6)
    assert len(gaps) == model.args.n_layers and min(gaps) > 1e-6


@pytest.mark.interop
def test_quantized_experts_in_blocks(tiny_hf, tiny_gguf, tmp_path):  # noqa: F811
    """Q4_K_M (llama.cpp keeps the expert tensors as K-quants): held in their blocks, toymlx
    computes exactly what the float32-decoded file computes, a generation step (fewer
    token-expert pairs than experts: only the chosen experts decoded) too; against llama.cpp,
    which also rounds activations to 8 bits in its quantized products, the logits move by its
    own quantization margin where that flips a token's experts, and little elsewhere."""
    kind = "qwen3moe-q"
    src = tiny_gguf(kind)
    dst = tmp_path / "q4km.gguf"
    q = llamacpp_quantize(src, dst, "Q4_K_M")
    assert q["types"]["blk.0.ffn_up_exps.weight"] in ("Q4_K", "Q5_K", "Q6_K")
    ids = token_ids(tiny_hf(kind), N_TOKENS)
    blocks, _ = load_llama(dst, weights="blocks")
    assert isinstance(blocks.layers[0].mlp.up_exps, BlockExperts)
    floats, _ = load_llama(dst)
    assert isinstance(floats.layers[0].mlp.up_exps, ExpertLinear)
    mine = logits(blocks, ids)
    assert np.array_equal(mine, logits(floats, ids))
    one = [logits(blocks, ids[t:t + 1]) for t in range(4)]
    assert all(np.array_equal(o, logits(floats, ids[t:t + 1])) for t, o in enumerate(one))
    cpp, _ = llamacpp_logits(dst, ids)
    ref, _ = llamacpp_logits(src, ids)
    per_pos = np.abs(mine - cpp).max(-1)
    own = float(np.abs(cpp - ref).max())
    report("qwen3moe-q Q4_K_M", toymlx_vs_llamacpp_max_abs=float(per_pos.max()),
           toymlx_vs_llamacpp_median_position=float(np.median(per_pos)),
           llamacpp_q4km_vs_its_f32=own, top1=float((mine.argmax(-1) == cpp.argmax(-1)).mean()))
    # test_hf_tiny's quantized tolerance (within llama.cpp's own move, top-1 agreeing on 90%),
    # and most positions (those whose experts agree) much closer
    assert per_pos.max() <= max(own, 0.05) and (mine.argmax(-1) == cpp.argmax(-1)).mean() >= 0.9
    assert np.median(per_pos) < 0.15


def adapted(tiny_hf, tiny_gguf, targets: str, kind: str = "qwen3moe"):  # noqa: F811
    """The tiny `kind` file, its test ids, its model with seeded LoRA (rank 4, alpha 8) on
    `targets`, and its general.* metadata (for the adapter file)."""
    path = tiny_gguf(kind)
    model, g = load_llama(path)
    meta = {k: v for k, v in g.metadata.items() if k.startswith("general.")}
    mx.random.seed(0)
    apply_lora(model, targets, rank=4, alpha=8.0)
    return path, token_ids(tiny_hf(kind), N_TOKENS), model, meta


def _fixed_batch(ids: list[int]) -> tuple[mx.array, mx.array]:
    x = mx.array([ids[:-1], ids[::-1][:-1]])
    y = mx.array([ids[1:], ids[::-1][1:]])
    return x, y


@pytest.mark.interop
def test_lora_step_lowers_the_loss_and_llamacpp_loads_the_adapter(tiny_hf, tiny_gguf,  # noqa: F811
                                                                   tmp_path):
    """LoRA on the attention and the router (llama.cpp's `build_moe_ffn` applies an adapter to
    `ffn_gate_inp`): a step lowers the loss on a fixed batch; the adapter file loads in
    llama.cpp, whose logits with it are toymlx's."""
    path, ids, model, meta = adapted(tiny_hf, tiny_gguf, "q,k,v,o,router")
    assert "layers.1.mlp.router" in lora_layers(model)
    x, y = _fixed_batch(ids)

    def loss_fn(m):
        return nn.losses.cross_entropy(m(x), y, reduction="mean")

    opt_step = nn.value_and_grad(model, loss_fn)
    import mlx.optimizers as optim

    opt = optim.Adam(learning_rate=2e-3)
    losses, seconds = [], []
    for _ in range(4):
        t0 = time.perf_counter()
        loss, grads = opt_step(model)
        opt.update(model, grads)
        mx.eval(model.parameters(), opt.state, loss)
        seconds.append(time.perf_counter() - t0)
        losses.append(float(loss))
    after = float(loss_fn(model))
    router_b = np.abs(np.array(lora_layers(model)["layers.0.mlp.router"].lora_b)).max()
    report("qwen3moe lora", losses=losses + [after], step_s=seconds, router_lora_b_max=router_b)
    assert after < losses[-1] < losses[0] and router_b > 0  # the router's adapter trained too
    out = write_adapter(tmp_path / "moe-adapter.gguf", model, meta)
    # toymlx-export --fuse: the adapted tensors are dense (attention, router), the experts
    # are copied from the base
    in_llamacpp(path, out, ids, logits(model, ids), tmp_path, "qwen3moe attention+router")


def in_llamacpp(path, adapter, ids, want: np.ndarray, tmp_path, what: str) -> None:
    """llama.cpp's logits with `adapter` on base `path`, and on the file `toymlx-export --fuse`
    writes of the two, are toymlx's (`want`); the adapter moves them."""
    from toymlx_cli.export import main as export

    got, _ = llamacpp_logits(path, ids, lora=adapter)
    base, _ = llamacpp_logits(path, ids)
    fused = tmp_path / "fused.gguf"
    assert export(["--base", str(path), "--adapter", str(adapter), "--fuse", "--out",
                   str(fused)]) == 0
    on_fused, _ = llamacpp_logits(fused, ids)
    mine_fused = logits(load_llama(fused)[0], ids)  # toymlx reading the file it wrote
    d, d_fused = float(np.abs(want - got).max()), float(np.abs(on_fused - want).max())
    d_mine = float(np.abs(on_fused - mine_fused).max())
    report(f"{what} adapter in llama.cpp", toymlx_vs_llamacpp_max_abs=d,
           llamacpp_fused_vs_toymlx_adapter_max_abs=d_fused,
           llamacpp_fused_vs_toymlx_fused_max_abs=d_mine,
           adapter_moves_llamacpp_by=float(np.abs(got - base).max()))
    assert d < HF_TOL and d_fused < HF_TOL and d_mine < HF_TOL
    assert np.abs(got - base).max() > 1e-2


@pytest.mark.interop
def test_greedy_decoding_with_the_kv_cache_is_llamacpp_s(tiny_hf, tiny_gguf):  # noqa: F811
    from toymlx.generation.generate import generate

    kind = "qwen3moe-q"  # 256 wide: its greedy reply varies (the 64-wide one repeats a token)
    path = tiny_gguf(kind)
    model, _ = load_llama(path)
    prompt = token_ids(tiny_hf(kind), 8, seed=21)  # a prompt whose greedy reply varies
    mine = list(generate(model, Tokenizer.from_gguf(path), prompt, max_tokens=16))
    theirs = llamacpp_greedy(path, prompt, max_tokens=16)
    report(f"{kind} greedy", toymlx=mine, llamacpp=theirs)
    assert mine == theirs and len(mine) == 16 and len(set(mine)) > 4
    full = logits(model, prompt + mine)  # the cached steps' choices are the full forward's
    assert [int(t) for t in full[len(prompt) - 1:-1].argmax(-1)] == mine
    ref = hf_logits(tiny_hf(kind), prompt + mine)
    assert np.abs(full - ref).max() < HF_TOL


@pytest.mark.interop
def test_dora_on_experts_and_a_dense_router_are_refused(tiny_gguf):  # noqa: F811
    from toymlx.models.llama import LlamaArgs
    from toymlx.models.lora import check_targets

    model, _ = load_llama(tiny_gguf("qwen3moe"))
    with pytest.raises(ValueError, match=r"^--lora\.targets: up is the experts' 3-D tensor in "
                                         r"this qwen3moe base, which only --fine-tune-type lora "
                                         r"adapts \(llama.cpp applies a LoRA pair per expert\), "
                                         r"found dora$"):
        apply_lora(model, "q,up", kind="dora")
    assert not lora_layers(model)  # nothing half-applied
    with pytest.raises(ValueError, match=r"^--lora\.targets: router is a mixture of experts' "
                                         r"ffn_gate_inp; this llama base is dense and has "
                                         r"q,k,v,o,gate,up,down$"):
        check_targets(("q", "router"), LlamaArgs())


@pytest.mark.interop
@pytest.mark.parametrize("kind", ["qwen3moe", "mixtral", "qwen2moe"])
def test_expert_lora_loads_in_llamacpp(kind, tiny_hf, tiny_gguf, tmp_path):  # noqa: F811
    """LoRA on the 3-D expert tensors: an A and B per expert (llama.cpp's adapter loader takes
    `ffn_*_exps` pairs of ne {in, r, E} and {r, out, E} and `build_lora_mm_id` applies each
    token's chosen experts' pairs), trained a step, written, read back and run by llama.cpp;
    its logits are toymlx's; `toymlx-export --fuse` writes the changed expert tensors, and
    llama.cpp's logits on that file are the adapter's."""
    from toymlx.generation.generate import generate, load_for_generation
    from toymlx.interop.modelfile import write_modelfile
    from toymlx.training.adapter import apply_adapter, load_adapter

    path, ids, model, meta = adapted(tiny_hf, tiny_gguf, "q,gate,up,down", kind)
    m, f = lora_layers(model)["layers.0.mlp.up_exps"], model.args.expert_width
    assert m.lora_a.shape == (8, 4, 64) and m.lora_b.shape == (8, f, 4)
    mx.random.seed(1)
    for layer in lora_layers(model).values():
        layer.lora_b = mx.random.normal(layer.lora_b.shape) * 0.3
    want = logits(model, ids)
    out = write_adapter(tmp_path / "experts.gguf", model, meta)
    ad = load_adapter(out)
    assert ad.metadata["toy.lora.targets"] == "q,gate,up,down"  # the experts' paths' names
    assert ad.pairs["blk.1.ffn_down_exps.weight"][0].shape == (8, 4, f)
    again = apply_adapter(load_llama(path)[0], out)
    assert np.array_equal(logits(again, ids), want)
    in_llamacpp(path, out, ids, want, tmp_path, f"{kind} experts")  # fused: experts changed
    # toymlx-generate --adapter: greedy decoding with the KV cache (a token at a time: each
    # step's own experts' pairs) is llama.cpp's with the adapter
    prompt = token_ids(tiny_hf(kind), 8, seed=21)
    model_ad, tok = load_for_generation(path, adapter=out)
    mine = list(generate(model_ad, tok, prompt, max_tokens=12))
    theirs = llamacpp_greedy(path, prompt, max_tokens=12, lora=out)
    report(f"{kind} experts greedy with the adapter", toymlx=mine, llamacpp=theirs)
    assert mine == theirs and len(mine) > 0
    # toymlx-export --format modelfile checks the adapter against its base: a pair per expert
    # (3-D) against the 3-D expert tensor (it took only matrices, and failed with "too many
    # values to unpack")
    modelfile, _, ad_file, _ = write_modelfile(tmp_path / "ollama", out, str(path))
    assert f"ADAPTER {ad_file}" in modelfile.read_text().splitlines()
    # a step trains the experts' pairs: their gradient reaches A and B
    x, y = _fixed_batch(ids)
    _, grads = nn.value_and_grad(model, lambda mm: nn.losses.cross_entropy(
        mm(x), y, reduction="mean"))(model)
    ga = dict(tree_flatten(grads))["layers.0.mlp.gate_exps.lora_a"]
    assert ga.shape == (8, 4, 64) and float(mx.abs(ga).max()) > 0


@pytest.mark.interop
def test_expert_lora_on_block_held_experts(tiny_gguf, tmp_path):  # noqa: F811
    """Q4_K_M experts held in their blocks (decoded in the step, decoded again in the backward
    pass: `toymlx.models.moe.decoded_experts`'s own gradient) against the same file decoded to
    float32 (MLX's autograd through gather_mm): equal logits, and equal gradients of every LoRA
    pair, the attention's (reached through the experts' input gradient) and the experts'."""
    dst = tmp_path / "q4km.gguf"
    llamacpp_quantize(tiny_gguf("qwen3moe-q"), dst, "Q4_K_M")
    ids = list(range(3, 3 + 24))
    x, y = _fixed_batch(ids)
    grads, outs = [], []
    for weights in ("blocks", "float32"):
        model, _ = load_llama(dst, weights=weights)
        held = type(model.layers[0].mlp.up_exps)
        assert held is (BlockExperts if weights == "blocks" else ExpertLinear)
        mx.random.seed(0)
        apply_lora(model, "q,gate,down", rank=4, alpha=8.0)
        mx.random.seed(1)
        for layer in lora_layers(model).values():
            layer.lora_b = mx.random.normal(layer.lora_b.shape) * 0.1
        loss, g = nn.value_and_grad(model, lambda mm: nn.losses.cross_entropy(
            mm(x), y, reduction="mean"))(model)
        grads.append(dict(tree_flatten(g)))
        outs.append(float(loss))
    worst = max(float(mx.abs(grads[0][k] - v).max() / (mx.abs(v).max() + 1e-12))
                for k, v in grads[1].items())
    report("qwen3moe-q Q4_K_M expert lora blocks vs float32", loss=outs,
           largest_relative_gradient_difference=worst)
    assert outs[0] == pytest.approx(outs[1], abs=1e-6) and worst < 1e-4
    assert set(grads[0]) == set(grads[1]) and "layers.1.mlp.down_exps.lora_a" in grads[0]


def test_pairs_sorted_by_expert_compute_what_unsorted_pairs_do(monkeypatch):
    """From `SORT_FROM` (token, expert) pairs on, `MoE` applies its experts to the pairs sorted
    by expert (a LoRA pair's gradient then a matmul per expert, where unsorted MLX forms an
    (r, in) product per pair: the walk's 1024-token step peaked 108 MB above LoRA on q alone,
    4 MB sorted): its output and every gradient (float and block-held experts, LoRA pairs on
    them, the input's) are the unsorted path's, each pair back at its token."""
    from toymlx.gguf.blocks import CODECS, random_blocks, split_rows
    from toymlx.gguf.reader import GGMLQuantizationType as T
    from toymlx.models import moe as moe_module
    from toymlx.models.lora import ExpertLoRA

    e, d, f = 8, 64, 32
    codec = CODECS[T.Q8_0]
    mx.random.seed(0)
    block = MoE(d, e, 2, f)
    block.router.weight = mx.random.normal((e, d)) * 0.3
    block.gate_exps.weight = mx.random.normal((e, f, d)) * 0.1
    block.up_exps.weight = mx.random.normal((e, f, d)) * 0.1
    raw = random_blocks(codec, e * d, f // codec.block_values, seed=3)
    parts = {k: mx.array(v) for k, v in split_rows(codec, raw, (e, d, f)).items()}
    block.down_exps = BlockExperts(codec, parts, e, d, f)
    for name in ("gate_exps", "down_exps"):
        pair = ExpertLoRA(getattr(block, name), rank=4)
        pair.lora_b = mx.random.normal(pair.lora_b.shape) * 0.1
        setattr(block, name, pair)
    x = mx.random.normal((2, 40, d))  # 80 tokens, 160 pairs
    probe = mx.random.normal((2, 40, d))

    def run() -> tuple[mx.array, dict, mx.array]:
        def loss(m, xx):
            return (m(xx) * probe).sum()

        y = block(x)
        grads = dict(tree_flatten(nn.value_and_grad(block, loss)(block, x)[1]))
        dx = mx.grad(lambda xx: loss(block, xx))(x)
        mx.eval(y, grads, dx)
        return y, grads, dx

    assert 2 * 80 >= moe_module.SORT_FROM
    y, grads, dx = run()
    monkeypatch.setattr(moe_module, "SORT_FROM", 10**9)  # every pair in token order
    y0, grads0, dx0 = run()
    assert set(grads) == set(grads0) and "down_exps.lora_a" in grads and "up_exps.weight" in grads

    def close(a, b) -> bool:
        return float(mx.abs(a - b).max()) <= 1e-5 * float(mx.abs(b).max())

    assert close(y, y0) and close(dx, dx0) and all(close(grads[k], v) for k, v in grads0.items())
