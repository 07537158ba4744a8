"""The two merge algorithms llama.cpp tokenizes with, as Hugging Face `tokenizers` BPE models:
byte-level BPE by merge rank, its text cut first by the regexes of `tokenizer.ggml.pre`
(`build_bpe`, `PRE_TOKENIZERS`; gemma4's raw-UTF-8 form by `encode_spm_style`), and
SentencePiece BPE by score (`build_spm`)."""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
from tokenizers import Regex, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from toymlx.data.vocab import K_MERGES, SPACE, TokenizerError


# ------------------------------------------------------------------ pre-tokenizers
@dataclass(frozen=True)
class PreTokenizer:
    """What llama.cpp's BPE tokenizer does for one `tokenizer.ggml.pre` value."""

    regexes: tuple[str, ...]
    """Applied in turn to every piece the previous ones produced (`llm_tokenizer_bpe`)."""
    ignore_merges: bool = False
    """A piece that is itself a token is that token, unmerged."""
    add_bos: bool = False
    """add_bos when the GGUF has no `add_bos_token` key."""
    force_bos: bool = False
    """add_bos even when the GGUF says false (llama.cpp's Gemma 4 override)."""
    spm_style: bool = False
    """Spaces escaped to "▁", raw UTF-8 pieces (no GPT-2 byte map), `<0xXX>` byte fallback."""


# The regexes of src/llama-vocab.cpp, as llama.cpp writes them (case-insensitive groups spelled
# out, so that llama.cpp picks its hand-written splitter for each).
_GPT2_RE = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_LLAMA3_RE = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
              r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_RE = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
             r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN35_RE = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
              r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_NEWLINE_RUNS_RE = r"[^\n]+|[\n]+"
# Phi-4's and Mistral-Nemo's regexes split a letter run where lower case turns upper ("camelCase":
# "camel", "Case"). llama.cpp runs them with std::regex on text whose non-ASCII characters it
# first replaces by one stand-in per category: every non-ASCII letter is then both upper and
# lower case, and a combining mark is no letter. These are llama.cpp's spellings of them, which
# say exactly that ("a letter that is not a-z", "a letter that is not A-Z").
_UPPER = r"(?:(?=\p{L})[^a-z])"
_LOWER = r"(?:(?=\p{L})[^A-Z])"
_NOT_LN = r"[^\r\n\p{L}\p{N}]?"
_GPT4O_RE = (f"{_NOT_LN}{_UPPER}*{_LOWER}+{_CONTRACTIONS}?|{_NOT_LN}{_UPPER}+{_LOWER}*"
             + _CONTRACTIONS + r"?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN_RE = (f"{_NOT_LN}{_UPPER}*{_LOWER}+|{_NOT_LN}{_UPPER}+{_LOWER}*"
              r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen2's, but a run of other characters takes no newlines after it
_SEED_CODER_RE = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}\r\n]+"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# SuperBPE merges across spaces: only runs of digits are cut out, and cut in threes from their
# right end (llama.cpp's std::regex \d is ASCII's 0-9 alone)
_SUPERBPE_RES = (r"\p{N}+", r"(?=(?:[0-9]{3})+(?![0-9]))")
# DeepSeek's: each newline alone, runs of letters (DeepSeek LLM's: of cased scripts only) and of
# punctuation, runs of CJK and Hangul (the range U+0800-U+4E00 with them, whitespace excepted:
# llama.cpp replaces non-ASCII whitespace by a stand-in before it matches), then digits
# (DeepSeek-Coder's each alone, DeepSeek LLM's in runs)
_DEEPSEEK_CJK = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff&&[^\\s]]+"
_DEEPSEEK_CODER_RES = ("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _DEEPSEEK_CJK, r"\p{N}")
_DEEPSEEK_LETTERS = (
    "A-Za-z\xb5\xc0-\xd6\xd8-\xf6\xf8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af"
    "\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1"
    "\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5"
    "\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a"
    "\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d"
    "\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3"
    "\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115"
    "\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f"
    "\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3"
    "\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf"
    "\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f"
    "\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2"
    "\U000118a0-\U000118df\U0001e900-\U0001e943")
# U+3000 (ideographic space) ends the punctuation range in llama.cpp's regex but is whitespace
# there, which \s? takes instead
_DEEPSEEK_LLM_RES = ("[\r\n]", r"\s?[" + _DEEPSEEK_LETTERS + "]+",
                     r"\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3001\u3002]+",
                     r"\s+$", _DEEPSEEK_CJK, r"\p{N}+")
# Viking's: runs of anything but whitespace and a few punctuation marks (with the one space
# before such a run), then each digit alone
_VIKING_RES = (" ?[^(\\s|.,!?\u2026\u3002\uff0c\u3001\u0964\u06d4\u060c)]+", r"\p{N}")
_DEFAULT_RES = (r"[\p{P}\$\+<=>\^~\|]+", _GPT2_RE, r"\p{N}+", r"[0-9][0-9][0-9]")
_SMOLLM_RES = (r"\p{N}", _GPT2_RE)

# pre name -> what llama.cpp does; names grouped as llama.cpp groups them (the cases of
# llm_tokenizer_bpe's regex switch, split where their flags differ). Granite 3.x files say
# "refact", SmolLM3's "smaug-bpe", OLMo 2's "dbrx"; Gemma's are SentencePiece ("llama").
# Left out: names whose files need what toymlx does not do (add_sep: jina-v1-en, jina-v2-code,
# roberta-bpe, modern-bert's files; granite-embed-multi-311m's gemma4 form in a gpt2 file), and
# names whose models are of architectures toymlx does not load (falcon, bloom, poro-chat,
# gpt3-finnish, chatglm-bpe, glm4, glm5, chameleon, jais-2, tiny_aya, cohere2moe, kimi-k2,
# deepseek-v3, hunyuan-dense, hy_v4, joyai-llm, spark2_5, youtu, afmoe, bailingmoe,
# bailingmoe2, llada-moe, exaone-moe, laguna, minicpm5, sarvam-moe, granite-embed-multi-97m;
# ufakzeka, whose model's architecture llama.cpp's converter does not say).
PRE_TOKENIZERS: dict[str, PreTokenizer] = {"default": PreTokenizer(_DEFAULT_RES)}
for _name in ("gpt-2", "phi-2", "mpt", "olmo", "jina-es", "jina-de", "jina-v2-es", "jina-v2-de",
              "gigachat", "mellum", "exaone4", "a.x-4.0", "jais", "trillion", "granite-docling"):
    PRE_TOKENIZERS[_name] = PreTokenizer((_GPT2_RE,))
for _name in ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b",
              "mellum2"):
    PRE_TOKENIZERS[_name] = PreTokenizer(_SMOLLM_RES)
for _name in ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0",
              "lfm2", "jina-v5-nano"):
    PRE_TOKENIZERS[_name] = PreTokenizer((_LLAMA3_RE,), ignore_merges=True, add_bos=True)
for _name in ("dbrx", "smaug-bpe"):  # Llama 3's regex, merged by rank throughout, no bos
    PRE_TOKENIZERS[_name] = PreTokenizer((_LLAMA3_RE,))
for _name in ("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2", "hunyuan",
              "solar-open", "grok-2"):
    PRE_TOKENIZERS[_name] = PreTokenizer((_QWEN2_RE,))
PRE_TOKENIZERS["qwen35"] = PreTokenizer((_QWEN35_RE,))
for _name in ("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"):
    PRE_TOKENIZERS[_name] = PreTokenizer((_GPT4O_RE,))
PRE_TOKENIZERS["tekken"] = PreTokenizer((_TEKKEN_RE,), ignore_merges=True, add_bos=True)
PRE_TOKENIZERS["seed-coder"] = PreTokenizer((_SEED_CODER_RE,))
PRE_TOKENIZERS["superbpe"] = PreTokenizer(_SUPERBPE_RES)
PRE_TOKENIZERS["deepseek-coder"] = PreTokenizer(_DEEPSEEK_CODER_RES)
PRE_TOKENIZERS["deepseek-llm"] = PreTokenizer(_DEEPSEEK_LLM_RES)
PRE_TOKENIZERS["viking"] = PreTokenizer(_VIKING_RES)
PRE_TOKENIZERS["gemma4"] = PreTokenizer((_NEWLINE_RUNS_RE,), force_bos=True, spm_style=True)
SUPPORTED_PRE = tuple(PRE_TOKENIZERS)


def _gpt2_byte_table() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode character table."""
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in keep}
    n = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + n)
            n += 1
    return table


BYTE_TO_UNICODE = _gpt2_byte_table()
UNICODE_TO_BYTE = {c: b for b, c in BYTE_TO_UNICODE.items()}


def build_bpe(vocab: dict[str, int], merges: list[str], rules: PreTokenizer, source: str):
    """Byte-level BPE by merge rank (`tokenizer.ggml.model` gpt2, and gemma4's raw-UTF-8
    form), cut first by `rules`' regexes; `source` names the file in errors."""
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    if not all(len(p) == 2 and p[0] for p in pairs):
        pairs = []  # llama.cpp cuts at the first space after the first character
        for i, m in enumerate(merges):
            cut = m.find(" ", 1)
            if cut < 0:
                raise TokenizerError(f"{source}: {K_MERGES}: expected 'left right' strings, "
                                     f"found {m!r} at index {i}")
            pairs.append((m[:cut], m[cut + 1:]))
    byte_fallback = rules.spm_style
    try:
        bpe = models.BPE(vocab=vocab, merges=pairs, ignore_merges=rules.ignore_merges,
                         byte_fallback=byte_fallback)
    except Exception:  # noqa: BLE001 (tokenizers raises a bare Exception for a non-token)
        # llama.cpp keeps merges whose parts are not tokens, but they can never fire
        pairs = [(a, b) for a, b in pairs if a in vocab and b in vocab and a + b in vocab]
        bpe = models.BPE(vocab=vocab, merges=pairs, ignore_merges=rules.ignore_merges,
                         byte_fallback=byte_fallback)
    hf = HFTokenizer(bpe)
    if not rules.spm_style:  # gemma4 cuts at newline runs itself (`_encode_spm_style`)
        hf.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in rules.regexes]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    return hf


def build_spm(tokens: list[str], scores: list[float], vocab: dict[str, int],
              unk: int | None) -> tuple[HFTokenizer, list[list[int]]]:
    """SentencePiece BPE as HF BPE: every split of a token into two tokens is a merge,
    ranked by the merged token's score (highest first). Equal scores go lower id first,
    where llama.cpp takes the leftmost pair: the same for vocabularies whose scores differ
    (Llama 2, Phi-3, Gemma).

    llama.cpp's symbols start as characters, and a character that is no token still merges
    into the tokens that hold it (a vocabulary cut short: `tests/hf_tiny.py`'s 512 tokens
    hold "er" but no "e"); HF BPE would turn it into its bytes first. Such a character is a
    stand-in symbol here, id `len(tokens) + i`, and the list returned holds, for each, the ids
    llama.cpp gives it where it stays unmerged (its byte tokens), for `resegment`. Real
    vocabularies (Llama 2, Phi-3, Gemma's 262k) hold every character of their tokens: none."""
    scores = np.asarray(scores, dtype=np.float64)
    order = np.lexsort((np.arange(len(scores)), -scores)).tolist()
    texts = [tokens[i] for i in order]
    loose = sorted({c for t in tokens for c in t}.difference(vocab))
    symbols = {**vocab, **{c: len(tokens) + i for i, c in enumerate(loose)}}
    merges = [(a, b) for t in texts for cut in range(1, len(t))
              if (a := t[:cut]) in symbols and (b := t[cut:]) in symbols]
    unk_text = tokens[unk] if unk is not None else None
    bpe = models.BPE(vocab=symbols, merges=merges, unk_token=unk_text, byte_fallback=True)
    return HFTokenizer(bpe), [_byte_fallback(c, vocab, unk) for c in loose]


def _byte_fallback(char: str, vocab: dict[str, int], unk: int | None) -> list[int]:
    """The ids of a character that is no token, as HF BPE's byte fallback gives them: its
    `<0xXX>` byte tokens, or the unknown token where one of them is missing."""
    ids = [vocab.get(f"<0x{b:02X}>") for b in char.encode("utf-8")]
    if all(i is not None for i in ids):
        return ids
    return [unk] if unk is not None else []


def resegment(ids: list[int], n_tokens: int, loose: list[list[int]]) -> np.ndarray:
    """HF BPE's ids of `build_spm`'s model as llama.cpp's: a stand-in symbol (id `n_tokens`
    + i) left unmerged becomes `loose[i]`, its character's byte tokens."""
    arr = np.asarray(ids, dtype=np.int32)
    if not loose or not arr.size or arr.max() < n_tokens:
        return arr
    out: list[int] = []
    for i in arr.tolist():
        out.extend(loose[i - n_tokens] if i >= n_tokens else (i,))
    return np.asarray(out, dtype=np.int32)


def encode_spm_style(hf: HFTokenizer, vocab: dict[str, int], text: str) -> np.ndarray:
    """Gemma 4: spaces to "▁", runs of newlines apart from the rest; a run of newlines
    that is a token is that token, unmerged (llama.cpp's fix for Gemma 4)."""
    runs = [r for r in re.split("(\n+)", text.replace(" ", SPACE)) if r]
    ids: list[int | None] = [vocab.get(r) if r[0] == "\n" else None for r in runs]
    todo = [r for r, i in zip(runs, ids) if i is None]
    encs = iter(hf.encode_batch(todo, add_special_tokens=False) if todo else [])
    out: list[int] = []
    for i in ids:
        if i is None:
            out.extend(next(encs).ids)
        else:
            out.append(i)
    return np.asarray(out, dtype=np.int32)
