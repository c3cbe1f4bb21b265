"""loraplex worker: GGUF models and LoRA adapters in torch, by layer (docs/architecture.md#layers).

Imports nothing: `formats` and `contract` are torch-free and the gateway uses them;
`model`, `lora`, `engine`, `shard` and `cli` build on them, each importing only the
layers below its own (tests/test_layers.py).
"""
