"""Tokenizers between GGUF metadata and Hugging Face's `tokenizer.json`.

A GGUF carries no tokenizer.json, only llama.cpp's description of one: the token
list, token types, merges, special ids and a pre-tokenizer *name*. This module
rebuilds the `tokenizers.Tokenizer` that name stands for (and goes the other way
for the GGUF writer), so a GGUF-loaded model tokenizes like its HF original.
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from kiln.runtime.errors import ModelLoadError

log = logging.getLogger(__name__)

# llama.cpp's token types (tokenizer.ggml.token_type).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# The split regexes of the HF tokenizer.json files that llama.cpp's pre-tokenizer names stand for.
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

_LLAMA3_NAMES = {"llama-bpe", "llama3", "llama-v3", "smaug-bpe", "dbrx", "falcon3"}
_QWEN2_NAMES = {"qwen2", "deepseek-r1-qwen"}
_GPT2_NAMES = {"gpt2", "default"}


# ---------------------------------------------------------------------------
# GGUF metadata -> tokenizer.json
# ---------------------------------------------------------------------------


def _byte_level_pre_tokenizer(pre: str):
    """The pre-tokenizer (and normalizer) HF uses for llama.cpp's pre-tokenizer name `pre`."""
    if pre == "smollm":
        # SmolLM/SmolLM2: single digits, then GPT-2's regex.
        return None, pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    if pre in _LLAMA3_NAMES or pre in _QWEN2_NAMES:
        split = LLAMA3_SPLIT if pre in _LLAMA3_NAMES else QWEN2_SPLIT
        normalizer = normalizers.NFC() if pre in _QWEN2_NAMES else None
        return normalizer, pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    if pre not in _GPT2_NAMES:
        log.warning(
            "GGUF pre-tokenizer %r is not one Kiln knows; using GPT-2's. "
            "Tokenization may differ from the original model.",
            pre,
        )
    return None, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _unique_tokens(tokens: list[str]) -> list[str]:
    """A vocabulary maps strings to ids, so a repeated string gets a placeholder."""
    seen: set[str] = set()
    out = []
    for i, tok in enumerate(tokens):
        if tok in seen:
            log.warning("GGUF token %d repeats %r; renamed to a placeholder", i, tok)
            tok = f"<kiln_duplicate_token_{i}>"
        seen.add(tok)
        out.append(tok)
    return out


def _merges_from_scores(vocab: dict[str, int], scores: list[float]) -> list[tuple[str, str]]:
    """BPE merges implied by a SentencePiece vocabulary: every split of a token into two
    tokens, best-scored result first (what HF does for files that list no merges)."""
    merges = []
    for piece, piece_id in vocab.items():
        score = scores[piece_id] if piece_id < len(scores) else 0.0
        local = [
            (piece[:i], piece[i:], score)
            for i in range(1, len(piece))
            if piece[:i] in vocab and piece[i:] in vocab
        ]
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        merges.extend(local)
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(a, b) for a, b, _ in merges]


def _template(bos: str | None, bos_id, eos: str | None, eos_id, add_bos: bool, add_eos: bool):
    if not ((add_bos and bos is not None) or (add_eos and eos is not None)):
        return None
    single, pair, specials = "$A:0", "$A:0 $B:1", []
    if add_bos and bos is not None:
        single, pair = f"{bos}:0 {single}", f"{bos}:0 $A:0 {bos}:1 $B:1"
        specials.append((bos, bos_id))
    if add_eos and eos is not None:
        single += f" {eos}:0"
        pair = pair.replace("$A:0", f"$A:0 {eos}:0") + f" {eos}:1"
        if (eos, eos_id) not in specials:
            specials.append((eos, eos_id))
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)


def tokenizer_from_gguf(meta: dict[str, Any], context_length: int | None = None) -> tuple[str, dict[str, Any]]:
    """(tokenizer.json text, tokenizer_config dict) from a GGUF's `tokenizer.*` metadata.

    `meta` maps GGUF keys to plain Python values (strings, numbers, lists).
    """
    kind = meta.get("tokenizer.ggml.model")
    tokens = meta.get("tokenizer.ggml.tokens")
    if kind is None or not tokens:
        raise ModelLoadError("the GGUF file has no tokenizer (tokenizer.ggml.model / tokens missing)")
    tokens = _unique_tokens(list(tokens))
    types = list(meta.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens))
    vocab = {tok: i for i, tok in enumerate(tokens)}

    def special(key: str) -> tuple[str | None, int | None]:
        idx = meta.get(f"tokenizer.ggml.{key}")
        if idx is None or not 0 <= int(idx) < len(tokens):
            return None, None
        return tokens[int(idx)], int(idx)

    bos, bos_id = special("bos_token_id")
    eos, eos_id = special("eos_token_id")
    unk, _ = special("unknown_token_id")
    pad, _ = special("padding_token_id")
    add_bos = meta.get("tokenizer.ggml.add_bos_token")
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))

    if kind == "gpt2":
        add_bos = bool(add_bos) if add_bos is not None else False
        merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or []]
        pre = meta.get("tokenizer.ggml.pre", "default")
        tok = Tokenizer(
            models.BPE(
                vocab=vocab,
                merges=merges,
                dropout=None,
                fuse_unk=False,
                byte_fallback=False,
                ignore_merges=pre in _LLAMA3_NAMES,
            )
        )
        normalizer, pre_tokenizer = _byte_level_pre_tokenizer(pre)
        if normalizer is not None:
            tok.normalizer = normalizer
        tok.pre_tokenizer = pre_tokenizer
        tok.decoder = decoders.ByteLevel()
        post = _template(bos, bos_id, eos, eos_id, add_bos, add_eos)
        tok.post_processor = post or processors.ByteLevel(trim_offsets=False)
    elif kind == "llama":
        # SentencePiece BPE: `▁` for spaces, <0xNN> byte fallback tokens.
        add_bos = bool(add_bos) if add_bos is not None else True  # llama.cpp's default here
        if meta.get("tokenizer.ggml.merges"):
            merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
        else:
            scores = list(meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens))
            mergeable = {t: i for i, t in enumerate(tokens) if types[i] in (NORMAL, USER_DEFINED)}
            merges = _merges_from_scores(mergeable, scores)
        tok = Tokenizer(
            models.BPE(
                vocab=vocab,
                merges=merges,
                dropout=None,
                unk_token=unk,
                fuse_unk=True,
                byte_fallback=True,
            )
        )
        # llama.cpp puts a space before the text and after every special token: "always".
        space_prefix = meta.get("tokenizer.ggml.add_space_prefix", True)
        tok.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement="▁", prepend_scheme="always" if space_prefix else "never", split=False
        )
        steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
        if space_prefix:
            steps.append(decoders.Strip(" ", 1, 0))
        tok.decoder = decoders.Sequence(steps)
        post = _template(bos, bos_id, eos, eos_id, add_bos, add_eos)
        if post is not None:
            tok.post_processor = post
    else:
        raise ModelLoadError(
            f"GGUF tokenizer type {kind!r} is not supported (Kiln reads 'gpt2' byte-level BPE and 'llama' SentencePiece)"
        )

    # Control and unknown tokens are special; user-defined ones are matched whole but are text.
    added = [
        AddedToken(t, special=ty != USER_DEFINED, normalized=False)
        for t, ty in zip(tokens, types)
        if ty in (CONTROL, UNKNOWN, USER_DEFINED)
    ]
    if added:
        tok.add_tokens(added)

    tokenizer_config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "unk_token": unk,
        "pad_token": pad,
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "clean_up_tokenization_spaces": False,
    }
    if meta.get("tokenizer.chat_template"):
        tokenizer_config["chat_template"] = meta["tokenizer.chat_template"]
    if context_length:
        tokenizer_config["model_max_length"] = int(context_length)
    return tok.to_str(), tokenizer_config


# ---------------------------------------------------------------------------
# tokenizer.json -> GGUF metadata
# ---------------------------------------------------------------------------


def _token_content(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


def _detect_pre(pre: dict | None) -> str:
    """llama.cpp's name for a tokenizer.json's byte-level pre-tokenizer."""
    if pre is None:
        return "gpt2"
    steps = pre["pretokenizers"] if pre.get("type") == "Sequence" else [pre]
    kinds = [s.get("type") for s in steps]
    if kinds == ["ByteLevel"] and steps[0].get("use_regex", True):
        return "gpt2"
    if kinds == ["Digits", "ByteLevel"] and steps[0].get("individual_digits") and steps[1].get("use_regex", True):
        return "smollm"
    if kinds == ["Split", "ByteLevel"] and not steps[1].get("use_regex", True):
        regex = steps[0].get("pattern", {}).get("Regex")
        if regex == LLAMA3_SPLIT:
            return "llama-bpe"
        if regex == QWEN2_SPLIT:
            return "qwen2"
    log.warning("pre-tokenizer %s has no llama.cpp name; writing 'gpt2'", json.dumps(pre)[:200])
    return "gpt2"


def _infer_add_bos(tj: dict, bos: str | None) -> bool:
    post = tj.get("post_processor") or {}
    posts = post.get("processors", []) if post.get("type") == "Sequence" else [post]
    for p in posts:
        if p.get("type") == "TemplateProcessing" and bos:
            single = p.get("single", [])
            return any(s.get("SpecialToken", {}).get("id") == bos for s in single[:1])
    return False


def tokenizer_to_gguf(
    tokenizer_json: str, tokenizer_config: dict[str, Any], vocab_size: int
) -> dict[str, Any]:
    """GGUF `tokenizer.*` metadata (key -> value) for a tokenizer.json.

    Byte-level BPE becomes llama.cpp's 'gpt2' model; SentencePiece-style BPE (byte
    fallback, `▁` spaces) its 'llama' model, with scores that replay the merge order.
    The token list is padded to `vocab_size` (the embedding's row count) as llama.cpp requires.
    """
    tj = json.loads(tokenizer_json)
    model = tj.get("model", {})
    if model.get("type") != "BPE":
        raise ModelLoadError(f"cannot write a {model.get('type')!r} tokenizer to GGUF (only BPE is supported)")
    id_to_token: dict[int, str] = {int(i): t for t, i in model["vocab"].items()}
    special_ids: dict[int, bool] = {}
    for a in tj.get("added_tokens", []):
        id_to_token[int(a["id"])] = a["content"]
        special_ids[int(a["id"])] = bool(a.get("special"))
    n = max(vocab_size, max(id_to_token) + 1)
    if n > vocab_size:
        raise ModelLoadError(f"the tokenizer has {n} tokens but the model's vocab_size is {vocab_size}")

    spm = bool(model.get("byte_fallback"))
    tokens, types = [], []
    byte_token = re.compile(r"^<0x[0-9A-Fa-f]{2}>$")
    for i in range(n):
        t = id_to_token.get(i)
        if t is None:
            tokens.append(f"[PAD{i}]")
            types.append(UNUSED)
        elif i in special_ids:
            tokens.append(t)
            types.append(CONTROL if special_ids[i] else USER_DEFINED)
        elif spm and byte_token.match(t):
            tokens.append(t)
            types.append(BYTE)
        else:
            tokens.append(t)
            types.append(NORMAL)

    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    ids = {t: i for i, t in enumerate(tokens)}

    def sid(name: str) -> int | None:
        content = _token_content(tokenizer_config.get(name))
        return ids.get(content) if content is not None else None

    meta: dict[str, Any] = {}
    if spm:
        unk = model.get("unk_token")
        if unk in ids:
            types[ids[unk]] = UNKNOWN
        # llama.cpp's SentencePiece tokenizer merges the best-scored pair first:
        # score a token by minus the rank of the merge that makes it.
        scores = [0.0] * n
        for rank, m in enumerate(merges):
            merged = m.replace(" ", "", 1)
            if merged in ids and scores[ids[merged]] == 0.0:
                scores[ids[merged]] = -float(rank + 1)
        pre = tj.get("pre_tokenizer") or {}
        normalizer = tj.get("normalizer") or {}
        space_prefix = pre.get("prepend_scheme", "always") != "never" if pre.get("type") == "Metaspace" else (
            "Prepend" in json.dumps(normalizer)
        )
        meta["tokenizer.ggml.model"] = "llama"
        meta["tokenizer.ggml.scores"] = scores
        meta["tokenizer.ggml.add_space_prefix"] = bool(space_prefix)
    else:
        meta["tokenizer.ggml.model"] = "gpt2"
        meta["tokenizer.ggml.pre"] = _detect_pre(tj.get("pre_tokenizer"))
        meta["tokenizer.ggml.merges"] = merges
    meta["tokenizer.ggml.tokens"] = tokens
    meta["tokenizer.ggml.token_type"] = types
    for name, key in (
        ("bos_token", "bos_token_id"),
        ("eos_token", "eos_token_id"),
        ("unk_token", "unknown_token_id"),
        ("pad_token", "padding_token_id"),
    ):
        if (i := sid(name)) is not None:
            meta[f"tokenizer.ggml.{key}"] = i
    add_bos = tokenizer_config.get("add_bos_token")
    if add_bos is None:
        add_bos = _infer_add_bos(tj, _token_content(tokenizer_config.get("bos_token")))
    meta["tokenizer.ggml.add_bos_token"] = bool(add_bos)
    if tokenizer_config.get("add_eos_token"):
        meta["tokenizer.ggml.add_eos_token"] = True
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):  # HF's named templates: keep the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    if template:
        meta["tokenizer.chat_template"] = template
    return meta
