"""toymlx-generate --model PATH.gguf|runs/<id> --prompt "...": stream a model's answer (the prompt
rendered through the GGUF's chat template wherever it has one, as mlx_lm.generate) or, with
--ignore-chat-template or without a template, its continuation of the raw text."""

from __future__ import annotations

import dataclasses
import os
import shlex
import sys
import time
from dataclasses import dataclass
from typing import Annotated, Literal

import tyro
from toymlx_cli import console_command, run_command

import toymlx  # noqa: F401  (loads the optimised BLAS before mlx)
from toymlx.backend.files import counted, not_utf8

PROG = "toymlx-generate"


@dataclass
class Args:
    """Generate text from a llama GGUF (toymlx checkpoint or llama.cpp model) with MLX."""

    model: str
    """A llama-architecture GGUF file, or a run directory (its weights/latest is used)."""
    prompt: Annotated[str, tyro.conf.arg(aliases=("-p",))] = ""
    """The user's message, rendered through the GGUF's chat template wherever it has one (as
    mlx_lm.generate); raw text to continue with --ignore-chat-template or where there is no
    template; '-' reads it from stdin (as mlx_lm.generate). --chat without it: a conversation
    typed turn by turn, as mlx_lm.chat."""
    max_tokens: Annotated[int, tyro.conf.arg(aliases=("-n",))] = 128
    """Most new tokens to generate (generation also stops at an end-of-generation token, as
    llama.cpp: eos, or an end-of-turn token such as <|im_end|> or <|eot_id|>)."""
    context_shift: bool = True
    """Where the text reaches the window the model reads at once (a from-scratch or warm-start
    run's --seq-len, else the model's context) and more tokens are asked for, drop its older
    half and go on from the newer half, computed again: no token is predicted from more than
    the window (nanoGPT's sample.py reads the last block_size tokens; llama.cpp's
    --context-shift, off by default there). --no-context-shift stops at the window. A --chat
    conversation instead drops its earliest whole turns (a message and its reply; the --system
    message and the newest message kept) where the next would leave no room for a reply
    (--max-tokens, at most half the context), as Ollama and LM Studio do, and says so; a reply
    itself stops at the context. --no-context-shift: a conversation that fills the context stops
    (/reset)."""
    temperature: Annotated[float, tyro.conf.arg(aliases=("--temp",))] = 0.7
    """Sampling temperature (--temp: mlx_lm.generate's and llama.cpp's spelling); 0 is greedy
    (always the most likely token), mlx_lm.generate's default."""
    top_p: float = 0.9
    """Nucleus sampling: draw only from the most likely tokens holding this much probability."""
    top_k: int = 0
    """Draw only from the k most likely tokens (0: off)."""
    min_p: float = 0.0
    """Drop tokens less likely than min_p times the most likely one (0: off)."""
    repetition_penalty: float | None = None
    """Divide the logits of the last 20 tokens by this (above 1 discourages repeats)."""
    seed: Annotated[int, tyro.conf.arg(aliases=("-s",))] = 0
    """Seed for sampling, so a run can be repeated exactly."""
    num_samples: int = 1
    """Samples to draw from the prompt with the model loaded once (nanoGPT's num_samples):
    they are drawn with the seeds --seed, --seed + 1, ..., each the text that seed alone
    prints; on stdout each is followed by a line of 15 dashes. Needs --temperature > 0; at most
    1,000 (more: another call from --seed 1000 up)."""
    chat: bool = False
    """Without --prompt: a conversation typed turn by turn. With it: the chat template, as by
    default, but an error where the GGUF has none."""
    ignore_chat_template: bool = False
    """Continue --prompt as raw text even where the GGUF has a chat template (mlx_lm.generate's
    flag; an instruct model often ends at once on raw text)."""
    system: Annotated[str | None, tyro.conf.arg(aliases=("-sys", "--system-prompt"))] = None
    """An optional system message placed before the user's (the chat template only; where the
    template has no system role, as Gemma's, at the start of the user's message, as llama.cpp
    puts it). -sys and --system-prompt: llama-cli's and mlx_lm.generate's spellings."""
    adapter: str | None = None
    """A LoRA adapter GGUF (or a LoRA run directory) to apply on top of --model."""
    device: Literal["auto", "cpu", "gpu"] = "auto"
    """Where MLX runs: auto picks the GPU when MLX has one."""
    engine: Literal["mlx", "llama.cpp", "auto"] = "mlx"
    """What decodes: MLX (toymlx's own numerics); llama.cpp (llama-cpp-python, the interop
    extra: 2-4x faster on a CPU, reading the file's quantized weights and computing with
    quantized arithmetic); auto: llama.cpp where MLX computes on the CPU and it is installed (else, or if
    it fails to start, MLX). Same files, adapters and samplers."""


class UsageError(ValueError):
    """Bad user input; reported as one line on stderr with exit status 2."""


STDIN_LIMIT = 16 * 2**20
"""Most bytes `--prompt -` takes from stdin, and a --chat turn (its line): over 4 million
tokens of text, more than any model's context holds. An endless stream (`yes |`, /dev/zero)
was read until memory ran out."""


def within_stdin_limit(raw: str | bytes, what: str) -> str | bytes:
    """`raw`, read from stdin with a size limit of STDIN_LIMIT + 1, unless it reached that:
    UsageError naming `what`."""
    if len(raw) > STDIN_LIMIT:
        raise UsageError(f"{what}: expected at most {STDIN_LIMIT:,} bytes (16 MiB, more than "
                         f"any model's context holds), found more; is stdin an endless stream?")
    return raw


def utf8_text(value: str | bytes, what: str) -> str:
    """`value` as text; UsageError naming `what` and the first thing that is not UTF-8: a byte
    (with the iconv line a training file's gets, for stdin: `single_byte_hint`; undecodable
    bytes of the command line arrive as surrogate escapes, U+DC80..U+DCFF) or a lone
    surrogate."""
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError as e:
            from toymlx.data.text import single_byte_hint

            hint = single_byte_hint(None, value[e.start]) if value[:e.start].isascii() else ""
            raise UsageError(f"{what}: expected UTF-8 text, found the byte 0x{value[e.start]:02x} "
                             f"at byte {e.start}{hint}") from None
    if found := not_utf8(value):
        raise UsageError(f"{what}: expected UTF-8 text, found {found}")
    return value


def templated(tokenizer, args: Args) -> bool:
    """Whether the prompt goes through the GGUF's chat template: with --chat (which needs one),
    else wherever the GGUF has one and a prompt is given (as mlx_lm.generate), unless
    --ignore-chat-template; UsageError for flags that contradict that."""
    if args.chat and args.ignore_chat_template:
        raise UsageError("--ignore-chat-template: expected without --chat (a chat renders the "
                         "chat template), found both")
    if args.chat:
        _need_template(tokenizer, args)
        return True
    use = bool(tokenizer.chat_template and args.prompt) and not args.ignore_chat_template
    if args.system is not None and not use:
        raise UsageError(f"--system: expected a prompt rendered through a chat template, found "
                         f"{_raw_reason(args)}")
    return use


def _raw_reason(args: Args) -> str:
    """Why a prompt is raw text (`templated` said no)."""
    if args.ignore_chat_template:
        return "--ignore-chat-template"
    return "no --prompt" if not args.prompt else f"{args.model} has no tokenizer.chat_template"


def prompt_ids(tokenizer, args: Args, history: list[dict[str, str]] | None = None) -> list[int]:
    """Token ids of the prompt: the chat template rendered with the conversation so far
    (`history`, alternating user and assistant messages) and a user turn where `templated`
    says so, else plain text."""
    if not templated(tokenizer, args):
        ids = tokenizer.encode(args.prompt)
        if not ids:
            raise no_prompt(tokenizer)
        return ids
    messages = [*(history or []), {"role": "user", "content": args.prompt}]
    if args.system:
        messages = with_system(tokenizer, args.system, messages)
    text = render_chat(tokenizer, messages, args.model)
    # A template that writes the BOS token itself must not get a second one from encode.
    bos = tokenizer.bos_id
    ids = tokenizer.encode(text)
    if bos is not None and len(ids) > 1 and ids[0] == bos and ids[1] == bos:
        ids = ids[1:]
    return ids


def no_prompt(tokenizer) -> UsageError:
    """The refusal of a generation with no text to start from: no --prompt (or an empty one)
    and a tokenizer that adds no BOS token, naming the ways to give the text."""
    ways = "--prompt TEXT, or --prompt - to read it from stdin"
    if tokenizer.chat_template:
        ways = "--prompt TEXT, --prompt - to read it from stdin, or --chat for a conversation"
    return UsageError("--prompt: expected the text to answer or continue (this model's tokenizer "
                      f"adds no BOS token to start from), found none; give {ways}")


def render_chat(tokenizer, messages: list[dict[str, str]], model: str) -> str:
    """The chat template over `messages` with the assistant's header after them; an error the
    template raises itself (its `raise_exception`, a Jinja error) is a UsageError naming the
    file, not a traceback."""
    import jinja2

    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    except jinja2.TemplateError as e:
        roles = ", ".join(m["role"] for m in messages)
        raise UsageError(f"{model}: tokenizer.chat_template: expected to render a conversation "
                         f"of roles {roles}, found the template's error: {e}") from None


def with_system(tokenizer, system: str, messages: list[dict[str, str]]) -> list[dict[str, str]]:
    """`messages` (a user's first) with --system's message: before them, or, where the template
    has no system role, at the start of the first user message (`system_in_user`)."""
    from toymlx.data.chat_template import system_in_user, system_refused

    if system_refused(tokenizer) is None:
        return [{"role": "system", "content": system}, *messages]
    return system_in_user(messages, system)


def system_note(tokenizer, args: Args, gguf_path: str) -> str | None:
    """One line where --system goes into the first user message (`with_system`); else None."""
    from toymlx.data.chat_template import system_refused

    if not args.system or not tokenizer.chat_template or args.ignore_chat_template:
        return None
    refused = system_refused(tokenizer)
    if refused is None:
        return None
    return (f"{PROG}: {gguf_path}: its chat template has no system role (it raises "
            f"{refused!r}): --system starts the first user message instead, a blank line "
            "after it, as llama.cpp's Gemma template puts it")


def _need_template(tokenizer, args: Args) -> None:
    if not tokenizer.chat_template:
        raise UsageError(f"{args.model}: --chat: expected a GGUF with tokenizer.chat_template, "
                         "found none (drop --chat to continue plain text)")


def no_tokens_note(tokenizer, args: Args, ids: list[int], window: Window) -> str:
    """Why a generation made no new token, in one line: --max-tokens 0, a prompt that fills
    the window (without a context shift), or the model ending at once, and whether the prompt
    went through the chat template."""
    if args.max_tokens == 0:
        why = "--max-tokens is 0"
    elif len(ids) >= window.size:
        why = f"the prompt ({len(ids)} tokens) fills {window}"
    else:
        from toymlx.generation.generate import stop_ids

        eos, stop = getattr(tokenizer, "eos_id", None), sorted(stop_ids(tokenizer))
        first = (f"the end-of-sequence token {eos}" if stop == [eos] else
                 "an end-of-generation token (one of " + ", ".join(
                     f"{i} {tokenizer.token_text(i)}" for i in stop) + ")")
        how = ("rendered through the GGUF's chat template" if templated(tokenizer, args) else
               f"raw text ({_raw_reason(args)})")
        why = f"the model ended at once (its first token was {first}); the prompt was {how}"
        if args.ignore_chat_template:
            why += ", which an instruct model often ends at once: drop --ignore-chat-template"
    return f"{PROG}: 0 new tokens: {why}"


CHAT_HELP = ("type a message and Enter; /reset forgets the conversation, /quit or Ctrl-D "
             "ends it")


def chat(model, tokenizer, args: Args, context: int, inp=None, out=None) -> int:
    """The conversation of `--chat` without `--prompt`: each line read is a user turn, the
    reply streams to `out`, and the next turn's prompt is the whole conversation rendered
    again, its start, as far as it matches the tokens already computed, taken from the KV
    caches kept between turns (MLX: `PromptCache`). MLX's decoder (`decoder_for`) is made
    once for the whole conversation, /reset included: made per turn, every turn traced each
    block's one-token step again (SmolLM2: 30 blocks, their start and finish). Where the next
    turn would not leave room for its reply in `context`, its earliest turns are dropped for
    good (`fitted`; not with --no-context-shift, which stops there), one line on stderr saying
    so, and the caches keep only the start the new prompt shares with them (the system
    message's). Returns the number of turns answered."""
    from toymlx.generation.generate import LlamaCppDecoder, PromptCache, decoder_for

    on_mlx = not isinstance(model, LlamaCppDecoder)
    kept = PromptCache() if on_mlx else None
    decoder = decoder_for(model) if on_mlx else None
    inp = sys.stdin if inp is None else inp
    out = sys.stdout if out is None else out
    _need_template(tokenizer, args)
    interactive = inp.isatty()
    if interactive:
        print(f"{PROG} --chat: {CHAT_HELP}", file=sys.stderr)
    history: list[dict[str, str]] = []
    turns = lines = 0
    while True:
        if interactive:
            print("> ", end="", file=sys.stderr, flush=True)
        raw = (inp.buffer if hasattr(inp, "buffer") else inp).readline(STDIN_LIMIT + 1)
        lines += 1
        within_stdin_limit(raw, f"stdin line {lines}")  # the conversation ends: no line end
        try:
            line = utf8_text(raw, f"stdin line {lines}")
        except UsageError as e:  # this turn only: the conversation so far is kept
            print(f"{PROG}: error: {e}; the turn is skipped, the conversation goes on",
                  file=sys.stderr)
            continue
        if not line or line.strip() in ("/quit", "/exit"):
            return turns
        text = line.strip()
        if text == "/reset":
            history = []
            kept = None if kept is None else PromptCache()
            continue
        if not text:
            continue
        turn = Args(**{**vars(args), "prompt": text})
        if args.context_shift:
            ids, dropped = fitted(tokenizer, turn, history, context)
        else:
            ids, dropped = prompt_ids(tokenizer, turn, history), 0
        if len(ids) >= context:  # the conversation so far is kept for a shorter message
            print(full_note(turn, len(ids), context), file=sys.stderr)
            continue
        if dropped:
            history = history[2 * dropped:]
            print(dropped_note(turn, dropped, len(history) // 2, len(ids), context),
                  file=sys.stderr)
        reply, n = stream(model, tokenizer, ids, turn, out, kept, decoder)
        if n == 0:
            print(no_tokens_note(tokenizer, turn, ids, Window(context)), file=sys.stderr)
        elif n < args.max_tokens and len(ids) + n >= context:
            print(reply_cut_note(turn, len(ids), n, context), file=sys.stderr)
        history += [{"role": "user", "content": text},
                    {"role": "assistant", "content": reply.strip()}]
        turns += 1


def reply_room(args: Args, context: int) -> int:
    """The tokens a --chat turn keeps free in the model's context for its reply: --max-tokens,
    at most half the context (a larger --max-tokens would leave no room for the conversation;
    a reply that runs past the context stops there)."""
    return min(args.max_tokens, context // 2)


def fitted(tokenizer, turn: Args, history: list[dict[str, str]],
           context: int) -> tuple[list[int], int]:
    """The prompt ids of a --chat turn (`prompt_ids`), and how many of `history`'s earliest
    turns (a user message and its reply each) they leave out: none where the whole
    conversation leaves `reply_room` in `context`, else the fewest that do, or all of them.
    The system message and the new message are always kept, and whole turns go, so that the
    template renders a conversation that starts with a user's message (Ollama's `chatPrompt`
    drops single messages, llama.cpp's conversation mode drops tokens and can cut a message)."""
    room = reply_room(turn, context)
    dropped = 0
    while True:
        ids = prompt_ids(tokenizer, turn, history[2 * dropped:])
        if len(ids) + room <= context or 2 * dropped >= len(history):
            return ids, dropped
        dropped += 1


def full_note(args: Args, n_prompt: int, context: int) -> str:
    """One line for a --chat turn whose prompt of `n_prompt` tokens fills `context`: with the
    context shift, the new message alone (the earlier turns all left out) does, and the turn is
    skipped; without it, the conversation does, and it stops."""
    if not args.context_shift:
        return (f"{PROG}: the conversation ({n_prompt} tokens) fills the model's context "
                f"({context}); /reset to start again")
    system = " with the system message" if args.system else ""
    return (f"{PROG}: your message ({n_prompt} tokens through the chat template{system}) fills "
            f"the model's context ({context}) alone; the turn is skipped, the conversation goes "
            "on")


def dropped_note(args: Args, dropped: int, kept: int, n_prompt: int, context: int) -> str:
    """One line for a --chat turn that dropped the `dropped` earliest turns of the conversation
    (`fitted`), `kept` earlier turns left, `n_prompt` tokens now read."""
    parts = (["the system message"] if args.system else []) + \
        ([counted(kept, "earlier turn")] if kept else []) + ["your message"]
    reads = f"{', '.join(parts[:-1])} and {parts[-1]}" if len(parts) > 1 else parts[0]
    return (f"{PROG}: dropped the conversation's earliest {counted(dropped, 'turn')} (a message "
            f"and its reply each) to fit the model's context ({context} tokens) with room for a "
            f"{reply_room(args, context)}-token reply; the model reads {reads} ({n_prompt} "
            "tokens)")


def reply_cut_note(args: Args, n_prompt: int, n_new: int, context: int) -> str:
    """One line for a --chat reply that stopped at `context` (not at --max-tokens): llama.cpp's
    conversation mode without its context shift stops there too. A token-level shift inside the
    reply would cut the system message and the turn's own start out of what the model reads."""
    then = ("the next turn drops the earliest turns to make room" if args.context_shift else
            "/reset to start again (--no-context-shift)")
    return (f"{PROG}: the reply stopped at the model's context ({context} tokens: {n_prompt} of "
            f"the conversation, {n_new} of the reply; --max-tokens {args.max_tokens}); {then}")


def stream(model, tokenizer, ids: list[int], args: Args, out=None, kept=None,
           decoder=None, fresh: bool = False, window: Window | None = None) -> tuple[str, int]:
    """Write the continuation to `out` (stdout) as it is produced; return (text, token count).
    `model`: an MLX `Llama`, or a `LlamaCppDecoder` (the llama.cpp engine, which keeps a
    conversation's shared start itself); `kept`: MLX's `PromptCache` of a conversation;
    `decoder`: MLX's `decoder_for(model)`, made once for several calls; `fresh`: the llama.cpp
    child decodes as one started with --seed would (a sample of `samples`); `window`: the
    window of `samples` (shifted past unless --no-context-shift); None: the model's context,
    where a conversation stops."""
    from toymlx.generation.generate import LlamaCppDecoder, generate, stop_ids

    out = sys.stdout if out is None else out
    size = None if window is None else window.size
    shift = window is not None and args.context_shift
    if isinstance(model, LlamaCppDecoder):
        tokens = model.generate(ids, stop_ids(tokenizer), args.max_tokens,
                                args.temperature, args.top_p, args.top_k, args.min_p,
                                args.repetition_penalty, args.seed if fresh else None, size,
                                shift)
    else:
        tokens = generate(model, tokenizer, ids, args.max_tokens, args.temperature, args.top_p,
                          args.seed, args.top_k, args.min_p, args.repetition_penalty, kept,
                          decoder, size, shift)

    # Decoding prompt + new tokens and printing the part after the prompt's own decoding keeps
    # word-initial spaces that a tokenizer drops at the start of a text, and re-decoding the
    # growing list lets a multi-byte character split over tokens print once it is complete.
    base = tokenizer.decode(ids)
    new: list[int] = []
    shown = ""
    for tok in tokens:
        new.append(tok)
        text = _continuation(tokenizer, ids, new, base)
        if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the next token
            continue
        if len(text) > len(shown):
            out.write(text[len(shown):])
            out.flush()
            shown = text
    text = _continuation(tokenizer, ids, new, base)
    if len(text) > len(shown):
        out.write(text[len(shown):])
    if text and not text.endswith("\n"):
        out.write("\n")
    out.flush()
    return text, len(new)


def _continuation(tokenizer, ids: list[int], new: list[int], base: str) -> str:
    full = tokenizer.decode(ids + new)
    return full[len(base):] if full.startswith(base) else tokenizer.decode(new)


MAX_SAMPLES = 1000
"""Most samples one call draws: a count no reader reads (a hostile 2**63 decoded until
killed); the seeds being consecutive, a call from --seed S + 1000 goes on where one stops."""

SEPARATOR = "-" * 15
"""The line on stdout after each sample of --num-samples above 1, as nanoGPT's sample.py
prints it: a script splits the output on it, and a sample not followed by it was cut (Ctrl-C)."""


def check_samples(args: Args) -> None:
    """UsageError for a --num-samples that cannot be drawn as its help says."""
    n = args.num_samples
    if not 1 <= n <= MAX_SAMPLES:
        raise UsageError(f"--num-samples: expected a count in 1..{MAX_SAMPLES}, found {n} (more "
                         f"samples: another call with --seed {MAX_SAMPLES} higher)")
    if n == 1:
        return
    if args.temperature == 0:
        raise UsageError(f"--temperature: expected > 0 with --num-samples {n}, found 0 (greedy: "
                         "every sample would be the same text; drop --num-samples)")
    if args.chat and not args.prompt:
        raise UsageError(f"--num-samples {n}: expected a --prompt (a --chat conversation "
                         "answers each turn once), found none")
    if args.seed + n - 1 >= 2**64:  # sample k's seed is --seed + k
        raise UsageError(f"--seed: expected <= {2**64 - n} with --num-samples {n} (the "
                         f"samples' seeds run from it up to {2**64 - 1}), found {args.seed}")


def trained_window(model: str) -> int | None:
    """The --seq-len of the from-scratch or warm-start run `model` lies in (the run folder, or a
    checkpoint in its weights/), from its run_start, or of a lone checkpoint (moved out of its
    run, exported) from its `TRAINED_WINDOW` key; None for any other model or record."""
    from pathlib import Path

    from toymlx.bundle.events import iter_events, run_start
    from toymlx.bundle.model_store import is_store_name
    from toymlx.bundle.outputs import bundle_of
    from toymlx.gguf.llama import TRAINED_WINDOW
    from toymlx.gguf.reader import GGUFError, GGUFFile

    if is_store_name(model):
        return None
    run = bundle_of(Path(model))
    if run is None:
        try:  # the model's own readers name what is wrong with it
            seq_len = GGUFFile(model).metadata.get(TRAINED_WINDOW) if Path(model).is_file() \
                else None
        except (OSError, GGUFError):
            return None
        return seq_len if isinstance(seq_len, int) and seq_len > 0 else None
    try:
        start = run_start(iter_events(run))
    except (OSError, ValueError):  # the run's own readers name what is wrong with it
        return None
    if start is None or start.get("recipe") not in ("from-scratch", "warm-start"):
        return None  # a lora run's base read longer texts than its --seq-len
    seq_len = (start.get("config") or {}).get("seq_len")
    return seq_len if isinstance(seq_len, int) and seq_len > 0 else None


@dataclass(frozen=True)
class Window:
    """The most tokens of text the model reads at once in toymlx-generate, and what sets it:
    a from-scratch or warm-start run's --seq-len (`trained`), else the model's context."""

    size: int
    trained: bool = False

    def __str__(self) -> str:
        if self.trained:
            return f"the {self.size}-token window the run trained on (--seq-len {self.size})"
        return f"the model's context ({self.size} tokens)"


def reading_window(model: str, context: int) -> Window:
    """The window `samples` keeps the text within: the run's trained window where `model` is a
    from-scratch or warm-start run that recorded one no longer than the context (a run's
    checkpoints carry --seq-len as their context, an older run's the preset's longer one, but
    past --seq-len tokens the model reads positions it never trained on and the text falls
    apart), else the model's context."""
    trained = trained_window(model)
    return Window(trained, True) if trained is not None and trained <= context else \
        Window(context)


def prompt_cut_note(n_prompt: int, window: Window) -> str | None:
    """One line where the context shift cuts the prompt (it fills the window); None if not."""
    from toymlx.generation.window import in_view

    kept = in_view(n_prompt, window.size)
    if kept == n_prompt:
        return None
    return (f"{PROG}: the prompt ({n_prompt} tokens) fills {window}: the model reads its last "
            f"{counted(kept, 'token')} (the context shift; a prompt under {window.size} tokens "
            "is read whole)")


def shift_note(n_prompt: int, n_new: int, window: Window) -> str | None:
    """One line where a sample of `n_new` tokens went past the window by context shifts: where
    the first came, what each dropped, and how to stay within; None where none came."""
    from toymlx.generation.window import in_view, shift_keep, shifts

    count = shifts(n_prompt, n_new, window.size)
    if count == 0:
        return None
    room, keep = window.size - in_view(n_prompt, window.size), shift_keep(window.size)
    further = "; a run trained on a longer --seq-len reads further" if window.trained else ""
    return (f"{PROG}: context shift after new token {room}: the text filled {window}, so the "
            f"model went on from its last {counted(keep, 'token')}, computed again, and reads "
            f"no further back ({counted(count, 'shift')} in {n_new} new tokens, each dropping "
            f"the older {window.size - keep}); --max-tokens {room} stays within it, "
            f"--no-context-shift stops there{further}")


def samples(model, tokenizer, ids: list[int], args: Args, engine: str, window: Window) -> None:
    """The --num-samples samples of the prompt on stdout, the k-th (from 0) drawn as `--seed` + k
    alone draws it (each from an empty KV cache, the MLX model traced once), each followed by
    SEPARATOR where there are several; a line of counts and timing for each on stderr, and
    where the text reaches `window`, a line on the first context shift (or the stop)."""
    from toymlx.generation.generate import LlamaCppDecoder, decoder_for

    if args.context_shift and (note := prompt_cut_note(len(ids), window)):
        print(note, file=sys.stderr)
    several = args.num_samples > 1
    decoder = None if isinstance(model, LlamaCppDecoder) else decoder_for(model)
    shift_told = False
    for k in range(args.num_samples):
        one = dataclasses.replace(args, seed=args.seed + k)
        t0 = time.perf_counter()
        try:
            _, n = stream(model, tokenizer, ids, one, decoder=decoder, fresh=several,
                          window=window)
        except KeyboardInterrupt:
            if several:  # which ones a script can take: those followed by SEPARATOR
                print(f"\n{PROG}: {k} of {args.num_samples} samples printed whole; sample "
                      f"{k + 1} (--seed {one.seed}) was cut", file=sys.stderr, end="")
            raise
        if several:
            print(SEPARATOR, flush=True)
        dt = time.perf_counter() - t0
        which = f"sample {k + 1} of {args.num_samples} (--seed {one.seed}): " if several else ""
        print(f"{PROG}: {which}{len(ids)} prompt + {n} new tokens in {dt:.2f} s "
              f"({n / dt if dt > 0 else 0:.1f} tok/s, {engine})", file=sys.stderr)
        if n == 0:
            print(no_tokens_note(tokenizer, args, ids, window), file=sys.stderr)
        elif args.context_shift:
            if not shift_told and (note := shift_note(len(ids), n, window)):
                print(note, file=sys.stderr)
                shift_told = True
        elif n < args.max_tokens and len(ids) + n >= window.size:
            print(f"{PROG}: stopped at {window}: {len(ids)} prompt + {n} new tokens fill it "
                  f"(--max-tokens {args.max_tokens}, --no-context-shift)", file=sys.stderr)


def store_layers_note(spec: str) -> str | None:
    """One line for an Ollama model whose manifest carries TEMPLATE, SYSTEM or PARAMETER layers
    (`ollama run` applies them): toymlx-generate uses the GGUF's chat template and its own
    flags instead; None for any other model."""
    from toymlx.bundle.model_store import OLLAMA, is_store_name, resolve

    if not (is_store_name(spec) and spec.startswith(OLLAMA)):
        return None
    found = resolve(spec, "--model", with_adapter=True, check_digest=False)  # its layers alone
    kinds = [k for k in ("template", "system", "params") if k in found.layers]
    if not kinds:
        return None
    what = {"template": "TEMPLATE (the GGUF's tokenizer.chat_template is used)",
            "system": "SYSTEM (give it as --system)",
            "params": "PARAMETER (the sampling flags given here are used)"}
    return (f"{PROG}: {spec}: its Ollama layers {', '.join(what[k] for k in kinds)} are not "
            "applied")


def _nanogpt_prompt_file(prompt: str) -> str | None:
    """The file a `--prompt FILE:NAME` names, as sample.py's --start=FILE:NAME reads it, there
    or not (a typo'd name was generated from as the text); None for a text that cannot name
    one: a second line, a space after `FILE:`, a name longer than the file system takes."""
    name = prompt.removeprefix("FILE:")
    if name == prompt or not name or "\n" in name or name[0].isspace():
        return None
    if any(len(part.encode()) > 255 for part in name.split("/")):
        return None
    return name


def run(args: Args) -> int:
    """Generate as `args` say."""
    from toymlx.backend.device import on_gpu, select_device
    from toymlx.generation.generate import (
        EngineFailed,
        LlamaCppDecoder,
        check_one_adapter,
        check_sampling,
        choose_engine,
        load_model,
        load_tokenizer,
        model_files,
        used_files,
    )
    from toymlx.generation.sampling import check_top_k

    if nanogpt_file := _nanogpt_prompt_file(args.prompt):  # never taken as the text
        there = os.path.isfile(nanogpt_file)
        raise UsageError(f"--prompt: expected the prompt's text, found nanoGPT's "
                         f"{args.prompt!r} (sample.py's --start=FILE:...)"
                         + ("" if there else f", and no file {nanogpt_file} is there")
                         + f"; to read {nanogpt_file if there else 'a file'}: --prompt - < "
                         + (shlex.quote(nanogpt_file) if there else "FILE"))
    if args.prompt == "-":
        raw = within_stdin_limit(sys.stdin.buffer.read(STDIN_LIMIT + 1), "--prompt -: stdin")
        raw = raw.removeprefix(b"\xef\xbb\xbf")  # Notepad's UTF-8 BOM: not text, as in training
        if not raw:  # an empty pipe would be generated from as a raw BOS alone
            raise UsageError("--prompt -: expected the prompt's text on stdin, found it empty "
                             "(ended at once)")
        args = dataclasses.replace(args, prompt=utf8_text(raw, "stdin"))
    utf8_text(args.prompt, "--prompt")
    if args.system is not None:
        utf8_text(args.system, "--system")
    if args.max_tokens < 0:
        raise UsageError(f"--max-tokens: expected a count >= 0, found {args.max_tokens}; for "
                         "llama.cpp's -n -1 (on to the end) give a large count, e.g. "
                         "--max-tokens 100000: generation stops at an end-of-generation token "
                         "(or at the model's window, with --no-context-shift)")
    check_sampling(args.temperature, args.top_p, args.top_k, args.min_p,
                   args.repetition_penalty)  # before the model loads
    if not 0 <= args.seed < 2**64:  # MLX's seed is an unsigned 64-bit integer
        raise UsageError(f"--seed: expected 0..{2**64 - 1}, found {args.seed}")
    check_samples(args)
    if args.device == "gpu" and args.engine == "llama.cpp":  # its child decodes on the CPU
        raise UsageError("--device gpu: expected --engine mlx or auto (--engine llama.cpp "
                         "decodes on the CPU), found --engine llama.cpp")
    select_device(args.device)
    engine = choose_engine(args.engine, on_gpu())
    # the header's refusals first (--top-k past the vocabulary); an Ollama blob's SHA-256 (a
    # read of the whole model) after them, before the weights load. `used`: said once it loads
    used = f"{PROG}: {used_files(args.model, args.adapter, check_digest=False)}"
    if note := store_layers_note(args.model):
        used += "\n" + note
    conversation = args.chat and not args.prompt
    gguf_path, adapters = model_files(args.model, args.adapter, check_digest=False)
    tokenizer, model_args = load_tokenizer(gguf_path, args.model)  # the header alone
    if note := system_note(tokenizer, args, gguf_path):
        used += "\n" + note
    check_top_k(args.top_k, model_args.vocab_size, gguf_path)
    if not conversation and not args.prompt and not tokenizer.encode(""):
        raise no_prompt(tokenizer)  # before the weights load
    gguf_path, adapters = model_files(args.model, args.adapter)
    try:
        if engine == "llama.cpp":
            if conversation:
                _need_template(tokenizer, args)
                print(used, file=sys.stderr)
                model = LlamaCppDecoder(gguf_path, adapters, seed=args.seed,
                                        context=model_args.context)
                try:  # one llama.cpp child answers every turn
                    chat(model, tokenizer, args, model_args.context)
                finally:
                    model.close()
                return 0
            ids = prompt_ids(tokenizer, args)
            window = reading_window(args.model, model_args.context)
            # the text in view never holds more than the window (nor the prompt and new tokens)
            model = LlamaCppDecoder(gguf_path, adapters, seed=args.seed,
                                    context=min(window.size, len(ids) + args.max_tokens))
            print(used, file=sys.stderr)
            try:
                samples(model, tokenizer, ids, args, engine, window)
            finally:
                model.close()
    except EngineFailed as e:  # before its first token: nothing is printed yet
        if args.engine != "auto":
            raise UsageError(f"--engine llama.cpp: {e}") from None
        print(f"{PROG}: {e}; decoding with MLX instead (--engine mlx skips llama.cpp)",
              file=sys.stderr)
        engine = "mlx"
    if engine == "mlx":
        check_one_adapter(args.model, adapters)
        model = load_model(gguf_path, adapters)
        if conversation:
            _need_template(tokenizer, args)
            print(used, file=sys.stderr)
            chat(model, tokenizer, args, model.args.context)
            return 0
        ids = prompt_ids(tokenizer, args)
        print(used, file=sys.stderr)
        samples(model, tokenizer, ids, args, engine, reading_window(args.model, model.args.context))
    return 0


@console_command("toymlx-generate")
def main(argv: list[str] | None = None) -> int:
    return run_command(PROG, Args, run, argv, (ValueError, OSError, KeyError))


if __name__ == "__main__":
    sys.exit(main())
