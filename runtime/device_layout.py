"""How one export spreads a model over several devices: plain data both sides read.

Pipeline parallelism cuts the decoder into `pipeline_parallel` stages of contiguous layers;
tensor parallelism splits each stage's attention heads (whole K/V groups) and MLP columns over
`tensor_parallel` ranks. Device `stage * tensor_parallel + rank` runs one rank of one stage and
holds the KV cache of exactly that work: its stage's layers, its rank's K/V heads. A page id
means the same page on every device, so the runtime's page accounting never changes; only the
bytes of a page are spread out. Device 0 also takes the embeddings, the final norm and the
output projection (so a request's inputs and logits stay where a one-device export has them).
"""

from __future__ import annotations

from dataclasses import dataclass

from .config import kv_page_elems


@dataclass(frozen=True)
class DeviceLayout:
    tensor_parallel: int = 1
    pipeline_parallel: int = 1

    @property
    def device_count(self) -> int:
        return self.tensor_parallel * self.pipeline_parallel

    def device(self, stage: int, rank: int) -> int:
        return stage * self.tensor_parallel + rank

    def stage_layers(self, layer_count: int) -> list[range]:
        """Each stage's layers: contiguous, as even as can be, the earlier stages taking one more."""
        base, extra = divmod(layer_count, self.pipeline_parallel)
        ranges, start = [], 0
        for stage in range(self.pipeline_parallel):
            size = base + (stage < extra)
            ranges.append(range(start, start + size))
            start += size
        return ranges

    def problem(self, layers: int, heads: int, kv_heads: int, intermediate: int) -> str | None:
        """Why a model of these sizes cannot take this layout, or None."""
        if self.tensor_parallel < 1 or self.pipeline_parallel < 1:
            return "tensor and pipeline parallel sizes must be positive"
        if self.pipeline_parallel > layers:
            return f"--pipeline-parallel {self.pipeline_parallel} is more stages than the model's {layers} layers"
        for what, count in (("key/value heads", kv_heads), ("attention heads", heads),
                            ("MLP columns", intermediate)):
            if count % self.tensor_parallel:
                return f"--tensor-parallel {self.tensor_parallel} does not divide the model's {count} {what}"
        return None

    def page_elems(self, layers: int, kv_heads: int, block_seq_stride: int, head_dim: int,
                   kv_cache_dtype: str = "float32") -> list[int]:
        """Elements (of kv_cache_dtype, not its storage type) of one page on each device, in device
        order (a float cache's sum to a one-device page's)."""
        local_heads = kv_heads // self.tensor_parallel
        return [kv_page_elems(len(stage), local_heads, head_dim, block_seq_stride, kv_cache_dtype)
                for stage in self.stage_layers(layers) for _ in range(self.tensor_parallel)]
