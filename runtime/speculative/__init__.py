"""Speculative decoding: cheap drafts of the next tokens, checked by the model in one call.

A proposer guesses k tokens per sequence (`prompt_lookup`: n-grams found earlier in the
sequence; `draft_model`: a small model of the same tokenizer); the scheduler turns a decode
batch into one prefill call over each row's last token and its draft; `acceptance` keeps
the longest prefix of the draft the model agrees with, plus one token of the model's own.
"""

from .speculator import Speculator

__all__ = ["Speculator"]
