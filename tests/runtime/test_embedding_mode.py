"""Embeddings through the engine's seams, without a device: the pooling arithmetic, the
scheduler giving embedding prompts calls of their own (and the whole prompt where pooling reads
every position), the call made of such a batch, the sentence-transformers files read, and the
contract's embed functions."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from kiln.models.sentence_transformers import read_embedding_spec
from kiln.runtime.batch import Batch, Phase
from kiln.runtime.config import KilnParams, ModelParams, PagedKVCacheParams
from kiln.runtime.contract import Capabilities, expected_functions, parse_function_name, FunctionKind
from kiln.runtime.errors import InvalidRequestError
from kiln.runtime.invocation import InvocationError, build_invocation
from kiln.runtime.pooling import PooledState, PoolingParams, finish_embedding
from kiln.runtime.request import Request, Sequence
from kiln.runtime.sampling import SamplingParams
from tests.runtime.test_scheduler import STOPPING, make, names


def embedding_seq(length, mode="last", name="e", priority=0):
    params = SamplingParams(max_tokens=1, pooling=PoolingParams(mode))
    request = Request(list(range(10, 10 + length)), params, name, priority=priority)
    request.sequences.append(Sequence(request, 0))
    STOPPING.add(request)
    return request.sequences[0]


def generation_seq(length, name="g"):
    request = Request(list(range(10, 10 + length)), SamplingParams(max_tokens=5), name)
    request.sequences.append(Sequence(request, 0))
    STOPPING.add(request)
    return request.sequences[0]


@pytest.mark.parametrize("mode", ["last", "mean", "cls"])
def test_pooling_over_chunks_is_pooling_over_the_whole_prompt(mode):
    hidden = np.random.default_rng(0).normal(size=(11, 6)).astype(np.float32)
    state = PooledState(PoolingParams(mode))
    for start in (0, 4, 8):  # three chunks, the last one short
        state.add_chunk(start, hidden[start:start + 4])
    vector = state.result(hidden[8:])
    expected = {"last": hidden[-1], "mean": hidden.mean(0), "cls": hidden[0]}[mode]
    np.testing.assert_allclose(vector, expected / np.linalg.norm(expected), rtol=1e-5)
    # Recomputed from position 0 (preempted): what came before is forgotten.
    state.add_chunk(0, hidden[:4])
    state.add_chunk(4, hidden[4:8])
    state.add_chunk(8, hidden[8:])
    np.testing.assert_allclose(state.result(hidden[8:]), vector, rtol=1e-6)


def test_matryoshka_cuts_before_normalising_and_normalising_is_optional():
    vector = np.array([3.0, 4.0, 12.0])
    np.testing.assert_allclose(finish_embedding(vector, PoolingParams(dimensions=2)), [0.6, 0.8])
    np.testing.assert_allclose(finish_embedding(vector, PoolingParams(normalize=False)), vector)
    with pytest.raises(InvalidRequestError, match="pooling must be one of"):
        PoolingParams("max")


def test_embedding_prompts_get_calls_of_their_own_in_priority_order():
    scheduler, _ = make(prefill=(1, 2, 4))
    for s in (embedding_seq(6, name="e1"), generation_seq(6, "g1"), embedding_seq(6, name="e2"),
              embedding_seq(6, name="e3")):
        scheduler.add(s)
    batch = scheduler.schedule()  # the first in line is an embedding: the call is embed's, every row one
    assert batch.phase is Phase.EMBED and names(scheduler, batch) == ["e1", "e2"]
    assert batch.samples == (True, True) and batch.full_logits == (False, False)  # last-token: one position each
    scheduler.written(batch)
    for s in scheduler.sequences_of(batch):
        scheduler.finish(s, "stop")  # as the embedding mode ends them
    batch = scheduler.schedule()  # g1 arrived before e3
    assert batch.phase is Phase.PREFILL and names(scheduler, batch) == ["g1"]


def test_mean_pooling_computes_the_whole_prompt_while_last_token_pooling_reuses_a_cached_prefix():
    scheduler, _ = make(trie=True)
    warm = generation_seq(12, "warm")
    scheduler.add(warm)
    scheduler.written(scheduler.schedule())
    scheduler.finish(warm, "stop")  # its full pages stay in the prefix cache
    for s in (embedding_seq(12, "last", "last"), embedding_seq(12, "mean", "mean")):
        scheduler.add(s)
    calls = {}
    while len(calls) < 2:
        batch = scheduler.schedule()
        calls[names(scheduler, batch)[0]] = (batch.starts[0], batch.full_logits[0])
        scheduler.written(batch)
        for s in scheduler.sequences_of(batch):
            scheduler.finish(s, "stop")
    # The cache leaves the last page's token to compute; mean pooling reads every position's.
    assert calls == {"last": (8, False), "mean": (0, True)}


def capabilities(embed=(1, 4)):
    return Capabilities(prefill_batch_sizes=(1, 4), decode_batch_sizes=(1, 4), prefill_last_batch_sizes=(1, 4),
                        has_prefill_position=True, prefill_returns_last_only=False, block_seq_stride=4,
                        max_seq_len=64, embed_batch_sizes=embed, hidden_size=8)


def test_an_embed_batch_calls_embed_with_prefills_arguments_reading_what_pooling_needs():
    batch = Batch(Phase.EMBED, 4, (1, 2), (0, 4), ((5, 6, 7), (8, 9)), ((1, 2), (3, 4)), (True, True),
                  (False, True))
    call = build_invocation(batch, capabilities(), 16, 100)
    assert call.function == "embed_bs4"
    assert [a.shape for a in call.arguments] == [(4, 4), (4,), (4,), (4, 2)]
    assert call.read_at == ((0, 2), (1, slice(0, 2))) and call.wanted == (True, True)
    with pytest.raises(InvocationError, match="no embed function"):
        build_invocation(batch, capabilities(embed=(1,)), 16, 100)


def test_the_contract_lists_embed_functions_where_the_export_has_them():
    params = ModelParams(max_seq_len=64, transformer_block_count=1, attn_head_dim=4, prefill_batch_sizes=[1, 4],
                         decode_batch_sizes=[1], paged_kv_cache=PagedKVCacheParams(block_seq_stride=4, attention_head_count_kv=1,
                                                                            device_block_count=16))
    kiln = KilnParams(embed_batch_sizes=[1, 4], hidden_size=8)
    names = expected_functions(params, False, kiln)
    assert names[-2:] == ["embed_bs1", "embed_bs4"]
    assert parse_function_name("embed_bs4") == (FunctionKind.EMBED, 4)
    abi = Capabilities.of(params, kiln, names)
    assert (abi.embed_batch_sizes, abi.hidden_size) == ((1, 4), 8)
    with pytest.raises(ValueError, match="embed_bs4"):
        Capabilities.of(params, kiln, names[:-1])
    assert Capabilities.of(params, replace(kiln, embed_batch_sizes=[]), names[:-2]).embed_batch_sizes == ()


def write_modules(directory, *stages, pooling=None):
    directory.mkdir(exist_ok=True)
    (directory / "modules.json").write_text(json.dumps([
        {"idx": i, "name": str(i), "path": path, "type": f"sentence_transformers.models.{kind}"}
        for i, (path, kind) in enumerate(stages)]))
    if pooling is not None:
        (directory / "1_Pooling").mkdir(exist_ok=True)
        (directory / "1_Pooling" / "config.json").write_text(json.dumps(pooling))


def test_the_sentence_transformers_files_say_how_to_pool(tmp_path):
    assert read_embedding_spec(tmp_path, {}).to_json() == {"pooling": "last", "normalize": True,
                                                          "matryoshka_dimensions": None}
    write_modules(tmp_path, ("", "Transformer"), ("1_Pooling", "Pooling"), pooling={"pooling_mode_mean_tokens": True})
    spec = read_embedding_spec(tmp_path, {"matryoshka_dimensions": [32, 8]})
    assert (spec.pooling, spec.normalize, spec.matryoshka_dimensions, spec.unsupported) == ("mean", False, [8, 32], None)
    write_modules(tmp_path, ("", "Transformer"), ("1_Pooling", "Pooling"), ("2_Dense", "Dense"),
                  pooling={"pooling_mode_cls_token": True})
    assert "Dense" in read_embedding_spec(tmp_path, {}).unsupported
    write_modules(tmp_path, ("", "Transformer"), ("1_Pooling", "Pooling"), pooling={"pooling_mode_max_tokens": True})
    assert "pooling_mode_max_tokens" in read_embedding_spec(tmp_path, {}).unsupported


def test_an_export_refuses_embeddings_it_cannot_pool_before_any_work(tmp_path, tiny_checkpoint):
    from kiln.export.export_model import export_model
    from kiln.export.options import ExportOptions
    from kiln.runtime.errors import ExportError

    refused = replace(tiny_checkpoint, embedding=replace(tiny_checkpoint.embedding, unsupported="its Dense stage"))
    with pytest.raises(ExportError, match="--embeddings: .*Dense"):
        export_model(refused, ExportOptions(embedding_functions=True, max_seq_len=64), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_ggufs_pooling_type_says_how_to_pool():
    from kiln.models.gguf_loader import gguf_embedding_spec

    assert gguf_embedding_spec({"general.architecture": "qwen2"}).pooling == "last"
    assert gguf_embedding_spec({"general.architecture": "qwen2", "qwen2.pooling_type": 1}).pooling == "mean"
    assert gguf_embedding_spec({"general.architecture": "llama", "llama.pooling_type": 2}).pooling == "cls"
    assert "pooling_type 4" in gguf_embedding_spec({"general.architecture": "llama", "llama.pooling_type": 4}).unsupported
