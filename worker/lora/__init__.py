"""LoRA on a LoRA-free model (torch), in one-way stages as vLLM's:
request scales -> per-token mapping (`mapping`, pure) -> stacked weights (`weights`)
-> layers wrapping the base linears (`layers`, attached by `attach`) -> kernels (`backend`).
"""
