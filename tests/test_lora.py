"""LoRA on a tiny random Llama: exact step 0, counts, fuse, adapter GGUF, masking, the recipe."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from cli_errors import error_line
from conftest import end_child
from gguf.constants import GGMLQuantizationType
from gguf.quants import quantize
from mlx import nn
from mlx.utils import tree_flatten

from toymlx.data.chat import SFTData, load_examples, split_examples
from toymlx.data.tokenizer import Tokenizer, byte_tokenizer
from toymlx.gguf.llama import load_llama, write_llama
from toymlx.gguf.quant import gguf_to_mlx_quant
from toymlx.gguf.reader import GGUFError, GGUFFile
from toymlx.gguf.writer import QuantTensor, write_gguf
from toymlx.interop.merge import write_merged
from toymlx.models.llama import Llama, tiny
from toymlx.models.lora import (
    DoRALinear,
    LoRALinear,
    apply_lora,
    fuse,
    lora_layers,
    parse_targets,
    resolve_targets,
)
from toymlx.models.losses import lm_loss
from toymlx.models.ops import EXACT as EXACT_OPS
from toymlx.recipes.lora import resolve_base_dtype
from toymlx.training import memory
from toymlx.training.adapter import apply_adapter, load_adapter, load_adapter_weights, write_adapter

CHATML = ("{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'] + '</s>' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}")
ARGS = tiny(d_model=64, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=96, context=256)
TOKENS = mx.array([[1, 72, 101, 108, 108, 111, 35, 120, 44, 200, 3, 17]])


def tok_meta() -> dict:
    meta = byte_tokenizer().to_metadata()
    meta["tokenizer.chat_template"] = CHATML
    return meta


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    """A random tiny Llama with a byte tokenizer and a chat template, as an F32 GGUF."""
    mx.random.seed(3)
    path = tmp_path_factory.mktemp("tiny") / "tiny.gguf"
    write_llama(path, Llama(ARGS), tok_meta(), name="tiny test llama")
    return path


def base(path: Path, dtype: str = "float32") -> Llama:
    model, g = load_llama(path, weights=dtype)
    g.close()
    return model


def randomize_b(model: nn.Module, seed: int = 0, std: float = 0.3) -> None:
    """Give every adapter a non-zero B so the update changes the logits."""
    mx.random.seed(seed)
    for m in lora_layers(model).values():
        m.lora_b = mx.random.normal(m.lora_b.shape) * std
    mx.eval(model.parameters())


def test_step0_logits_equal_base_exactly(tiny_gguf):
    model = base(tiny_gguf)
    before = model(TOKENS)
    apply_lora(model, "q,k,v,o,gate,up,down", rank=4, alpha=8.0)
    after = model(TOKENS)
    assert mx.array_equal(before, after).item()
    assert all(float(mx.abs(m.lora_a).max()) > 0 for m in lora_layers(model).values())


def test_trainable_count_q_only(tiny_gguf):
    model = apply_lora(base(tiny_gguf), "q", rank=8, alpha=16.0)
    trainable = dict(tree_flatten(model.trainable_parameters()))
    d = ARGS.d_model
    assert sum(v.size for v in trainable.values()) == ARGS.n_layers * 8 * (d + d) == 3072
    assert sorted(trainable) == sorted(f"layers.{i}.attn.q_proj.lora_{x}"
                                       for i in range(3) for x in "ab")
    m = lora_layers(model)["layers.0.attn.q_proj"]
    assert m.lora_a.shape == (8, d) and m.lora_b.shape == (d, 8) and m.scale == 2.0


def test_targets_and_last_layers(tiny_gguf):
    model = apply_lora(base(tiny_gguf), ("k", "down"), layers=2, rank=2, alpha=2.0)
    assert list(lora_layers(model)) == ["layers.1.attn.k_proj", "layers.1.mlp.down_proj",
                                        "layers.2.attn.k_proj", "layers.2.mlp.down_proj"]
    n = sum(v.size for _, v in tree_flatten(model.trainable_parameters()))
    kv = ARGS.n_kv_heads * ARGS.head_dim
    assert n == 2 * 2 * ((64 + kv) + (ARGS.ffn_dim + 64))


def test_unknown_target_and_bad_layers_name_the_flag(tiny_gguf):
    model = base(tiny_gguf)
    with pytest.raises(ValueError, match=r"--lora\.targets: expected a comma list of q, k, v, qkv, o, "
                                         r"gate, up, gate_up, down, z, beta, alpha, out, router, "
                                         r"ple_gate, ple_proj, all-linear or mlx-lm-default; "
                                         r"found unknown target 'qq'"):
        apply_lora(model, "q,qq")
    with pytest.raises(ValueError, match=r"--lora\.layers: expected 1\.\.3"):
        apply_lora(model, "q", layers=4)
    assert not lora_layers(model)


@pytest.mark.parametrize("targets,said", [
    ("q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj", "q,k,v,o,gate,up,down"),
    ("self_attn.q_proj,v", "q,v"),  # mlx-lm's keys, one of toymlx's among them
    ("q_proj,all-linear,router", "q,all-linear,router"),  # all-linear is toymlx's too
])
def test_hugging_face_s_target_modules_are_named_as_toymlx_s(targets, said):
    """PEFT's (Unsloth's) target_modules given to --lora.targets: the error says the same list
    in toymlx's names (before: "found unknown target 'q_proj'" alone)."""
    with pytest.raises(ValueError) as e:
        parse_targets(targets)
    first = targets.split(",")[0]
    assert str(e.value) == (
        "--lora.targets: expected a comma list of q, k, v, qkv, o, gate, up, gate_up, down, z, "
        f"beta, alpha, out, router, ple_gate, ple_proj, all-linear or mlx-lm-default; found "
        f"unknown target {first!r} "
        "(Hugging Face's "
        "names; toymlx's are "
        f"--lora.targets {said})")


@pytest.mark.parametrize("targets,said", [
    ("attn_q,attn_v", "q,v"),
    ("attn_q,attn_k,attn_v,attn_output,ffn_gate,ffn_up,ffn_down", "q,k,v,o,gate,up,down"),
    ("attn_qkv,o,ffn_gate_inp,ffn_down_exps", "qkv,o,router,down"),  # toymlx's among them
])
def test_llama_cpp_s_tensor_names_are_named_as_toymlx_s(tiny_gguf, tmp_path, capsys, targets,
                                                        said):
    """A llama.cpp user names what to adapt as llama.cpp's adapters do (blk.N.attn_q): the
    one line says the same list in toymlx's names (before: "found unknown target 'attn_q'"
    alone), before the base is loaded and no run folder made."""
    assert _train(["--recipe", "lora", "--base", str(tiny_gguf), "--lora.targets", targets,
                   "--runs-root", str(tmp_path), "--run-id", "t"]) == 2
    assert error_line(capsys) == (
        "toymlx-train: error: --lora.targets: expected a comma list of q, k, v, qkv, o, gate, "
        "up, gate_up, down, z, beta, alpha, out, router, ple_gate, ple_proj, all-linear or "
        f"mlx-lm-default; found unknown target {targets.split(',')[0]!r} (llama.cpp's tensor "
        f"names; toymlx's are --lora.targets {said})")
    assert not (tmp_path / "t").exists()


@pytest.mark.parametrize("targets,said", [
    ("ffn_up", "gate_up"),
    ("attn_qkv,attn_output,ffn_up,ffn_down", "qkv,o,gate_up,down"),
    ("attn_q,attn_v", "qkv"),
    ("attn_q,attn_k,attn_v,attn_output,ffn_gate,ffn_up,ffn_down", "qkv,o,gate_up,down"),
    ("ffn_gate", "gate_up"),
])
def test_llama_cpp_s_tensor_names_on_phi3_are_named_as_phi3_s(tmp_path, capsys, targets, said):
    """phi3's `ffn_up` is its fused gate-and-up projection: the hint said `up`, which phi3 has
    not (the base check then refused it, naming gate_up); other files' `attn_q`, `attn_k`,
    `attn_v` and `ffn_gate` were said as q, k, v and gate, which phi3 holds in its fused qkv
    and gate_up. The hint names phi3's own targets, and the list it says trains."""
    from arch_files import arch_gguf

    phi3 = arch_gguf("phi3", tmp_path / "phi3.gguf")
    run = ["--recipe", "lora", "--base", str(phi3), "--runs-root", str(tmp_path), "--steps",
           "1", "--batch-size", "1", "--seq-len", "16", "--no-progress", "--no-compile"]
    assert _train([*run, "--lora.targets", targets, "--run-id", "t"]) == 2
    assert error_line(capsys).endswith(
        f"found unknown target {targets.split(',')[0]!r} (llama.cpp's tensor names; toymlx's "
        f"are --lora.targets {said})")
    assert not (tmp_path / "t").exists()
    assert _train([*run, "--lora.targets", said, "--run-id", "said"]) == 0
    saved = json.loads((tmp_path / "said" / "config.json").read_text())
    assert saved["config"]["lora"]["targets"] == said


@pytest.mark.parametrize("targets,whose,said", [
    ("Q,V", "upper case", "q,v"),
    ("q,V", "upper case", "q,v"),
    ("all", "LLaMA-Factory's all", "all-linear"),
])
def test_targets_spelt_otherwise_are_named_as_toymlx_s(targets, whose, said):
    """Upper case (`Q,V`) and LLaMA-Factory's `all` were refused as unknown with no word of the
    names meant; the line now says them in toymlx's spelling. A name toymlx does not know in any
    case gets no hint."""
    from toymlx.models.lora import parse_targets

    with pytest.raises(ValueError) as e:
        parse_targets(targets)
    bad = next(t for t in targets.split(",") if t != t.lower() or t == "all")
    assert str(e.value).endswith(f"found unknown target {bad!r} ({whose}; toymlx's are "
                                 f"--lora.targets {said})")
    with pytest.raises(ValueError) as e:
        parse_targets("Q,Bogus")
    assert str(e.value).endswith("found unknown target 'Q'")


def test_all_linear_is_every_projection_the_base_s_blocks_have(tiny_gguf):
    """--lora.targets all-linear (PEFT's target_modules, mlx-lm's default without keys) resolved
    against the base: a dense llama's seven projections, phi3's fused four, qwen35's full- and
    linear-attention blocks' (qkv, z, beta, alpha, out too), a mixture of experts' attention and
    expert tensors without its router (added where named); applied to the tiny llama, the same
    21 layers as the seven named (before: all-linear was refused, and its hint said the seven
    on every base)."""
    from toymlx.models.llama import LlamaArgs

    seven = ("q", "k", "v", "o", "gate", "up", "down")
    assert resolve_targets("all-linear", ARGS) == seven
    phi3 = replace(ARGS, arch="phi3", fused_qkv=True, fused_gate_up=True)
    assert resolve_targets("all-linear", phi3) == ("qkv", "o", "gate_up", "down")
    qwen35 = LlamaArgs(arch="qwen35", attn_out_gate=True, qk_norm=True, rope_neox=True,
                       linear_layers=(True, True, True, False), ssm_head_dim=8, ssm_k_heads=2,
                       ssm_v_heads=4)
    assert resolve_targets("all-linear", qwen35) == (
        "q", "k", "v", "qkv", "o", "gate", "up", "down", "z", "beta", "alpha", "out")
    moe = replace(ARGS, arch="qwen3moe", n_experts=4, n_experts_used=2)
    assert resolve_targets("all-linear", moe) == seven
    assert resolve_targets("all-linear,router", moe) == (*seven, "router")
    assert resolve_targets(["v", "all-linear"], ARGS) == ("v", "q", "k", "o", "gate", "up", "down")
    assert parse_targets("q,all-linear") == ("q", "all-linear")  # unresolved until the base
    named = lora_layers(apply_lora(base(tiny_gguf), ",".join(seven)))
    every = lora_layers(apply_lora(base(tiny_gguf), "all-linear"))
    assert list(every) == list(named) and len(every) == 3 * 7


def test_mlx_lm_default_is_all_linear_and_a_mixture_of_experts_router():
    """--lora.targets mlx-lm-default (an mlx-lm config without lora_parameters.keys; checked
    against mlx-lm's own linear_to_lora_layers in tests/test_mlx_lm_config.py): all-linear on a
    dense, phi3 or qwen35 base, and the router too on a mixture of experts (qwen3moe, mixtral's
    llama), where all-linear keeps its meaning (router out); on qwen2moe, whose shared expert
    mlx-lm would adapt too and toymlx cannot, one line naming those modules and what to give."""
    from toymlx.models.llama import LlamaArgs

    seven = ("q", "k", "v", "o", "gate", "up", "down")
    phi3 = replace(ARGS, arch="phi3", fused_qkv=True, fused_gate_up=True)
    qwen35 = LlamaArgs(arch="qwen35", attn_out_gate=True, qk_norm=True, rope_neox=True,
                       linear_layers=(True, True, True, False), ssm_head_dim=8, ssm_k_heads=2,
                       ssm_v_heads=4)
    for a in (ARGS, phi3, qwen35):
        assert resolve_targets("mlx-lm-default", a) == resolve_targets("all-linear", a)
    for moe in (replace(ARGS, arch="qwen3moe", n_experts=4, n_experts_used=2),
                replace(ARGS, n_experts=4, n_experts_used=2)):  # mixtral: a llama file
        assert resolve_targets("mlx-lm-default", moe) == (*seven, "router")
        assert resolve_targets("all-linear", moe) == seven
    qwen2moe = replace(ARGS, arch="qwen2moe", n_experts=4, n_experts_used=2,
                       shared_expert_ffn_dim=32)
    with pytest.raises(ValueError) as e:
        resolve_targets("mlx-lm-default", qwen2moe)
    assert str(e.value) == (
        "--lora.targets: mlx-lm-default (mlx-lm's default without lora_parameters.keys) adapts "
        "every linear layer of this qwen2moe base's blocks, its shared expert's too "
        "(mlp.shared_expert.gate_proj, mlp.shared_expert.up_proj, mlp.shared_expert.down_proj, "
        "mlp.shared_expert_gate), which toymlx cannot adapt; name the others instead: "
        "--lora.targets all-linear,router (lora_parameters.keys self_attn.q_proj, "
        "self_attn.k_proj, self_attn.v_proj, self_attn.o_proj, mlp.gate, "
        "mlp.switch_mlp.gate_proj, mlp.switch_mlp.up_proj, mlp.switch_mlp.down_proj)")


def test_fuse_matches_lora_forward(tiny_gguf):
    model = apply_lora(base(tiny_gguf), "q,v,o,up", rank=4, alpha=8.0)
    randomize_b(model)
    want = model(TOKENS)
    plain = model(TOKENS)
    fuse(model)
    assert not lora_layers(model)
    assert all(isinstance(m, nn.Linear) for p, m in model.named_modules() if p.endswith("_proj"))
    got = model(TOKENS)
    assert mx.abs(got - want).max().item() < 1e-5
    assert mx.abs(plain - base(tiny_gguf)(TOKENS)).max().item() > 1e-2  # the update is real


def test_adapter_gguf_round_trip(tiny_gguf, tmp_path):
    model = apply_lora(base(tiny_gguf), "q,k,gate", rank=4, alpha=8.0)
    randomize_b(model)
    want = model(TOKENS)
    path = write_adapter(tmp_path / "a.gguf", model, {"general.architecture": "llama",
                                                      "general.name": "tiny"},
                         {"general.step": 7})
    g = GGUFFile(path)
    assert g.metadata["general.type"] == "adapter"
    assert g.metadata["general.architecture"] == "llama"
    assert g.metadata["adapter.type"] == "lora"
    assert g.metadata["adapter.lora.alpha"] == 8.0
    assert g.metadata_types["adapter.lora.alpha"][0] == 6  # GGUF float32
    assert g.tensors["blk.0.attn_q.weight.lora_a"].shape == (4, 64)
    assert g.tensors["blk.0.attn_q.weight.lora_b"].shape == (64, 4)
    assert g.tensors["blk.2.attn_k.weight.lora_b"].shape == (ARGS.n_kv_heads * ARGS.head_dim, 4)
    assert g.tensors["blk.1.ffn_gate.weight.lora_a"].shape == (4, 64)
    assert {t.type.name for t in g.tensors.values()} == {"F32"}
    assert len(g.tensors) == 3 * 3 * 2
    ad = load_adapter(path)
    m = lora_layers(model)["layers.1.attn.k_proj"]
    np.testing.assert_array_equal(ad.pairs["blk.1.attn_k.weight"][0], np.array(m.lora_a))
    np.testing.assert_array_equal(ad.pairs["blk.1.attn_k.weight"][1], np.array(m.lora_b))
    # a fresh base + the file computes exactly what the trained model did
    other = apply_adapter(base(tiny_gguf), path)
    assert mx.array_equal(other(TOKENS), want).item()
    # resume: the file's tensors go back into an identically configured model
    resumed = apply_lora(base(tiny_gguf), "q,k,gate", rank=4, alpha=8.0)
    load_adapter_weights(resumed, path)
    assert mx.array_equal(resumed(TOKENS), want).item()


@pytest.mark.parametrize("alpha", [0.3, 8])
def test_an_alpha_float32_cannot_hold_exactly_goes_back_into_its_run(tiny_gguf, tmp_path, alpha):
    """adapter.lora.alpha is float32: --lora.alpha 0.3 read back as 0.30000001192092896, which
    the exact comparison refused, so no run of such an alpha could resume ("expected ... alpha
    0.3, found ... alpha 0.30000001192092896; pass --lora.alpha 0.3"), nor start from it."""
    model = apply_lora(base(tiny_gguf), "q", rank=4, alpha=alpha)
    randomize_b(model)
    path = write_adapter(tmp_path / "a.gguf", model, {"general.architecture": "llama"})
    resumed = apply_lora(base(tiny_gguf), "q", rank=4, alpha=alpha)
    load_adapter_weights(resumed, path)
    assert mx.array_equal(resumed(TOKENS), model(TOKENS)).item()
    with pytest.raises(GGUFError, match=r"alpha 0\.31 \(this run's\)"):
        load_adapter_weights(apply_lora(base(tiny_gguf), "q", rank=4, alpha=0.31), path)


def test_adapter_errors(tiny_gguf, tmp_path):
    with pytest.raises(GGUFError, match=r"--adapter: expected an adapter GGUF .*, found a llama "
                                        r"model, not an adapter \(general\.type unset"):
        load_adapter(tiny_gguf)
    model = apply_lora(base(tiny_gguf), "q", rank=2)
    good = write_adapter(tmp_path / "good.gguf", model, {"general.architecture": "llama"})
    wrong_arch = write_adapter(tmp_path / "arch.gguf", model, {"general.architecture": "gpt2"})
    with pytest.raises(GGUFError, match=r"'general\.architecture': expected 'llama' \(the base "
                                        r"model's\), found 'gpt2'"):
        apply_adapter(base(tiny_gguf), wrong_arch)
    # an adapter trained on a wider model does not fit this base
    mx.random.seed(1)
    wide = Llama(tiny(d_model=96, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=96))
    wide_path = write_adapter(tmp_path / "wide.gguf", apply_lora(wide, "q", rank=2),
                              {"general.architecture": "llama"})
    with pytest.raises(GGUFError, match=r"blk\.0\.attn_q\.weight.*expected \(r, 64\) and "
                                        r"\(64, r\).*found \(2, 96\) and \(96, 2\)"):
        apply_adapter(base(tiny_gguf), wide_path)
    deep = write_adapter(tmp_path / "deep.gguf",
                         apply_lora(Llama(tiny(d_model=64, n_layers=5, n_heads=4, n_kv_heads=2,
                                               ffn_dim=96)), "q", layers=1, rank=2),
                         {"general.architecture": "llama"})
    with pytest.raises(GGUFError, match=r"blk\.4\.attn_q\.weight\.lora_a'.*3-block base"):
        apply_adapter(base(tiny_gguf), deep)
    # a run directory resolves to weights/latest
    run = tmp_path / "run"
    (run / "weights").mkdir(parents=True)
    (run / "weights" / "adapter_step_1.gguf").write_bytes(good.read_bytes())
    (run / "weights" / "latest").symlink_to("adapter_step_1.gguf")
    assert len(lora_layers(apply_adapter(base(tiny_gguf), run))) == 3
    # one half of a pair missing
    g = GGUFFile(good)
    tensors = {n: g.load(n) for n in g.tensors if n != "blk.1.attn_q.weight.lora_b"}
    write_gguf(tmp_path / "half.gguf", dict(g.metadata), tensors)
    with pytest.raises(GGUFError, match=r"'blk\.1\.attn_q\.weight\.lora_b': expected present"):
        load_adapter(tmp_path / "half.gguf")


def test_quantized_base_holds_gguf_blocks_exactly(tiny_gguf, tmp_path):
    """Q4_0/Q4_1/Q8_0 projections become MLX triplets that dequantize to the file's values."""
    g = GGUFFile(tiny_gguf)
    kinds = [GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0]
    tensors = {}
    for i, (name, info) in enumerate(g.tensors.items()):
        w = g.load(name)
        if name.startswith("blk.") and w.ndim == 2:
            t = kinds[i % 3]
            tensors[name] = QuantTensor(t, quantize(w, t), w.shape)
        else:
            tensors[name] = w
    qpath = write_gguf(tmp_path / "q.gguf", dict(g.metadata), tensors)
    qg = GGUFFile(qpath)
    for name in [n for n in qg.tensors if n.startswith("blk.") and n.endswith("_q.weight")]:
        w, s, b, bits = gguf_to_mlx_quant(qg, name)
        deq = mx.dequantize(mx.array(w), mx.array(s), mx.array(b), group_size=32, bits=bits)
        np.testing.assert_array_equal(np.array(deq), qg.load(name))
    flt, qnt = base(qpath, "float32"), base(qpath, "quantized")
    assert isinstance(qnt.layers[0].attn.q_proj, nn.QuantizedLinear)
    assert mx.abs(flt(TOKENS) - qnt(TOKENS)).max().item() < 1e-4
    # LoRA wraps a quantized projection as well, and step 0 is still the base
    before = qnt(TOKENS)
    apply_lora(qnt, "q,v", rank=4)
    assert mx.array_equal(qnt(TOKENS), before).item()
    assert isinstance(base(g.path, "quantized").layers[0].attn.q_proj, nn.Linear)  # F32 stays


def test_auto_base_dtype_holds_float32_on_the_cpu_where_half_the_memory_fits(monkeypatch):
    """--base-dtype auto: MLX's quantized layers on a GPU; on the CPU float32 while a step with
    it takes at most half the available memory (and --grad-checkpoint does not ask for memory
    first), else the file's blocks; an explicit choice is kept."""
    asked = []

    def step_bytes(held):
        asked.append(held)
        return {"float32": 6_000, "blocks": 2_000}[held]

    monkeypatch.setenv(memory.AVAILABLE_ENV, "12000")
    assert resolve_base_dtype("auto", False, False, step_bytes) == "float32"
    assert asked == ["float32"]
    monkeypatch.setenv(memory.AVAILABLE_ENV, "11999")
    assert resolve_base_dtype("auto", False, False, step_bytes) == "blocks"
    monkeypatch.setenv(memory.AVAILABLE_ENV, "10" + "0" * 12)
    assert resolve_base_dtype("auto", False, True, step_bytes) == "blocks"  # memory first
    assert resolve_base_dtype("auto", True, False, step_bytes) == "quantized"  # a GPU
    for choice in ("blocks", "quantized", "float32", "bfloat16", "float16"):
        assert resolve_base_dtype(choice, False, False, step_bytes) == choice


def test_merged_export_matches_lora_forward(tiny_gguf, tmp_path):
    model = apply_lora(base(tiny_gguf), "q,k,v,o,gate,up,down", rank=4, alpha=8.0)
    randomize_b(model, std=0.1)
    want = model(TOKENS)
    ad = write_adapter(tmp_path / "a.gguf", model, {"general.architecture": "llama"})
    out = write_merged(tmp_path / "merged.gguf", tiny_gguf, ad, "f32")
    g = GGUFFile(out)
    assert g.metadata["tokenizer.chat_template"] == CHATML
    assert g.metadata["general.file_type"] == 0 and g.metadata["toy.merged_adapter"] == "a.gguf"
    assert mx.abs(base(out)(TOKENS) - want).max().item() < 1e-5
    q8 = write_merged(tmp_path / "merged_q8.gguf", tiny_gguf, ad, "q8_0")
    assert GGUFFile(q8).tensors["blk.0.attn_q.weight"].type.name == "Q8_0"
    assert GGUFFile(q8).tensors["blk.0.attn_norm.weight"].type.name == "F32"
    assert mx.abs(base(q8)(TOKENS) - want).max().item() < 0.05


def test_masking_with_the_real_loss(tiny_gguf, tmp_path):
    """mask_prompt: prompt and padding labels never change the loss; answer labels do."""
    tok = Tokenizer.from_metadata(GGUFFile(tiny_gguf).metadata)
    model = apply_lora(base(tiny_gguf), "q", rank=4)
    randomize_b(model)
    examples = [{"prompt": "What is 2+2?", "completion": "Four."},
                {"messages": [{"role": "system", "content": "Be brief."},
                              {"role": "user", "content": "Name a colour"},
                              {"role": "assistant", "content": "Teal"},
                              {"role": "user", "content": "Another"},
                              {"role": "assistant", "content": "Mauve"}]}]
    train = []
    for i, e in enumerate(examples):  # one file per record shape (a file holds one shape)
        path = tmp_path / f"ex{i}.jsonl"
        path.write_text(json.dumps(e) + "\n")
        train += split_examples(load_examples(path), 0.0)[0]
    data = SFTData.from_examples(train, [], tok, seq_len=160, mask_prompt=True)
    batch = {k: v for k, v in data.train.items()}  # (2, 160): one padded example per row
    mask = batch["mask"]
    completion = "Four.</s>", "Teal</s>", "Mauve</s>"
    assert int(mask.sum()) == sum(len(tok.encode(c, add_bos=False)) for c in completion)
    assert (mask[:, -10:] == 0).all()  # the tail of both rows is padding

    def loss(b):
        out, n = lm_loss(model, {k: mx.array(v) for k, v in b.items()})
        return out.item(), n.item()

    ref, n = loss(batch)
    assert n == mask.sum()
    rng = np.random.default_rng(0)
    off = np.argwhere(mask == 0)
    for r, t in off[rng.choice(len(off), 12, replace=False)]:
        changed = {k: v.copy() for k, v in batch.items()}
        changed["targets"][r, t] = (changed["targets"][r, t] + 37) % 259
        assert loss(changed) == (ref, n)
    # padding inputs after the end cannot reach earlier positions (causal attention)
    pad = {k: v.copy() for k, v in batch.items()}
    last = np.max(np.nonzero(mask[0])[0])
    pad["inputs"][0, last + 1:] = rng.integers(3, 259, 160 - last - 1)
    assert loss(pad) == (ref, n)
    on = np.argwhere(mask == 1)[0]
    changed = {k: v.copy() for k, v in batch.items()}
    changed["targets"][on[0], on[1]] = (changed["targets"][on[0], on[1]] + 37) % 259
    assert loss(changed)[0] != ref


def _train(argv: list[str]) -> int:
    from toymlx_cli.train import main

    return main(argv)


def test_recipe_writes_adapters_and_resumes(tiny_gguf, tmp_path):
    common = ["--recipe", "lora", "--base", str(tiny_gguf), "--runs-root", str(tmp_path),
              "--steps", "6", "--batch-size", "2", "--seq-len", "64", "--lr", "1e-2",
              "--warmup", "1", "--eval-every", "3", "--eval-batches", "2",
              "--checkpoint-every", "3", "--lora.targets", "q,v", "--lora.rank", "4",
              "--no-progress", "--no-compile"]
    assert _train(common + ["--run-id", "full"]) == 0
    full = tmp_path / "full"
    names = sorted(p.name for p in (full / "weights").iterdir())
    assert names == ["adapter_step_3.gguf", "adapter_step_3.state.safetensors",
                     "adapter_step_6.gguf", "adapter_step_6.state.safetensors", "latest"]
    assert (full / "weights" / "latest").resolve().name == "adapter_step_6.gguf"
    events = [json.loads(line) for line in (full / "events.jsonl").read_text().splitlines()]
    start = events[0]
    assert start["model"]["n_trainable"] == 3 * 4 * ((64 + 64) + (64 + 32))
    assert start["model"]["lora_targets"] == "q,v" and start["model"]["base_dtype"] == "float32"
    assert start["config"]["base_dtype_resolved"] == "float32"  # auto, plenty of memory
    losses = [e["loss"] for e in events if e["kind"] == "step"]
    assert len(losses) == 6 and all(np.isfinite(losses))
    ad = load_adapter(full)
    assert ad.alpha == 16.0 and ad.metadata["general.step"] == 6
    assert np.abs(ad.pairs["blk.2.attn_v.weight"][1]).max() > 0  # B has moved off zero
    # the run folder is a model for generation: its base (from config.json) + its adapter
    from toymlx.generation.generate import load_for_generation

    run_model, _ = load_for_generation(full)
    by_hand = apply_adapter(base(tiny_gguf), full / "weights" / "latest")
    np.testing.assert_array_equal(np.array(run_model(TOKENS)), np.array(by_hand(TOKENS)))
    assert np.abs(np.array(run_model(TOKENS)) - np.array(base(tiny_gguf)(TOKENS))).max() > 1e-4

    # interrupted at step 3, then resumed: the same adapter as the uninterrupted run
    assert _train(common + ["--run-id", "cut", "--stop-at", "3"]) == 0
    cut = tmp_path / "cut"
    assert (cut / "weights" / "latest").resolve().name == "adapter_step_3.gguf"
    assert _train(["--resume", str(cut), "--no-progress"]) == 0
    assert (cut / "weights" / "latest").resolve().name == "adapter_step_6.gguf"
    resumed = load_adapter(cut)
    for name, (a, b) in ad.pairs.items():
        np.testing.assert_allclose(resumed.pairs[name][0], a, atol=1e-6)
        np.testing.assert_allclose(resumed.pairs[name][1], b, atol=1e-6)
    cut_losses = [json.loads(x) for x in (cut / "events.jsonl").read_text().splitlines()]
    assert [e["loss"] for e in cut_losses if e["kind"] == "step"] == pytest.approx(losses,
                                                                                   abs=1e-5)


def test_recipe_requires_base(tmp_path, capsys):
    rc = _train(["--recipe", "lora", "--runs-root", str(tmp_path), "--no-progress"])
    assert rc == 2
    assert "--base: expected the path of a GGUF to adapter-train" in capsys.readouterr().err
    rc = _train(["--recipe", "lora", "--base", str(tmp_path / "nope.gguf"),
                 "--runs-root", str(tmp_path), "--no-progress"])
    assert rc == 2 and "nope.gguf: --base: expected an existing GGUF file" in \
        capsys.readouterr().err


def test_lora_linear_wraps_with_from_base():
    mx.random.seed(0)
    lin = nn.Linear(32, 16, bias=True)
    m = LoRALinear.from_base(lin, rank=2, alpha=6.0, dropout=0.0)
    assert m.scale == 3.0 and m.lora_a.shape == (2, 32) and m.lora_b.shape == (16, 2)
    x = mx.random.normal((5, 32))
    assert mx.array_equal(m(x), lin(x)).item()
    m.lora_b = mx.ones((16, 2))
    fused = m.fuse()
    assert isinstance(fused, nn.Linear) and "bias" in fused
    assert mx.abs(fused(x) - m(x)).max().item() < 1e-5


def test_export_cli(tiny_gguf, tmp_path, capsys):
    from toymlx_cli.export import main as export

    model = apply_lora(base(tiny_gguf), "q,down", rank=4, alpha=8.0)
    randomize_b(model, std=0.1)
    want = model(TOKENS)
    run = tmp_path / "run"
    (run / "weights").mkdir(parents=True)
    write_adapter(run / "weights" / "adapter_step_5.gguf", model, {"general.architecture": "llama"})
    (run / "weights" / "latest").symlink_to("adapter_step_5.gguf")
    merged = tmp_path / "merged.gguf"
    assert export(["--base", str(tiny_gguf), "--adapter", str(run), "--fuse",
                   "--out", str(merged)]) == 0
    assert GGUFFile(merged).metadata["general.file_type"] == 0  # F32 by default
    assert mx.abs(base(merged)(TOKENS) - want).max().item() < 1e-5
    copy = tmp_path / "adapter.gguf"
    assert export(["--base", str(tiny_gguf), "--adapter", str(run), "--out", str(copy)]) == 0
    assert copy.read_bytes() == (run / "weights" / "adapter_step_5.gguf").read_bytes()
    f16 = tmp_path / "base-f16.gguf"
    assert export(["--base", str(tiny_gguf), "--out", str(f16), "--dtype", "f16"]) == 0
    g = GGUFFile(f16)
    assert g.tensors["blk.1.ffn_up.weight"].type.name == "F16"
    assert g.metadata["general.file_type"] == 1
    assert g.metadata["tokenizer.ggml.tokens"] == GGUFFile(tiny_gguf).metadata[
        "tokenizer.ggml.tokens"]
    capsys.readouterr()
    assert export(["--base", str(tiny_gguf), "--fuse", "--out", str(tmp_path / "x.gguf")]) == 2
    assert "--fuse: expected --adapter" in capsys.readouterr().err
    assert export(["--base", str(tiny_gguf), "--adapter", str(tiny_gguf), "--fuse",
                   "--out", str(tmp_path / "x.gguf")]) == 2
    assert (f"{tiny_gguf}: --adapter: expected an adapter GGUF (a lora run's adapter_step_N.gguf, "
            "or llama.cpp's) or a lora run's folder, found a llama model, not an adapter"
            ) in capsys.readouterr().err
    assert not (tmp_path / "x.gguf").exists()


def _dropout_grads(grad_checkpoint: bool, seed: int) -> tuple[float, dict[str, np.ndarray]]:
    """One step's loss and LoRA gradients of a 2-block Llama with LoRA dropout 0.1 on q, v and
    down, its random draws from `seed`."""
    mx.random.seed(0)
    model = Llama(tiny(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64),
                  replace(EXACT_OPS, grad_checkpoint=grad_checkpoint))
    apply_lora(model, "q,v,down", rank=2, dropout=0.1)
    for m in lora_layers(model).values():  # B at zero would hide the masks from the loss
        m.lora_b = mx.random.normal(m.lora_b.shape, scale=0.5)
    model.train()
    tokens = mx.array(np.random.default_rng(0).integers(0, 256, (2, 17)))

    def loss(m):
        return nn.losses.cross_entropy(m(tokens[:, :-1]), tokens[:, 1:]).mean()

    mx.random.seed(seed)
    value, grads = nn.value_and_grad(model, loss)(model)
    return value.item(), {k: np.array(v) for k, v in tree_flatten(grads)}


def test_grad_checkpoint_recomputes_the_dropout_masks_of_the_forward_pass():
    """--grad-checkpoint with LoRA dropout was refused: a recomputed block drew new masks from
    MLX's random state, moved on by then (mlx-lm accepts it so: its gradient is not that of
    the forward it ran). The recomputation now draws from the key the forward's block started
    from: the loss and every gradient are those without checkpointing, under the same seed."""
    want_loss, want = _dropout_grads(False, seed=5)
    got_loss, got = _dropout_grads(True, seed=5)
    assert got_loss == want_loss and got.keys() == want.keys()
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-7, err_msg=k)
    other_loss, other = _dropout_grads(False, seed=6)  # the masks matter: another seed differs
    assert other_loss != want_loss
    assert max(np.abs(other[k] - want[k]).max() for k in want) > 1e-3


def test_grad_checkpoint_with_lora_dropout_trains_the_same_losses(tiny_gguf, tmp_path, capsys):
    """A lora run with --lora.dropout 0.1 and --grad-checkpoint (refused before) logs the
    losses the same run logs without it, step by step, compiled, with gradient accumulation."""
    from toymlx_cli.train import main as train_main

    from toymlx.bundle.events import read_events

    data = mlx_lm_folder(tmp_path / "data")
    losses = {}
    for flag in ("--no-grad-checkpoint", "--grad-checkpoint"):
        run = tmp_path / "runs" / flag[2:]
        assert train_main(["--recipe", "lora", "--base", str(tiny_gguf), "--data.path",
                           str(data), "--lora.dropout", "0.1", "--lora.targets", "q,v,down",
                           "--steps", "4", "--batch-size", "2", "--grad-accum", "2",
                           "--lr", "1e-3", "--seq-len", "32", "--eval-every", "2",
                           "--no-progress", flag, "--runs-root", str(tmp_path / "runs"),
                           "--run-id", flag[2:]]) == 0
        events = read_events(run)
        losses[flag] = ([e["loss"] for e in events if e["kind"] == "step"],
                        [e["val_loss"] for e in events if e["kind"] == "eval"])
    capsys.readouterr()
    (want, want_val), (got, got_val) = losses.values()
    assert len(want) == 4 and len(want_val) == 2
    assert got == pytest.approx(want, rel=1e-5) and got_val == pytest.approx(want_val, rel=1e-5)


def mlx_lm_folder(path: Path, n_train: int = 12, n_valid: int = 3, n_test: int = 4) -> Path:
    """A data folder in mlx-lm's layout: chat records in train/valid/test.jsonl."""
    path.mkdir(parents=True, exist_ok=True)
    for name, n in (("train", n_train), ("valid", n_valid), ("test", n_test)):
        if n:
            (path / f"{name}.jsonl").write_text("".join(json.dumps({"messages": [
                {"role": "user", "content": f"{name} question {i}?"},
                {"role": "assistant", "content": f"answer {i * 7 % 10}"}]}) + "\n"
                for i in range(n)))
    return path


def number_stories_folder(path: Path, counts: dict[str, int],
                          prompt: str = "Tell me about the number {i}.") -> Path:
    """A data folder of prompt/completion records ("Once upon a time there was a number ..."),
    `counts` rows in each split's .jsonl: for bases without a chat template (stories260K)."""
    path.mkdir(parents=True, exist_ok=True)
    for name, n in counts.items():
        (path / f"{name}.jsonl").write_text("".join(json.dumps({
            "prompt": prompt.format(i=i),
            "completion": f" Once upon a time there was a number {i % 10}. It was happy."})
            + "\n" for i in range(n)))
    return path


def events_of(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]


def test_eval_split_test_refuses_a_test_set_edited_since_the_run(tiny_gguf, tmp_path, capsys):
    """config.json recorded the data folder's SHA-256, and each of its files', at the run's
    start: after test.jsonl is edited, `--split test` on the run names the file and both of
    its own digests (exit 2) rather than score other examples under the run's name;
    --data.path scores the data as it is now. An edit to train.jsonl alone changes nothing
    --split test scores, and is not refused. (The run is of --test: a run without it never
    reads test.jsonl, so its record leaves it out and --split test scores it as it is:
    tests/test_run_inputs.py.)"""
    import hashlib

    from toymlx_cli.eval import main as eval_main

    from toymlx.bundle.inputs import fingerprint

    data = mlx_lm_folder(tmp_path / "data")
    assert _train(["--recipe", "lora", "--base", str(tiny_gguf), "--runs-root", str(tmp_path),
                   "--run-id", "r", "--steps", "1", "--batch-size", "2", "--seq-len", "64",
                   "--eval-every", "0", "--no-progress", "--no-compile", "--test",
                   "--data.path", str(data)]) == 0
    test = data / "test.jsonl"
    was = fingerprint(test)
    capsys.readouterr()
    (data / "train.jsonl").write_text((data / "train.jsonl").read_text() + "\n")
    assert eval_main(["--model", str(tmp_path / "r"), "--split", "test"]) == 0
    assert json.loads(capsys.readouterr().out)["data"] == str(test)
    test.write_text(test.read_text().replace("question 0?", "question 9?"))
    now = fingerprint(test)
    edited = hashlib.sha256(test.read_bytes()).hexdigest()
    assert was["bytes"] == now["bytes"] and was["sha256"] != now["sha256"]
    assert eval_main(["--model", str(tmp_path / "r"), "--split", "test"]) == 2
    out = capsys.readouterr()
    assert out.out == ""
    assert out.err == (f"toymlx-eval: error: {test}: --split test: expected the test data the "
                       f"run recorded at its start (in {data}, recorded as data.path): "
                       f"{was['bytes']} bytes, sha256 {was['sha256']}; found it changed: "
                       f"{now['bytes']} bytes, sha256 {now['sha256']}; restore it, or score the "
                       f"data as it is now with --data.path {data}\n")
    assert hashlib.sha256(test.read_bytes()).hexdigest() == edited  # nothing written
    assert eval_main(["--model", str(tmp_path / "r"), "--split", "test",
                      "--data.path", str(data)]) == 0
    assert json.loads(capsys.readouterr().out)["data"] == str(test)
    # the validation split is read from valid.jsonl alone: scored after train.jsonl's edit,
    # refused after its own
    assert eval_main(["--model", str(tmp_path / "r")]) == 0
    capsys.readouterr()
    valid = data / "valid.jsonl"
    valid.write_text(valid.read_text() + valid.read_text().splitlines()[0] + "\n")
    assert eval_main(["--model", str(tmp_path / "r")]) == 2
    assert capsys.readouterr().err.startswith(
        f"toymlx-eval: error: {valid}: --split val: expected the validation data the run "
        f"recorded at its start (in {data}, recorded as data.path): ")


def test_eval_split_val_tokenizes_the_validation_examples_alone(tiny_gguf, tmp_path, capsys,
                                                                 monkeypatch):
    """`toymlx-eval --split val` tokenized every training example too before scoring the
    validation rows alone (a 100,000-row train.jsonl: over a minute, and its rows' memory);
    now only the examples it scores are tokenized, with valid.jsonl and with the last
    --data.val-fraction of the training file, and the loss is the run's own last one."""
    from toymlx_cli.eval import main as eval_main

    from toymlx.data import chat

    tokenized = []

    def counted(example, *a, **k):
        tokenized.append(example.source.rsplit(":", 1)[0])
        return tokenize(example, *a, **k)

    tokenize = chat._pieces  # each example's, as tokenizing cuts it
    for name, data in (("folder", mlx_lm_folder(tmp_path / "data", n_test=0)),
                       ("file", mlx_lm_folder(tmp_path / "one", n_valid=0, n_test=0)
                        / "train.jsonl")):
        assert _train(["--recipe", "lora", "--base", str(tiny_gguf), "--runs-root",
                       str(tmp_path), "--run-id", name, "--steps", "1", "--batch-size", "2",
                       "--seq-len", "64", "--no-progress", "--no-compile", "--data.val-fraction",
                       "0.25", "--data.path", str(data)]) == 0
        last = [e for e in events_of(tmp_path / name) if e["kind"] == "eval"][-1]["val_loss"]
        capsys.readouterr()
        monkeypatch.setattr(chat, "_pieces", counted)
        tokenized.clear()
        assert eval_main(["--model", str(tmp_path / name)]) == 0
        monkeypatch.setattr(chat, "_pieces", tokenize)
        out = json.loads(capsys.readouterr().out)
        valid = str(data / "valid.jsonl") if name == "folder" else str(data)
        assert (name, tokenized) == (name, [valid] * 3)  # 3 of 12 with the val-fraction
        assert out["rows"] == 3 and out["val_loss"] == pytest.approx(last, abs=1e-5)


def test_eval_of_a_run_with_no_validation_rows_says_why(tiny_gguf, tmp_path, capsys):
    """A run that held out nothing (--data.val-fraction 0) shows no empty eval line, and
    toymlx-eval on it says in one line why there is nothing to score (was a KeyError)."""
    from toymlx_cli.eval import main as eval_main

    data = mlx_lm_folder(tmp_path / "data", n_valid=0, n_test=0) / "train.jsonl"
    assert _train(["--recipe", "lora", "--base", str(tiny_gguf), "--runs-root", str(tmp_path),
                   "--run-id", "r", "--steps", "1", "--batch-size", "2", "--seq-len", "64",
                   "--no-progress", "--no-compile", "--data.val-fraction", "0",
                   "--data.path", str(data)]) == 0
    assert "step 1:  (" not in capsys.readouterr().err
    assert [e for e in events_of(tmp_path / "r") if e["kind"] == "eval"] == []
    assert eval_main(["--model", str(tmp_path / "r")]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"toymlx-eval: error: {data}: --split val: expected validation rows to score, found "
        "none: the run held out no examples (--data.val-fraction 0.0 of 12 examples, no "
        "valid.jsonl); score them all with --split all")
    assert eval_main(["--model", str(tmp_path / "r"), "--split", "all"]) == 0
    # validation prompts longer than the row: refused at the start of a run, and in toymlx-eval
    no_pack = mlx_lm_folder(tmp_path / "np-data", n_test=0)
    valid = no_pack / "valid.jsonl"
    valid.write_text(valid.read_text().replace("valid question", "valid question " + "x" * 40))
    argv = ["--recipe", "lora", "--base", str(tiny_gguf), "--runs-root", str(tmp_path),
            "--steps", "1", "--batch-size", "2", "--no-progress", "--no-compile",
            "--data.no-pack", "--data.path", str(no_pack)]
    capsys.readouterr()
    assert _train([*argv, "--seq-len", "40", "--run-id", "short"]) == 2
    want = (f"{valid}: validation: expected rows to score, found none: of its 3 examples, 3 "
            "with no trained token within the first 41 (prompts longer than --seq-len 40); "
            "raise --seq-len or shorten the prompts")
    assert capsys.readouterr().err.splitlines()[-1] == f"toymlx-train: error: {want}"
    assert _train([*argv, "--seq-len", "128", "--run-id", "np"]) == 0
    capsys.readouterr()
    assert eval_main(["--model", str(tmp_path / "np"), "--seq-len", "40"]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == f"toymlx-eval: error: {want}"


def _test_run(tiny_gguf: Path, root: Path, *extra: str, data: Path | None = None) -> list[str]:
    """The options of a 2-step lora run with --test (checkpoint at step 2, validated there), on
    `data` (default: a data folder made in `root`)."""
    return ["--recipe", "lora", "--base", str(tiny_gguf), "--runs-root", str(root), "--run-id",
            "r", "--steps", "2", "--batch-size", "2", "--seq-len", "64", "--eval-every", "0",
            "--no-progress", "--no-compile", "--data.path",
            str(data if data is not None else mlx_lm_folder(root / "data")), "--test", *extra]



@pytest.fixture(scope="module")
def uninterrupted(tiny_gguf, tmp_path_factory) -> Path:
    """`_test_run` with --fuse-at-end f32, never stopped: the figures and the file a stopped
    and resumed run must give."""
    root = tmp_path_factory.mktemp("uninterrupted")
    assert _train(_test_run(tiny_gguf, root, "--fuse-at-end", "f32")) == 0
    return root / "r"


def _stop_at_the_end(monkeypatch, where: str, sig: int) -> None:
    """Send `sig` to this process at `where` of a `_test_run`'s end: in its last step
    ("last step"), in the final validation's pass ("validation"), between its final checkpoint
    and --test ("before test"), in --test's pass ("test"), or once the export's temporary holds
    its header ("export"); the loop's StopSignals counts it (raised only into the export)."""
    import os

    from toymlx.gguf import writer
    from toymlx.training import trainer
    from toymlx.training.evaluate import Evaluator

    def send() -> None:
        os.kill(os.getpid(), sig)

    if where == "last step":
        step = trainer._Loop._step

        def stop_in_last(self, s, *args):
            if s == self.cfg.steps - 1:
                send()
            return step(self, s, *args)
        monkeypatch.setattr(trainer._Loop, "_step", stop_in_last)
    elif where == "validation":
        passes, evaluate = Evaluator.__call__, trainer._Loop._evaluate

        def stop_in_pass(self, *args, **kw):  # seen before its first micro-batch
            if getattr(self, "stop_in", False):
                self.stop_in = False
                send()
            return passes(self, *args, **kw)

        def final_pass(self, s, *args):
            self.evaluator.stop_in = s == self.cfg.steps
            return evaluate(self, s, *args)
        monkeypatch.setattr(Evaluator, "__call__", stop_in_pass)
        monkeypatch.setattr(trainer._Loop, "_evaluate", final_pass)
    elif where == "before test":
        train = trainer._Loop._train

        def train_then_stop(self, stop, bar):
            train(self, stop, bar)
            send()
        monkeypatch.setattr(trainer._Loop, "_train", train_then_stop)
    elif where == "test":
        test = trainer._Loop._test

        def stop_then_test(self, bar, *args):
            send()
            return test(self, bar, *args)
        monkeypatch.setattr(trainer._Loop, "_test", stop_then_test)
    else:
        pad, sent = writer._pad, []

        def stop_once_written(f, align):
            if "fused-" in Path(f.name).name and not sent:
                f.flush()
                sent.append(os.path.getsize(f.name))  # the header, in the temporary
                send()
            pad(f, align)
        monkeypatch.setattr(writer, "_pad", stop_once_written)


END_STOPS = {  # where: (what the message says, what is left undone)
    "last step": ("before the final validation",
                  "the final validation, --test and the export"),
    "validation": ("during the final validation", "the final validation, --test and the export"),
    "before test": ("before --test", "--test and the export"),
    "test": ("during --test", "--test and the export"),
    "export": ("during the export", "the export"),
}


@pytest.mark.parametrize("where", list(END_STOPS))
def test_a_stop_that_leaves_the_runs_end_undone_ends_it_interrupted(
        tiny_gguf, tmp_path, capsys, monkeypatch, uninterrupted, where):
    """One rule for a stop (here SIGTERM) after the last step's update, before or during what
    the run was asked to do after it (final validation, --test, --fuse-at-end's export): the
    run ends interrupted, exit 143, the signal in run_end, its line naming what is left undone
    and the resume that does it. Before: in --test's pass or before it, the test pass was
    abandoned or skipped and the message named only the export; in the last step or the final
    validation, "stopped by SIGTERM after step 2; resume with --resume RUN", naming nothing of
    the rest. The resume trains nothing and gives the uninterrupted run's figures to the bit
    and its fused file byte for byte, each part once."""
    import signal

    from toymlx.sweeps.supervisor import run_state

    _stop_at_the_end(monkeypatch, where, signal.SIGTERM)
    run = tmp_path / "r"
    # the uninterrupted run's data: a fused file records the path of the data it trained on
    assert _train(_test_run(tiny_gguf, tmp_path, "--fuse-at-end", "f32",
                            data=uninterrupted.parent / "data")) == 143
    monkeypatch.undo()
    when, undone = END_STOPS[where]
    end = events_of(run)[-1]
    assert (end["kind"], end["reason"], end["final_step"], end["exit_code"], end["signal"]) == (
        "run_end", "interrupted", 2, 143, "SIGTERM")
    assert end["message"] == (
        f"stopped by SIGTERM {when} (all 2 steps trained, checkpoint step_2 written): left "
        f"undone: {undone}; toymlx-train --resume {run} finishes it without training; or "
        f"toymlx-export --adapter {run} --fuse --dtype f32 --out {run}-fused-f32.gguf writes "
        "the export alone")
    out, err = capsys.readouterr()
    assert err.splitlines()[-1].startswith(f"toymlx: interrupted at step 2: {end['message']}.")
    if where == "test":
        assert (f"step 2: --test abandoned (SIGTERM came during its pass; toymlx-train --resume "
                f"{run} scores it)") in out.splitlines()
    assert not (run / "fused-f32.gguf").exists()
    assert run_state(run) == "resumable"  # a sweep's re-run resumes it
    n_before = len(events_of(run))
    assert _train(["--resume", str(run), "--no-progress"]) == 0
    events = events_of(run)
    added = [e["kind"] if e["kind"] != "eval" else e.get("split", "val")
             for e in events[n_before - 1:]]
    parts = {"last step": ["val", "test", "export"], "validation": ["val", "test", "export"],
             "before test": ["test", "export"], "test": ["test", "export"],
             "export": ["export"]}[where]
    assert added == ["resume", *parts, "run_end"]  # no step, no checkpoint: nothing retrained
    assert (events[-1]["reason"], events[-1]["exit_code"]) == ("completed", 0)

    def figures(evs: list[dict]) -> list[tuple]:
        return [(e["kind"], e["step"], e.get("split"), e.get("val_loss"), e.get("test_loss"),
                 e.get("test_perplexity"), e.get("loss"), e.get("path"), e.get("bytes"))
                for e in evs if e["kind"] in ("step", "eval", "export")]
    assert figures(events) == figures(events_of(uninterrupted))
    assert (run / "fused-f32.gguf").read_bytes() == (
        uninterrupted / "fused-f32.gguf").read_bytes()


def test_a_stop_during_the_test_pass_of_a_run_without_export(tiny_gguf, tmp_path, capsys,
                                                             monkeypatch):
    """Ctrl-C during --test's pass, the run's last part: it ended `completed` with exit 0 (a
    scheduler read success, the test figures missing). Now interrupted, exit 130, and the
    resume scores the test set as the uninterrupted run did."""
    import signal

    assert _train(_test_run(tiny_gguf, tmp_path / "full")) == 0
    _stop_at_the_end(monkeypatch, "test", signal.SIGINT)
    run = tmp_path / "r"
    assert _train(_test_run(tiny_gguf, tmp_path)) == 130
    monkeypatch.undo()
    end = events_of(run)[-1]
    assert (end["reason"], end["exit_code"], end["signal"]) == ("interrupted", 130, "SIGINT")
    assert end["message"] == (
        f"interrupted during --test (all 2 steps trained, checkpoint step_2 written): left "
        f"undone: --test; toymlx-train --resume {run} finishes it without training")
    assert (f"step 2: --test abandoned (SIGINT came during its pass; toymlx-train --resume "
            f"{run} scores it)") in capsys.readouterr().out.splitlines()
    assert _train(["--resume", str(run), "--no-progress"]) == 0
    tests = [e for e in events_of(run) if e.get("split") == "test"]
    full = [e for e in events_of(tmp_path / "full" / "r") if e.get("split") == "test"]
    assert [(e["test_loss"], e["test_perplexity"]) for e in tests] == [
        (e["test_loss"], e["test_perplexity"]) for e in full]


@pytest.mark.parametrize("how", ["killed", "interrupted"])
def test_a_run_stopped_after_its_final_checkpoint_is_finished_by_resume(tiny_gguf, tmp_path,
                                                                         capsys, how):
    """A run SIGKILLed after its final checkpoint (during --test, or before run_end), or
    stopped by Ctrl-C in its last step (final validation and --test skipped, run_end
    "interrupted ... resume with --resume"): --resume refused it as "completed at step 2",
    so its test figures and run_end were lost for good. Now the resume finishes it: the
    validation and test figures of the uninterrupted run, to the bit, and one run_end."""
    assert _train(_test_run(tiny_gguf, tmp_path / "full")) == 0
    full = events_of(tmp_path / "full" / "r")
    assert _train(_test_run(tiny_gguf, tmp_path)) == 0
    run = tmp_path / "r"
    lines = (run / "events.jsonl").read_text().splitlines(keepends=True)
    # killed during --test: its validation written; Ctrl-C in the last step: none of either
    drop = {"run_end", "test"} if how == "killed" else {"run_end", "val", "test"}

    def what(line: str) -> str:
        e = json.loads(line)
        return e.get("split", "val") if e["kind"] == "eval" else e["kind"]
    kept = [x for x in lines if what(x) not in drop]
    if how == "interrupted":
        kept.append(json.dumps({
            "kind": "run_end", "t": 1.0, "ended_at": "2026-12-01T00:00:00+00:00",
            "reason": "interrupted", "final_step": 2, "final_loss": 1.0, "exit_code": 130,
            "message": f"interrupted after step 2; resume with --resume {run}",
            "signal": "SIGINT"}) + "\n")
    (run / "events.jsonl").write_text("".join(kept))
    capsys.readouterr()
    assert _train(["--resume", str(run), "--no-progress"]) == 0
    end = ("killed: events.jsonl has no run_end" if how == "killed" else
           "run_end reason 'interrupted'")
    assert (f"toymlx-train: the run trained all 2 steps but did not complete ({end}): "
            "finishing it from step_2 (what follows the last step: final validation, --test, "
            "the export; then run_end)") in capsys.readouterr().err.splitlines()
    events = events_of(run)
    assert [e["kind"] for e in events].count("run_start") == 1
    assert [e["step"] for e in events if e["kind"] == "step"] == [1, 2]
    assert events[-1]["reason"] == "completed" and events[-1]["final_step"] == 2

    def figures(evs: list[dict]) -> list[tuple]:
        return [(e["step"], e.get("split", "val"), e.get("val_loss", e.get("test_loss")))
                for e in evs if e["kind"] == "eval"]
    assert figures(events) == figures(full)  # [(2, 'val', ...), (2, 'test', ...)]
    assert len(figures(events)) == 2


def test_a_broken_chat_template_is_named_as_the_ggufs(tmp_path, capsys):
    """A template that is not valid Jinja is the model file's fault: the error names the GGUF
    and its key, not the first data line that rendered it."""
    meta = tok_meta()
    meta["tokenizer.chat_template"] = "{% for m in messages %}{{ m.content }"
    gguf = tmp_path / "broken.gguf"
    mx.random.seed(3)
    write_llama(gguf, Llama(ARGS), meta, name="broken template")
    data = mlx_lm_folder(tmp_path / "data", n_test=0)
    capsys.readouterr()
    assert _train(["--recipe", "lora", "--base", str(gguf), "--runs-root", str(tmp_path),
                   "--run-id", "r", "--steps", "1", "--no-progress", "--no-compile",
                   "--data.path", str(data)]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"toymlx-train: error: {gguf}: tokenizer.chat_template: expected a valid Jinja "
        "template, found a syntax error at line 1: unexpected '}'")


def test_recipe_reads_an_mlx_lm_data_folder(tiny_gguf, tmp_path, capsys):
    data = mlx_lm_folder(tmp_path / "data")
    common = ["--recipe", "lora", "--base", str(tiny_gguf), "--runs-root", str(tmp_path),
              "--steps", "2", "--batch-size", "2", "--seq-len", "64", "--eval-every", "0",
              "--no-progress", "--no-compile", "--data.path", str(data)]
    assert _train(common + ["--run-id", "folder", "--test"]) == 0
    run = tmp_path / "folder"
    events = events_of(run)
    start = events[0]
    assert start["config"]["data_source"] == f"{data / 'train.jsonl'} + {data / 'valid.jsonl'}"
    # packed rows of 64: the 12 training conversations, and the 3 of valid.jsonl (a split of
    # train.jsonl would hold one conversation)
    assert start["config"]["train_rows"] == 10 and start["config"]["val_rows"] == 3
    assert start["config"]["test_source"] == str(data / "test.jsonl")
    # --test: one eval event with split test after the last step's validation, before run_end
    assert [(e["kind"], e.get("step"), e.get("split")) for e in events[-5:]] == [
        ("step", 2, None), ("eval", 2, None), ("checkpoint", 2, None), ("eval", 2, "test"),
        ("run_end", None, None)]
    test = [events[-2]]
    assert test[0]["test_perplexity"] == pytest.approx(np.exp(test[0]["test_loss"]), rel=1e-12)
    assert f"test_loss {test[0]['test_loss']:.4f}" in capsys.readouterr().err  # the final line
    # the same figure by hand: base + adapter, float64 log-softmax over test.jsonl's rows
    from toymlx.data.chat import held_out_rows
    from toymlx.generation.generate import load_for_generation

    model, tok = load_for_generation(run)
    rows = held_out_rows(load_examples(data / "test.jsonl"), tok, 64, True, True)
    logits = np.array(model(mx.array(rows["inputs"])), dtype=np.float64)  # (N, T, V)
    top = logits.max(-1, keepdims=True)
    logp = logits - (top + np.log(np.exp(logits - top).sum(-1, keepdims=True)))
    picked = np.take_along_axis(logp, rows["targets"][..., None], -1)[..., 0]  # (N, T)
    by_hand = -(picked * rows["mask"]).sum() / rows["mask"].sum()
    assert test[0]["test_loss"] == pytest.approx(by_hand, abs=2e-5)
    # toymlx-eval --split test and toymlx-report show the same figures
    from toymlx_cli.eval import main as eval_main

    assert eval_main(["--model", str(run), "--split", "test", "--batch-size", "3"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["rows"] == len(rows["inputs"]) and out["data"] == str(data / "test.jsonl")
    assert out["test_loss"] == pytest.approx(test[0]["test_loss"], abs=1e-5)
    assert eval_main(["--model", str(run)]) == 0  # the validation rows: valid.jsonl's
    out = json.loads(capsys.readouterr().out)
    assert out["rows"] == 3 and out["val_loss"] == pytest.approx(events[-4]["val_loss"], abs=1e-5)
    from toymlx.runner.report import format_table, summarize_run

    row = summarize_run(run)
    assert (row["test_loss"], row["test_perplexity"]) == (test[0]["test_loss"],
                                                          test[0]["test_perplexity"])
    assert row["final"] == events[-4]["val_loss"]  # the validation curve keeps its last point
    assert "test_perplexity" in format_table([row], []).splitlines()[0]
    (data / "train.jsonl").rename(data / "training.jsonl")
    capsys.readouterr()
    assert _train(common + ["--run-id", "bad"]) == 2
    assert error_line(capsys) == (
        f"toymlx-train: error: {data}: data folder: expected train.jsonl (required), valid.jsonl "
        "and test.jsonl (optional) (mlx-lm's layout; .json, .csv or .tsv in place of .jsonl), "
        "found test.jsonl, training.jsonl, valid.jsonl")
    assert not (tmp_path / "bad").exists()
    (data / "training.jsonl").rename(data / "train.jsonl")
    (data / "test.jsonl").unlink()
    assert _train(common + ["--run-id", "no-test", "--test"]) == 2
    assert error_line(capsys) == ("toymlx-train: error: --test: expected --data.path to be a data "
                                  f"folder with test.jsonl, found {data}")


def test_a_run_without_test_never_reads_test_jsonl(tiny_gguf, tmp_path, capsys):
    """test.jsonl is read only by a run that scores it (--test): a line it would refuse blocks
    no run without --test, which records no test set; --test refuses it, naming the line."""
    from cli_errors import error_line

    data = mlx_lm_folder(tmp_path / "data")
    with (data / "test.jsonl").open("a") as f:
        f.write("{not json\n")
    common = ["--recipe", "lora", "--base", str(tiny_gguf), "--runs-root", str(tmp_path),
              "--steps", "1", "--batch-size", "2", "--seq-len", "64", "--eval-every", "0",
              "--no-progress", "--no-compile", "--data.path", str(data)]
    assert _train(common + ["--run-id", "plain"]) == 0
    assert "test.jsonl" not in capsys.readouterr().err
    config = events_of(tmp_path / "plain")[0]["config"]
    assert "test_source" not in config and "test_rows" not in config
    assert _train(common + ["--run-id", "scored", "--test"]) == 2
    assert error_line(capsys) == (
        f"toymlx-train: error: {data / 'test.jsonl'}:5: bad JSON (Expecting property name "
        "enclosed in double quotes at column 2); expected one object per line {\"text\": ...}, "
        '{"prompt": ..., "completion": ...} or {"messages": [...]}')
    assert not (tmp_path / "scored").exists()


# ---- DoRA -----------------------------------------------------------------------------------
def test_dora_linear_against_float64_and_its_fuse():
    """y = m / ||W + s B A||_row * (W x + s B A x) + bias, in float64 numpy; step 0 = the base."""
    mx.random.seed(1)
    lin = nn.Linear(24, 10, bias=True)
    d = DoRALinear.from_base(lin, rank=3, alpha=6.0)
    x = mx.random.normal((4, 24))
    assert mx.array_equal(d(x), lin(x)).item()  # m = ||W||_row: exactly the base at step 0
    d.lora_b = mx.random.normal((10, 3)) * 0.5
    d.m = d.m * mx.linspace(0.5, 1.5, 10)
    w, bias, a, b, m = (np.array(t, dtype=np.float64) for t in
                        (lin.weight, lin.bias, d.lora_a, d.lora_b, d.m))
    adapted = w + 2.0 * b @ a
    want = (np.array(x, np.float64) @ adapted.T) * (m / np.linalg.norm(adapted, axis=1)) + bias
    np.testing.assert_allclose(np.array(d(x)), want, atol=2e-5)
    fused = d.fuse()
    assert isinstance(fused, nn.Linear) and not isinstance(fused, LoRALinear)
    np.testing.assert_allclose(np.array(fused(x)), want, atol=2e-5)
    # m, A and B train; the base weight does not (frozen by apply_lora in a model)
    grads = nn.value_and_grad(d, lambda xx: d(xx).sum())(x)[1]
    assert {"m", "lora_a", "lora_b"} <= set(grads)


def test_dora_adapter_file_round_trip(tiny_gguf, tmp_path):
    model = apply_lora(base(tiny_gguf), "q,down", rank=4, alpha=8.0, kind="dora")
    randomize_b(model, std=0.1)
    for m in lora_layers(model).values():
        m.m = m.m * 1.1
    want = np.array(model(TOKENS))
    path = write_adapter(tmp_path / "dora.gguf", model, {"general.architecture": "llama"})
    ad = load_adapter(path)
    assert ad.kind == "dora" and ad.metadata["adapter.type"] == "dora"
    assert ad.magnitudes["blk.1.ffn_down.weight"].shape == (64,)
    other = apply_adapter(base(tiny_gguf), path)
    assert all(isinstance(m, DoRALinear) for m in lora_layers(other).values())
    np.testing.assert_array_equal(np.array(other(TOKENS)), want)
    # a LoRA run cannot take a DoRA file's weights, nor the other way round
    with pytest.raises(GGUFError, match=r"'adapter.type': expected 'lora' \(this run's "
                                        r"--fine-tune-type\), found 'dora'"):
        load_adapter_weights(apply_lora(base(tiny_gguf), "q,down", rank=4, alpha=8.0), path)


# ---- the recipe's --fine-tune-type and --lora.init-adapter ---------------------------------
def recipe_args(tiny_gguf: Path, root: Path, data: Path, *more: str) -> list[str]:
    return ["--recipe", "lora", "--base", str(tiny_gguf), "--runs-root", str(root),
            "--data.path", str(data), "--steps", "4", "--batch-size", "2", "--seq-len", "64",
            "--lr", "1e-2", "--warmup", "1", "--eval-every", "0", "--eval-batches", "1",
            "--checkpoint-every", "2", "--no-progress", "--no-compile", *more]


def step_losses(run: Path) -> list[float]:
    return [e["loss"] for e in events_of(run) if e["kind"] == "step"]


def test_a_run_shorter_than_the_default_warmup_says_so_once(tiny_gguf, tmp_path, capsys):
    """--steps 2 with lora's default --warmup 10: every update's lr below --lr (logged), and one
    line at the start says so, naming the warm-up as the default."""
    data = mlx_lm_folder(tmp_path / "data")
    args = recipe_args(tiny_gguf, tmp_path, data, "--steps", "2", "--run-id", "r")
    at = args.index("--warmup")
    del args[at:at + 2]  # the default
    capsys.readouterr()
    assert _train(args) == 0
    err = capsys.readouterr().err
    assert err.count("toymlx-train: --warmup 10 (the recipe's default) is longer than --steps 2: "
                     "the learning rate is still warming up when the run ends (2/10 of the way) "
                     "and never reaches --lr 0.01; lower --warmup to reach it\n") == 1
    lrs = [e["lr"] for e in events_of(tmp_path / "r") if e["kind"] == "step"]
    assert lrs == pytest.approx([1e-3, 2e-3])


def test_dora_run_and_its_fused_export(tiny_gguf, tmp_path, capsys):
    from toymlx_cli.export import main as export

    from toymlx.generation.generate import load_for_generation

    data = mlx_lm_folder(tmp_path / "data")
    args = recipe_args(tiny_gguf, tmp_path, data, "--fine-tune-type", "dora",
                       "--lora.targets", "q,v,down", "--lora.rank", "4")
    assert _train([*args, "--run-id", "dora"]) == 0
    run = tmp_path / "dora"
    start = events_of(run)[0]
    # A, B and m per adapted weight: q (64 -> 64), v (64 -> 32), down (96 -> 64), 3 blocks
    assert start["model"]["n_trainable"] == 3 * (4 * (64 + 64) + 64 + 4 * (64 + 32) + 32
                                                 + 4 * (96 + 64) + 64)
    ad = load_adapter(run)
    assert ad.kind == "dora" and ad.metadata["general.step"] == 4
    model, _ = load_for_generation(run)  # base + the DoRA adapter
    with_adapter = np.array(model(TOKENS))
    assert np.abs(with_adapter - np.array(base(tiny_gguf)(TOKENS))).max() > 1e-3
    merged = tmp_path / "merged.gguf"
    assert export(["--base", str(tiny_gguf), "--adapter", str(run), "--fuse",
                   "--out", str(merged)]) == 0
    assert "adapter.type" not in GGUFFile(merged).metadata  # a plain model llama.cpp runs
    np.testing.assert_allclose(np.array(base(merged)(TOKENS)), with_adapter, atol=2e-5)
    assert export(["--base", str(tiny_gguf), "--adapter", str(run), "--out",
                   str(tmp_path / "x.gguf")]) == 2
    assert "found a DoRA adapter (toymlx's own format: llama.cpp has none); add --fuse" in \
        error_line(capsys, "toymlx-export")
    assert not (tmp_path / "x.gguf").exists()
    # resumed from step 2: the adapter of the uninterrupted run
    assert _train([*args, "--run-id", "cut", "--stop-at", "2"]) == 0
    assert _train(["--resume", str(tmp_path / "cut"), "--no-progress"]) == 0
    assert step_losses(tmp_path / "cut") == step_losses(run)
    resumed = load_adapter(tmp_path / "cut")
    for name, m in ad.magnitudes.items():
        np.testing.assert_array_equal(resumed.magnitudes[name], m)


def test_full_fine_tune_writes_full_ggufs_and_resumes_exactly(tiny_gguf, tmp_path):
    data = mlx_lm_folder(tmp_path / "data")
    args = recipe_args(tiny_gguf, tmp_path, data, "--fine-tune-type", "full")
    assert _train([*args, "--run-id", "full"]) == 0
    run = tmp_path / "full"
    names = sorted(p.name for p in (run / "weights").iterdir())
    assert names == ["latest", "step_2.gguf", "step_2.state.safetensors", "step_4.gguf",
                     "step_4.state.safetensors"]
    start = events_of(run)[0]
    trained = base(tiny_gguf)
    assert start["model"]["n_trainable"] == start["model"]["n_params"] == sum(
        v.size for _, v in tree_flatten(trained.parameters()))
    ckpt = run / "weights" / "step_4.gguf"
    g, b = GGUFFile(ckpt), GGUFFile(tiny_gguf)
    assert g.metadata["tokenizer.chat_template"] == CHATML  # the base's metadata, kept
    assert g.metadata["tokenizer.ggml.tokens"] == b.metadata["tokenizer.ggml.tokens"]
    assert g.metadata["general.step"] == 4 and sorted(g.tensors) == sorted(b.tensors)
    moved = {n for n in b.tensors
             if np.abs(g.load(n, np.float32) - b.load(n, np.float32)).max() > 1e-4}
    assert {"token_embd.weight", "blk.0.attn_q.weight", "blk.2.ffn_down.weight",
            "blk.1.attn_norm.weight"} <= moved  # every kind of weight trained
    # a resumed run gives the same losses and bit-identical weights
    _assert_resume_repeats(args, run, tmp_path, b.tensors, g)


def mlx_lm_trained(num_layers: int) -> dict[str, int]:
    """mlx-lm's full fine-tune (mlx_lm/lora.py, train_model) on its own Llama of ARGS' shape:
    `model.freeze()`, then `model.layers[-max(num_layers, 0):]` unfrozen; trained values by
    where they are ("layers.N" for a block's, else the parameter's own name)."""
    from mlx_lm.models.llama import Model, ModelArgs

    m = Model(ModelArgs(model_type="llama", hidden_size=ARGS.d_model,
                        num_hidden_layers=ARGS.n_layers, intermediate_size=ARGS.ffn_dim,
                        num_attention_heads=ARGS.n_heads, num_key_value_heads=ARGS.n_kv_heads,
                        rms_norm_eps=ARGS.norm_eps, vocab_size=ARGS.vocab_size,
                        tie_word_embeddings=ARGS.tie_embeddings))
    m.freeze()
    for layer in m.layers[-max(num_layers, 0):]:
        layer.unfreeze()
    return _by_place(tree_flatten(m.trainable_parameters()), "model.layers.")


def _by_place(named: list, block_prefix: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for name, v in named:
        place = ("layers." + name[len(block_prefix):].split(".")[0]
                 if name.startswith(block_prefix) else name)
        out[place] = out.get(place, 0) + v.size
    return out


@pytest.mark.parametrize("layers", [1, 2, 3])
def test_full_fine_tune_of_the_last_blocks_trains_what_mlx_lm_trains(tiny_gguf, tmp_path,
                                                                     layers):
    """--full.layers N: the trainable values are mlx-lm's full fine-tune with num_layers N,
    block by block (the embeddings, final norm and head frozen, even with N all blocks)."""
    from toymlx.models.ops import EXACT
    from toymlx.recipes import lora

    cfg = lora.Config(base=str(tiny_gguf), fine_tune_type="full", seq_len=64,
                      full=lora.FullOptions(layers=layers),
                      data=lora.ChatDataOptions(path=str(mlx_lm_folder(tmp_path / "d"))))
    task = lora.build(cfg, EXACT)
    ours = _by_place(tree_flatten(task.model.trainable_parameters()), "layers.")
    assert ours == mlx_lm_trained(layers)
    assert sorted(ours) == [f"layers.{i}" for i in range(3 - layers, 3)]
    assert task.model_info["full_layers"] == layers


def q8_base(tiny_gguf: Path, out: Path) -> Path:
    """tiny_gguf with every matrix (the token table too) in Q8_0."""
    g = GGUFFile(tiny_gguf)
    tensors = {}
    for name in g.tensors:
        w = g.load(name)
        tensors[name] = (QuantTensor(GGMLQuantizationType.Q8_0,
                                     quantize(w, GGMLQuantizationType.Q8_0), w.shape)
                         if w.ndim == 2 else w)
    return write_gguf(out, dict(g.metadata), tensors)


def test_full_fine_tune_of_the_last_block_keeps_the_rest_quantized(tiny_gguf, tmp_path):
    """--full.layers 1 on a Q8_0 base with --base-dtype blocks: the frozen blocks, embeddings
    and head stay the file's blocks (no float32 copy, gradient or optimizer state); each
    checkpoint is a full GGUF whose frozen tensors are the base's exact dequantization, bit for
    bit, and whose trained block moved; a resumed run gives the same losses and weights."""
    qpath = q8_base(tiny_gguf, tmp_path / "q8.gguf")
    data = mlx_lm_folder(tmp_path / "data")
    args = recipe_args(qpath, tmp_path, data, "--fine-tune-type", "full", "--full.layers", "1",
                       "--base-dtype", "blocks")
    assert _train([*args, "--run-id", "q"]) == 0
    run, b = tmp_path / "q", GGUFFile(qpath)
    start = events_of(run)[0]
    last = {n for n in b.tensors if n.startswith("blk.2.")}
    n_last = sum(b.tensors[n].n_elements for n in last)
    assert start["model"]["n_trainable"] == n_last
    model, g = load_llama(qpath, weights="blocks")
    g.close()
    quantized_bytes = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    last_held = sum(v.nbytes for _, v in tree_flatten(model.layers[2].parameters()))
    # the base as the file's blocks, but the trained block as float32
    assert start["model"]["base_held_bytes"] == quantized_bytes - last_held + 4 * n_last
    assert start["model"]["base_held_bytes"] < 4 * sum(t.n_elements for t in b.tensors.values())
    c = GGUFFile(run / "weights" / "step_4.gguf")
    assert sorted(c.tensors) == sorted(b.tensors)
    moved = {n for n in b.tensors if not np.array_equal(c.load(n, np.float32),
                                                        b.load(n, np.float32))}
    assert moved == last
    # the memory estimate counts the trained block's values once: as float32 in base, their
    # gradients and AdamW's moments in trained (12 bytes; 16 counted each value twice), and the
    # largest trained block once more in float32 while its update runs (`UPDATE_BLOCK_COPIES`)
    with GGUFFile(qpath) as g:
        est = memory.estimate(g, held="blocks", full=True, targets=(), rank=0, layers=1,
                              dora=False, batch_size=2, seq_len=64, ops=EXACT_OPS)
        every = memory.estimate(g, held="float32", full=True, targets=(), rank=0, layers=None,
                                dora=False, batch_size=2, seq_len=64, ops=EXACT_OPS)
        frozen = memory.base_bytes(g, "blocks", frozenset(last))
    assert est.trained == (12 + 4 * memory.UPDATE_BLOCK_COPIES) * n_last and est.base < every.base
    assert est.base == frozen + 4 * n_last
    # resumed from step 2: the same losses, the same weights
    _assert_resume_repeats(args, run, tmp_path, b.tensors, c)


@pytest.mark.parametrize("argv,want", [
    (["--lr-schedule-args", "1", "2"], (
        "--lr-schedule-args: expected none with --lr-schedule warmup-cosine (--lr, --warmup and "
        "--min-lr-ratio shape it), found [1.0, 2.0]; give an MLX --lr-schedule to use them")),
    (["--warmup-init", "0.5"], (
        "--warmup-init: expected with an MLX --lr-schedule (warmup-cosine rises from --lr / "
        "--warmup), found 0.5 with --lr-schedule warmup-cosine")),
    (["--lr-schedule", "constant", "--min-lr-ratio", "0.5"], (
        "--min-lr-ratio: expected with --lr-schedule warmup-cosine (the floor of its decay), "
        "found 0.5 with --lr-schedule constant")),
    # each given at its default (before: taken, compared with the default only)
    (["--warmup-init", "0"], (
        "--warmup-init: expected with an MLX --lr-schedule (warmup-cosine rises from --lr / "
        "--warmup), found 0.0 with --lr-schedule warmup-cosine")),
    (["--lr-schedule", "constant", "--min-lr-ratio", "0.1"], (
        "--min-lr-ratio: expected with --lr-schedule warmup-cosine (the floor of its decay), "
        "found 0.1 with --lr-schedule constant")),
])
def test_schedule_options_the_schedule_does_not_read_are_refused(tiny_gguf, tmp_path, capsys,
                                                                 argv, want):
    """Each was taken and ignored: the run trained on another schedule than the one asked."""
    data = mlx_lm_folder(tmp_path / "data")
    assert _train(recipe_args(tiny_gguf, tmp_path, data, *argv)) == 2
    assert error_line(capsys) == f"toymlx-train: error: {want}"
    assert not any(p.name not in ("data",) for p in tmp_path.iterdir())


def test_full_layers_apply_to_a_full_fine_tune_only(tiny_gguf, tmp_path, capsys):
    data = mlx_lm_folder(tmp_path / "data")
    assert _train(recipe_args(tiny_gguf, tmp_path, data, "--full.layers", "2")) == 2
    assert error_line(capsys) == (
        "toymlx-train: error: --full.layers: expected no value with --fine-tune-type lora (it "
        "steers a full fine-tune), found 2; remove it (--lora.layers for the adapters), or "
        "train --fine-tune-type full")
    assert _train(recipe_args(tiny_gguf, tmp_path, data, "--fine-tune-type", "full",
                              "--full.layers", "4")) == 2
    assert error_line(capsys) == ("toymlx-train: error: --full.layers: expected 1..3 (the "
                                  "base's block count) or unset for all, found 4")
    assert _train(recipe_args(tiny_gguf, tmp_path, data, "--fine-tune-type", "full",
                              "--base-dtype", "blocks")) == 2
    assert "--base-dtype: expected auto or float32 with --fine-tune-type full" in \
        error_line(capsys)
    assert not any(p.name not in ("data",) for p in tmp_path.iterdir())


def test_run_starts_from_an_adapter(tiny_gguf, tmp_path, capsys):
    from toymlx.data.chat import SFTData

    data = mlx_lm_folder(tmp_path / "data")
    args = recipe_args(tiny_gguf, tmp_path, data, "--lora.targets", "q,v", "--lora.rank", "4")
    assert _train([*args, "--run-id", "first"]) == 0
    first = tmp_path / "first" / "weights" / "adapter_step_4.gguf"
    assert _train([*args, "--run-id", "second", "--lora.init-adapter",
                   str(tmp_path / "first")]) == 0
    # step 1's loss is the first adapter's on step 1's batch (the loss before the update)
    model = apply_adapter(base(tiny_gguf), first)
    tok = Tokenizer.from_metadata(GGUFFile(tiny_gguf).metadata)
    batch = SFTData.from_file(data, tok, 64, True, True).batch(0, 0, 2)
    loss, _ = lm_loss(model, {k: mx.array(v[0]) for k, v in batch.items()})
    assert step_losses(tmp_path / "second")[0] == pytest.approx(loss.item(), abs=1e-5)
    assert step_losses(tmp_path / "second")[0] < step_losses(tmp_path / "first")[0] - 0.1
    capsys.readouterr()
    assert _train([*args, "--run-id", "r8", "--lora.rank", "8", "--lora.init-adapter",
                   str(first)]) == 2
    assert error_line(capsys) == (
        f"toymlx-train: error: {first}: tensor 'blk.0.attn_q.weight.lora_a': expected rank 8 and "
        "alpha 16.0 (this run's), found rank 4 and alpha 16.0; pass --lora.rank 4 to start from "
        "it")
    assert _train([*args, "--run-id", "kq", "--lora.targets", "k,q", "--lora.init-adapter",
                   str(first)]) == 2
    line = error_line(capsys)  # the options that match the adapter, as for mlx-lm's adapters
    assert "tensors: expected LoRA pairs for exactly the model's 6 adapted weights" in line
    assert line.endswith("; the adapter is this run's with --lora.targets q,v --lora.layers 3")
    assert _train([*args, "--run-id", "kq", "--lora.targets", "k,q", "--lora.rank", "2",
                   "--lora.alpha", "3", "--lora.init-adapter", str(first)]) == 2
    assert error_line(capsys).endswith(  # every option that differs, in one line
        "; the adapter is this run's with --lora.targets q,v --lora.layers 3 --lora.rank 4 "
        "--lora.alpha 16")
    assert _train([*args, "--run-id", "model", "--lora.init-adapter", str(tiny_gguf)]) == 2
    assert error_line(capsys) == (
        f"toymlx-train: error: {tiny_gguf}: --lora.init-adapter: expected {_ADAPTER_TAKES}, "
        "found a llama model, not an adapter (general.type unset, no lora_a/lora_b tensors); "
        "pass it as --base to fine-tune it")
    assert not any((tmp_path / n).exists() for n in ("r8", "kq", "model"))


_ADAPTER_TAKES = ("an adapter GGUF (a lora run's adapter_step_N.gguf, or llama.cpp's) or a "
                  "lora run's folder")


def test_a_full_fine_tune_given_as_the_adapter_to_merge_is_named_a_model(tiny_gguf, tmp_path,
                                                                        capsys):
    """toymlx-export --adapter RUN --fuse (and toymlx-generate --adapter) on a full fine-tune:
    "metadata key 'general.type': expected 'adapter' ..., found 'model' (a model; pass it as the
    base and the adapter separately)", naming no flag and no way to export it."""
    from toymlx_cli.export import main as export_main
    from toymlx_cli.generate import main as generate_main

    data = mlx_lm_folder(tmp_path / "data")
    assert _train(recipe_args(tiny_gguf, tmp_path, data, "--run-id", "full",
                              "--fine-tune-type", "full")) == 0
    capsys.readouterr()
    ckpt = tmp_path / "full" / "weights" / "step_4.gguf"  # its latest
    assert ckpt.is_file()
    said = (f"{ckpt}: --adapter: expected {_ADAPTER_TAKES}, found a llama model, not an adapter "
            "(general.type unset, no lora_a/lora_b tensors); a whole model has nothing to "
            f"merge: give {ckpt} as one (toymlx-export --base {ckpt} --out FILE.gguf, "
            f"toymlx-generate --model {ckpt})")
    out = tmp_path / "fused.gguf"
    assert export_main(["--adapter", str(tmp_path / "full"), "--fuse", "--out", str(out)]) == 2
    assert error_line(capsys, "toymlx-export") == f"toymlx-export: error: {said}"
    assert generate_main(["--model", str(tiny_gguf), "--adapter", str(tmp_path / "full"),
                          "--prompt", "hi"]) == 2
    assert error_line(capsys, "toymlx-generate") == f"toymlx-generate: error: {said}"
    assert not out.exists()


@pytest.mark.parametrize("recipe, argv, what, instead", [
    ("from-scratch", ["--model.d-model", "32", "--model.n-layers", "1", "--model.n-heads", "4",
                      "--model.n-kv-heads", "2", "--seq-len", "32"],
     "a llama model", "pass {ckpt} as --base to fine-tune it"),
    ("vit-tiny", ["--model.n-layers", "1"],
     "a vit model", "an image classifier cannot be adapted by the lora recipe"),
])
def test_a_run_of_another_recipe_as_the_initial_adapter_is_named(tiny_gguf, tmp_path, capsys,
                                                                   recipe, argv, what, instead):
    """--lora.init-adapter given a from-scratch or vit-tiny run (its checkpoint a model GGUF)
    was told `metadata key 'general.type': expected 'adapter' ..., found None (a model; pass it
    as the base and the adapter separately)`, toymlx-export's hint, naming no option."""
    assert _train(["--recipe", recipe, "--run-id", "other", "--runs-root", str(tmp_path),
                   "--steps", "1", "--batch-size", "2", "--eval-every", "0", "--no-compile",
                   "--no-progress", *argv]) == 0
    capsys.readouterr()
    run = tmp_path / "other"
    data = mlx_lm_folder(tmp_path / "data")
    assert _train(recipe_args(tiny_gguf, tmp_path, data, "--run-id", "lora",
                              "--lora.init-adapter", str(run))) == 2
    ckpt = run / "weights" / "step_1.gguf"
    assert error_line(capsys) == (
        f"toymlx-train: error: {run}: --lora.init-adapter: expected {_ADAPTER_TAKES}, found a "
        f"{recipe} run whose checkpoint weights/step_1.gguf is {what}, not an adapter "
        f"(general.type unset, no lora_a/lora_b tensors); {instead.format(ckpt=ckpt)}")
    assert not (tmp_path / "lora").exists()


def test_an_unpacked_run_traces_every_width_at_its_first_step(tiny_gguf, tmp_path):
    """--data.no-pack over answers of many lengths: the first step's event names every batch
    width of the run in the order the steps meet them (the widths `SFTData.batch` cuts the
    run's batches to), traced then; no later step names any."""
    data = tmp_path / "data"
    data.mkdir()
    for name, n in (("train", 12), ("valid", 2)):
        (data / f"{name}.jsonl").write_text("".join(json.dumps({"messages": [
            {"role": "user", "content": f"q{i}"},
            {"role": "assistant", "content": "a" * (9 * i)}]}) + "\n" for i in range(n)))
    assert _train(["--recipe", "lora", "--base", str(tiny_gguf), "--runs-root", str(tmp_path),
                   "--run-id", "r", "--steps", "6", "--batch-size", "2", "--seq-len", "128",
                   "--eval-every", "0", "--no-progress", "--data.path", str(data),
                   "--data.no-pack"]) == 0
    events = events_of(tmp_path / "r")
    steps = [e for e in events if e["kind"] == "step"]
    from toymlx.generation.generate import load_for_generation

    _, tok = load_for_generation(tmp_path / "r")
    sft = SFTData.from_file(data, tok, 128, mask_prompt=True, pack=False)
    seed = events[0]["config"]["seed"]
    widths = [sft.batch(s, seed, 2)["mask"].shape[-1] for s in range(6)]
    assert steps[0]["traced_widths"] == list(dict.fromkeys(widths))
    assert len(set(widths)) >= 3
    assert all("traced_widths" not in e for e in steps[1:])
    assert [e["batch_width"] for e in steps] == widths


def _assert_resume_repeats(args: list[str], run: Path, tmp_path: Path, names, final) -> None:
    """A run stopped at step 2 and resumed gives `run`'s losses and, at step 4, the tensors
    `names` of the GGUF `final` bit for bit."""
    assert _train([*args, "--run-id", "cut", "--stop-at", "2"]) == 0
    assert _train(["--resume", str(tmp_path / "cut"), "--no-progress"]) == 0
    assert step_losses(tmp_path / "cut") == step_losses(run)
    cut = GGUFFile(tmp_path / "cut" / "weights" / "step_4.gguf")
    for n in names:
        np.testing.assert_array_equal(cut.load(n, np.float32), final.load(n, np.float32))


def _val_run(tiny_gguf: Path, root: Path, run_id: str, *extra: str) -> list[str]:
    """The options of a 4-step lora run validated after steps 2 and 4 (a pass: 7 micro-batches
    of 64 validation rows) and checkpointed at its end."""
    return ["--recipe", "lora", "--base", str(tiny_gguf), "--runs-root", str(root), "--run-id",
            run_id, "--steps", "4", "--batch-size", "2", "--seq-len", "64", "--lr", "1e-2",
            "--warmup", "1", "--eval-every", "2", "--eval-batches", "100",
            "--no-progress", "--no-compile",
            "--data.path", str(mlx_lm_folder(root / "data", n_valid=64, n_test=0)), *extra]


def _stop_in_pass(monkeypatch, step: int, at: int, sigs: tuple) -> list[int]:
    """Send `sigs` to this process while the validation pass after step `step` computes its
    micro-batch number `at` (1-based); returns the micro-batches each pass computed."""
    import os
    import time

    from toymlx.backend.stop import REPEAT_S
    from toymlx.training import trainer
    from toymlx.training.evaluate import Evaluator

    computed: list[int] = []
    sums, evaluate = Evaluator._sums, trainer._Loop._evaluate

    def counted(self, micro):
        computed[-1] += 1
        if self.stop_after == (step, computed[-1]):
            for i, sig in enumerate(sigs):
                if i:  # a second request, not the first sent again (`REPEAT_S`)
                    time.sleep(2 * REPEAT_S)
                os.kill(os.getpid(), sig)  # counted by the loop's StopSignals, not raised
        return sums(self, micro)

    def each_pass(self, s, bar, *args):
        computed.append(0)
        self.evaluator.stop_after = (s, at) if s == step else None
        return evaluate(self, s, bar, *args)

    monkeypatch.setattr(Evaluator, "_sums", counted)
    monkeypatch.setattr(trainer._Loop, "_evaluate", each_pass)
    return computed


@pytest.mark.parametrize("sigs", [("SIGTERM",), ("SIGINT", "SIGINT")])
def test_a_stop_during_a_validation_pass_abandons_it_and_resume_redoes_it(
        tiny_gguf, tmp_path, capsys, monkeypatch, sigs):
    """A stop request while a periodic validation pass runs: the pass once ran to its end (25
    s of a LoRA run's pass on stories260K held off a Ctrl-C, a scheduler's SIGTERM and a
    second Ctrl-C), then its figures were recorded and the run stopped. Now the pass is
    abandoned after the micro-batch in flight, nothing of it is recorded, and the run stops as
    after a step (a second request skips its checkpoint); the resume validates that step
    first, so its events carry the uninterrupted run's figures and losses, to the bit."""
    import signal

    assert _train(_val_run(tiny_gguf, tmp_path, "full")) == 0
    full = events_of(tmp_path / "full")
    computed = _stop_in_pass(monkeypatch, 2, 3, tuple(getattr(signal, s) for s in sigs))
    capsys.readouterr()
    run = tmp_path / "r"
    code = 128 + getattr(signal, sigs[0])
    assert _train(_val_run(tiny_gguf, tmp_path, "r", "--checkpoint-every", "1")) == code
    assert computed == [3]  # the micro-batch in flight, then none of the other 4
    out = capsys.readouterr().out
    assert (f"step 2: validation abandoned ({sigs[0]} came during its pass; a --resume from "
            "this step runs it first)") in out.splitlines()
    events = events_of(run)
    assert not [e for e in events if e["kind"] == "eval"]
    end = events[-1]
    assert (end["reason"], end["final_step"], end["exit_code"], end["signal"]) == (
        "interrupted", 2, code, sigs[0])
    what = "by SIGINT (Ctrl-C)" if sigs[0] == "SIGINT" else "stopped by SIGTERM"
    if len(sigs) == 1:
        assert end["message"] == f"{what}; resume with --resume {run}"
        assert [e["step"] for e in events if e["kind"] == "checkpoint"] == [1, 2]
    else:  # the second skipped step 2's checkpoint, periodic or final
        assert end["message"] == (f"{what}; a second signal skipped its "
                                  f"checkpoint: resume with --resume {run} (from step 1)")
        assert [e["step"] for e in events if e["kind"] == "checkpoint"] == [1]
    monkeypatch.undo()
    assert _train(["--resume", str(run), "--no-progress"]) == 0
    events = events_of(run)

    def record(evs: list[dict]) -> list[tuple]:
        return [(e["kind"], e["step"], e.get("loss", e.get("val_loss"))) for e in evs
                if e["kind"] in ("step", "eval")]
    assert record(events) == record(full)  # the same figures, to the bit
    assert [e["step"] for e in events if e["kind"] == "eval"] == [2, 4]


@pytest.mark.parametrize("when", ["during", "before"])
def test_a_stop_during_the_fused_export_abandons_it(tiny_gguf, tmp_path, capsys, monkeypatch,
                                                   when):
    """--fuse-at-end: a stop request while the fused GGUF is written ("during", sent once its
    temporary holds the header), or one during --test's pass just before it ("before"). The
    export once ran to its end however long it took (a SIGTERM, a second Ctrl-C held off),
    and ran after a stop during --test. Now it is abandoned: its temporary removed, nothing
    under fused-f32.gguf, the final checkpoint intact; run_end interrupted by the signal,
    exit 143, one line naming the --resume that finishes the run and the toymlx-export
    command that writes the file alone, the same file the resume writes."""
    import os
    import signal

    from toymlx.backend.atomic import TMP_TAG
    from toymlx.gguf import writer
    from toymlx.training import trainer

    run = tmp_path / "r"
    seen: list[int] = []
    if when == "during":
        pad = writer._pad

        def stop_once_written(f, align):
            if "fused-" in Path(f.name).name and not seen:
                f.flush()
                seen.append(os.path.getsize(f.name))  # the header, in the temporary
                os.kill(os.getpid(), signal.SIGTERM)  # raised here by StopSignals.raising
            pad(f, align)
        monkeypatch.setattr(writer, "_pad", stop_once_written)
    else:
        test = trainer._Loop._test

        def stop_then_test(self, bar, *args):
            os.kill(os.getpid(), signal.SIGTERM)  # counted by the loop's StopSignals
            return test(self, bar, *args)
        monkeypatch.setattr(trainer._Loop, "_test", stop_then_test)
    assert _train(_test_run(tiny_gguf, tmp_path, "--fuse-at-end", "f32")) == 143
    assert seen[0] > 0 if when == "during" else not seen
    assert sorted(p.name for p in run.iterdir()) == ["config.json", "events.jsonl", "weights"]
    assert not [p for p in (run / "weights").iterdir() if TMP_TAG in p.name]
    assert (run / "weights" / "latest").resolve().name == "adapter_step_2.gguf"
    events = events_of(run)
    assert not [e for e in events if e["kind"] == "export"]
    end = events[-1]
    assert (end["reason"], end["final_step"], end["exit_code"], end["signal"]) == (
        "interrupted", 2, 143, "SIGTERM")
    part, undone = ("the export", "the export") if when == "during" else ("--test",
                                                                         "--test and the export")
    assert end["message"] == (
        f"stopped by SIGTERM during {part} (all 2 steps trained, checkpoint step_2 written): "
        f"left undone: {undone}; toymlx-train --resume {run} finishes it without training; or "
        f"toymlx-export --adapter {run} --fuse --dtype f32 --out {run}-fused-f32.gguf writes "
        "the export alone")
    monkeypatch.undo()
    from toymlx_cli.export import main as export_main

    assert export_main(["--adapter", str(run), "--fuse", "--dtype", "f32", "--out",
                        f"{run}-fused-f32.gguf"]) == 0
    capsys.readouterr()
    assert _train(["--resume", str(run), "--no-progress"]) == 0
    assert ("toymlx-train: the run trained all 2 steps but did not complete (run_end reason "
            "'interrupted'): finishing it from step_2 (what follows the last step: final "
            "validation, --test, the export; then run_end)") in capsys.readouterr().err
    ex = [e for e in events_of(run) if e["kind"] == "export"]
    assert len(ex) == 1 and ex[0]["path"] == "fused-f32.gguf"
    assert (run / "fused-f32.gguf").read_bytes() == Path(f"{run}-fused-f32.gguf").read_bytes()


def test_sigterm_during_a_long_validation_pass_ends_the_run_at_once(tmp_path, stories_path):
    """toymlx-train as a scheduler meets it: stories260K with 4,000 validation rows (a pass of
    6.4 s on this machine's CPU), SIGTERM sent once step 2's event is written, as the pass
    after it begins. The run once finished the pass and recorded it before stopping (a scheduler's
    SIGKILL may come first); now it exits 143 with step 2 checkpointed and no eval event."""
    import signal
    import subprocess
    import sys
    import time

    data = number_stories_folder(tmp_path / "data", {"train": 40, "valid": 4000},
                                 prompt="Tell me a story about the number {i}.")
    run = tmp_path / "r"
    exe = Path(sys.executable).parent / "toymlx-train"
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "toymlx_cli.train"]
    p = subprocess.Popen(cmd + ["--recipe", "lora", "--base", str(stories_path), "--runs-root",
                                str(tmp_path), "--run-id", "r", "--steps", "4", "--warmup", "1",
                                "--eval-every", "2", "--eval-batches", "100000",
                                "--no-progress", "--data.path", str(data)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        t0 = time.monotonic()
        events = run / "events.jsonl"
        while b'"step": 2,' not in (events.read_bytes() if events.exists() else b""):
            assert p.poll() is None, p.stderr.read()[-3000:]
            assert time.monotonic() - t0 < 300
            time.sleep(0.01)
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=300)
    finally:
        end_child(p)
    assert p.returncode == 143, err[-3000:]
    evs = events_of(run)
    assert not [e for e in evs if e["kind"] == "eval"], out
    assert [e["step"] for e in evs if e["kind"] == "checkpoint"] == [2]
    assert (evs[-1]["reason"], evs[-1]["final_step"], evs[-1]["signal"]) == (
        "interrupted", 2, "SIGTERM")


def test_the_final_line_names_the_step_of_an_earlier_validation(tiny_gguf, tmp_path, capsys,
                                                                monkeypatch):
    """SIGTERM in step 3 of a run validated every 2 steps: the final line showed step 2's
    val_loss as "interrupted at step 3 ... held-out: val_loss X", read as step 3's. Now the
    step is named where it is not the run's last."""
    import os
    import signal

    from toymlx.training import trainer

    step = trainer._Loop._step

    def stop_in_third(self, s, *args):
        if s == 2:
            os.kill(os.getpid(), signal.SIGTERM)  # counted by the loop's StopSignals
        return step(self, s, *args)

    monkeypatch.setattr(trainer._Loop, "_step", stop_in_third)
    run = tmp_path / "r"
    assert _train(_val_run(tiny_gguf, tmp_path, "r")) == 143
    val = [e["val_loss"] for e in events_of(run) if e["kind"] == "eval"]
    assert len(val) == 1
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"toymlx: interrupted at step 3: stopped by SIGTERM; resume with --resume "
        f"{run}. held-out: val_loss {val[0]:.4f} (at step 2). bundle: {run}")


def test_an_extended_runs_older_export_is_renamed_when_it_trains_on(tiny_gguf, tmp_path,
                                                                     capsys, monkeypatch):
    """A run completed at step 2 with --fuse-at-end, extended with --steps 4, its new export
    abandoned by SIGTERM: fused-f32.gguf, step 2's model, stayed beside step 4's weights under
    the name the run's own export takes, and the final line named it as the run's export. Now
    the resume renames it fused-f32.step_2.gguf before it trains (kept, not removed: it may be
    the only copy of that model), says so, and records it in the resume event; the run's own
    fused-f32.gguf appears only when its export is written."""
    import os
    import signal

    from toymlx.gguf import writer

    run = tmp_path / "r"
    args = _test_run(tiny_gguf, tmp_path, "--fuse-at-end", "f32")
    assert _train(args) == 0
    step2 = (run / "fused-f32.gguf").read_bytes()
    pad, sent = writer._pad, []

    def stop_once_written(f, align):
        if "fused-" in Path(f.name).name and not sent:
            sent.append(1)
            os.kill(os.getpid(), signal.SIGTERM)  # raised here by StopSignals.raising
        pad(f, align)

    monkeypatch.setattr(writer, "_pad", stop_once_written)
    capsys.readouterr()
    assert _train(["--resume", str(run), "--steps", "4", "--no-progress"]) == 143
    monkeypatch.undo()
    err = capsys.readouterr().err.splitlines()
    assert (f"toymlx-train: {run / 'fused-f32.gguf'} is the export of step_2, not of the "
            "weights this run ends with: renamed fused-f32.step_2.gguf (the run writes "
            "fused-f32.gguf when it completes)") in err
    assert " export: " not in err[-1]
    assert sorted(p.name for p in run.glob("fused-*")) == ["fused-f32.step_2.gguf"]
    assert (run / "fused-f32.step_2.gguf").read_bytes() == step2
    events = events_of(run)
    resume = next(e for e in events if e["kind"] == "resume")
    assert resume["exports_set_aside"] == {"fused-f32.gguf": "fused-f32.step_2.gguf"}
    assert (events[-1]["reason"], events[-1]["final_step"], events[-1]["exit_code"]) == (
        "interrupted", 4, 143)
    assert _train(["--resume", str(run), "--no-progress"]) == 0
    assert sorted(p.name for p in run.glob("fused-*")) == ["fused-f32.gguf",
                                                           "fused-f32.step_2.gguf"]
    assert [(e["step"], e["path"]) for e in events_of(run) if e["kind"] == "export"] == [
        (2, "fused-f32.gguf"), (4, "fused-f32.gguf")]
    assert (run / "fused-f32.gguf").read_bytes() != step2


def test_a_second_signal_before_any_checkpoint_says_how_to_start_over(
        tiny_gguf, tmp_path, capsys, monkeypatch):
    """Two Ctrl-C during step 2's validation with no checkpoint yet (--checkpoint-every 4):
    run_end said "resume with --resume RUN (from none)", and that --resume then found no
    checkpoint. Now it names the command that works, and that command does."""
    import signal

    _stop_in_pass(monkeypatch, 2, 3, (signal.SIGINT, signal.SIGINT))
    run = tmp_path / "r"
    assert _train(_val_run(tiny_gguf, tmp_path, "r", "--checkpoint-every", "4")) == 130
    end = events_of(run)[-1]
    assert end["message"] == ("by SIGINT (Ctrl-C); a second signal skipped its "
                              f"checkpoint: no checkpoint was written: start it over with "
                              f"toymlx-train --resume {run} --from step_0")
    monkeypatch.undo()
    capsys.readouterr()
    assert _train(["--resume", str(run), "--from", "step_0", "--no-progress"]) == 0
    assert events_of(run)[-1]["reason"] == "completed"


@pytest.mark.parametrize("meta, want", [
    ({"general.type": "imatrix"},
     "metadata key 'general.type': expected 'adapter' (a LoRA adapter GGUF), found 'imatrix'"),
])
def test_a_gguf_that_is_no_model_as_the_initial_adapter_is_not_called_a_model(tmp_path, meta,
                                                                             want):
    """`_a_model`'s line (a model GGUF given as --lora.init-adapter: pass it as --base) was said
    of any GGUF without lora tensors: an importance matrix read "found a None model, not an
    adapter ...; pass it as --base to fine-tune it". A file that is no model is named by its
    general.type, as for --adapter."""
    path = write_gguf(tmp_path / "x.gguf", meta, {"blk.0.attn_q.weight.in_sum2":
                                                  np.ones((4,), np.float32)})
    with pytest.raises(GGUFError) as e:
        load_adapter(path, flag="--lora.init-adapter")
    assert str(e.value) == f"{path}: {want}"


def test_a_batch_larger_than_one_training_row_says_one_row(tiny_gguf, tmp_path, capsys):
    """One training example, one row a example (--data.no-pack): the error read "holds 1
    rows"."""
    data = mlx_lm_folder(tmp_path / "data", n_train=1, n_valid=1, n_test=0)
    assert _train(["--recipe", "lora", "--base", str(tiny_gguf), "--runs-root",
                   str(tmp_path / "runs"), "--run-id", "r", "--steps", "1", "--seq-len", "128",
                   "--no-progress", "--no-compile", "--data.path", str(data),
                   "--data.no-pack"]) == 2
    assert error_line(capsys) == (
        "toymlx-train: error: --batch-size: expected at most 1 (the training split of "
        f"{data}/train.jsonl holds 1 row), found 4; use --batch-size 1 or less, or more data")


def test_a_batch_larger_than_the_packed_rows_names_the_examples_and_no_pack(tiny_gguf, tmp_path,
                                                                             capsys):
    """Six short examples pack into fewer rows than the default batch of 4: the error names the
    examples, the rows they pack into and --data.no-pack (mlx-lm's one example a row), where it
    said only that the training split of train.jsonl + valid.jsonl "holds 2 rows", which reads
    as a miscount of the six. No run folder is left behind."""
    data = mlx_lm_folder(tmp_path / "data", n_train=6, n_valid=2, n_test=0)
    assert _train(["--recipe", "lora", "--base", str(tiny_gguf), "--runs-root",
                   str(tmp_path / "runs"), "--run-id", "r", "--steps", "1", "--seq-len", "128",
                   "--no-progress", "--no-compile", "--data.path", str(data)]) == 2
    assert error_line(capsys) == (
        "toymlx-train: error: --batch-size: expected at most 3 (the 6 training examples of "
        f"{data}/train.jsonl pack into 3 rows of --seq-len 128), found 4; use --batch-size 3, "
        "--data.no-pack (one example a row), or more data")
    assert not (tmp_path / "runs" / "r").exists()
    assert _train(["--recipe", "lora", "--base", str(tiny_gguf), "--runs-root",
                   str(tmp_path / "runs"), "--run-id", "r", "--steps", "1", "--seq-len", "128",
                   "--no-progress", "--no-compile", "--data.path", str(data),
                   "--data.no-pack", "--eval-every", "0"]) == 0


def test_an_adapter_for_other_weights_names_the_model_s_one_as_one(tmp_path):
    """A model with one adapted weight (--lora.targets q --lora.layers 1) given an adapter of
    another: the error said "the model's 1 adapted weights"."""
    args = tiny(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, context=64)
    theirs, mine = Llama(args), Llama(args)
    apply_lora(theirs, ["v"], 1, 2, 4.0, 0.0)
    apply_lora(mine, ["q"], 1, 2, 4.0, 0.0)
    path = write_adapter(tmp_path / "v.gguf", theirs, {"general.architecture": "llama"})
    with pytest.raises(GGUFError) as e:
        load_adapter_weights(mine, path)
    assert str(e.value).startswith(
        f"{path}: tensors: expected LoRA pairs for exactly the model's 1 adapted weight, found 1 "
        "(missing ['blk.1.attn_q.weight'], unexpected ['blk.1.attn_v.weight'])")


def test_a_dense_run_s_adapter_names_its_mlp_targets_and_resume_says_them(tiny_gguf, tmp_path):
    """The dense MLP's paths (mlp.gate_proj) map back to gate, up, down: the expert tensors'
    names for the same targets replaced them when the two mappings were inverted as one, so the
    file said toy.lora.targets "q,mlp.gate_proj,mlp.down_proj" and a resume with other targets
    lost its hint."""
    model = apply_lora(base(tiny_gguf), "q,gate,down", rank=4, alpha=8.0)
    path = write_adapter(tmp_path / "a.gguf", model, {"general.architecture": "llama"})
    assert GGUFFile(path).metadata["toy.lora.targets"] == "q,gate,down"
    with pytest.raises(GGUFError) as e:
        load_adapter_weights(apply_lora(base(tiny_gguf), "q,gate", rank=4, alpha=8.0), path)
    assert str(e.value) == (
        f"{path}: tensors: expected LoRA pairs for exactly the model's 6 adapted weights, found "
        "9 (missing [], unexpected ['blk.0.ffn_down.weight', 'blk.1.ffn_down.weight']); the "
        "adapter is this run's with --lora.targets q,gate,down --lora.layers 3")


def test_a_dora_adapter_with_expert_tensors_pairs_is_refused(tmp_path):
    """DoRA adapts no 3-D expert tensor (apply_lora refuses it): a DoRA file holding one was
    read, its magnitudes ignored, and applied as plain LoRA."""
    e, r, n_in, n_out = 4, 2, 8, 6
    path = write_gguf(tmp_path / "dora-exps.gguf", {
        "general.type": "adapter", "general.architecture": "qwen3moe", "adapter.type": "dora",
        "adapter.lora.alpha": 4.0}, {
        "blk.0.ffn_up_exps.weight.lora_a": np.ones((e, r, n_in), np.float32),
        "blk.0.ffn_up_exps.weight.lora_b": np.ones((e, n_out, r), np.float32),
        "blk.0.ffn_up_exps.weight.dora_m": np.zeros((e,), np.float32)})
    with pytest.raises(GGUFError) as err:
        load_adapter(path)
    assert str(err.value) == (
        f"{path}: tensor 'blk.0.ffn_up_exps.weight.lora_a': expected 2 dimensions (a DoRA "
        "adapter adapts no expert tensor; --fine-tune-type lora does), found shape (4, 2, 8)")


def test_expert_lora_draws_one_a_and_fuses_in_the_base_s_dtype():
    """ExpertLoRA makes its (E, r, in) A as the one draw of its init (a 2-D A was drawn and
    thrown away first), and fuses a float base into its own dtype as LoRALinear does (it gave
    float32): W + scale B A per expert against float64 numpy."""
    from toymlx.models.lora import ExpertLoRA
    from toymlx.models.moe import ExpertLinear

    e, r, n_in, n_out = 3, 2, 16, 8
    experts = ExpertLinear(e, n_out, n_in)
    mx.random.seed(5)
    experts.weight = mx.random.normal((e, n_out, n_in)).astype(mx.bfloat16)
    mx.random.seed(7)
    m = ExpertLoRA.from_base(experts, rank=r, alpha=4.0)
    mx.random.seed(7)
    bound = 1.0 / np.sqrt(n_in)
    assert mx.array_equal(m.lora_a, mx.random.uniform(-bound, bound, (e, r, n_in))).item()
    assert m.lora_b.shape == (e, n_out, r) and not mx.any(m.lora_b).item()
    m.lora_b = mx.random.normal((e, n_out, r))
    fused = m.fuse()
    assert fused.weight.dtype == mx.bfloat16
    w, a, b = (np.array(t.astype(mx.float32), np.float64) for t in (experts.weight, m.lora_a,
                                                                     m.lora_b))
    want = w + 2.0 * b @ a  # scale alpha / r = 2
    got = np.array(fused.weight.astype(mx.float32), np.float64)
    assert np.abs(got - want).max() <= 2.0 ** -8 * np.abs(want).max()  # bfloat16's rounding
    assert np.abs(got - want).max() > 0  # rounded to bfloat16, not float32


def test_records_of_other_keys_are_refused_naming_data_keys(tiny_gguf, tmp_path, capsys,
                                                              monkeypatch):
    """{"question", "answer"} rows (a JSONL file or a CSV's columns) given without --data.keys
    were refused naming the keys found, not the flag that reads them, and only once the base
    had loaded (minutes for a large one); with --data.keys given, its own error stands (the
    keys named do not fit the row), and a sweep's early check of the data (`data_notes`) says
    the same as the run."""
    from toymlx_cli.train import main as train_main

    from toymlx.data.chat import DataError
    from toymlx.recipes import lora as lora_recipe
    from toymlx.recipes.lora import ChatDataOptions, Config, data_notes

    def load_llama(*a, **k):
        raise AssertionError("the base loaded before its data was read")

    monkeypatch.setattr(lora_recipe, "load_llama", load_llama)

    hint = ("; --data.keys reads a record's own keys as these, KEY=NAME pairs: prompt=NAME "
            "completion=NAME (or text=NAME, or messages=NAME)\n")
    jsonl = tmp_path / "qa.jsonl"
    jsonl.write_text(json.dumps({"question": "2+2?", "answer": "4"}) + "\n")
    csv = tmp_path / "qa.csv"
    csv.write_text("question,answer\n2+2?,4\n")
    wants = {
        jsonl: (f"{jsonl}:1: expected one of {{\"text\": ...}}, {{\"prompt\": ..., "
                "\"completion\": ...} or {\"messages\": [...]}, found keys ['answer', 'question']"),
        csv: (f"{csv}: row 1 (the header): expected the columns of one record shape (text; "
              "prompt and completion; or Alpaca's instruction, input (optional) and output; "
              "others are ignored), found ['question', 'answer']")}
    common = ["--recipe", "lora", "--base", str(tiny_gguf), "--steps", "1", "--no-progress",
              "--runs-root", str(tmp_path / "runs")]
    for path, want in wants.items():
        assert train_main([*common, "--data.path", str(path), "--run-id", path.suffix[1:]]) == 2
        assert capsys.readouterr().err == f"toymlx-train: error: {want}{hint}"
        with pytest.raises(DataError) as e:
            data_notes(Config(base=str(tiny_gguf), data=ChatDataOptions(path=str(path))))
        assert str(e.value) + "\n" == want + hint
    assert train_main([*common, "--data.path", str(jsonl), "--data.keys", "prompt=q",
                       "completion=answer", "--run-id", "keyed"]) == 2
    assert capsys.readouterr().err == ("toymlx-train: error: " + str(jsonl) + ":1: expected "
                                       "both \"q\" and \"answer\", found keys ['answer', "
                                       "'question']\n")
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())
