"""LoRA adapters (PEFT checkpoints) served beside the base model, a request picking one."""
