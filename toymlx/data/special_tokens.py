"""Special tokens as llama.cpp treats them: the attributes its loader derives at load time
(`token_attributes`: end-of-generation and fill-in-the-middle tokens recognised by their text,
Phi-3's right-stripping specials) and the cutting of special tokens out of the text before
tokenizing (`split_special`, llama.cpp's `tokenizer_st_partition`)."""

from __future__ import annotations

from typing import Any

from toymlx.data.vocab import (
    A_CONTROL,
    A_LSTRIP,
    A_NORMAL,
    A_RSTRIP,
    A_UNKNOWN,
    A_USER,
    K_EOS,
    SPECIAL,
    TYPE_ATTR,
)

# Token texts llama.cpp makes end-of-generation (and control) tokens (llama_vocab::impl::load).
_EOG_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<｜end▁of▁sentence｜>", "[e~["})
# Fill-in-the-middle tokens llama.cpp recognises by text when their id key is absent; the
# first found of a kind becomes a control token; pad, repo and file-separator ones end generation.
_FIM_TEXTS: dict[str, tuple[tuple[str, ...], bool]] = {
    "tokenizer.ggml.fim_pre_token_id": (("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>",
                                         "<｜fim▁begin｜>", "<PRE>", "▁<PRE>", "<|code_prefix|>",
                                         "<|prefix|>"), False),
    "tokenizer.ggml.fim_suf_token_id": (("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>",
                                         "<｜fim▁hole｜>", "<SUF>", "▁<SUF>", "<|code_suffix|>",
                                         "<|suffix|>"), False),
    "tokenizer.ggml.fim_mid_token_id": (("<|fim_middle|>", "<fim-middle>", "<fim_middle>",
                                         "<｜fim▁end｜>", "<MID>", "▁<MID>", "<|code_middle|>",
                                         "<|middle|>"), False),
    "tokenizer.ggml.fim_pad_token_id": (("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>",
                                         "[PAD]"), True),
    "tokenizer.ggml.fim_rep_token_id": (("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>",
                                         "<reponame>"), True),
    "tokenizer.ggml.fim_sep_token_id": (("<|file_sep|>",), True),
}
_FIM_OLD_KEYS = {"tokenizer.ggml.fim_pre_token_id": "tokenizer.ggml.prefix_token_id",
                 "tokenizer.ggml.fim_suf_token_id": "tokenizer.ggml.suffix_token_id",
                 "tokenizer.ggml.fim_mid_token_id": "tokenizer.ggml.middle_token_id"}
# gpt-oss: llama.cpp always renders these, as user-defined tokens
_ALWAYS_USER = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")
C_SPACE = " \t\n\v\f\r"  # C's isspace, which llama.cpp's special-token stripping uses


def token_attributes(tokens: list[str], ids: dict[str, int], types: list[int],
                     meta: dict[str, Any], eos: int | None, model_name: str
                     ) -> tuple[list[int], set[int]]:
    """llama.cpp's token attributes: the GGUF types, then what its loader changes by text;
    and the end-of-generation ids. `meta` is the `tokenizer.*` metadata, `eos` its eos id."""
    attrs = [TYPE_ATTR.get(t, 0) for t in types]
    eog = {ids[t] for t in _EOG_TEXTS if t in ids}
    for key, (texts, ends) in _FIM_TEXTS.items():
        fim = meta.get(key, meta.get(_FIM_OLD_KEYS.get(key, ""), -1))
        if isinstance(fim, int) and 0 <= fim < len(tokens):
            found = fim
        else:
            found = next((ids[t] for t in texts if t in ids), None)
            if found is not None:
                attrs[found] |= A_CONTROL
        if ends and found is not None:
            eog.add(found)
    for i in eog:
        if tokens[i] in _EOG_TEXTS:
            attrs[i] |= A_CONTROL
    for t in _ALWAYS_USER:
        if t in ids:
            attrs[ids[t]] = A_USER
    for key in (K_EOS, "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        i = eos if key == K_EOS else meta.get(key)
        if isinstance(i, int) and 0 <= i < len(tokens):
            eog.add(i)
    texts = {tokens[i] for i in eog}
    # o200k_harmony and solar-open: "<|end|>" ends a message, not the generation
    if "<|end|>" in texts and (("<|return|>" in texts and "<|call|>" in texts)
                               or ("<|calls|>" in texts and "<|flush|>" in texts)):
        eog.discard(ids["<|end|>"])
        attrs[ids["<|end|>"]] = A_USER
    # gemma4 and plamo2 have a normal "</s>"
    if "</s>" in texts and ("<|tool_response>" in texts or "<|plamo:eos|>" in texts):
        eog.discard(ids["</s>"])
        attrs[ids["</s>"]] = A_NORMAL
    if "phi-3" in model_name or "phi3" in model_name:
        for i, a in enumerate(attrs):
            if a & SPECIAL:
                attrs[i] = a | A_RSTRIP
        if "</s>" in ids:
            attrs[ids["</s>"]] |= A_RSTRIP
        for t in ("<unk>", "<s>", "<|endoftext|>"):
            if t in ids:
                attrs[ids[t]] &= ~A_RSTRIP
    return attrs, eog


def split_special(text: str, partition: list[tuple[str, int, int]], parse_special: bool
                  ) -> list[str | int]:
    """llama.cpp's tokenizer_st_partition: raw-text fragments and special token ids, cutting
    out `partition`'s (text, id, attributes), longest text first."""
    frags: list[str | int] = [text] if text else []
    for tok_text, tok_id, attr in partition:
        if not parse_special and attr & (A_CONTROL | A_UNKNOWN):
            continue
        # the whole text first: one scan, where most specials are not found at all
        if tok_text not in text or not any(isinstance(f, str) and tok_text in f
                                           for f in frags):
            continue
        out: list[str | int] = []
        for f in frags:
            if isinstance(f, str) and tok_text in f:
                pieces = f.split(tok_text)
                last = len(pieces) - 1
                for j, p in enumerate(pieces):
                    if j:
                        out.append(tok_id)
                    if j and attr & A_RSTRIP:  # C isspace: " \t\n\v\f\r"
                        p = p.lstrip(C_SPACE)
                    if j < last and attr & A_LSTRIP:
                        p = p.rstrip(C_SPACE)
                    if p:
                        out.append(p)
            else:
                out.append(f)
        frags = out
    return frags
