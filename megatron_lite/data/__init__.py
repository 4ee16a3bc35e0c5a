"""Token data: Megatron/GPT-NeoX MMIDIDX indexed datasets."""
