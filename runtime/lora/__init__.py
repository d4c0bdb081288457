"""Many LoRA adapters over one compiled model: PEFT adapters read and checked (adapter.py), the
build's adapter slots filled and evicted (slots.py), their stacked weights (weights.py)."""
