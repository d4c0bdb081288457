"""PagedLlama spread over several devices: pipeline stages of layers, tensor-parallel shards of
each layer (runtime/device_layout.py says which device does what).

A rank's attention is an `Attention` over its own heads (its K/V groups and their query heads),
whose output projection takes only those heads' columns, so it returns a partial sum; its MLP
is an `MLP` over its own columns, whose down projection likewise returns a partial sum. The
stage's first device adds the partials to the residual (a reduce there, and the next layer's
input sent back out: an all-reduce in two steps). Norms run on that device too. Each device
writes and reads its own cache buffer, laid out as one device's cache over its own layers and
heads (`CachePages`), so the math is PagedLlama's line for line and the logits agree with a
one-device export's to float rounding.

Placement is written into the traced program: parameters carry a device trait (their globals
get the device's affinity), and `to_device` marks each tensor that moves (IREE's
`flow.tensor.transfer`). Run eagerly, the moves are copies and the model is plain torch.
"""

from __future__ import annotations

import copy
from dataclasses import replace

import torch
from iree.turbine.aot import DeviceTensorTrait
from iree.turbine.ops.iree import transfer_to_logical_device
from torch import nn

from kiln.runtime.device_layout import DeviceLayout
from kiln.runtime.errors import ModelLoadError

from .config import LlamaConfig
from .llama import MLP, ROTARY_BUFFERS, Attention, CachePages, PagedLlama, PagedStep, SparseMoE, cache_dtype_name


def to_device(tensor: torch.Tensor, device: int) -> torch.Tensor:
    return transfer_to_logical_device(str(device), tensor)


def _place(module: nn.Module, device: int) -> nn.Module:
    for parameter in module.parameters():
        DeviceTensorTrait(device).set(parameter)
    return module


def _linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> nn.Linear:
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    layer.weight = nn.Parameter(weight.clone())
    if bias is not None:
        layer.bias = nn.Parameter(bias.clone())
    return layer


def rank_config(config: LlamaConfig, ranks: int) -> LlamaConfig:
    """One rank's share of a layer: its heads and MLP columns (the head size unchanged)."""
    return replace(config, num_attention_heads=config.num_attention_heads // ranks,
                   num_key_value_heads=config.num_key_value_heads // ranks,
                   intermediate_size=config.intermediate_size // ranks,
                   moe_intermediate_size=config.moe_intermediate_size // ranks,
                   shared_expert_intermediate_size=config.shared_expert_intermediate_size // ranks)


def attention_shard(attn: Attention, config: LlamaConfig, rank: int) -> Attention:
    """Rank `rank`'s heads of `attn` (config: rank_config's): its K/V heads and the query heads
    that share them, which are contiguous in Llama's head order."""
    d = config.head_dim
    q_rows = slice(rank * config.num_attention_heads * d, (rank + 1) * config.num_attention_heads * d)
    kv_rows = slice(rank * config.num_key_value_heads * d, (rank + 1) * config.num_key_value_heads * d)

    def rows(projection: nn.Linear, part: slice) -> nn.Linear:
        return _linear(projection.weight[part], None if projection.bias is None else projection.bias[part])

    shard = Attention(config, attn.sliding, attn.rotates)
    shard.fused = attn.fused
    shard.q_norm, shard.k_norm = copy.deepcopy(attn.q_norm), copy.deepcopy(attn.k_norm)  # per head: every rank's own copy
    shard.q_proj, shard.k_proj, shard.v_proj = rows(attn.q_proj, q_rows), rows(attn.k_proj, kv_rows), rows(attn.v_proj, kv_rows)
    shard.o_proj = _linear(attn.o_proj.weight[:, q_rows])
    return shard


def mlp_shard(mlp: MLP | SparseMoE, config: LlamaConfig, rank: int) -> MLP | SparseMoE:
    """Rank `rank`'s MLP columns: gate/up rows and the matching down-projection columns; for a
    mixture of experts, those of every expert, the router whole on every rank."""
    if isinstance(mlp, SparseMoE):
        part = slice(rank * config.moe_intermediate_size, (rank + 1) * config.moe_intermediate_size)
        shard = copy.deepcopy(mlp)
        e = mlp.experts
        shard.experts.gate_proj = nn.Parameter(e.gate_proj[:, part].clone())
        shard.experts.up_proj = nn.Parameter(e.up_proj[:, part].clone())
        shard.experts.down_proj = nn.Parameter(e.down_proj[:, :, part].clone())
        if mlp.shared_expert is not None:  # its columns cut as a dense MLP's; its gate whole, scaling each part
            shard.shared_expert = mlp_shard(mlp.shared_expert, replace(
                config, intermediate_size=config.shared_expert_intermediate_size), rank)
        return shard
    part = slice(rank * config.intermediate_size, (rank + 1) * config.intermediate_size)
    shard = MLP(config)
    shard.gate_proj, shard.up_proj = _linear(mlp.gate_proj.weight[part]), _linear(mlp.up_proj.weight[part])
    shard.down_proj = _linear(mlp.down_proj.weight[:, part])
    return shard


class ShardedLayer(nn.Module):
    """One decoder layer: norms on the stage's first device, a shard of attention and MLP per rank."""

    def __init__(self, layer, config: LlamaConfig, layout: DeviceLayout, stage: int):
        super().__init__()
        lead = layout.device(stage, 0)
        ranks = range(layout.tensor_parallel)
        share = rank_config(config, layout.tensor_parallel)
        self.input_layernorm = _place(layer.input_layernorm, lead)
        self.post_attention_layernorm = _place(layer.post_attention_layernorm, lead)
        self.attention_output_norm = _place(layer.attention_output_norm, lead)
        self.mlp_output_norm = _place(layer.mlp_output_norm, lead)
        self.attention = nn.ModuleList(_place(attention_shard(layer.self_attn, share, r), layout.device(stage, r))
                                       for r in ranks)
        self.mlp = nn.ModuleList(_place(mlp_shard(layer.mlp, share, r), layout.device(stage, r)) for r in ranks)


class ShardedPagedLlama(nn.Module):
    """A loaded PagedLlama's weights, cut and placed by `layout`; forward_paged takes one cache per device."""

    def __init__(self, model: PagedLlama, layout: DeviceLayout):
        super().__init__()
        c = model.config
        self.config, self.layout = c, layout
        self.causal, self.block_seq_stride, self.gather_pages = model.causal, model.block_seq_stride, model.gather_pages
        if model.page_groups is not None:
            raise ValueError("a model spread over devices keeps every layer in every page: build it without page groups")
        if c.qk_norm_whole and layout.tensor_parallel > 1:
            raise ModelLoadError(f"{c.architecture}'s q/k norm spans every head at once, which tensor parallelism "
                                 "splits among devices: spread it over devices with pipeline parallelism alone")
        self.page_groups = None
        self.model = model.model  # embeddings and final norm stay on device 0, under their own names
        self.lm_head = model.lm_head
        self.register_buffer("inv_freq", model.inv_freq, persistent=False)
        for name in ROTARY_BUFFERS[1:]:
            self.register_buffer(name, getattr(model, name), persistent=False)
        self.long_rope_from, self.rotary_factor = model.long_rope_from, model.rotary_factor
        self.stage_layers = layout.stage_layers(c.num_hidden_layers)
        self.stages = nn.ModuleList(
            nn.ModuleList(ShardedLayer(model.model.layers[i], c, layout, stage) for i in layers)
            for stage, layers in enumerate(self.stage_layers))
        # The whole layers now live in `stages`, cut up; the originals must not be exported too.
        self.model.layers = nn.ModuleList()
        _place(self.model, 0)
        if self.lm_head is not None:
            _place(self.lm_head, 0)

    # The embedding, rotary tables and output head are PagedLlama's, over the same attributes.
    embed = PagedLlama.embed
    rotary = PagedLlama.rotary
    logits = PagedLlama.logits

    def page_elems(self, dtype=torch.float32) -> list[int]:
        c = self.config
        return self.layout.page_elems(c.num_hidden_layers, c.num_key_value_heads, self.block_seq_stride, c.head_dim,
                                      cache_dtype_name(dtype))

    def allocate_cache(self, pages: int, dtype=torch.float32) -> list[torch.Tensor]:
        return [torch.zeros(pages, elems, dtype=dtype) for elems in self.page_elems(dtype)]

    def forward_paged(self, tokens, start_pos, seq_lens, seq_block_ids, cache: list[torch.Tensor]) -> torch.Tensor:
        """PagedLlama.forward_paged over the layout's devices; hidden states [N,T,hidden] on device 0."""
        c, layout = self.config, self.layout
        local_heads = c.num_key_value_heads // layout.tensor_parallel
        h = self.embed(tokens)
        step = PagedStep.of(self, tokens, start_pos, seq_lens, seq_block_ids, h.dtype)
        steps = {0: step}

        def on(device: int, tensor: torch.Tensor, where: int) -> torch.Tensor:
            return tensor if device == where else to_device(tensor, device)

        where = 0
        for stage, layers in enumerate(self.stage_layers):
            lead = layout.device(stage, 0)
            h, where = on(lead, h, where), lead
            devices = [layout.device(stage, r) for r in range(layout.tensor_parallel)]
            for device in devices:
                if device not in steps:
                    steps[device] = step.moved(lambda x, device=device: to_device(x, device))
            pages = [CachePages(cache[d], len(layers), local_heads, c.head_dim, self.block_seq_stride) for d in devices]
            for index, layer in enumerate(self.stages[stage]):
                x = layer.input_layernorm(h)
                partials = [pages[r].attend(attn, index, on(d, x, lead), steps[d], self.gather_pages)
                            for r, (d, attn) in enumerate(zip(devices, layer.attention))]
                h = h + layer.attention_output_norm(self._reduce(partials, devices, lead))
                x = layer.post_attention_layernorm(h)
                partials = [mlp(on(d, x, lead)) for d, mlp in zip(devices, layer.mlp)]
                h = h + layer.mlp_output_norm(self._reduce(partials, devices, lead))
        return on(0, h, where)

    @staticmethod
    def _reduce(partials: list[torch.Tensor], devices: list[int], lead: int) -> torch.Tensor:
        """The ranks' partial sums, added on the stage's first device in rank order."""
        total = partials[0]
        for partial, device in zip(partials[1:], devices[1:]):
            total = total + to_device(partial, lead)
        return total
