"""A FakeProgram that writes scripted replies, so the server's handling of a given text (a
reasoning block, a tool call, JSON) can be tested through real HTTP without a trained model.

A reply is chosen by a trigger, a string the prompt contains (say, in the user's message), and
written token by token greedily: after a prompt that contains the trigger, the next token is the
reply's next one, then EOS. Where the reply has got to is read from the prefix itself: the
longest beginning of the reply that the prefix ends with. That is the true position as long as
the reply does not begin with the prompt's last token. Prompts without a trigger get the fake
model's own tokens.
"""

from __future__ import annotations

import numpy as np
from tokenizers import Tokenizer

from kiln.runtime.contract import Artifacts

from tests.fake_program import EOS, VOCAB, FakeProgram


def peaked(token: int) -> np.ndarray:
    """Logits whose argmax is `token`, the others falling off with their distance to it (so a
    grammar that forbids it leaves the nearest allowed token)."""
    return -np.abs(np.arange(VOCAB) - token).astype(np.float32)


class ScriptedProgram(FakeProgram):
    def __init__(self, artifacts: Artifacts, device: str = "local-task", parameter_memory: str = "auto",
                 replies: dict[str, str] | None = None):
        super().__init__(artifacts, device, parameter_memory)
        self.tokenizer = Tokenizer.from_file(str(artifacts.tokenizer_path))
        self.replies = {trigger: self.tokenizer.encode(text, add_special_tokens=False).ids
                        for trigger, text in (replies or {}).items()}

    def logits(self, prefix: list[int]) -> np.ndarray:
        text = self.tokenizer.decode(prefix, skip_special_tokens=False)
        reply = next((ids for trigger, ids in self.replies.items() if trigger in text), None)
        if reply is None:
            return super().logits(prefix)
        written = max(j for j in range(len(reply) + 1) if j == 0 or prefix[-j:] == reply[:j])
        return peaked(reply[written] if written < len(reply) else EOS)
