"""Pages that hold a model's layers by groups (runtime/config.py's PageGroups): the same logits as
pages holding every layer, with a sliding group's pages of blocks out of the window given back
(table entries 0, the padding page)."""

from __future__ import annotations

import pytest
import torch

from kiln.models.config import SLIDING
from kiln.models.llama import PagedLlama
from kiln.models.loader import load_hf_directory
from kiln.runtime.config import PageGroups

from tests.hf_families import write_family_checkpoint


def test_groups_hold_one_kind_of_layer_as_many_a_page_as_both_kinds_allow():
    gemma3_270m = PageGroups.of([i % 6 != 5 for i in range(18)], 512)  # three global layers, fifteen local
    assert gemma3_270m.layers == ((5, 11, 17), (0, 1, 2), (3, 4, 6), (7, 8, 9), (10, 12, 13), (14, 15, 16))
    assert gemma3_270m.sliding == (False,) + (True,) * 5 and gemma3_270m.place(12) == (4, 1)
    assert PageGroups.of([i % 6 != 5 for i in range(26)], 512).layers_per_page == 2  # Gemma 3 1B: 4 and 22
    assert PageGroups.of([True] * 4, 12).layers == ((0, 1, 2, 3),)  # every layer windowed (Mistral v0.1)
    assert PageGroups.from_json(gemma3_270m.to_json()) == gemma3_270m


@pytest.mark.parametrize("family", ["gemma3", "gemma2"])
def test_grouped_pages_give_every_layer_pages_logits_with_the_window_given_back(family, tmp_path):
    """A 20-token prefill, then ten decode steps whose tables name page 0 for every sliding group's
    block out of the window (6 keys, 4-token pages): the reference's logits."""
    pytest.importorskip("transformers")
    checkpoint = load_hf_directory(write_family_checkpoint(family, tmp_path))
    c, stride = checkpoint.config, 4
    groups = PageGroups.of([kind == SLIDING for kind in c.layer_types], c.sliding_window)
    assert any(groups.sliding) and not all(groups.sliding)
    model = PagedLlama(c, block_seq_stride=stride, page_groups=groups).load_tensors(checkpoint.tensors).eval()
    tokens = list(range(5, 35))
    cache = model.allocate_cache(1 + groups.count * 8)
    table = torch.arange(1, 1 + groups.count * 8).view(1, groups.count, 8)  # distinct pages in every group
    with torch.no_grad():
        want = model.forward_reference(torch.tensor([tokens]))[0]
        h = model.forward_paged(torch.tensor([tokens[:20]]), torch.tensor([0]), torch.tensor([20]), table[:, :, :5],
                                cache)
        got = [model.logits(h)[0]]
        for position in range(20, 30):
            windowed = table.clone()
            gone = max(0, position - c.sliding_window + 1) // stride
            windowed[:, [g for g, sliding in enumerate(groups.sliding) if sliding], :gone] = 0
            h = model.forward_paged(torch.tensor([[tokens[position]]]), torch.tensor([position]),
                                    torch.tensor([position + 1]), windowed[:, :, : position // stride + 1], cache)
            got.append(model.logits(h)[0])
    got = torch.cat(got)
    assert (got - want).abs().max() / want.abs().max() < 1e-5
