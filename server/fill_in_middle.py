"""Fill-in-the-middle: /v1/completions' `suffix` for code models trained to write the middle
between a prefix and a suffix (Qwen2.5-Coder, CodeGemma, StarCoder, DeepSeek-Coder).

Such a model reads `<prefix token> prefix <suffix token> suffix <middle token>` (the
prefix-suffix-middle order all of these use) and writes the middle, ending it with a token of
its own (`<|fim_pad|>`, `<|file_sep|>`, `<|endoftext|>`...: llama.cpp ends an infill on the
same ones). The tokens are found in the model's vocabulary by their spellings; a model with none
has no fill-in-the-middle, and a `suffix` for it is a 400, as OpenAI answers for its chat models.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenizers import Tokenizer

# Per family: the prefix, suffix and middle tokens; the tokens that may end a fill; and the
# repository-name and file-separator tokens of repository-level prompts (None: it has none).
_SPELLINGS = (
    (("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),  # Qwen2.5-Coder, CodeGemma
     ("<|fim_pad|>", "<|file_sep|>", "<|repo_name|>", "<|endoftext|>", "<|file_separator|>"),
     ("<|repo_name|>", "<|file_sep|>")),
    (("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),  # StarCoder, SantaCoder, Granite Code
     ("<fim_pad>", "<file_sep>", "<|endoftext|>"),
     ("<reponame>", "<file_sep>")),
    (("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"),  # DeepSeek-Coder
     ("<|EOT|>", "<｜end▁of▁sentence｜>"),
     (None, None)),
)


@dataclass(frozen=True)
class FillInMiddle:
    """A model's fill-in-the-middle tokens (ids)."""

    prefix: int
    suffix: int
    middle: int
    ends: tuple[int, ...]  # tokens that end a fill, beside the model's EOS
    repository: int | None = None  # a repository's name follows it
    file_separator: int | None = None  # a file's name and text follow it

    @classmethod
    def of(cls, tokenizer: Tokenizer) -> FillInMiddle | None:
        for markers, ends, (repository, separator) in _SPELLINGS:
            ids = [tokenizer.token_to_id(token) for token in markers]
            if None not in ids:
                found = tuple(i for i in (tokenizer.token_to_id(token) for token in ends) if i is not None)
                return cls(*ids, ends=found, repository=repository and tokenizer.token_to_id(repository),
                           file_separator=separator and tokenizer.token_to_id(separator))
        return None

    def prompt(self, lead: list[int], prefix: list[int], suffix: list[int], context: list[int] = ()) -> list[int]:
        """The ids the model reads: `lead` (what the tokenizer puts before any text, a BOS), the
        repository-level `context` (other files), then the prefix and suffix, each after its
        token, and the middle token last."""
        return [*lead, *context, self.prefix, *prefix, self.suffix, *suffix, self.middle]
