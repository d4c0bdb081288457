"""A Hugging Face Qwen3-MoE directory with random float32 weights: what a mixture's decode step and
prefill cost, where a real mixture's weights are not to be had offline.

    python -m benchmarks.synthetic_moe [-o DIR] [--layers 8] [--experts 64] [--active 8]

The default is a quarter of Qwen3-30B-A3B's layer (hidden 1024 against 2048, 64 experts of 384
against 128 of 768, 8 chosen of each token's, as there) over 8 layers: 0.6 B parameters, 0.6 of
them in the experts, 2.4 GB. Written by transformers, with the bundled SmolLM2's tokenizer. A
router's scores are spread as a trained one's are (far from ties).

    kiln export-model --model DIR --output-dir ART --quantize q4_1 --cpu-kernels --bs-prefill 1 \\
        --bs-decode 1,4 --max-seq-len 512 && kiln compile-vmfb ART/model.mlir --target cpu -o ART/model_cpu.vmfb
    python -m benchmarks.profile_step --artifacts ART --function decode_bs1 --context 256
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def write(directory: Path, layers: int = 8, experts: int = 64, active: int = 8, seed: int = 0) -> Path:
    import torch
    import transformers

    from kiln.models.default_model import default_model_path
    from kiln.models.loader import load_checkpoint

    bundled = load_checkpoint(default_model_path())
    config = transformers.Qwen3MoeConfig(
        vocab_size=bundled.config.vocab_size, hidden_size=1024, intermediate_size=2048, num_hidden_layers=layers,
        num_attention_heads=16, num_key_value_heads=4, head_dim=64, num_experts=experts,
        num_experts_per_tok=active, moe_intermediate_size=384, max_position_embeddings=4096,
        bos_token_id=bundled.config.bos_token_id, eos_token_id=bundled.config.eos_token_ids[0],
        tie_word_embeddings=False, norm_topk_prob=True)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.dim() == 1:
                parameter.copy_(1.0 + 0.1 * torch.randn_like(parameter))
            else:
                spread = 8.0 if name.endswith(".mlp.gate.weight") else 1.0
                parameter.copy_(torch.randn_like(parameter) * spread * parameter.shape[-1] ** -0.5)
    model.save_pretrained(directory)
    (directory / "tokenizer.json").write_text(bundled.tokenizer_json)
    (directory / "tokenizer_config.json").write_text(json.dumps(bundled.tokenizer_config))
    return directory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-o", "--output", type=Path, default=Path("synthetic-qwen3-moe"))
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--active", type=int, default=8, help="experts each token chooses")
    args = parser.parse_args()
    print(write(args.output, args.layers, args.experts, args.active))


if __name__ == "__main__":
    main()
