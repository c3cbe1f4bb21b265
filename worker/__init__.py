"""loraplex worker: GGUF models and LoRA adapters in torch.

Imports nothing heavy: the gateway uses the torch-free modules (gguf_file,
adapter, fingerprint, tokenizer, chat_template, alora) directly.
"""
