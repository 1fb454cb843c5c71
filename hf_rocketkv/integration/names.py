"""The name hf_rocketkv registers with transformers: ``from_pretrained(..., attn_implementation=ATTN_NAME)``."""

ATTN_NAME = "rocketkv"
